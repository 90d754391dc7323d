"""`reward.function: judge`: a second, frozen model grades each answer (LLM-as-a-judge).

The judge is a vLLM engine of its own in the rollout process (`RolloutEngine` on
`reward.judge.model_dir`, on the rollout's event loop beside the policy's replicas). It is
not part of the `ReplicaSet`: no publication reaches it and no policy request is routed to
it. Each finished answer becomes one judge request — the prompt template filled with the
row's prompt, the answer and the label, each fenced with a nonce of its own call
(judge_text.py) — awaited by that trajectory's own coroutine, so the answers that finish
close together are in flight together and vLLM decodes them as one batch (its scheduler
batches concurrent requests; no window of our own is needed).

Limits: at `attach` the judge's context must hold the template, the longest prompt and
answer the policy may write (`rollout.max_total_tokens`) and `reward.judge.max_tokens`, or
the run stops naming both keys; a judge prompt that still does not fit (a long label, a
tokenizer that splits the answer finer than the policy's) is that trajectory's error — the
answer is not cut, since a judge grading part of it would grade something else.

The judge's output is untrusted model text: `max_tokens` bounds it, the parser reads it
with one regex (never eval), only the judge's own words count (judge_text.py), a number
must be a plain decimal of at most 32 characters, finite and inside [score_min, score_max],
and a choice a whole word of `choices`. A failure — unparseable output, a prompt past the
judge's context, an engine error, `reward.timeout_s` passing — is the trajectory's error
under `reward.on_error` like any reward function's (default: scored 0 and counted), one line
naming the trajectory and what the judge wrote (shortened). Every call is recorded in
RUN/judge/records.jsonl.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from typing import Any

from tsync_mcore.rewards.call import RewardFailed, RewardResult
from tsync_mcore.rewards.judge_text import (FIELDS, JudgeParseError, Parser, ParserConfigError,
                                            check_template, fill, new_nonce, shorten)

__all__ = ["FIELDS", "JudgeParseError", "JudgeLimitsError", "JudgeRunner", "JudgeStats",
           "Parser", "ParserConfigError", "check_template", "fill"]


class JudgeLimitsError(ValueError):
    """The judge's context cannot hold the prompts the policy's limits allow (one line naming
    both keys)."""


# --- the runner -------------------------------------------------------------------------------

class JudgeStats:
    """The judge's counters since the last `take`; `busy_s` is wall time with at least one
    judge request in flight (concurrent requests count once)."""

    def __init__(self) -> None:
        self.calls = self.parse_failures = self.timeouts = self.engine_errors = 0
        self.too_long = 0
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
               f"{prefix}judge_too_long": float(self.too_long),
               f"{prefix}judge_in_flight_max": float(self.in_flight_max)}
        self.calls = self.parse_failures = self.timeouts = self.engine_errors = 0
        self.too_long = 0
        self.busy_s, self.in_flight_max = 0.0, self.in_flight
        return out


class JudgeRunner:
    """RewardRunner's `score` for reward.function 'judge': one judge request per answer.

    Built with the config (template and parser checked then); `attach` gives it the judge
    engine and tokenizer once the rollout started them, and checks the judge's context
    against `policy_tokens` (rollout.max_total_tokens: the longest prompt and answer). Its
    coroutines run on the engine's event loop (the rollout's)."""

    def __init__(self, jc: Any, *, timeout_s: float, on_error: str, records_dir: str,
                 seed: int = 0, policy_tokens: int = 0) -> None:
        check_template(jc.prompt_template)
        self.jc, self.parser = jc, Parser.from_config(jc)
        self.spec = f"judge {jc.model_dir}"
        self.timeout_s, self.on_error, self.seed = timeout_s, on_error, seed
        self.policy_tokens = policy_tokens
        self.records_dir = records_dir
        self.takes_messages = False
        self.engine: Any = None
        self.tok: Any = None
        self.context: int | None = None  # the judge engine's max_model_len
        self.stats = JudgeStats()
        self._records: Any = None

    def attach(self, engine: Any, tokenizer: Any) -> None:
        """The judge's engine (anything with RolloutEngine.generate) and tokenizer. chat:
        the tokenizer must have a chat template, and the engine's context (its
        `max_model_len`) must hold what the policy may write: both checked now, not at the
        first answer (JudgeLimitsError: one line naming the keys)."""
        if self.jc.chat and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"reward.judge.chat: the judge's tokenizer "
                             f"({self.jc.model_dir}) has no chat template; set "
                             f"reward.judge.chat: false to send the filled template as is")
        self.engine, self.tok = engine, tokenizer
        self.context = getattr(engine, "max_model_len", None)
        if self.context is not None:
            # the template, its fences and chat wrapping, with every field empty
            frame = len(self.prompt_ids(prompt="", response="", label="", nonce=new_nonce()))
            need = frame + self.policy_tokens + self.jc.max_tokens
            if need > self.context:
                raise JudgeLimitsError(
                    f"config keys 'reward.judge.max_model_len' and 'rollout.max_total_tokens': "
                    f"the judge's context of {self.context} tokens cannot hold the template "
                    f"({frame} tokens) + rollout.max_total_tokens={self.policy_tokens} (the "
                    f"policy's prompt and answer) + reward.judge.max_tokens="
                    f"{self.jc.max_tokens} = {need}: raise reward.judge.max_model_len (0: the "
                    f"checkpoint's) or lower rollout.max_total_tokens")
        os.makedirs(self.records_dir, exist_ok=True)
        self._records = open(os.path.join(self.records_dir, "records.jsonl"), "a",
                             encoding="utf-8")

    def close(self) -> None:
        if self._records is not None:
            self._records.close()
            self._records = None

    def prompt_ids(self, *, prompt: Any, response: str, label: Any, nonce: str) -> list[int]:
        text = fill(self.jc.prompt_template, prompt=prompt, response=response, label=label,
                    nonce=nonce)
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
            ids = self.prompt_ids(prompt=prompt, response=response, label=label,
                                  nonce=new_nonce())
            n_prompt = len(ids)
            if self.context is not None and n_prompt + self.jc.max_tokens > self.context:
                kind = "length"
                why = (f"judge prompt of {n_prompt} tokens + reward.judge.max_tokens="
                       f"{self.jc.max_tokens} exceed the judge's context ({self.context} "
                       f"tokens): the answer ({len(response)} characters) is not judged")
            else:
                out = await asyncio.wait_for(self.engine.generate(
                    ids, max_tokens=self.jc.max_tokens, temperature=self.jc.temperature,
                    seed=self._seed(key)), self.timeout_s)
                reason = out.finish_reason
                text = self.tok.decode(out.token_ids, skip_special_tokens=True)
                reward = self.parser(text, response)
        except asyncio.TimeoutError:
            kind, why = "timeout", f"timed out after {self.timeout_s:g}s (reward.timeout_s)"
        except JudgeParseError as e:
            kind, why = "parse", f"cannot score the judge's output ({e}): {shorten(text)}"
        except Exception as e:  # the engine (a dead engine), the tokenizer
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
        elif kind == "length":
            stats.too_long += 1
        msg = None if why is None else f"reward {self.spec} on {where}: {why}"
        self._record({"traj_id": key, "where": where, "answer": response, "output": text,
                      "finish_reason": reason, "prompt_tokens": n_prompt, "reward": reward,
                      "error": msg, "seconds": round(time.perf_counter() - t0, 6),
                      "in_flight": in_flight,
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
