"""The OpenAI endpoint's per-trajectory recorder (tsync_mcore.rollout.openai.session): no
engine, the demo model's tokenizer. An agent's conversation must map to exactly the ids the
built-in agent loop feeds the engine."""

from __future__ import annotations

import asyncio
import json

import pytest

from tsync_mcore.rollout.engine import GenOut
from tsync_mcore.rollout.envs import (
    ToyToolConfig,
    ToyToolEnv,
    observation_ids,
    prompt_ids,
)
from tsync_mcore.rollout.loop import run_trajectory
from tsync_mcore.channel.sources import MAX_SEGMENTS
from tsync_mcore.rollout.openai.session import (
    HistoryRewritten,
    LimitReached,
    Session,
    SessionError,
    assistant_message,
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from tsync_mcore.model.tiny import DEMO_MODEL, make_tiny_checkpoint

    d = make_tiny_checkpoint(str(tmp_path_factory.mktemp("demo") / "m"), **DEMO_MODEL)
    return AutoTokenizer.from_pretrained(d)


def digits(tok):
    return sorted(ToyToolEnv(tok).target_ids)


class Scripted:
    """An engine that answers turn i with scripted[i] (log-probs -0.5, version 3)."""

    def __init__(self, scripted):
        self.scripted, self.prompts = list(scripted), []

    async def generate(self, prompt_ids, *, max_tokens, temperature=1.0, seed=None, **kw):
        self.prompts.append(list(prompt_ids))
        ids = self.scripted[len(self.prompts) - 1][:max_tokens]
        return GenOut(list(ids), [-0.5] * len(ids), "stop", 3, [3] * len(ids))


def script(tok):
    d, eos = digits(tok), tok.eos_token_id
    return [[d[0], d[1], eos],  # ends with EOS: the observation adds no closing id
            [d[2], 65, 66, d[3]],  # cut by length: the observation closes it
            [d[4], eos]]


def agent_turns(tok, session, actions, target, with_eos_count=True):
    """What the demo agent does: task messages, each answer appended, the counter's text."""
    messages = ToyToolEnv.task_messages(7)
    n_t = n_a = 0
    prompts = []
    for i, a in enumerate(actions):
        p = session.plan_chat(messages)
        prompts.append(p.prompt_ids)
        out = GenOut(list(a), [-0.5] * len(a), "stop", 3, [3] * len(a))
        answer = assistant_message(tok.decode(a, skip_special_tokens=True), False, i)
        session.commit(p, out, answer)
        n_a += len(a)
        n_t += sum(t in target for t in a)
        messages = messages + [answer, {"role": "tool",
                                        "content": ToyToolEnv.tool_text(n_t, n_a)}]
    return prompts


def test_an_agents_conversation_is_the_built_in_loops_ids(tok):
    actions = script(tok)
    env = ToyToolEnv(tok, ToyToolConfig(max_turns=3, latency_median_s=1e-4,
                                        tool_timeout_s=5.0))
    engine = Scripted(actions)
    res = asyncio.run(run_trajectory(engine, env, max_turns=3, max_tokens_per_turn=8,
                                     max_total_tokens=400, seed=5, env_seed=7))
    s = Session(tok, "t0", seed=5, max_turns=3, max_tokens_per_turn=8, max_total_tokens=400)
    prompts = agent_turns(tok, s, actions, env.target_ids)
    assert prompts == engine.prompts  # every turn's prompt, id for id
    got = s.result(env.reward(), "agent_exit")
    assert got.tokens == res.tokens
    assert got.scored_mask == res.scored_mask
    assert got.turn_ends == res.turn_ends and got.prompt_len == res.prompt_len
    assert got.logprobs == res.logprobs and got.token_versions == res.token_versions
    assert s.prompt_len == len(prompt_ids(tok, ToyToolEnv.task_messages(7)))
    # the second turn's added ids are observation_ids' (EOS already sampled: no closing)
    obs = observation_ids(tok, [{"role": "tool", "content": "2/3 digits"}], actions[0])
    assert s.turns[1]["prompt_ids"] == obs
    assert s.turns[2]["prompt_ids"][0] == tok.eos_token_id  # length-cut turn closed by EOS
    rec = s.record(reward=1.0)
    json.dumps(rec)
    assert rec["rewrites"] == 0 and rec["requests"] == 3


def test_a_rewritten_history_is_refused_or_starts_a_segment(tok):
    actions = script(tok)
    for mode in ("reject", "segment"):
        s = Session(tok, "t1", history=mode)
        messages = ToyToolEnv.task_messages(1)
        p = s.plan_chat(messages)
        s.commit(p, GenOut(actions[0], [-1.0] * 3, "stop", 0), {"role": "assistant",
                                                                "content": "x"})
        edited = messages + [{"role": "assistant", "content": "something else"},
                             {"role": "tool", "content": "1/3 digits"}]
        if mode == "reject":
            with pytest.raises(HistoryRewritten, match="messages\\[1\\] differs from the "
                                                       "assistant message"):
                s.plan_chat(edited)
            assert s.rewrites == 1 and s.n_turns == 1  # nothing changed
            continue
        p = s.plan_chat(edited)
        assert p.new_segment and p.rewritten
        s.commit(p, GenOut(actions[2], [-1.0] * 2, "stop", 0))
        assert s.rewrites == 1 and len(s.segments) == 1 and s.n_turns == 1
        assert s.prompt_len == len(p.prompt_ids)
        assert s.tokens == p.prompt_ids + actions[2]
        # dropping messages is a rewrite too: yet another segment
        q = s.plan_chat(edited[:1])
        assert q.new_segment and s.rewrites == 2


def test_tool_call_messages_round_trip(tok):
    tools = [{"type": "function", "function": {"name": "python", "parameters": {}}}]
    s = Session(tok, "t2")
    messages = [{"role": "user", "content": "run it"}]
    p = s.plan_chat(messages, tools=tools)
    text = 'ok <tool_call>{"name": "python", "arguments": {"code": "1+1"}}</tool_call>'
    action = tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]
    answer = assistant_message(tok.decode(action, skip_special_tokens=True), True, 0)
    assert answer["content"] == "ok"
    call = answer["tool_calls"][0]
    assert call["function"]["name"] == "python"
    assert json.loads(call["function"]["arguments"]) == {"code": "1+1"}
    s.commit(p, GenOut(action, [-0.1] * len(action), "stop", 0), answer)
    # what the openai client sends back: the message as returned (arguments a string)
    back = {"role": "assistant", "content": "ok",
            "tool_calls": [{"id": call["id"], "type": "function",
                            "function": {"name": "python", "arguments": '{"code":"1+1"}'}}]}
    result = {"role": "tool", "tool_call_id": call["id"], "content": "2"}
    q = s.plan_chat(messages + [back, result], tools=tools)
    assert not q.new_segment
    assert q.new_ids == observation_ids(tok, [{"role": "tool", "content": "2"}], action)
    assert q.prompt_ids == s.tokens + q.new_ids
    # another tool list is another conversation
    with pytest.raises(HistoryRewritten, match="tools"):
        Session(tok, "t3", history="reject")._rewrite("the request's tools differ")


