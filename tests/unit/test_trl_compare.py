"""perf/studies/trl_compare.py and perf/studies/trl_runner.py: the tsync-mcore → GRPOConfig mapping, the
result arithmetic, the reward wrapper and the step clock, without TRL installed (TRL's own
GRPOConfig takes the mapping in tests/integration/test_trl_compare.py)."""

from __future__ import annotations

import asyncio

import pytest

from perf.studies import trl_compare as tc
from perf.studies import trl_runner as tr
from tsync_mcore.config import LearnerConfig
from tsync_mcore.data import Row
from tsync_mcore.rewards.call import parse_result
from tests.helpers.trl_compare_shared import tsync_args, tsync_cfg


def _learner(**kw) -> LearnerConfig:
    base = dict(objective="grpo", token_norm="token_mean", adv_std="unbiased", adv_eps=1e-4)
    return LearnerConfig(**{**base, **kw})


@pytest.mark.parametrize("kw, loss, scale", [
    ({}, "dapo", "group"),
    ({"token_norm": "seq_mean_token_mean"}, "grpo", "group"),
    ({"token_norm": "trajectory"}, "grpo", "group"),  # full groups: 1/(n_groups·m·L) = 1/(B·L)
    ({"token_norm": "seq_mean_token_sum_norm", "token_norm_constant": 24.0}, "dr_grpo", "group"),
    ({"objective": "dr_grpo", "adv_std": "population", "adv_eps": 1e-6}, "dapo", "none"),
])
def test_trl_loss_follows_the_objectives_table(kw, loss, scale):
    assert tc.trl_loss(_learner(**kw), 24) == {"loss_type": loss, "scale_rewards": scale}


@pytest.mark.parametrize("kw, key", [
    ({"adv_std": "population"}, "learner.adv_std"),
    ({"adv_eps": 1e-6}, "learner.adv_eps"),  # TRL's ε is 1e-4, hard-coded
    ({"token_norm": "group_scaled_token_mean"}, "learner.token_norm"),
    ({"token_norm": "seq_mean_token_sum_norm", "token_norm_constant": 16.0},
     "learner.token_norm_constant"),
    ({"objective": "rloo", "adv_std": "population"}, "learner.objective"),
])
def test_trl_loss_refuses_what_trl_cannot_run(kw, key):
    with pytest.raises(tc.CompareError, match=key.replace(".", r"\.")):
        tc.trl_loss(_learner(**kw), 24)


def test_tsync_config_is_valid_and_pins_disjoint_cores(tmp_path):
    cfg = tsync_cfg(tmp_path)
    assert (cfg.launch.rollout_cpus, cfg.launch.learner_cpus) == ("0", "1")
    assert cfg.learner.adv_eps == tc.TRL_ADV_EPS and cfg.learner.adv_std == "unbiased"
    assert cfg.run.export_hf and cfg.rollout.env == "dataset"
    shared = tsync_cfg(tmp_path, tsync_placement="shared")
    assert (shared.launch.rollout_cpus, shared.launch.learner_cpus) == ("", "")
    assert tc.split_cpus([0, 1, 2, 3, 4]) == ([0, 1], [2, 3, 4])
    with pytest.raises(tc.CompareError, match="shared"):
        tc.split_cpus([3])


def test_grpo_kwargs_make_one_update_one_step_on_the_batch(tmp_path):
    cfg = tsync_cfg(tmp_path, {"optim.weight_decay": 0.01, "optim.clip_grad": 0.5})
    kw = tc.grpo_kwargs(cfg, "/out")
    # GRPOConfig.__post_init__ (1.16.0): generation batch = per-device batch × steps per
    # generation (one process); the trainer steps once per gradient_accumulation_steps
    assert kw["per_device_train_batch_size"] * kw["steps_per_generation"] == 2 * 4
    assert kw["gradient_accumulation_steps"] == 1 == kw["num_iterations"]
    assert kw["num_generations"] == 4 and kw["max_steps"] == 3 and kw["seed"] == 7
    assert kw["max_completion_length"] == 8 and kw["temperature"] == 1.0
    assert (kw["learning_rate"], kw["lr_scheduler_type"], kw["warmup_steps"]) == (
        2e-5, "constant", 0)
    assert (kw["adam_beta1"], kw["adam_beta2"], kw["adam_epsilon"]) == (0.9, 0.999, 1e-8)
    assert (kw["weight_decay"], kw["max_grad_norm"]) == (0.01, 0.5)
    assert kw["beta"] == 0.0 and not kw["use_vllm"] and not kw["bf16"]
    assert not kw["shuffle_dataset"]  # the rows come in tsync-mcore's order
    assert (kw["loss_type"], kw["scale_rewards"]) == ("dapo", "group")


