"""Math and release rules without a model: closures, numerics, admission cap, config errors."""

import random

import pytest
import torch

from tsync_mcore.channel.routing import BalancedRouter
from tsync_mcore.channel.sources import BatchPlan, TrajectorySource, assign_groups
from tsync_mcore.config import ConfigError, load_config
from tsync_mcore.learner.accumulators import GradAccumulators
from tsync_mcore.learner.schedule import ReadinessQueue
from tsync_mcore.objectives import ADVANTAGES


def _stream(rewards, H, objective, dtype, order):
    """Fold sources in `order` through the accumulators and close the group."""
    acc = GradAccumulators([torch.zeros(H.shape[1], dtype=dtype)], k_open=1, dtype=dtype)
    c = rewards[order[0]]
    acc.open_group("g", shift=c)
    for i in order:
        acc.fold_pair("g", [H[i].to(dtype)], rewards[i])
    scale, mu = ADVANTAGES[objective].closure(rewards, c, 1e-6)
    acc.close_group("g", scale, mu)
    return acc.batch[0].double()


def _direct(rewards, H, objective):
    adv = ADVANTAGES[objective].advantages(rewards, 1e-6)
    return sum(a * h for a, h in zip(adv, H.double())) / len(rewards)


def _textbook(rewards, H, objective):
    r = torch.tensor(rewards, dtype=torch.float64)
    m = len(rewards)
    if objective == "grpo":
        a = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
    elif objective == "dr_grpo":
        a = r - r.mean()
    else:
        a = r - (r.sum() - r) / (m - 1)
    return (a[:, None] * H.double()).sum(0) / m


@pytest.mark.parametrize("objective", ["grpo", "dr_grpo", "rloo"])
def test_streamed_closure_equals_textbook_advantages(objective):
    g = torch.Generator().manual_seed(0)
    H = torch.randn(6, 1000, generator=g, dtype=torch.float64)
    rewards = [0.1, 0.9, 0.4, 0.4, 1.0, 0.0]
    ref = _textbook(rewards, H, objective)
    for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 2, 4]):
        got = _stream(rewards, H, objective, torch.float64, order)
        assert torch.allclose(got, ref, rtol=0, atol=1e-12 * ref.abs().max())
    assert torch.allclose(_direct(rewards, H, objective), ref, rtol=0, atol=1e-12 * ref.abs().max())


@pytest.mark.parametrize("rewards", [[0.3] * 8, [100.5] * 8])
def test_uniform_group_is_exactly_zero_in_fp32(rewards):
    H = torch.randn(8, 4096, generator=torch.Generator().manual_seed(1))
    got = _stream(rewards, H, "grpo", torch.float32, list(range(8)))
    assert torch.count_nonzero(got) == 0


def test_shifted_sums_survive_large_nearly_equal_rewards():
    # Σ r H − μ Σ H cancels catastrophically here; the shifted form does not.
    rng = random.Random(0)
    rewards = [100.5 + 0.01 * rng.random() for _ in range(8)]
    H = torch.randn(8, 4096, generator=torch.Generator().manual_seed(2))
    ref = _textbook(rewards, H, "grpo")
    got = _stream(rewards, H, "grpo", torch.float32, list(range(8)))
    assert float((got - ref).norm() / ref.norm()) < 1e-5


