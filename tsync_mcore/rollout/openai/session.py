"""Token-exact recording of one trajectory served through the OpenAI-compatible endpoint.

An agent speaks messages (or text); the learner trains on token ids. A `Session` keeps,
per trajectory, the ids the engine saw and sampled: the first request's prompt, every
sampled completion exactly as vLLM returned it (scored), and between them the ids of the
messages the agent added (unscored) — never a re-tokenization of text the model wrote.

A chat request *extends* the trajectory when its messages start with the previous
request's messages followed by the assistant message the server returned (compared by
role, content and tool calls). Its new ids are then the recorded ids plus the ids of the
new messages only, laid out exactly as the built-in loop lays out an observation
(`envs.observation_ids`): the EOS that closes the assistant turn (unless the completion
already ended with it: one cut by max_tokens or at a stop string did not), then the rest
of the template's text after the assistant's content, tokenized. Any other request rewrote history: `history="reject"` refuses it
(`HistoryRewritten`, HTTP 400); `history="segment"` starts a new segment from that
request's prompt. Every segment trains: each is sent as a source of its own with the
trajectory's reward (`TrajectorySource.segment`), and the record lists the earlier ones.

The limits hold over the whole trajectory, every segment counted: its turns
(`max_turns`), its sampled tokens (at most what one unrewritten context leaves after the
first prompt: `max_total_tokens` − that prompt), its segments (`max_segments`) and the
tokens it trains (`max_trained_tokens`: prompt and completion of every segment, since a
rewrite re-trains the history it repeats); one segment's context stays within
`max_total_tokens`. A request past a limit is refused (`LimitReached`, HTTP 400) and
records nothing: the trajectory keeps what it has and ends by its own rules, as one that
used its turns.

A text request (`/v1/completions`) extends when its prompt ids start with the recorded
ids, or its prompt text starts with the recorded ids decoded (special tokens kept); the
remainder is tokenized.

Pure: no engine, no server. `plan_*` computes the next prompt without changing the
session; `commit` records the engine's answer, so a failed generation leaves no trace.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tsync_mcore.channel.sources import MAX_SEGMENTS
from tsync_mcore.rollout.types import TrajectoryResult, turn_seed
from tsync_mcore.sandbox.tools import parse_tool_calls

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_SENTINEL = "\x00TSYNC-ASSISTANT-END\x00"


class SessionError(ValueError):
    """A request this trajectory cannot take (HTTP 400); the message says why, in one line."""


class HistoryRewritten(SessionError):
    """The request's prompt is not a token-exact extension of the trajectory so far."""


class LimitReached(SessionError):
    """The trajectory has used a budget (`limit`: the rollout key that sets it)."""

    def __init__(self, message: str, limit: str):
        super().__init__(message)
        self.limit = limit


