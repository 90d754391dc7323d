"""make demo-real's pieces that run without a model: its config and its summary line."""

import json

from tsync_mcore.cli import demo_real
from tsync_mcore.config import load_config


def test_config_is_the_real_task_on_disjoint_cores():
    cfg = load_config(demo_real.DEMO_REAL_CONFIG, {})
    assert cfg.rollout.env.startswith("reasoning_gym:") and cfg.learner.schedule == "thundersync"
    assert cfg.run.eval_every and cfg.run.eval_first and cfg.reasoning_gym.eval_size >= 128
    assert cfg.data.eval_n == 1 and cfg.rollout.eval_temperature == 0  # greedy, one sample
    assert set(cfg.launch.rollout_cpus.split(",")).isdisjoint(cfg.launch.learner_cpus.split(","))


def test_summary_compares_the_first_and_last_evaluation(tmp_path):
    rows = [{"eval/pass@1": p, "eval/policy_version": v, "eval/n_prompts": 130}
            for v, p in ((0, 0.2), (10, 0.25), (70, 0.4))]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = demo_real.summary(demo_real.eval_rows(str(tmp_path)), 1500)
    assert got == ("eval accuracy (greedy, 130 held-out problems): θ_0 20.0% → θ_70 40.0% "
                   "(+20.0 points) in 25.0 min")
    assert "fewer than two" in demo_real.summary(demo_real.eval_rows(str(tmp_path / "x")), 60)
