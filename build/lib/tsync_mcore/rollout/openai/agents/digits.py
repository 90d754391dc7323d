"""The demo task's agent, written against the official `openai` client only.

    OPENAI_BASE_URL=http://HOST:PORT/t/<trajectory>/v1 OPENAI_API_KEY=... \
    TSYNC_TASK='{"messages": [...], "max_turns": 3, ...}' python -m tsync_mcore.rollout.openai.agents.digits

It is what the built-in loop does for the toy task (rollout.env: toy), as an outside agent
would: ask the model, append its answer, append the counter tool's answer ("<digit
tokens>/<tokens> digits", counted from the returned log-probs' tokens, the closing EOS
included) as a `tool` message, until max_turns. The reward is the rollout's (the toy task's,
from the recorded ids); an agent could post its own: POST <base>/reward {"reward": x}.
A 400 (e.g. the trajectory reached rollout.max_total_tokens) ends the episode normally.

With TSYNC_POOL_URL set (rollout.agent_pool > 0) it is a pool worker instead: it pulls
trajectories and runs each the same way (tsync_mcore.rollout.openai.agents.pool.serve).
"""

from __future__ import annotations

import sys
from typing import Any

import openai

DIGITS = "0123456789"


def is_digit_token(text: str) -> bool:
    s = text.strip()
    return bool(s) and all(c in DIGITS for c in s)


def run(client: openai.OpenAI, task: dict[str, Any]) -> list[dict[str, Any]]:
    """One episode; returns the conversation."""
    messages = list(task["messages"])
    max_turns = int(task.get("max_turns", 3))
    n_digits = n_tokens = 0
    for turn in range(max_turns):
        try:
            r = client.chat.completions.create(
                model=task.get("model", "tsync"), messages=messages, logprobs=True,
                max_tokens=task.get("max_tokens_per_turn"),
                temperature=task.get("temperature", 1.0))
        except openai.BadRequestError as e:
            print(f"[agent] turn {turn}: {e.message}", file=sys.stderr)
            break
        choice = r.choices[0]
        messages.append({"role": "assistant", "content": choice.message.content})
        tokens = [c.token for c in (choice.logprobs.content or [])]
        n_tokens += len(tokens)
        n_digits += sum(is_digit_token(t) for t in tokens)
        if turn == max_turns - 1:
            break  # the last answer has no tool call behind it
        messages.append({"role": "tool", "content": f"{n_digits}/{n_tokens} digits"})
    return messages


def main() -> int:
    from tsync_mcore.rollout.openai.agents import pool
    return pool.main(run)


if __name__ == "__main__":
    sys.exit(main())