class BadMessage(SessionError):
    """A chat message of the wrong shape; `param` names the field, as OpenAI's errors do
    (messages[2].tool_calls[0].function)."""

    def __init__(self, message: str, param: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def _text(content: Any) -> str:
    """Message content as text: None → "", a list of parts → their text joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "text":
                parts.append(str(p.get("text", "")))
            elif isinstance(p, str):
                parts.append(p)
            else:
                raise SessionError(f"message content part of type "
                                   f"{p.get('type') if isinstance(p, dict) else type(p).__name__!r}"
                                   f" is not supported (text only)")
        return "".join(parts)
    raise SessionError(f"message content must be a string or a list of text parts, "
                       f"got {type(content).__name__}")


def _args(a: Any) -> Any:
    if isinstance(a, str):
        try:
            return json.loads(a)
        except (json.JSONDecodeError, RecursionError):
            return a
    return a


def _calls_key(calls: Any) -> tuple:
    return tuple((c["function"]["name"],
                  json.dumps(_args(c["function"].get("arguments")), sort_keys=True))
                 for c in calls or [])


def _kind(v: Any) -> str:
    return {str: "a string", list: "a list", dict: "an object", bool: "a boolean",
            type(None): "null"}.get(type(v), f"a {type(v).__name__}")


def check_message(i: int, m: Any) -> None:
    """OpenAI's shape of messages[i], or BadMessage naming the field: an object with a
    string role; content text, text parts or null; tool_calls a list of {"function":
    {"name": <non-empty string>, "arguments": <JSON text or object>}} (id a string, type
    "function"); tool_call_id and name strings."""
    at = f"messages[{i}]"
    if not isinstance(m, dict):
        raise BadMessage(f"must be an object, got {_kind(m)}", at)
    if not isinstance(m.get("role"), str) or not m["role"]:
        raise BadMessage(f"must be a non-empty string, got {_kind(m.get('role'))}", at + ".role")
    try:
        _text(m.get("content"))
    except BadMessage:
        raise
    except SessionError as e:
        raise BadMessage(str(e), at + ".content") from None
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None and not isinstance(m[key], str):
            raise BadMessage(f"must be a string, got {_kind(m[key])}", f"{at}.{key}")
    calls = m.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        raise BadMessage(f"must be a list of tool calls, got {_kind(calls)}", at + ".tool_calls")
    for j, c in enumerate(calls):
        where = f"{at}.tool_calls[{j}]"
        if not isinstance(c, dict):
            raise BadMessage(f"must be an object, got {_kind(c)}", where)
        if c.get("type", "function") != "function":
            raise BadMessage(f"must be 'function', got {str(c['type'])[:40]!r}", where + ".type")
        if c.get("id") is not None and not isinstance(c["id"], str):
            raise BadMessage(f"must be a string, got {_kind(c['id'])}", where + ".id")
        fn = c.get("function")
        if not isinstance(fn, dict):
            raise BadMessage(f'must be an object {{"name": ..., "arguments": ...}}, got '
                             f'{_kind(fn)}', where + ".function")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadMessage(f"must be a non-empty string, got {_kind(fn.get('name'))}",
                             where + ".function.name")
        if fn.get("arguments") is not None and not isinstance(fn["arguments"], (str, dict)):
            raise BadMessage(f"must be a JSON string or an object, got "
                             f"{_kind(fn['arguments'])}", where + ".function.arguments")


def message_key(m: dict[str, Any]) -> tuple:
    """What makes two messages the same turn: role, content (as text), tool calls (name
    and arguments, as JSON), the tool call they answer. `m` passed `check_message`."""
    return (m["role"], _text(m.get("content")), _calls_key(m.get("tool_calls")),
            m.get("tool_call_id") or "")


def render_message(m: dict[str, Any]) -> dict[str, Any]:
    """A message as the chat template takes it: content as text, tool-call arguments as
    objects (HF templates dump them)."""
    out = {k: v for k, v in m.items() if v is not None}
    out["content"] = _text(m.get("content"))
    if m.get("tool_calls"):
        out["tool_calls"] = [{"type": "function", "id": c.get("id", ""),
                              "function": {"name": c["function"]["name"],
                                           "arguments": _args(c["function"].get("arguments"))}}
                             for c in m["tool_calls"]]
    return out


def assistant_message(text: str, with_tools: bool, turn: int) -> dict[str, Any]:
    """The assistant message the server returns for a completion's text: with tools, the
    `<tool_call>` blocks become `tool_calls` and `content` is the text outside them
    (stripped; None when empty). Malformed blocks stay in the content."""
    if not with_tools:
        return {"role": "assistant", "content": text}
    calls, kept = [], []

    def take(match: re.Match) -> str:
        parsed = parse_tool_calls(match.group(0))
        if parsed and not parsed[0].error:
            kept.append(parsed[0])
            return ""
        return match.group(0)

    content = _CALL.sub(take, text)
    for j, c in enumerate(kept):
        args = c.arguments if isinstance(c.arguments, str) else json.dumps(c.arguments)
        calls.append({"id": f"call_{turn}_{j}", "type": "function",
                      "function": {"name": c.name, "arguments": args}})
    if not calls:
        return {"role": "assistant", "content": text}
    content = content.strip()
    return {"role": "assistant", "content": content or None, "tool_calls": calls}


@dataclass
class Pending:
    """The next turn's prompt, computed but not recorded yet."""

    prompt_ids: list[int]  # the whole prompt the engine gets
    new_ids: list[int]  # the ids this request adds to the record (all of it on a new segment)
    new_segment: bool  # the request starts a (new) segment
    rewritten: bool  # it started one because the history was rewritten
    messages: list[dict[str, Any]] | None  # chat: the request's messages
    tools: list[dict[str, Any]] | None
    max_tokens: int
    kwargs: dict[str, Any] | None = None  # chat_template_kwargs it was rendered with


@dataclass
class Session:
    tokenizer: Any
    traj_id: str
    version: int = 0  # the policy version of the batch it belongs to
    seed: int | None = None  # sampling seed (per turn derived as the built-in loop does)
    history: str = "segment"  # "segment" | "reject"
    # the limits (module doc): max_turns over all segments; max_total_tokens one segment's
    # context and the sampled tokens over all; max_trained_tokens 0: no bound of its own
    max_segments: int = MAX_SEGMENTS
    max_trained_tokens: int = 0
    max_turns: int = 1 << 30
    max_tokens_per_turn: int = 1 << 30
    max_total_tokens: int = 1 << 30
    # (tokens, bytes): no prompt may exceed `tokens`, and none of them spans more than
    # `bytes` (params.prompt_bytes_bound); a longer text is refused before tokenizing
    prompt_bound: tuple[int, int] | None = None
    tokens: list[int] = field(default_factory=list)
    scored_mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    token_versions: list[int | None] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    prompt_len: int = 0
    turns: list[dict[str, Any]] = field(default_factory=list)  # this segment's, for the record
    segments: list[dict[str, Any]] = field(default_factory=list)  # earlier segments
    rewrites: int = 0  # requests that rewrote history (started a segment or were refused)
    n_requests: int = 0  # turns sampled over all segments
    n_sampled: int = 0  # tokens sampled over all segments
    first_prompt_len: int = 0  # the first segment's prompt
    earlier_tokens: int = 0  # tokens of the earlier segments (each trains)
    reward: float | None = None  # posted by the agent
    closed: str = ""  # why requests are refused now ("" while open)
    _conv: list[dict[str, Any]] | None = None  # last request's messages + returned answer
    _text_ok: bool = True  # the record may be extended by a text prompt

    def __post_init__(self) -> None:
        if self.history not in ("segment", "reject"):
            raise ValueError(f"history must be 'segment' or 'reject', got {self.history!r}")

    # --- the next prompt --------------------------------------------------------------

    def _render(self, messages: Sequence[dict], tools: list | None, gen: bool,
                kwargs: dict | None = None) -> str:
        kw = {**(kwargs or {}), **({"tools": tools} if tools else {})}
        try:
            return self.tokenizer.apply_chat_template(
                [render_message(m) for m in messages], add_generation_prompt=gen,
                tokenize=False, **kw)
        except SessionError:
            raise
        except Exception as e:  # a template error names the message it could not render
            raise SessionError(f"the chat template cannot render these messages: "
                               f"{str(e).splitlines()[0] if str(e) else type(e).__name__}")

    def _ids(self, text: str) -> list[int]:
        try:
            size = len(text.encode("utf-8"))  # a lone surrogate (JSON allows it): refused
        except UnicodeEncodeError as e:
            raise SessionError(f"the messages are not valid Unicode (a lone surrogate "
                               f"{text[e.start]!r} in the rendered prompt)") from None
        if self.prompt_bound is not None and size > self.prompt_bound[1]:
            n, most = self.prompt_bound
            raise SessionError(f"the prompt is {size} bytes, more than any prompt that fits "
                               f"can be: at most {n} tokens (max_model_len, rollout."
                               f"max_total_tokens) of at most {most // n} bytes each; not "
                               f"tokenized")
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def _budget(self, prompt_len: int, max_tokens: int | None, new_segment: bool) -> int:
        """The tokens the next turn may sample from a prompt of `prompt_len` (a new
        segment's, or the current one's extended); LimitReached past a trajectory's limit."""
        t = self.traj_id
        room = self.max_total_tokens - prompt_len
        if room <= 0:
            raise LimitReached(f"trajectory {t}: the prompt of {prompt_len} tokens "
                               f"reaches rollout.max_total_tokens={self.max_total_tokens}",
                               "max_total_tokens")
        first = self.first_prompt_len if self.turn_ends else prompt_len
        sampled_room = self.max_total_tokens - first - self.n_sampled
        if sampled_room <= 0:
            raise LimitReached(f"trajectory {t} has sampled {self.n_sampled} tokens over its "
                               f"segments, all that rollout.max_total_tokens="
                               f"{self.max_total_tokens} leaves after its first prompt of "
                               f"{first}", "max_total_tokens")
        b = min(self.max_tokens_per_turn, room, sampled_room)
        if self.max_trained_tokens:
            trained = self.earlier_tokens + (len(self.tokens) if new_segment else 0) + prompt_len
            if trained >= self.max_trained_tokens:
                raise LimitReached(f"trajectory {t}: this prompt would make {trained} tokens "
                                   f"to train over its {len(self.segments) + 1 + new_segment} "
                                   f"segments, rollout.max_trained_tokens="
                                   f"{self.max_trained_tokens} leaves no room to sample",
                                   "max_trained_tokens")
            b = min(b, self.max_trained_tokens - trained)
        if max_tokens is not None:
            if max_tokens < 1:
                raise SessionError(f"max_tokens must be >= 1, got {max_tokens}")
            b = min(b, max_tokens)
        return b

    def _check_open(self) -> None:
        if self.closed:
            raise SessionError(f"trajectory {self.traj_id} is closed: {self.closed}")
        if self.n_requests >= self.max_turns:  # refused before any rendering
            raise LimitReached(f"trajectory {self.traj_id} has used its {self.max_turns} "
                               f"turns (rollout.max_turns, over all its segments)",
                               "max_turns")

    def _rewrite(self, why: str) -> None:
        """A request rewrote the history: refused under `reject` or past max_segments
        (before its prompt is rendered), else it starts a new segment."""
        self.rewrites += 1
        if self.history == "reject":
            raise HistoryRewritten(f"trajectory {self.traj_id}: {why}; the prompt is not a "
                                   f"token-exact extension of the trajectory so far "
                                   f"(rollout.openai_history: reject)")
        if len(self.segments) + 1 >= self.max_segments:
            raise LimitReached(f"trajectory {self.traj_id} has used its {self.max_segments} "
                               f"segments (rollout.max_segments): a history rewrite cannot "
                               f"start another ({why})", "max_segments")

    def plan_chat(self, messages: Sequence[dict[str, Any]], tools: list | None = None,
                  max_tokens: int | None = None, kwargs: dict | None = None) -> Pending:
        """`kwargs`: the request's chat_template_kwargs (e.g. enable_thinking)."""
        self._check_open()
        messages = list(messages)
        if not messages:
            raise SessionError("messages must not be empty")
        for i, m in enumerate(messages):
            check_message(i, m)
        keys = [message_key(m) for m in messages]
        if not self.turn_ends:
            return self._fresh_chat(messages, tools, max_tokens, False, kwargs)
        why = self._not_extension(keys, tools)
        if why:
            self._rewrite(why)
            return self._fresh_chat(messages, tools, max_tokens, True, kwargs)
        prev = self._conv
        P = self._render(prev, tools, gen=False, kwargs=self._kwargs)
        F = self._render(messages, tools, gen=True, kwargs=kwargs)
        if F.startswith(P):
            new = self._after_assistant(prev, tools, F[len(P):])
        else:
            # A template may render the conversation's last answer unlike an earlier one
            # (Qwen3 wraps only the last in an empty think block): what counts is whether
            # the new prompt starts with what the model saw and wrote — the last turn's
            # prompt and the completion's text.
            new = self._after_completion(prev, tools, F)
            if new is None:
                self._rewrite("the chat template renders the earlier turns differently "
                              "once these messages follow")
                return self._fresh_chat(messages, tools, max_tokens, True, kwargs)
        ids = self.tokens + new
        return Pending(ids, new, False, False, messages, tools,
                       self._budget(len(ids), max_tokens, False), kwargs)

    def _not_extension(self, keys: list[tuple], tools: list | None) -> str:
        if self._conv is None:
            return "a chat request after a text completion"
        prev = [message_key(m) for m in self._conv]
        if len(keys) < len(prev) or keys[:len(prev)] != prev:
            n = next((i for i, (a, b) in enumerate(zip(keys, prev)) if a != b),
                     min(len(keys), len(prev)))
            what = ("the assistant message the server returned" if n == len(prev) - 1
                    else f"message {n}")
            return (f"messages[{n}] differs from {what} of the trajectory so far"
                    if n < len(keys) else
                    f"the request has {len(keys)} messages, the trajectory so far "
                    f"{len(prev)}")
        if (tools or None) != (self._tools or None):
            return "the request's tools differ from the trajectory's"
        return ""

    _tools: list | None = None
    _kwargs: dict | None = None  # the last chat request's chat_template_kwargs

    def _fresh_chat(self, messages: list, tools: list | None, max_tokens: int | None,
                    rewritten: bool, kwargs: dict | None = None) -> Pending:
        ids = self._ids(self._render(messages, tools, gen=True, kwargs=kwargs))
        if not ids:
            raise SessionError("the messages render to an empty prompt")
        return Pending(ids, ids, True, rewritten, messages, tools,
                       self._budget(len(ids), max_tokens, True), kwargs)

    def _after_assistant(self, prev: list[dict], tools: list | None, suffix: str) -> list[int]:
        """The ids between the last completion and the next one: the template's text after
        the assistant's content (its closing, then `suffix`), with the closing EOS as one id
        — exactly `envs.observation_ids` for the ChatML layout."""
        probe = list(prev[:-1]) + [{"role": "assistant", "content": _SENTINEL}]
        R = self._render(probe, tools, gen=False, kwargs=self._kwargs)
        closing = R[R.rindex(_SENTINEL) + len(_SENTINEL):]
        tail = closing + suffix
        tok = self.tokenizer
        eos, eos_text = tok.eos_token_id, tok.eos_token
        last = self.tokens[self.turn_ends[-1] - 1]
        if eos_text and tail.startswith(eos_text):
            close = [] if last == eos else [eos]
            return close + self._ids(tail[len(eos_text):])
        return self._ids(tail)

    def _after_completion(self, prev: list[dict], tools: list | None, F: str) -> list[int] | None:
        """The ids after the last completion when the rendered prompt F starts with the
        last turn's prompt text and the completion's text (special tokens skipped, as the
        answer's content was decoded), followed by the EOS that closes it; else None."""
        seen = self._render(prev[:-1], tools, gen=True, kwargs=self._kwargs) + self.tokenizer.decode(
            self.turns[-1]["completion_ids"], skip_special_tokens=True)
        eos, eos_text = self.tokenizer.eos_token_id, self.tokenizer.eos_token
        if not eos_text or not F.startswith(seen + eos_text):
            return None
        close = [] if self.tokens[self.turn_ends[-1] - 1] == eos else [eos]
        return close + self._ids(F[len(seen) + len(eos_text):])

    def plan_text(self, prompt: str | Sequence[int], max_tokens: int | None = None) -> Pending:
        self._check_open()
        if isinstance(prompt, str):
            if not self.turn_ends:
                return self._fresh_ids(self._ids(prompt), max_tokens, False)
            rec = self.tokenizer.decode(self.tokens, skip_special_tokens=False,
                                        clean_up_tokenization_spaces=False)
            if not prompt.startswith(rec):
                self._rewrite("the prompt text does not start with the trajectory's text "
                              "so far")
                return self._fresh_ids(self._ids(prompt), max_tokens, True)
            new = self._ids(prompt[len(rec):])
        else:
            ids = [int(t) for t in prompt]
            if not self.turn_ends:
                return self._fresh_ids(ids, max_tokens, False)
            if ids[:len(self.tokens)] != self.tokens:
                self._rewrite("the prompt ids do not start with the trajectory's ids so far")
                return self._fresh_ids(ids, max_tokens, True)
            new = ids[len(self.tokens):]
        if not new:
            raise SessionError("the prompt adds no tokens to the trajectory: every turn must "
                               "start with prompt tokens")
        ids = self.tokens + new
        return Pending(ids, new, False, False, None, None,
                       self._budget(len(ids), max_tokens, False))

    def _fresh_ids(self, ids: list[int], max_tokens: int | None, rewritten: bool) -> Pending:
        if not ids:
            raise SessionError("the prompt is empty")
        return Pending(ids, ids, True, rewritten, None, None,
                       self._budget(len(ids), max_tokens, True))

    # --- recording ----------------------------------------------------------------------

    def sampling_seed(self, turn: int | None = None) -> int | None:
        """The built-in loop's per-turn seed (types.turn_seed) for this segment's turn."""
        return turn_seed(self.seed, len(self.turn_ends) if turn is None else turn)

    def commit(self, pending: Pending, out: Any, answer: dict[str, Any] | None = None) -> None:
        """Record the engine's answer (`GenOut`) to `pending`; `answer`: the assistant
        message returned to a chat request."""
        if pending.new_segment:
            if self.turn_ends:
                self.segments.append(self.segment_record())
                self.earlier_tokens += len(self.tokens)
            else:
                self.first_prompt_len = len(pending.new_ids)
            self.tokens, self.scored_mask, self.logprobs, self.token_versions = [], [], [], []
            self.turn_ends, self.finish_reasons, self.policy_versions, self.turns = \
                [], [], [], []
            self.prompt_len = len(pending.new_ids)
        action = list(out.token_ids)
        lps = list(out.logprobs)
        vers = list(out.token_versions) or [out.policy_version] * len(action)
        if len(lps) != len(action) or len(vers) != len(action):
            raise RuntimeError("engine output: token ids, log-probs and versions differ in "
                               "length")
        n = len(pending.new_ids)
        self.tokens += pending.new_ids + action
        self.scored_mask += [0] * n + [1] * len(action)
        self.logprobs += [None] * n + lps
        self.token_versions += [None] * n + vers
        self.turn_ends.append(len(self.tokens))
        self.finish_reasons.append(out.finish_reason)
        self.policy_versions.append(out.policy_version)
        self.turns.append({"prompt_ids": list(pending.new_ids), "completion_ids": action,
                           "logprobs": lps, "versions": vers,
                           "finish_reason": out.finish_reason})
        self.n_requests += 1
        self.n_sampled += len(action)
        if pending.messages is not None:
            self._conv = list(pending.messages) + [answer or {"role": "assistant",
                                                              "content": ""}]
            self._tools, self._kwargs = pending.tools, pending.kwargs
        else:
            self._conv = None

    # --- out -------------------------------------------------------------------------------

    @property
    def n_turns(self) -> int:
        return len(self.turn_ends)

    def actions(self) -> list[list[int]]:
        """Each turn's sampled ids (this segment)."""
        return [t["completion_ids"] for t in self.turns]

    def segment_record(self) -> dict[str, Any]:
        return {"tokens": list(self.tokens), "scored_mask": list(self.scored_mask),
                "logprobs": list(self.logprobs), "token_versions": list(self.token_versions),
                "turn_ends": list(self.turn_ends), "prompt_len": self.prompt_len,
                "turns": [dict(t) for t in self.turns]}

    def record(self, **extra: Any) -> dict[str, Any]:
        """One JSON line of RUN/agent/records.jsonl: the trained segment, earlier segments,
        counts."""
        return {"traj_id": self.traj_id, "version": self.version, **self.segment_record(),
                "earlier_segments": list(self.segments), "rewrites": self.rewrites,
                "requests": self.n_requests, "sampled_tokens": self.n_sampled,
                "trained_tokens": self.earlier_tokens + len(self.tokens), **extra}

    def result(self, reward: float, stop_reason: str, **timing: Any) -> TrajectoryResult:
        """The trajectory as the built-in loop's `TrajectoryResult`: the last segment, and
        the earlier ones in `earlier`."""
        return TrajectoryResult(
            tokens=list(self.tokens), scored_mask=list(self.scored_mask),
            turn_ends=list(self.turn_ends), reward=float(reward), prompt_len=self.prompt_len,
            n_turns=len(self.turn_ends), logprobs=list(self.logprobs),
            finish_reasons=list(self.finish_reasons), policy_versions=list(self.policy_versions),
            token_versions=list(self.token_versions), stop_reason=stop_reason,
            earlier=[dict(seg) for seg in self.segments], **timing)
