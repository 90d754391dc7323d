"""`reward.function: judge`: a second, frozen model grades each answer (LLM-as-a-judge).

The judge is a vLLM engine of its own in the rollout process (`RolloutEngine` on
`reward.judge.model_dir`, on the rollout's event loop beside the policy's replicas). It is
not part of the `ReplicaSet`: no publication reaches it and no policy request is routed to
it. Each finished answer becomes one judge request — the prompt template filled with the
row's prompt, the answer and the label — awaited by that trajectory's own coroutine, so the
answers that finish close together are in flight together and vLLM decodes them as one
batch (its scheduler batches concurrent requests; no window of our own is needed).

The judge's output is untrusted model text: `max_tokens` bounds it, the parser reads it
with one regex (never eval), a number must be a plain decimal of at most 32 characters,
finite and inside [score_min, score_max], and a choice a whole word of `choices`. A failure —
unparseable output, an engine error, `reward.timeout_s` passing — is the trajectory's
error under `reward.on_error` like any reward function's, one line naming the trajectory
and what the judge wrote (shortened). Every call is recorded in RUN/judge/records.jsonl.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from tsync_mcore.rewards.call import RewardFailed, RewardResult

FIELDS = ("prompt", "response", "label")
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_DECIMAL = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")  # ASCII; no exponent, nan, inf
MAX_NUMBER_CHARS = 32  # a score longer than this is no score (e.g. "9" × 5000)
MAX_OUTPUT_CHARS = 1 << 16  # parse() refuses more: max_tokens keeps real outputs far below
SHOWN_CHARS = 120  # of the judge's output, in an error line


class ParserConfigError(ValueError):
    """reward.judge's parser keys are wrong; `key` names the one."""

    def __init__(self, key: str, msg: str) -> None:
        super().__init__(msg)
        self.key = key


class JudgeParseError(ValueError):
    """The judge's output gives no score; the message says why (one line)."""


# --- the prompt -------------------------------------------------------------------------------

def check_template(template: str) -> None:
    """ValueError unless `template` holds {response} and no placeholder but FIELDS'."""
    if not isinstance(template, str) or not template.strip():
        raise ValueError("must be a non-empty string")
    names = set(_PLACEHOLDER.findall(template))
    unknown = sorted(names - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown placeholder {{{unknown[0]}}} (known: "
                         f"{', '.join('{' + f + '}' for f in FIELDS)})")
    if "response" not in names:
        raise ValueError("must contain {response} (the answer the judge grades)")


def as_text(value: Any) -> str:
    """A row's prompt or label as the judge reads it: a string as is, chat messages as
    `role: content` lines, None as "", anything else as JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value):
        return "\n".join(f"{m.get('role', 'user')}: {m['content']}" for m in value)
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def fill(template: str, *, prompt: Any, response: str, label: Any) -> str:
    """The template with each placeholder replaced in one pass: text inserted for one
    placeholder is never searched again (an answer writing "{label}" cannot pull the label
    into the judge's prompt)."""
    values = {"prompt": as_text(prompt), "response": response, "label": as_text(label)}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


# --- the parser -------------------------------------------------------------------------------

def shorten(text: str, n: int = SHOWN_CHARS) -> str:
    """repr of the first n characters (one line whatever it holds), and the length if cut."""
    return repr(text[:n]) + (f"…({len(text)} chars)" if len(text) > n else "")


@dataclass(frozen=True)
class Parser:
    """Judge output → reward (see JudgeConfig's parser keys)."""

    kind: str  # "regex" | "choices"
    pattern: re.Pattern[str]
    pick: str = "last"
    score_min: float = 0.0
    score_max: float = 10.0
    normalize: bool = True
    choices: tuple[tuple[str, float], ...] = ()

    @classmethod
    def from_config(cls, jc: Any) -> "Parser":
        """From JudgeConfig; ParserConfigError names the key that is wrong."""
        if jc.parser == "regex":
            try:
                pat = re.compile(jc.pattern)
            except (re.error, TypeError) as e:
                raise ParserConfigError("pattern", f"not a regular expression: {e}") from None
            if pat.groups != 1:
                raise ParserConfigError("pattern", f"must have exactly one group (the "
                                        f"score), has {pat.groups}: {jc.pattern!r}")
            if not jc.score_min < jc.score_max:
                raise ParserConfigError("score_max", f"must be > score_min ({jc.score_min}), "
                                        f"got {jc.score_max}")
            return cls("regex", pat, jc.pick, float(jc.score_min), float(jc.score_max),
                       bool(jc.normalize))
        if not jc.choices:
            raise ParserConfigError("choices", "parser 'choices' needs a mapping of words to "
                                    "rewards, e.g. {correct: 1, incorrect: 0}")
        words: dict[str, float] = {}
        for word, value in jc.choices.items():
            if not re.fullmatch(r"\w+(?:[ -]\w+)*", word):
                raise ParserConfigError("choices", f"{word!r} is not a word (letters, digits, "
                                        f"_, single spaces or hyphens between them)")
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value)):
                raise ParserConfigError("choices", f"{word!r} maps to {value!r}, not a finite "
                                        f"number")
            if word.lower() in words:
                raise ParserConfigError("choices", f"{word!r} is listed twice (case is ignored)")
            words[word.lower()] = float(value)
        # longest first: "not correct" wins over "correct" where both match at one place
        alts = "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))
        pat = re.compile(rf"(?<!\w)({alts})(?!\w)", re.IGNORECASE)
        return cls("choices", pat, jc.pick, choices=tuple(words.items()))

    def __call__(self, text: str) -> float:
        """The reward the output gives; JudgeParseError says why there is none."""
        if len(text) > MAX_OUTPUT_CHARS:
            raise JudgeParseError(f"output of {len(text)} characters (at most "
                                  f"{MAX_OUTPUT_CHARS} are read)")
        found = [m.group(1) for m in self.pattern.finditer(text)]
        if not found:
            raise JudgeParseError("no score found" if self.kind == "regex" else
                                  f"none of the choices {[w for w, _ in self.choices]} found")
        values = [self._value(g) for g in found]
        if self.pick == "only" and len(set(values)) > 1:
            raise JudgeParseError(f"{len(values)} verdicts that disagree "
                                  f"({', '.join(map(repr, found[:4]))})")
        return values[0] if self.pick == "first" else values[-1]

    def _value(self, group: str) -> float:
        if self.kind == "choices":
            return dict(self.choices)[group.lower()]
        s = group.strip()
        if len(s) > MAX_NUMBER_CHARS:
            raise JudgeParseError(f"score of {len(s)} characters")
        if not _DECIMAL.fullmatch(s):
            raise JudgeParseError(f"score {s!r} is not a decimal number")
        x = float(s)
        if not math.isfinite(x):  # "1" × 400 digits would be inf; refused above, kept safe
            raise JudgeParseError(f"score {s!r} is not finite")
        if not self.score_min <= x <= self.score_max:
            raise JudgeParseError(f"score {x:g} outside [{self.score_min:g}, "
                                  f"{self.score_max:g}]")
        if self.normalize:
            return (x - self.score_min) / (self.score_max - self.score_min)
        return x


