"""A terminal agent for rollout.env: terminal, written against the official `openai` client:
the usual function-calling loop, with the tools run by the rollout in the episode's sandbox.

    rollout.agent: openai
    rollout.env: terminal
    rollout.agent_command: python -m tsync_mcore.rollout.openai.agents.terminal

Each turn asks the model with the task's `tools` (their OpenAI schemas); every tool call in
the answer runs through POST $TSYNC_TOOLS_URL/<name> {"arguments": ...} and its output goes
back as a `tool` message. The episode ends on an answer without tool calls, or at max_turns.
The reward is the task verifier's, on the repo the calls left behind (none is posted).
With TSYNC_POOL_URL set (rollout.agent_pool > 0) it serves the pool (agents.pool.serve).
"""

from __future__ import annotations

import sys
from typing import Any

import openai


def call_tool(client: openai.OpenAI, name: str, arguments: str) -> str:
    """One tool call, run by the rollout; its output (or an "error: ..." text). The tool
    route is the trajectory's base URL + /tools (TSYNC_TOOLS_URL, the handout's tools_url)."""
    url = f"{str(client.base_url).rstrip('/')}/tools/{name}"
    try:
        r = client.post(url, cast_to=object, body={"arguments": arguments})
    except openai.APIStatusError as e:
        return f"error: {e.message}"
    return str(r.get("content", "")) if isinstance(r, dict) else str(r)


def run(client: openai.OpenAI, task: dict[str, Any]) -> list[dict[str, Any]]:
    """One episode; returns the conversation."""
    messages = list(task["messages"])
    for turn in range(int(task.get("max_turns", 4))):
        try:
            r = client.chat.completions.create(
                model=task.get("model", "tsync"), messages=messages, tools=task.get("tools"),
                max_tokens=task.get("max_tokens_per_turn"),
                temperature=task.get("temperature", 1.0))
        except openai.BadRequestError as e:  # e.g. the token budget is spent
            print(f"[agent] turn {turn}: {e.message}", file=sys.stderr)
            break
        msg = r.choices[0].message
        calls = msg.tool_calls or []
        messages.append({"role": "assistant", "content": msg.content,
                         **({"tool_calls": [c.model_dump() for c in calls]} if calls else {})})
        if not calls:
            break
        for c in calls:
            messages.append({"role": "tool", "tool_call_id": c.id,
                             "content": call_tool(client, c.function.name, c.function.arguments)})
    return messages


def main() -> int:
    from tsync_mcore.rollout.openai.agents import pool
    return pool.main(run)


if __name__ == "__main__":
    sys.exit(main())