def test_reused_pairs_need_no_zeroing():
    """Pairs go back to the pool with their data: later groups write before they add, an
    unwritten G1' counts as zero, and the member that closes a group may fold direct."""
    g = torch.Generator().manual_seed(3)
    n = 1000
    acc = GradAccumulators([torch.zeros(n, dtype=torch.float64)], k_open=1, dtype=torch.float64)
    ref = torch.zeros(n, dtype=torch.float64)
    cases = [  # (rewards, members with no scored tokens (H = 0, never folded), last direct)
        ([0.1, 0.9, 0.4, 0.4], set(), False),
        ([0.3, 0.3, 0.3, 0.3], set(), False),  # G1' never written
        ([0.5, 0.2, 0.2, 0.8], {0}, False),  # c = 0.5 but the first fold has r − c ≠ 0
        ([0.7, 0.7, 0.1], set(), True),
        ([0.2, 0.6], set(), True),  # one pair fold: only G2 written
    ]
    for k, (rewards, unfolded, last_direct) in enumerate(cases):
        H = torch.randn(len(rewards), n, generator=g, dtype=torch.float64)
        H[list(unfolded)] = 0.0
        acc.open_group(f"g{k}", shift=rewards[0])
        for i in range(len(rewards)):
            if i in unfolded:
                continue
            if last_direct and i == len(rewards) - 1:
                acc.fold_direct([H[i]], ADVANTAGES["grpo"].source_coef(rewards, i, 1e-6))
            else:
                acc.fold_pair(f"g{k}", [H[i]], rewards[i])
        scale, mu = ADVANTAGES["grpo"].closure(rewards, rewards[0], 1e-6)
        acc.close_group(f"g{k}", scale, mu)
        ref += _textbook(rewards, H, "grpo")
        assert torch.allclose(acc.batch[0], ref, rtol=0, atol=1e-12 * ref.abs().max()), rewards
    assert len(acc._free) == 2  # one pair (G1', G2) served every group


def _src(t, g, v=0):
    return TrajectorySource(t, g, (1, 2), (0, 1), 1.0, v)


def test_queue_release_rules_and_admission_cap():
    plan = BatchPlan()
    for g in "ABC":
        plan.add_group(g, [f"{g}{i}" for i in range(3)])
    arrivals = ["A0", "B0", "C0", "A1", "B1", "C1", "A2", "B2", "C2"]
    for schedule in ("sync", "group_ready", "thundersync"):
        q = ReadinessQueue(schedule, plan, k_open=1)
        served, seen = [], {}
        for a in arrivals:
            q.arrive(_src(a, a[0]))
            seen[a[0]] = seen.get(a[0], 0) + 1
            if seen[a[0]] == 3:  # the learner's call: every reward of the group is known
                q.complete(a[0])
            while (s := q.next()) is not None:
                served.append(s)
                assert q.open_groups <= 1
        q.close()
        while (s := q.next()) is not None:
            served.append(s)
        ids = [s.source.traj_id for s in served]
        assert sorted(ids) == sorted(arrivals)
        assert [s.last_here for s in served].count(True) == 3
        if schedule == "sync":
            assert ids == ["A0", "A1", "A2", "B0", "B1", "B2", "C0", "C1", "C2"]
            assert all(s.fold == "direct" for s in served)
        if schedule == "group_ready":
            assert all(s.fold == "direct" for s in served)
            assert ids[:3] == ["A0", "A1", "A2"]
        if schedule == "thundersync":
            # A is opened at once; B and C wait for A to close (cap 1); work conserving.
            # The member that completes A knows its advantage: it folds direct and closes A.
            assert ids[:3] == ["A0", "A1", "A2"]
            assert [s.fold for s in served[:3]] == ["pair", "pair", "direct"]
            assert served[2].closes_group and served[2].last_here


def test_queue_group_completed_by_announcement():
    """Balanced routing: a rank holds some members; the rest are announced (rewards only)."""
    plan = BatchPlan()
    plan.add_group("A", ["A0", "A1", "A2"])
    q = ReadinessQueue("thundersync", plan, k_open=1)
    q.arrive(_src("A0", "A"))
    s = q.next()
    assert (s.source.traj_id, s.fold, s.closes_group, s.last_here) == ("A0", "pair", False, False)
    assert q.next() is None and q.open_groups == 1
    q.complete("A")  # A1, A2 were served elsewhere: only the pair's close is left here
    s = q.next()
    assert (s.source, s.group_id, s.closes_group, s.last_here) == (None, "A", True, True)
    assert q.next() is None and q.open_groups == 0 and q.pending() == 0
    g = ReadinessQueue("group_ready", plan, k_open=1)
    g.arrive(_src("A1", "A"))
    assert g.next() is None  # held until the group's rewards are all known
    g.complete("A")
    s = g.next()
    assert (s.source.traj_id, s.fold, s.last_here) == ("A1", "direct", True)


