"""A finished trajectory as the learner's sources: its reward shaped (DAPO's overlong
penalty), one source per segment, each with its sampling log-probs and the policy versions
that sampled it."""

from __future__ import annotations

from tsync_mcore.channel.sources import TrajectorySource
from tsync_mcore.config import RewardConfig, RolloutConfig
from tsync_mcore.rollout.pacing import span_off_policy
from tsync_mcore.rollout.types import TrajectoryResult


def shaped_reward(res: TrajectoryResult, rw: RewardConfig,
                  rc: RolloutConfig) -> tuple[float, bool]:
    """The reward with DAPO's overlong shaping (reward.overlong_buffer), and whether it was
    penalised: a response of L generated tokens past L_max − buffer loses
    (L − (L_max − buffer))/buffer·penalty."""
    if not rw.overlong_buffer or not isinstance(res.reward, (int, float)):
        return res.reward, False
    budget = rw.overlong_max_len or rc.max_tokens_per_turn * rc.max_turns
    exceed = res.n_scored - (budget - rw.overlong_buffer)  # every segment's
    penalty = min(-exceed / rw.overlong_buffer * rw.overlong_penalty, 0.0)
    return res.reward + penalty, penalty < 0


def trajectory_sources(traj_id: str, gid: str, res: TrajectoryResult, order: int,
                       loaded: int) -> list[TrajectorySource]:
    """A finished trajectory as sources, one per segment (one unless its history was
    rewritten): their sampling log-probs, and the versions that sampled them (the
    oldest as policy_version; per token when several; `loaded`, the version served, for a
    segment with no scored token). A later segment shares the group's prompt only if it starts
    with it. `order`: the first segment's ready_order."""
    segs = res.segments()
    n, total = len(segs), res.n_scored
    group_prompt = segs[0]["tokens"][:segs[0]["prompt_len"]]
    out = []
    for j, seg in enumerate(segs):
        toks, mask = seg["tokens"], seg["scored_mask"]
        behaviour, versions, sampled_by = span_off_policy(
            seg["logprobs"], seg["token_versions"], mask, 0, len(toks), loaded)
        shares = j == 0 or (toks[:len(group_prompt)] == group_prompt
                            and not any(mask[:len(group_prompt)]))
        out.append(TrajectorySource(
            traj_id=traj_id, group_id=gid, tokens=tuple(toks), scored_mask=tuple(mask),
            reward=res.reward, policy_version=sampled_by, ready_order=order + j,
            prompt_len=len(group_prompt) if shares else None,
            behaviour_logprobs=behaviour, token_versions=versions, segment=j,
            n_segments=n, trajectory_scored=total if n > 1 else None))
    return out
