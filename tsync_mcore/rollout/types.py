"""What the built-in agent loop (tsync_mcore.rollout.loop) and the OpenAI endpoint's
sessions (tsync_mcore.rollout.openai) share: a finished trajectory, and the per-turn
sampling seed that makes both paths sample alike."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


def turn_seed(seed: int | None, turn: int) -> int | None:
    """Distinct, reproducible sampling seeds per turn of one trajectory."""
    return None if seed is None else (seed * 1_000_003 + turn) % (2**31 - 1)


@dataclass
class TrajectoryResult:
    tokens: list[int]
    scored_mask: list[int]
    turn_ends: list[int]  # exclusive end index of each turn
    reward: float
    prompt_len: int
    n_turns: int
    logprobs: list[float | None]  # sampling log-prob of each scored token, None elsewhere
    finish_reasons: list[str]  # per turn: "stop", "length"
    policy_versions: list[int]  # engine weight version that finished each turn
    # the weight version that sampled each scored token, None elsewhere (a turn cut by an
    # in-flight swap has two: docs/design/async.md)
    token_versions: list[int | None]
    stop_reason: str  # "done" (env), "max_turns", "max_total_tokens"
    n_timeouts: int = 0  # tool calls cut by the agent's own step timeout
    gen_s: float = 0.0  # time awaiting the engine
    tool_s: float = 0.0  # time awaiting env.step
    wall_s: float = 0.0
    t_start: float = 0.0  # time.monotonic() at start / end, to compare trajectories
    t_end: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    # Segments before this one, when the history was rewritten mid-episode (the OpenAI
    # endpoint's records: tokens, scored_mask, logprobs, token_versions, prompt_len, ...);
    # the fields above are the last segment's. Every segment trains.
    earlier: list[dict[str, Any]] = field(default_factory=list)

    @property
    def n_scored(self) -> int:
        """Scored tokens of the whole trajectory, every segment."""
        return sum(self.scored_mask) + sum(sum(s["scored_mask"]) for s in self.earlier)

    def segments(self) -> list[dict[str, Any]]:
        """Every segment, first to last, as {tokens, scored_mask, logprobs, token_versions,
        prompt_len}."""
        last = dict(tokens=self.tokens, scored_mask=self.scored_mask, logprobs=self.logprobs,
                    token_versions=self.token_versions, prompt_len=self.prompt_len)
        keys = tuple(last)
        return [{k: s[k] for k in keys} for s in self.earlier] + [last]

    def turn_starts(self) -> list[int]:
        return [0] + self.turn_ends[:-1]

    def to_json(self, traj_id: str, group_id: str, policy_version: int,
                ready_order: int = 0) -> dict[str, Any]:
        """One line of the learner's GRPO JSON Lines format (docs/design/replay.md)."""
        return {"traj_id": traj_id, "group_id": group_id, "tokens": list(self.tokens),
                "scored_mask": list(self.scored_mask), "reward": float(self.reward),
                "ready_order": ready_order, "policy_version": policy_version,
                "prompt_len": self.prompt_len}

    def to_opd_json(self, traj_id: str, group_id: str, policy_version: int,
                    teacher_logprobs: Sequence[float | None],
                    turn_ready_order: Sequence[int]) -> dict[str, Any]:
        """One line of the learner's OPD format; teacher log-probs aligned with tokens."""
        return {"traj_id": traj_id, "group_id": group_id, "tokens": list(self.tokens),
                "scored_mask": list(self.scored_mask),
                "teacher_logprobs": list(teacher_logprobs), "turn_ends": list(self.turn_ends),
                "turn_ready_order": list(turn_ready_order), "policy_version": policy_version,
                "prompt_len": self.prompt_len}