def test_balanced_router_least_assigned_and_announces_split_groups_only():
    groups = {"A": ["a0", "a1"], "B": ["b0", "b1"], "C": ["c0"]}
    r = BalancedRouter(groups, 2)
    assert r.route("a0", "A", 0.1, 10).rank == 0
    assert r.route("b0", "B", 0.2, 3).rank == 1
    assert r.route("b1", "B", 0.3, 3).rank == 1  # 6 < 10: B stays whole, no announcement
    last_b = r.route("c0", "C", 0.9, 5)  # rank 1 (6 < 10); a one-member group
    assert (last_b.rank, last_b.rewards, last_b.announce_to) == (1, None, ())
    a1 = r.route("a1", "A", 0.5, 1)  # 10 vs 11: rank 0 again, A whole on rank 0
    assert (a1.rank, a1.rewards) == (0, None)
    r2 = BalancedRouter(groups, 2)
    r2.route("a0", "A", 0.1, 10)
    split = r2.route("a1", "A", 0.5, 1)  # rank 1 (0 < 10): A is split
    assert split.rank == 1 and split.rewards == {"a0": 0.1, "a1": 0.5}
    assert split.announce_to == (0, 1)


def test_group_assignment_is_balanced_and_deterministic():
    plan = BatchPlan()
    tokens = {}
    for g in range(10):
        plan.add_group(f"g{g}", ["a"])
        tokens[f"g{g}"] = 10 * (g + 1)
    owner = assign_groups(plan, tokens, 3)
    assert owner == assign_groups(plan, tokens, 3)
    load = [sum(tokens[g] for g, r in owner.items() if r == k) for k in range(3)]
    assert max(load) - min(load) <= 10
    # token counts unknown (the channel registers groups before any token exists): by count
    blind = assign_groups(plan, {}, 3)
    assert sorted(list(blind.values()).count(k) for k in range(3)) == [3, 3, 4]


