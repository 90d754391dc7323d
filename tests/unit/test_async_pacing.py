"""The asynchronous schedules' rollout rules (rollout/pacing.py), without an engine."""

import pytest

from tsync_mcore.channel.sources import TrajectorySource, check_off_policy
from tsync_mcore.rollout.pacing import BatchFormer, Group, may_start, span_off_policy


def test_span_off_policy_one_version_sends_no_per_token_versions():
    mask = [0, 0, 1, 1, 0, 1]
    lps = [None, None, -0.5, -1.0, None, -2.0]
    vs = [None, None, 3, 3, None, 3]
    behaviour, versions, oldest = span_off_policy(lps, vs, mask, 0, 6, default=9)
    assert behaviour == (None, None, -0.5, -1.0, None, -2.0)
    assert versions == () and oldest == 3


def test_span_off_policy_across_a_swap_marks_every_token_and_the_oldest():
    # a turn cut by a swap: two tokens of θ_3, then θ_4; an OPD span [2, 6)
    mask = [0, 0, 1, 1, 1, 0]
    lps = [None, None, -0.5, -1.0, -0.1, None]
    vs = [None, None, 3, 3, 4, None]
    behaviour, versions, oldest = span_off_policy(lps, vs, mask, 2, 6, default=9)
    assert behaviour == (-0.5, -1.0, -0.1, None)
    assert versions == (3, 3, 4, 3) and oldest == 3
    # what the learner's check accepts: one entry per token, the oldest is policy_version
    src = TrajectorySource(traj_id="t", group_id="g", tokens=(1, 2, 3, 4), scored_mask=(1, 1, 1, 0),
                           reward=0.0, policy_version=oldest, behaviour_logprobs=behaviour,
                           token_versions=versions)
    check_off_policy("t", src)
    # a span without scored tokens takes the default version
    assert span_off_policy(lps, vs, mask, 0, 2, default=9) == ((None, None), (), 9)
    with pytest.raises(ValueError, match="no version"):
        span_off_policy(lps, [None] * 6, mask, 0, 6, default=0)


def test_staleness_bound_counts_batches_ahead_of_the_loaded_version():
    # G = 4, max_staleness 1, started at v0 = 2: under θ_2 two batches' worth may start
    assert may_start(7, loaded=2, v0=2, max_staleness=1, groups_per_batch=4)
    assert not may_start(8, loaded=2, v0=2, max_staleness=1, groups_per_batch=4)
    assert may_start(11, loaded=3, v0=2, max_staleness=1, groups_per_batch=4)
    assert not may_start(12, loaded=3, v0=2, max_staleness=1, groups_per_batch=4)


def test_batches_form_in_completion_order_and_stale_groups_are_dropped():
    f = BatchFormer(groups_per_batch=2, max_staleness=1)
    for gid, oldest in (("a", 0), ("b", 1), ("c", 0)):
        f.add(Group(gid, 0, [], oldest))
    batch, stale = f.take(1)  # lag 1 is allowed
    assert [g.group_id for g in batch] == ["a", "b"] and stale == []
    batch, stale = f.take(2)  # "c" (θ_0) would have lag 2
    assert batch == [] and [g.group_id for g in stale] == ["c"] and f.dropped == 1


def test_a_group_older_than_max_staleness_never_joins_a_batch():
    f = BatchFormer(groups_per_batch=2, max_staleness=1)
    f.add(Group("old", 0, [], 0))
    f.add(Group("new", 1, [], 2))
    batch, stale = f.take(2)  # "old" has lag 2 > 1
    assert batch == [] and [g.group_id for g in stale] == ["old"] and f.dropped == 1
    f.add(Group("newer", 2, [], 2))
    batch, stale = f.take(2)
    assert [g.group_id for g in batch] == ["new", "newer"] and stale == [] and f.ready == []


def test_config_refuses_what_fully_async_cannot_do():
    from tsync_mcore.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"'learner.schedule'.*GRPO family.*one_step_off"):
        load_config(None, {"learner.schedule": "fully_async", "learner.objective": "opd"})
    dataset = {"rollout.env": "dataset", "data.train": "t.jsonl", "data.eval": "e.jsonl",
               "reward.function": "exact_match"}
    with pytest.raises(ConfigError, match=r"'run.eval_every'.*fully_async"):
        load_config(None, {"learner.schedule": "fully_async", "run.eval_every": 1, **dataset})
    with pytest.raises(ConfigError, match=r"'run.eval_first'.*fully_async"):
        load_config(None, {"learner.schedule": "fully_async", "run.eval_first": True, **dataset})
    with pytest.raises(ConfigError, match=r"'run.budget_s'"):
        load_config(None, {"run.budget_s": -1})
    with pytest.raises(ConfigError, match=r"'rollout.max_groups_in_flight'"):
        load_config(None, {"rollout.max_groups_in_flight": -1})
    load_config(None, {"learner.schedule": "one_step_off", "learner.objective": "opd"})
