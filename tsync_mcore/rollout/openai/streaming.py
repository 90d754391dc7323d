"""The OpenAI endpoint's `stream: true` answers: a finished response cut into OpenAI's
chunks and sent as Server-Sent Events (the engine returns whole completions)."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import StreamingResponse


def sse(chunks: list[dict]) -> StreamingResponse:
    """OpenAI's event stream: one `data:` event per chunk, then `data: [DONE]`."""
    events = [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]
    return StreamingResponse(iter(events), media_type="text/event-stream")


def chat_chunks(resp: dict, include_usage: bool) -> list[dict]:
    """A chat.completion as chat.completion.chunk's: role, content, one per tool call, the
    finish reason with the `tsync` object, then usage (when asked). The log-probs ride on
    the content chunk (on the last one when there is no content)."""
    head = {"id": resp["id"], "object": "chat.completion.chunk", "created": resp["created"],
            "model": resp["model"]}
    choice, extra = resp["choices"][0], {"usage": None} if include_usage else {}
    msg, lp = choice["message"], choice["logprobs"]

    def chunk(delta: dict, finish: str | None = None, logprobs: Any = None, **more) -> dict:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": finish}], **extra, **more}

    out = [chunk({"role": "assistant", "content": ""})]
    if msg.get("content"):
        out.append(chunk({"content": msg["content"]}, logprobs=lp))
        lp = None
    for j, call in enumerate(msg.get("tool_calls") or []):
        out.append(chunk({"tool_calls": [{"index": j, **call}]}))
    out.append(chunk({}, choice["finish_reason"], lp, tsync=resp["tsync"]))
    if include_usage:
        out.append({**head, "choices": [], "usage": resp["usage"]})
    return out


def text_chunks(resp: dict, include_usage: bool) -> list[dict]:
    """A text_completion as its stream: the text (with its log-probs), the finish reason
    with the `tsync` object, then usage (when asked)."""
    head = {k: resp[k] for k in ("id", "object", "created", "model")}
    choice, extra = resp["choices"][0], {"usage": None} if include_usage else {}
    out = [{**head, "choices": [{"index": 0, "text": choice["text"],
                                 "logprobs": choice["logprobs"], "finish_reason": None}],
            **extra},
           {**head, "choices": [{"index": 0, "text": "", "logprobs": None,
                                 "finish_reason": choice["finish_reason"]}],
            **extra, "tsync": resp["tsync"]}]
    if include_usage:
        out.append({**head, "choices": [], "usage": resp["usage"]})
    return out