def test_config_errors_name_the_key(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("learner:\n  k_opn: 2\n")
    with pytest.raises(ConfigError, match="learner.k_opn"):
        load_config(p)
    p.write_text("learner:\n  schedule: fast\n")
    with pytest.raises(ConfigError, match="learner.schedule"):
        load_config(p)
    p.write_text("optim:\n  lr: -1\n")
    with pytest.raises(ConfigError, match="optim.lr"):
        load_config(p)
    p.write_text("model:\n  tp: two\n")
    with pytest.raises(ConfigError, match="model.tp"):
        load_config(p)
    cfg = load_config(None, {"learner.k_open": 3})
    assert cfg.learner.k_open == 3 and cfg.optim.lr == 1e-6
    p.write_text("rollout:\n  routing: random\n")
    with pytest.raises(ConfigError, match="rollout.routing"):
        load_config(p)
    with pytest.raises(ConfigError, match="rollout.routing.*OPD routes by group"):
        load_config(None, {"learner.objective": "opd", "rollout.routing": "balanced"})
    assert load_config(None, {}).routing == "balanced"  # auto, GRPO
    assert load_config(None, {"learner.objective": "opd"}).routing == "static"


def test_shipped_configs_load():
    import glob
    paths = glob.glob("configs/*.yaml")
    assert paths
    for p in paths:
        load_config(p)


def test_token_norm_auto_and_objective_names():
    assert load_config(None, {}).learner.token_norm == "trajectory"  # GRPO family
    assert load_config(None, {"learner.objective": "opd"}).learner.token_norm == "token_mean"
    with pytest.raises(ConfigError, match="learner.token_norm.*OPD streams turns"):
        load_config(None, {"learner.objective": "opd", "learner.token_norm": "trajectory"})
    with pytest.raises(ConfigError, match="learner.objective.*'ppo'"):
        load_config(None, {"learner.objective": "ppo"})
    with pytest.raises(ConfigError, match="learner.max_open_bytes"):
        load_config(None, {"learner.max_open_bytes": -1})


def test_queue_turns_wait_for_their_previous_turn_and_prefer_a_warm_context():
    from tsync_mcore.channel.sources import TurnSource

    def turn(t, j, g="G"):
        return TurnSource(t, g, j, 3, j * 2, (1, 2), (0, 1), (None, -1.0), 0)

    plan = BatchPlan(groups={"G": ["a", "b"]}, n_turns={"a": 3, "b": 3})
    q = ReadinessQueue("thundersync", plan, k_open=1)
    q.arrive(turn("a", 1))  # early: waits for a#0
    assert q.next() is None
    for u in (turn("b", 0), turn("a", 0)):
        q.arrive(u)
    served = [q.next().source.key for _ in range(2)]
    assert served == ["b#0", "a#0"]  # release order among starts
    q.arrive(turn("b", 1))
    # a was served last and its next turn is released: it runs first, context warm
    assert [q.next().source.key for _ in range(2)] == ["a#1", "b#1"]
    assert q.next() is None
    g = ReadinessQueue("group_ready", plan, k_open=1)
    for u in (turn("a", 0), turn("b", 0), turn("a", 1)):
        g.arrive(u)
    assert g.next() is None  # OPD group_ready: the whole group's turns first
    g.complete("G")
    assert g.next().source.key == "a#0"
    s = ReadinessQueue("sync", plan, k_open=1)
    for u in (turn("b", 1), turn("a", 0), turn("b", 0), turn("a", 1)):
        s.arrive(u)
    s.close()
    order = []
    while (svc := s.next()) is not None:
        order.append(svc.source.key)
    assert order == ["a#0", "a#1", "b#0", "b#1"]  # registered order, turns in order


def test_stopped_prints_one_line_and_keeps_the_traceback(tmp_path, capsys):
    from tsync_mcore.cli.launch import stopped
    try:
        raise RuntimeError("CUDA out of memory\nmore detail")
    except RuntimeError as e:
        code = stopped("learner rank 1", e, str(tmp_path))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 4 and len(err) == 1
    assert err[0].startswith("error: learner rank 1 stopped: RuntimeError: CUDA out of memory at ")
    assert "Traceback" in open(tmp_path / "logs" / "learner_rank_1.traceback").read()
    assert stopped("rollout", KeyboardInterrupt(), str(tmp_path)) == 130


def test_uniform_group_adds_exactly_nothing_and_equal_rewards_fold_into_g2_alone():
    H = torch.randn(4, 64, dtype=torch.float64)
    # every reward equal: the group's term is exactly zero, whatever its scale (no NaN)
    acc = GradAccumulators([torch.full((64,), 3.0)], k_open=1)
    acc.batch[0].fill_(3.0)
    acc.open_group("g", shift=1.0)
    for h in H:
        acc.fold_pair("g", [h.float()], 1.0)
    acc.close_group("g", float("inf"), 0.0)
    assert torch.equal(acc.batch[0], torch.full((64,), 3.0)) and not acc.open
    # rewards 0, 1, 0, 0 after c = 0: the reward-0 members after G1' exists touch G2 only,
    # and the sum still equals the textbook group gradient
    rewards = [0.0, 1.0, 0.0, 0.0]
    for objective in ("grpo", "dr_grpo"):
        got = _stream(rewards, H, objective, torch.float64, [0, 1, 2, 3])
        assert torch.allclose(got, _textbook(rewards, H, objective), rtol=1e-10, atol=1e-12)