@pytest.mark.parametrize("sets, key", [
    ({"learner.schedule": "one_step_off"}, "learner.schedule"),
    ({"learner.is_correction": "tis"}, "learner.is_correction"),
    ({"optim.lr_schedule": "cosine"}, "optim.lr_schedule"),
    ({"model.lora.rank": 4}, "model.lora"),
    ({"data.chat_template": False}, "data.chat_template"),
])
def test_grpo_kwargs_refuse_work_trl_does_differently(tmp_path, sets, key):
    with pytest.raises(tc.CompareError, match=key.replace(".", r"\.")):
        tc.grpo_kwargs(tsync_cfg(tmp_path, sets), "/out")


def test_summarize_skips_the_warm_up_update():
    trl = [{"update": k, "wall_s": w, "reward_mean": r}
           for k, w, r in ((1, 30.0, 0.0), (2, 10.0, 0.5), (3, 14.0, 1.0))]
    ts = [{"update": k, "wall_s": w, "reward_mean": 0.25} for k, w in ((1, 20.0), (2, 6.0),
                                                                        (3, 6.0))]
    s = tc.summarize(trl, ts)
    assert s["trl_wall_mean_s"] == 12.0 and s["tsync_wall_mean_s"] == 6.0
    assert s["ratio_tsync_over_trl"] == 0.5
    assert s["trl_reward_mean"] == 0.5 and s["tsync_reward_mean"] == 0.25
    assert tc.summarize(trl[:1], ts)["ratio_tsync_over_trl"] is None  # nothing after warm-up
    assert tc.summarize([], ts)["trl_wall_mean_s"] is None
    md = tc.markdown({"trl": {"rows": trl}, "tsync": {"rows": ts}, "summary": s,
                      "eval": {"n": 4, "before": 0.25, "trl": 0.5}})
    assert "| 2 | 10.00 | 0.500 | 6.00 | 0.250 |" in md
    assert "ratio tsync/TRL 0.500" in md and "after tsync-mcore -" in md


def test_tsync_rows_keep_the_updates_that_trained():
    metrics = [{"step": 1, "ok": True, "step_wall_time_s": 3.0, "reward_mean": 0.5},
               {"step": 2, "ok": False, "step_wall_time_s": 1.0, "reward_mean": 0.0},
               {"step": 3, "step_wall_time_s": 2.0, "reward_mean": 1.0}]
    assert tc.tsync_rows(metrics) == [{"update": 1, "wall_s": 3.0, "reward_mean": 0.5},
                                      {"update": 3, "wall_s": 2.0, "reward_mean": 1.0}]


def test_reward_wrapper_scores_each_completion_with_its_row():
    seen = []

    def fn(prompt, response, label, meta, **_):
        seen.append((prompt, response, label, dict(meta)))
        meta["touched"] = True  # must not leak into the next call
        return {"reward": float(response.strip() == label), "len": len(response)}

    rows = [Row(index=0, prompt="1 + 1?", label="2", meta={"src": "a"}),
            Row(index=1, prompt="2 + 2?", label="4", meta={})]
    reward = tr.make_reward(fn, rows, parse_result)
    completions = [[{"role": "assistant", "content": "2"}], [{"role": "assistant", "content": "5"}],
                   [{"role": "assistant", "content": "4"}]]
    out = reward(prompts=[None] * 3, completions=completions, row=[0, 0, 1],
                 trainer_state=None, log_metric=print)
    assert out == [1.0, 0.0, 1.0]
    assert seen[0] == ("1 + 1?", "2", "2", {"src": "a"}) and seen[1][3] == {"src": "a"}
    assert rows[0].meta == {"src": "a"}
    assert tr.completion_text("plain") == "plain"

    async def slow(prompt, response, label, meta, **_):
        await asyncio.sleep(0)
        return 1

    assert tr.make_reward(slow, rows, parse_result)([None], ["x"], [1]) == [1.0]
    with pytest.raises(ValueError, match="not finite"):
        tr.make_reward(lambda **_: float("nan"), rows, parse_result)([None], ["x"], [0])


def test_step_clock_rows():
    clock = tr.StepClock()
    clock.begin(10.0)
    clock.end(1, 12.5)
    clock.log(1, {"reward": 0.25, "step_time": 2.0, "loss": 0.1})
    clock.begin(20.0)
    clock.end(2, 21.0)
    assert clock.rows() == [
        {"update": 1, "wall_s": 2.5, "reward_mean": 0.25, "trl_step_time_s": 2.0},
        {"update": 2, "wall_s": 1.0, "reward_mean": None, "trl_step_time_s": None}]
    with pytest.raises(RuntimeError):
        clock.end(3, 30.0)


def test_bad_inputs_are_one_line_and_exit_2(tmp_path, capsys):
    args = tsync_args(tmp_path)
    common = ["--train", args.train, "--reward", args.reward, "--out", str(tmp_path / "o")]
    assert tc.main(["--model", str(tmp_path / "nowhere"), *common]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model" in err
    bad = ["--model", args.model, "--train", args.train, "--out", str(tmp_path / "o")]
    assert tc.main([*bad, "--reward", str(tmp_path / "none.py") + ":score"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "none.py" in err
    assert tc.main([*bad, "--reward", args.reward, "--group-size", "1"]) == 2
    assert "--group-size" in capsys.readouterr().err

