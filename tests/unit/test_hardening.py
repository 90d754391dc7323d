"""Bad input and broken numerics: configs, source bounds, and the step guard.

Every case here must end in a typed error whose message names the problem and the place (a
config key, a file, a source), and a non-finite update must never step: θ and the optimizer
stay as they were, so the run that skipped it matches the run that never saw it, bit for bit.
"""

import pytest
import torch

from tsync_mcore.channel.sources import (
    MAX_ABS_REWARD,
    SourceError,
    TrajectorySource,
    TurnSource,
    validate_source,
    validate_turn,
)
from tsync_mcore.config import ConfigError, load_config, parse_overrides

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
    ({"rollout.max_num_seqs": 0}, "rollout.max_num_seqs", ">= 1"),
    ({"publish.method": "nfs"}, "publish.method", "one of"),
    ({"publish.bucket_mb": 0}, "publish.bucket_mb", "(0, 16384]"),
    ({"publish.bucket_mb": "big"}, "publish.bucket_mb", "number"),
    ({"publish.delta_dense": 1.5}, "publish.delta_dense", "[0, 1]"),
    ({"publish.delta": True, "publish.method": "file"}, "publish.delta", "dist"),
    ({"publish.port": 70000}, "publish.port", "TCP port"),
    ({"publish.lora": "adapter", "publish.method": "dist"}, "publish.lora", "file"),
    ({"publish.nope": 1}, "publish.nope", "unknown key"),
    ({"run.publish_port": -1}, "publish.port", "TCP port"),  # the old name: the new one's check
    ({"rollout.render": "template", "rollout.agent": "openai"}, "rollout.render", "builtin"),
    ({"rollout.render": "template", "learner.objective": "opd"}, "rollout.render", "OPD"),
    ({"rollout.chat_template_kwargs": {"x": [1]}}, "rollout.chat_template_kwargs", "booleans"),
    ({"rollout.max_segments": 257}, "rollout.max_segments", "[1, 256]"),
    ({"rollout.max_segments": 0}, "rollout.max_segments", "[1, 256]"),
    ({"rollout.max_trained_tokens": 10}, "rollout.max_trained_tokens", "max_total_tokens"),
    ({"rollout.max_trained_tokens": -1}, "rollout.max_trained_tokens", "0"),
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


def test_all_finite_is_exact_for_nan_and_both_infinities_in_any_vector():
    """The step guard's check (one min/max pass per vector) against torch.isfinite."""
    from tsync_mcore.learner.policy import all_finite
    base = [torch.randn(1000), torch.randn(7, dtype=torch.float64), torch.empty(0),
            torch.randn(33).to(torch.bfloat16)]
    assert bool(all_finite(base, "cpu")) and bool(all_finite([], "cpu"))
    big = [torch.full((5,), torch.finfo(torch.float32).max), torch.full((5,), -3e38)]
    assert bool(all_finite(big, "cpu"))  # extremes are finite: no overflow on the way
    for bad in (float("nan"), float("inf"), -float("inf")):
        for j in (0, 1, 3):
            vs = [v.clone() for v in base]
            vs[j][len(vs[j]) // 2] = bad
            assert not bool(all_finite(vs, "cpu"))
            assert bool(all_finite(vs, "cpu")) == all(bool(torch.isfinite(v).all()) for v in vs)
