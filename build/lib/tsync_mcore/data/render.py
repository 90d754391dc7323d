"""Prompt rows → chat messages → token ids that end where the model's answer starts."""

from __future__ import annotations

from typing import Any

from tsync_mcore.data.load import DataError, Row


def row_messages(row: Row, system_prompt: str = "") -> list[dict[str, str]]:
    """The row's prompt as chat messages, with `system_prompt` first unless the row has one."""
    if isinstance(row.prompt, str):
        msgs = [{"role": "user", "content": row.prompt}]
    else:
        msgs = [dict(m) for m in row.prompt]
    if system_prompt and msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": system_prompt})
    return msgs


def render_prompt(tokenizer: Any, row: Row, system_prompt: str = "",
                  chat_template: bool = True) -> list[int]:
    """Token ids of the row's prompt: chat messages (and string prompts when
    `chat_template`) through the tokenizer's chat template with the generation prompt;
    otherwise the text as it is (system prompt, blank line, prompt)."""
    if isinstance(row.prompt, str) and not chat_template:
        text = f"{system_prompt}\n\n{row.prompt}" if system_prompt else row.prompt
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"row {row.index}: the tokenizer has no chat template to render "
                        f"chat prompts with (for plain-text prompts set data.chat_template=false)")
    text = tokenizer.apply_chat_template(row_messages(row, system_prompt),
                                         add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)
