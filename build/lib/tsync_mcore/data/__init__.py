"""Prompts in: dataset files (tsync_mcore.data.load), their rendering to token ids
(render), and the epoch-shuffled order in which training visits them (sampler)."""

from tsync_mcore.data.load import DataError, PromptSet, Row, load_prompts
from tsync_mcore.data.render import render_prompt, row_messages
from tsync_mcore.data.sampler import EpochSampler

__all__ = ["DataError", "EpochSampler", "PromptSet", "Row", "load_prompts", "render_prompt",
           "row_messages"]
