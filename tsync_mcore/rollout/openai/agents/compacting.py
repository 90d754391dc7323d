"""An agent that rewrites its own history, as long-horizon agents do (official `openai`
client only).

    OPENAI_BASE_URL=... OPENAI_API_KEY=... TSYNC_TASK='{"messages": [...], ...}' \
    python -m tsync_mcore.rollout.openai.agents.compacting

Turn 1 asks the task, with Qwen3's non-thinking switch (`chat_template_kwargs`
{"enable_thinking": false}: the prompt ends in an empty think block; templates without the
switch ignore it). Turn 2 appends the answer and a user follow-up: Qwen3's template drops
the earlier answer's think block, so the prompt no longer extends what the model saw and
the endpoint starts a new segment. Turn 3 compacts: the conversation is replaced by
the task's system message and a user message summarising the answers so far, as context
compaction or a hand-off to a sub-agent does: another segment under any template. Later
turns alternate follow-ups and compactions. Every segment trains (docs/guide/agents.md,
"Rewritten histories").
"""

from __future__ import annotations

import sys
from typing import Any

import openai


def run(client: openai.OpenAI, task: dict[str, Any]) -> list[dict[str, Any]]:
    """One episode; returns the conversation as it stands at the end."""
    system = [m for m in task["messages"] if m.get("role") == "system"]
    messages = list(task["messages"])
    answers: list[str] = []
    for turn in range(int(task.get("max_turns", 3))):
        if turn % 2 == 1:
            messages.append({"role": "user", "content": "Go on."})
        elif turn:
            summary = " | ".join(a.strip()[:24] for a in answers)
            messages = system + [{"role": "user", "content": f"Earlier answers: {summary}. "
                                                             f"Continue the task."}]
        try:
            r = client.chat.completions.create(
                model=task.get("model", "tsync"), messages=messages,
                max_tokens=task.get("max_tokens_per_turn"),
                temperature=task.get("temperature", 1.0),
                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        except openai.BadRequestError as e:  # e.g. the trajectory's budget is spent
            print(f"[agent] turn {turn}: {e.message}", file=sys.stderr)
            break
        content = r.choices[0].message.content or ""
        answers.append(content)
        messages.append({"role": "assistant", "content": content})
    return messages


def main() -> int:
    from tsync_mcore.rollout.openai.agents import pool
    return pool.main(run)


if __name__ == "__main__":
    sys.exit(main())