# --- the runner -------------------------------------------------------------------------------

class JudgeStats:
    """The judge's counters since the last `take`; `busy_s` is wall time with at least one
    judge request in flight (concurrent requests count once)."""

    def __init__(self) -> None:
        self.calls = self.parse_failures = self.timeouts = self.engine_errors = 0
        self.busy_s = 0.0
        self.in_flight = 0
        self.in_flight_max = 0
        self._since: float | None = None

    def started(self) -> int:
        if self.in_flight == 0:
            self._since = time.perf_counter()
        self.in_flight += 1
        self.calls += 1
        self.in_flight_max = max(self.in_flight_max, self.in_flight)
        return self.in_flight

    def ended(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._since is not None:
            self.busy_s += time.perf_counter() - self._since
            self._since = None

    def take(self, prefix: str = "reward/") -> dict[str, float]:
        busy = self.busy_s
        if self._since is not None:  # requests still in flight: their time so far
            now = time.perf_counter()
            busy += now - self._since
            self._since = now
        out = {f"{prefix}judge_s": busy, f"{prefix}judge_calls": float(self.calls),
               f"{prefix}judge_parse_failures": float(self.parse_failures),
               f"{prefix}judge_timeouts": float(self.timeouts),
               f"{prefix}judge_engine_errors": float(self.engine_errors),
               f"{prefix}judge_in_flight_max": float(self.in_flight_max)}
        self.calls = self.parse_failures = self.timeouts = self.engine_errors = 0
        self.busy_s, self.in_flight_max = 0.0, self.in_flight
        return out


class JudgeRunner:
    """RewardRunner's `score` for reward.function 'judge': one judge request per answer.

    Built with the config (template and parser checked then); `attach` gives it the judge
    engine and tokenizer once the rollout started them. Its coroutines run on the engine's
    event loop (the rollout's)."""

    def __init__(self, jc: Any, *, timeout_s: float, on_error: str, records_dir: str,
                 seed: int = 0) -> None:
        check_template(jc.prompt_template)
        self.jc, self.parser = jc, Parser.from_config(jc)
        self.spec = f"judge {jc.model_dir}"
        self.timeout_s, self.on_error, self.seed = timeout_s, on_error, seed
        self.records_dir = records_dir
        self.takes_messages = False
        self.engine: Any = None
        self.tok: Any = None
        self.stats = JudgeStats()
        self._records: Any = None

    def attach(self, engine: Any, tokenizer: Any) -> None:
        """The judge's engine (anything with RolloutEngine.generate) and tokenizer. chat:
        the tokenizer must have a chat template (checked now, not at the first answer)."""
        if self.jc.chat and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"reward.judge.chat: the judge's tokenizer "
                             f"({self.jc.model_dir}) has no chat template; set "
                             f"reward.judge.chat: false to send the filled template as is")
        self.engine, self.tok = engine, tokenizer
        os.makedirs(self.records_dir, exist_ok=True)
        self._records = open(os.path.join(self.records_dir, "records.jsonl"), "a",
                             encoding="utf-8")

    def close(self) -> None:
        if self._records is not None:
            self._records.close()
            self._records = None

    def prompt_ids(self, *, prompt: Any, response: str, label: Any) -> list[int]:
        text = fill(self.jc.prompt_template, prompt=prompt, response=response, label=label)
        if not self.jc.chat:
            return list(self.tok(text, add_special_tokens=True)["input_ids"])
        messages = ([{"role": "system", "content": self.jc.system_prompt}]
                    if self.jc.system_prompt else []) + [{"role": "user", "content": text}]
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5: a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def _seed(self, key: str) -> int:
        """Sampling seed of one request: stable per (run seed, trajectory) across processes."""
        digest = hashlib.sha256(f"{self.seed}/{key}".encode()).digest()
        return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF

    async def score(self, where: str, *, prompt: Any, response: str, label: Any,
                    meta: dict[str, Any], messages: list[dict] | None = None,
                    traj_id: str | None = None) -> RewardResult:
        """One judge request for one answer; `where` names the trajectory and row in errors,
        `traj_id` keys its record."""
        if self.engine is None:
            raise RuntimeError("JudgeRunner.score before attach(): no judge engine")
        key = traj_id or where
        t0 = time.perf_counter()
        text, reason, n_prompt, reward, why, kind = "", "", 0, None, None, None
        stats = self.stats  # evaluation swaps in its own; this call stays with its own
        in_flight = stats.started()
        try:
            ids = self.prompt_ids(prompt=prompt, response=response, label=label)
            n_prompt = len(ids)
            out = await asyncio.wait_for(self.engine.generate(
                ids, max_tokens=self.jc.max_tokens, temperature=self.jc.temperature,
                seed=self._seed(key)), self.timeout_s)
            reason = out.finish_reason
            text = self.tok.decode(out.token_ids, skip_special_tokens=True)
            reward = self.parser(text)
        except asyncio.TimeoutError:
            kind, why = "timeout", f"timed out after {self.timeout_s:g}s (reward.timeout_s)"
        except JudgeParseError as e:
            kind, why = "parse", f"cannot score the judge's output ({e}): {shorten(text)}"
        except Exception as e:  # the engine (a prompt past max_model_len, a dead engine)
            first = (str(e).strip().splitlines() or [""])[0][:300]
            kind, why = "engine", f"judge request failed: {type(e).__name__}: {first}"
        finally:
            stats.ended()
        if kind == "timeout":
            stats.timeouts += 1
        elif kind == "parse":
            stats.parse_failures += 1
        elif kind == "engine":
            stats.engine_errors += 1
        msg = None if why is None else f"reward {self.spec} on {where}: {why}"
        self._record({"traj_id": key, "where": where, "output": text, "finish_reason": reason,
                      "prompt_tokens": n_prompt, "reward": reward, "error": msg,
                      "seconds": round(time.perf_counter() - t0, 6), "in_flight": in_flight,
                      # the judge's weights: 0 for good (no publication reaches its engine)
                      "judge_version": getattr(self.engine, "version", None)})
        if msg is None:
            return RewardResult(float(reward), {})
        if self.on_error == "fail":
            raise RewardFailed(msg)
        return RewardResult(0.0, {}, msg)

    def _record(self, rec: dict[str, Any]) -> None:
        if self._records is not None:
            self._records.write(json.dumps(rec, ensure_ascii=False) + "\n")
            self._records.flush()

    def take_metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """reward/judge_* since the last call (`prefix` "eval/reward_": evaluation's)."""
        return self.stats.take(prefix)
