"""Bad input and broken numerics: configs, source bounds, and the step guard.

Every case here must end in a typed error whose message names the problem and the place (a
config key, a file, a source), and a non-finite update must never step: θ and the optimizer
stay as they were, so the run that skipped it matches the run that never saw it, bit for bit.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tsync_mcore.config import ConfigError, load_config, parse_overrides
from tsync_mcore.channel.sources import (MAX_ABS_REWARD, SourceError, TrajectorySource, TurnSource,
                                 validate_source, validate_turn)
from tsync_mcore.util.net import free_port as _free_port

from tests.helpers.paths import ROOT

# (overrides, the key or file the message must name, a word of the reason)
BAD_CONFIGS = [
    ({"optim.lr": float("inf")}, "optim.lr", "finite"),
    (parse_overrides(["optim.lr=.inf"]), "optim.lr", "finite"),  # YAML's spelling (--set)
    ({"optim.eps": float("inf")}, "optim.eps", "finite"),
    ({"optim.eps": float("nan")}, "optim.eps", "finite"),
    ({"learner.adv_eps": float("inf")}, "learner.adv_eps", "finite"),
    ({"optim.clip_grad": float("nan")}, "optim.clip_grad", "finite"),
    ({"channel.timeout_s": float("inf")}, "channel.timeout_s", "finite"),
    ({"rollout.temperature": -0.5}, "rollout.temperature", ">= 0"),
    ({"rollout.n_learners": 3, "model.tp": 2}, "rollout.n_learners", "tensor-parallel"),
    ({"channel.addr": "no-such-host.invalid"}, "channel.addr", "resolvable"),
    ({"channel.addr": "300.1.2.3"}, "channel.addr", "resolvable"),
    ({"model": 3}, "'model'", "mapping"),
    ({"model": 3, "model.tp": 2}, "'model'", "section"),
    ({"learner.k_open": "4"}, "learner.k_open", "integer"),
    ({"learner.max_tokens": -1}, "learner.max_tokens", ">= 0"),
    ({"learner.on_nonfinite": "ignore"}, "learner.on_nonfinite", "one of"),
    ({"learner.bogus": 1}, "learner.bogus", "unknown key"),
    ({"rollout.kv_cache_gib": 0}, "rollout.kv_cache_gib", "> 0"),
    ({"publish.method": "nfs"}, "publish.method", "one of"),
    ({"publish.bucket_mb": 0}, "publish.bucket_mb", "(0, 16384]"),
    ({"publish.bucket_mb": "big"}, "publish.bucket_mb", "number"),
    ({"publish.delta_dense": 1.5}, "publish.delta_dense", "[0, 1]"),
    ({"publish.delta": True, "publish.method": "file"}, "publish.delta", "dist"),
    ({"publish.port": 70000}, "publish.port", "TCP port"),
    ({"publish.lora": "adapter", "publish.method": "dist"}, "publish.lora", "file"),
    ({"publish.nope": 1}, "publish.nope", "unknown key"),
    ({"run.publish_port": -1}, "publish.port", "TCP port"),  # the old name: the new one's check
]


@pytest.mark.parametrize("overrides,key,why", BAD_CONFIGS, ids=[c[1] + "-" + str(i) for i, c in
                                                                enumerate(BAD_CONFIGS)])
def test_bad_config_values_are_refused_naming_the_key(overrides, key, why):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    msg = str(e.value)
    assert key in msg and why in msg and "\n" not in msg, msg


@pytest.mark.parametrize("text,why", [
    ("- model\n- learner\n", "got a YAML list"),
    ("model: [1, 2\n", "not valid YAML"),
    ("learner:\n  k_open: 2\n    schedule: sync\n", "not valid YAML"),
    (b"\x89PNG\r\n\x1a\n\x00\xff", "not UTF-8"),
])
def test_bad_config_files_are_refused_naming_the_file(tmp_path, text, why):
    path = tmp_path / "c.yaml"
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(path) in str(e.value) and why in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize("item", ["learner.k_open", "=3", "learner..k_open=2", "a=[1,"])
def test_malformed_overrides_are_refused(item):
    with pytest.raises(ConfigError, match="override"):
        parse_overrides([item])


def test_launcher_prints_one_error_line_for_a_bad_config(tmp_path):
    """The rollout launcher (it reads its config before importing the engine) and the
    learner launcher, which validates before torch.distributed starts."""
    for script in ("launch/rollout.py", "launch/learner.py"):
        p = subprocess.run([sys.executable, os.path.join(ROOT, script), "--config",
                            os.path.join(ROOT, "configs/grpo_cpu_tiny.yaml"), "--set",
                            "channel.timeout_s=.inf", f"run.dir={tmp_path}"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2, p.stderr
        assert len(lines) == 1 and lines[0].startswith("error: ") and "channel.timeout_s" in \
            lines[0] and "Traceback" not in p.stderr, p.stderr


# --- source bounds ----------------------------------------------------------------------

def _traj(**kw):
    base = dict(traj_id="t0", group_id="g0", tokens=(1, 2, 3, 4), scored_mask=(0, 0, 1, 1),
                reward=1.0, policy_version=0)
    return TrajectorySource(**{**base, **kw})


def _turn(**kw):
    base = dict(traj_id="t0", group_id="g0", turn=0, n_turns=1, start=0, tokens=(1, 2, 3),
                scored_mask=(0, 1, 1), teacher_logprobs=(None, -0.5, -2.0), policy_version=0)
    return TurnSource(**{**base, **kw})


@pytest.mark.parametrize("reward", [1e200, -1e7, MAX_ABS_REWARD * 1.5, float("inf"),
                                    float("nan"), True, "1.0", None])
def test_rewards_outside_the_bound_are_refused(reward):
    with pytest.raises(SourceError, match="reward") as e:
        validate_source(_traj(reward=reward), vocab_size=256)
    assert "'t0'" in str(e.value)
    validate_source(_traj(reward=-MAX_ABS_REWARD), vocab_size=256)  # the bound itself is fine


@pytest.mark.parametrize("lp", [-1e300, -3.4e38, -65504.0, -1e9, float("-inf"), 0.5, "x"])
def test_teacher_logprobs_a_masked_logit_gives_are_refused(lp):
    with pytest.raises(SourceError, match="teacher log-prob") as e:
        validate_turn(_turn(teacher_logprobs=(None, -0.5, lp)), vocab_size=256)
    assert "token 2" in str(e.value)
    validate_turn(_turn(teacher_logprobs=(None, -0.5, -9000.0)), vocab_size=256)


def test_sources_longer_than_the_learner_accepts_are_refused_before_any_work():
    long = _traj(tokens=(1,) * 300, scored_mask=(0,) * 299 + (1,))
    with pytest.raises(SourceError, match="300 tokens, more than the learner accepts \\(256"):
        validate_source(long, vocab_size=256, max_tokens=256)
    # an OPD turn is bounded by where it ends: its context is attended too
    late = _turn(start=250, turn=1, n_turns=2, tokens=(1,) * 10, scored_mask=(0,) * 10,
                 teacher_logprobs=(None,) * 10)
    with pytest.raises(SourceError, match="260 tokens"):
        validate_turn(late, vocab_size=256, max_tokens=256)
    validate_source(long, vocab_size=256, max_tokens=300)


# --- the step guard -----------------------------------------------------------------------

def _worker(hf_dir, out, mode, check):
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
         str(_free_port()), os.path.join(ROOT, "tests/helpers/workers/nonfinite_worker.py"), hf_dir,
         str(out), mode, check], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = [json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    return {r["rank"]: r["results"] for r in rows}




@pytest.mark.parametrize("check", ["update", "source"])
def test_a_non_finite_update_never_steps_and_leaves_no_trace_in_theta_or_adam(tiny_qwen2,
                                                                              tmp_path, check):
    """A, P, B where P's gradient overflows FP32 on rank 0 only: both ranks skip P, and the
    parameters after B equal those of the run A, B bit for bit (so Adam's moments and step
    count were untouched too)."""
    poisoned = _worker(tiny_qwen2, tmp_path, "poisoned", check)
    clean = _worker(tiny_qwen2, tmp_path, "clean", check)
    for rank in (0, 1):
        a, p, b = poisoned[rank]
        assert a["ok"] and b["ok"] and not p["ok"], poisoned[rank]
        assert [a["version"], p["version"], b["version"]] == [1, 1, 2]
        assert [r["grad_norm"] for r in (a, b)] == [r["grad_norm"] for r in clean[rank]]
    named = poisoned[0][1]["nonfinite"] + poisoned[1][1]["nonfinite"]
    if check == "source":  # the unit that broke the sums, on the rank that owns its group
        assert len(named) == 1 and "(group 'v1-g0')" in named[0], named
    else:
        assert named == []
    x = load_file(str(tmp_path / f"params_poisoned_{check}.safetensors"))
    y = load_file(str(tmp_path / f"params_clean_{check}.safetensors"))
    assert all(torch.equal(x[k], y[k]) for k in x)


def test_replay_of_a_non_finite_update_fails_and_writes_nothing(tiny_qwen2, tmp_path):
    """The replay command used to report rc 0 with grad_norm [NaN] and write the NaN θ."""
    from tests.helpers.batchgen import make_batch
    rows = sorted(make_batch(256, n_groups=3, m=3, version=0, seed=2),
                  key=lambda r: r["ready_order"])
    g = rows[0]["group_id"]
    members = [r["traj_id"] for r in rows if r["group_id"] == g]
    for r in rows:
        if r["group_id"] == g:
            r["reward"] = 1e-300 if r["traj_id"] == members[1] else 0.0
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("learner:\n  adv_eps: 1.0e-300\n  check_finite: source\n")
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "tsync_mcore.learner.replay", "--model", tiny_qwen2,
                        "--batch", str(batch), "--out", str(out), "--config", str(cfg)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    err = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert p.returncode == 3 and len(err) == 1, p.stderr[-3000:]
    assert "reduced gradient is not finite" in err[0] and f"(group '{g}')" in err[0], err
    assert "Traceback" not in p.stderr and not out.exists()
