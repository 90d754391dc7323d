"""Fused kernels for the tsync-mcore learner: Triton on GPU (or the Triton CPU
interpreter with TRITON_INTERPRET=1), plain torch elsewhere. Importing this package
never imports Triton; see ``dispatch`` for how each call picks its backend.

Not named `triton_kernels`: that is the Triton project's kernel library, which vLLM probes
for at start-up: any folder of that name on sys.path would answer its probe.
"""

from tsync_mcore.kernels.dispatch import backend_for, triton_usable
from tsync_mcore.kernels.grpo_accumulate import accumulate_g1g2_, axpy_, combine_group_
from tsync_mcore.kernels.lm_head import fused_lm_head_logprob
from tsync_mcore.kernels.scored_logprob import (
    LogprobPartials,
    all_reduce_partials,
    combine_entropy,
    combine_partials,
    logprob_partials,
    scored_logprob,
    scored_logprob_backward,
)

__all__ = [
    "LogprobPartials",
    "accumulate_g1g2_",
    "all_reduce_partials",
    "axpy_",
    "backend_for",
    "combine_entropy",
    "combine_group_",
    "combine_partials",
    "fused_lm_head_logprob",
    "logprob_partials",
    "scored_logprob",
    "scored_logprob_backward",
    "triton_usable",
]