def test_text_completions_extend_by_ids_or_text(tok):
    s = Session(tok, "t4", history="reject", max_turns=4)
    p = s.plan_text("Hello there")
    s.commit(p, GenOut([65, 66], [-1.0, -1.0], "length", 0))
    p = s.plan_text(s.tokens + [67])
    assert p.new_ids == [67]
    s.commit(p, GenOut([68], [-1.0], "length", 0))
    text = tok.decode(s.tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    p = s.plan_text(text + " more")
    assert p.new_ids == tok(" more", add_special_tokens=False).input_ids
    with pytest.raises(SessionError, match="adds no tokens"):
        s.plan_text(list(s.tokens))
    with pytest.raises(HistoryRewritten, match="ids do not start"):
        s.plan_text([1, 2, 3])
    with pytest.raises(HistoryRewritten, match="chat request after a text completion"):
        s.plan_chat([{"role": "user", "content": "hi"}])


def test_budgets_are_the_built_in_loops(tok):
    s = Session(tok, "t5", max_turns=1, max_tokens_per_turn=8, max_total_tokens=40)
    p = s.plan_chat([{"role": "user", "content": "hi"}], max_tokens=100)
    assert p.max_tokens == 8
    assert s.plan_chat([{"role": "user", "content": "hi"}], max_tokens=3).max_tokens == 3
    s.commit(p, GenOut([65], [-1.0], "stop", 0), {"role": "assistant", "content": "A"})
    with pytest.raises(SessionError, match="used its 1 turns"):
        s.plan_chat([{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "A"}, {"role": "user", "content": "b"}])
    long = Session(tok, "t6", max_total_tokens=5)
    with pytest.raises(SessionError, match="reaches rollout.max_total_tokens=5"):
        long.plan_chat([{"role": "user", "content": "a long message " * 5}])
    s.closed = "its agent exited"
    with pytest.raises(SessionError, match="closed: its agent exited"):
        s.plan_text("x")


def rewrite_each_turn(s, n, tokens=1):
    """A hostile agent: n requests, each a one-message conversation of its own (a history
    rewrite: a new segment), `tokens` sampled; the LimitReached that stopped it, or None."""
    for k in range(n):
        try:
            p = s.plan_chat([{"role": "user", "content": f"rewrite {k}: " + "go on " * 4}])
        except LimitReached as e:
            return e
        ids = [65 + k % 20] * min(tokens, p.max_tokens)
        s.commit(p, GenOut(ids, [-0.5] * len(ids), "length", 3, [3] * len(ids)),
                 {"role": "assistant", "content": "A"})
    return None


def test_limits_hold_over_every_segment_of_a_rewriting_trajectory(tok):
    """Turns, sampled tokens, segments and trained tokens are counted over the whole
    trajectory: 1-token rewrites cannot buy a fresh budget per segment. A refused request
    records nothing; what was recorded stays trainable (at most max_segments segments)."""
    prompt = len(Session(tok, "p").plan_chat(
        [{"role": "user", "content": "rewrite 0: " + "go on " * 4}]).prompt_ids)
    s = Session(tok, "turns", max_turns=3, max_tokens_per_turn=8, max_total_tokens=160)
    e = rewrite_each_turn(s, 300)
    assert e.limit == "max_turns" and "used its 3 turns" in str(e) and "\n" not in str(e)
    res = s.result(0.5, "agent_exit")
    assert len(res.segments()) == 3 and res.n_scored == 3 and s.rewrites == 2
    trained = sum(len(seg["tokens"]) for seg in res.segments())
    assert trained == s.record()["trained_tokens"] <= 3 * 160

    s = Session(tok, "segments", max_turns=10**6, max_total_tokens=10**6)
    e = rewrite_each_turn(s, 300)  # 256 by default: what a source carries
    assert e.limit == "max_segments" and len(s.segments) + 1 == MAX_SEGMENTS
    s = Session(tok, "segments", max_turns=10**6, max_total_tokens=10**6, max_segments=5)
    assert rewrite_each_turn(s, 300).limit == "max_segments" and len(s.segments) == 4
    assert s.n_requests == 5 and s.rewrites == 5  # the refused one counted, not recorded

    # sampled: what one context leaves after the first prompt, over every segment
    s = Session(tok, "sampled", max_turns=10**6, max_total_tokens=prompt + 10)
    e = rewrite_each_turn(s, 300, tokens=3)
    assert e.limit == "max_total_tokens" and s.n_sampled == 10 and "sampled 10 tokens" in str(e)
    assert s.record()["sampled_tokens"] == 10 and s.n_requests == 4  # 3 + 3 + 3 + 1

    # trained: prompt and completion of every segment
    s = Session(tok, "trained", max_turns=10**6, max_total_tokens=prompt + 50,
                max_trained_tokens=4 * prompt)
    e = rewrite_each_turn(s, 300, tokens=1)
    assert e.limit == "max_trained_tokens", e
    assert s.record()["trained_tokens"] <= 4 * prompt and len(s.segments) + 1 == 3
    # an extension of the last segment is held to the same total
    s = Session(tok, "trained2", max_turns=10**6, max_total_tokens=10**6)
    rewrite_each_turn(s, 2)  # two segments
    more = s._conv + [{"role": "user", "content": "x"}]
    ext = len(s.plan_chat(more).prompt_ids)
    s.max_trained_tokens = s.earlier_tokens + ext + 4
    p = s.plan_chat(more, max_tokens=8)
    assert not p.new_segment and p.max_tokens == 4
    s.max_trained_tokens -= 4
    with pytest.raises(LimitReached, match="max_trained_tokens"):
        s.plan_chat(more)


def test_a_trajectory_that_never_rewrites_keeps_its_budgets(tok):
    """The limits over segments never cut a trajectory that extends its one context: its
    turns and its context length bound it as before (the built-in loop's budgets)."""
    s = Session(tok, "honest", max_turns=3, max_tokens_per_turn=8, max_total_tokens=160,
                max_segments=1, max_trained_tokens=160)
    prompts = agent_turns(tok, s, script(tok), set())
    assert len(prompts) == 3 and not s.segments and s.rewrites == 0
    assert s.record()["trained_tokens"] == len(s.tokens) <= 160


def test_a_lone_surrogate_is_a_400_line_not_a_tokenizer_error(tok):
    """JSON can carry "\\ud800"; no tokenizer takes a lone surrogate (HF raises TypeError)."""
    s = Session(tok, "t7")
    with pytest.raises(SessionError, match=r"not valid Unicode \(a lone surrogate '\\ud800'"):
        s.plan_chat([{"role": "user", "content": "a\ud800b"}])
    with pytest.raises(SessionError, match="not valid Unicode"):
        s.plan_text("x\udfff")
    assert s.plan_chat([{"role": "user", "content": "ab"}]).max_tokens >= 1  # still usable


def _qwen3(tok):
    import copy

    from tests.helpers.qwen3_template import QWEN3_CHAT_TEMPLATE
    q = copy.deepcopy(tok)
    q.chat_template = QWEN3_CHAT_TEMPLATE
    return q


def _turn(s, tok, messages, text):
    """One chat turn whose completion is `text` (then EOS); returns (pending, answer)."""
    p = s.plan_chat(messages)
    ids = list(tok(text, add_special_tokens=False).input_ids) + [tok.eos_token_id]
    answer = {"role": "assistant", "content": text}
    s.commit(p, GenOut(ids, [-0.5] * len(ids), "stop", 0, [0] * len(ids)), answer)
    return p, answer


def test_qwen3s_template_extends_tool_turns_and_rewrites_at_a_new_query(tok):
    """Qwen3's template wraps the conversation's last answer in an empty think block and
    drops earlier answers' reasoning once a user query follows. A tool turn after an answer
    without reasoning extends the record (the prompt starts with what the model saw and
    wrote); a user query after an answer with reasoning rewrites it (a new segment, the
    prompt rendered afresh); every prompt the engine gets is the record, id for id."""
    q = _qwen3(tok)
    s = Session(q, "t", max_turns=8, max_tokens_per_turn=64, max_total_tokens=4000)
    msgs = [{"role": "system", "content": "Count."}, {"role": "user", "content": "Go."}]
    p0, a0 = _turn(s, q, msgs, "12 34")
    msgs = msgs + [a0, {"role": "tool", "content": "2/2 digits"}]
    p1, a1 = _turn(s, q, msgs, "<think>more</think>56")
    assert not p1.new_segment and s.rewrites == 0
    assert p1.prompt_ids == p0.prompt_ids + s.turns[0]["completion_ids"] + p1.new_ids
    want = q.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert q.decode(p1.prompt_ids, skip_special_tokens=False) == want
    # a new user query: the template drops the think block of the answer before it
    msgs = msgs + [a1, {"role": "user", "content": "Again."}]
    p2, _ = _turn(s, q, msgs, "7")
    assert p2.new_segment and p2.rewritten and s.rewrites == 1 and len(s.segments) == 1
    assert "more" not in q.decode(p2.prompt_ids)
    assert p2.prompt_ids == list(q(q.apply_chat_template(msgs, tokenize=False,
                                                         add_generation_prompt=True),
                                   add_special_tokens=False).input_ids)
    res = s.result(1.0, "agent_exit")
    c = [len(t["completion_ids"]) for t in res.earlier[0]["turns"]]
    assert len(res.earlier) == 1 and res.earlier[0]["turn_ends"] == [
        len(p0.prompt_ids) + c[0], len(p1.prompt_ids) + c[1]]
    assert res.n_scored == sum(len(t["completion_ids"]) for seg in res.earlier
                               for t in seg["turns"]) + len(s.turns[0]["completion_ids"])


def test_qwen3s_non_thinking_prompt_is_rewritten_by_the_next_query(tok):
    """chat_template_kwargs {"enable_thinking": false}: the prompt ends in an empty think
    block the model saw; the next user query renders that answer without it: a rewrite.
    The request's kwargs are checked before any rendering."""
    from tsync_mcore.rollout.openai.params import ApiError, template_kwargs
    q = _qwen3(tok)
    off = {"enable_thinking": False}
    s = Session(q, "t", max_turns=8, max_tokens_per_turn=64, max_total_tokens=4000)
    msgs = [{"role": "user", "content": "Go."}]
    p0 = s.plan_chat(msgs, kwargs=off)
    assert q.decode(p0.prompt_ids).endswith("<think>\n\n</think>\n\n")
    ids = list(q("12", add_special_tokens=False).input_ids) + [q.eos_token_id]
    a0 = {"role": "assistant", "content": "12"}
    s.commit(p0, GenOut(ids, [-0.5] * len(ids), "stop", 0, [0] * len(ids)), a0)
    p1 = s.plan_chat(msgs + [a0, {"role": "user", "content": "More."}], kwargs=off)
    assert p1.new_segment and p1.rewritten
    assert template_kwargs({"chat_template_kwargs": off}) == off
    for bad in ([1], {"tokenize": True}, {"x y": 1}, {"k": [1]}, {"k": "x" * 2000},
                {f"k{i}": 1 for i in range(17)}):
        with pytest.raises(ApiError, match="chat_template_kwargs"):
            template_kwargs({"chat_template_kwargs": bad})


def test_the_built_in_loop_renders_turns_with_the_chat_template(tok):
    """rollout.render: template. With a template that extends (the demo's ChatML) the loop
    feeds the engine the very ids the token loop does; with Qwen3's non-thinking prompt each
    tool turn drops the empty think block the model saw, so every turn is a segment of its
    own, each prompt the template's rendering of the conversation, every sampled id kept."""
    from tsync_mcore.rollout.loop import run_rendered

    def env():
        return ToyToolEnv(tok, ToyToolConfig(max_turns=3, latency_median_s=1e-4,
                                             tool_timeout_s=5.0))
    kw = dict(max_turns=3, max_tokens_per_turn=8, max_total_tokens=400, seed=5, env_seed=7)
    tokens_engine, rendered_engine = Scripted(script(tok)), Scripted(script(tok))
    want = asyncio.run(run_trajectory(tokens_engine, env(), **kw))
    got = asyncio.run(run_rendered(rendered_engine, env(), tokenizer=tok, **kw))
    assert rendered_engine.prompts == tokens_engine.prompts
    assert (got.tokens, got.scored_mask, got.turn_ends, got.earlier) == \
        (want.tokens, want.scored_mask, want.turn_ends, [])
    assert got.reward == want.reward and got.stop_reason == want.stop_reason

    q = _qwen3(tok)
    engine = Scripted(script(q))
    res = asyncio.run(run_rendered(engine, ToyToolEnv(q, ToyToolConfig(
        max_turns=3, latency_median_s=1e-4, tool_timeout_s=5.0)), tokenizer=q,
        template_kwargs={"enable_thinking": False}, **kw))
    assert len(res.earlier) == 2  # three turns, three segments
    for p, seg in zip(engine.prompts, res.segments()):
        assert seg["tokens"][:len(p)] == p and q.decode(p).endswith("<think>\n\n</think>\n\n")
    assert res.n_scored == sum(len(a[:8]) for a in script(q))
