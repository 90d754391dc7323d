"""Building the Megatron-Core GPTModel for a spec: layer specs (local, TE, SDPA attention),
the TransformerConfig, MoE settings, and the CPU/eval-mode adjustments."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention

from tsync_mcore import platform
from tsync_mcore.model.attention import SDPAttention
from tsync_mcore.model.bridge.spec import ModelSpec, load_hf_config
from tsync_mcore.model.bridge.weights import expert_parallel_layout, load_hf_weights

# --------------------------------------------------------------------------- building


def _te_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or RuntimeError (cudnn) without CUDA
        return False
    return True


ATTENTIONS = ("auto", "sdpa", "megatron")


def _layer_spec(spec: ModelSpec, which: str, attention: str = "auto"):
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    if which == "auto":
        which = "te" if platform.on_gpu() and _te_available() else "local"
    if which == "te":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=spec.num_experts or None, moe_grouped_gemm=False,
            qk_layernorm=spec.qk_norm)
    if which == "local":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        # why moe_grouped_gemm=False: SequentialMLP (one MLP per local expert, plain
        # matmuls) runs anywhere; the grouped-GEMM experts need TE or torch's CUDA kernels.
        layer = get_gpt_layer_local_spec(num_experts=spec.num_experts or None,
                                         moe_grouped_gemm=False, qk_layernorm=spec.qk_norm,
                                         normalization="RMSNorm")
        # why: megatron's DotProductAttention materializes and masks the score matrix; on GPU
        # SDPA's flash kernels are the fast path without TE. The CPU default stays megatron's
        # (the committed CPU perf baseline and FP64 equivalences were measured with it).
        if attention == "sdpa" or (attention == "auto" and platform.on_gpu()):
            layer.submodules.self_attention.submodules.core_attention = SDPAttention
        return layer
    raise ValueError(f"spec must be 'auto', 'te' or 'local', got {which!r}")


def unwrap(model: torch.nn.Module) -> GPTModel:
    # why: megatron DDP (and Float16Module) keep the GPTModel in `.module`.
    while not isinstance(model, GPTModel) and hasattr(model, "module"):
        model = model.module
    if not isinstance(model, GPTModel):
        raise TypeError(f"expected a GPTModel (optionally DDP-wrapped), got {type(model)}")
    return model


def attention_mode(model: torch.nn.Module) -> str:
    """FLOP-ledger attention mode of `model`: 'causal' when its kernels skip masked blocks
    (SDPA, TE), 'full' for megatron's DotProductAttention (whole score matrix)."""
    core = unwrap(model).decoder.layers[0].self_attention.core_attention
    return "full" if type(core) is DotProductAttention else "causal"


def _moe_config(spec: ModelSpec, aux_loss_coeff: float) -> dict:
    """TransformerConfig MoE settings routing exactly like Qwen3-MoE.

    HF: p = softmax(router logits) over all experts, keep the top k, and divide by their sum
    when norm_topk_prob. Softmax over all experts renormalised on the top k equals a softmax
    over the top-k logits alone, which is megatron's moe_router_pre_softmax=False; without
    renormalisation the probabilities stay the full softmax's (pre_softmax=True).
    """
    if not spec.moe:
        return {}
    return dict(
        num_moe_experts=spec.num_experts,
        moe_ffn_hidden_size=spec.moe_ffn,
        moe_router_topk=spec.top_k,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not spec.norm_topk_prob,
        # why "none" at 0: the aux-loss path does extra work (and all-reduces) for nothing
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff else "none",
        moe_aux_loss_coeff=aux_loss_coeff,
        # why alltoall: the expert-parallel dispatch megatron scales with; works on gloo
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        # no capacity factor: every routed token reaches its experts, as in HF
        moe_expert_capacity_factor=None,
        # each router gets a RouterReplay, so the learner can replay or record routing
        # (model/routing_replay.py); with no replay set a router routes itself
        moe_enable_routing_replay=True,
        expert_model_parallel_size=expert_parallel_layout()[1],
    )


def _router_gemm_without_te() -> None:
    # why: megatron 0.16.1's router gating reads `te_general_gemm` unguarded, a name
    # moe_utils only binds when Transformer Engine imports (CPU, or a GPU without TE);
    # None makes it take its own torch matmul path.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _transformer_config(spec: ModelSpec, dtype: torch.dtype, tp: int,
                        moe_aux_loss_coeff: float = 0.0) -> TransformerConfig:
    return TransformerConfig(
        **_moe_config(spec, moe_aux_loss_coeff),
        num_layers=spec.layers,
        hidden_size=spec.hidden,
        num_attention_heads=spec.heads,
        num_query_groups=spec.kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_eps,  # mcore default 1e-5 is wrong for 1e-6 models
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,  # defaults are 0.1
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        masked_softmax_fusion=False,  # fused causal softmax ignores explicit masks
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        sequence_parallel=False,  # needs TE/apex norms
        use_cpu_initialization=not platform.on_gpu(),  # False fails on CPU
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
    )


def build_model(
    hf_dir: str,
    *,
    dtype: torch.dtype = torch.float32,
    spec: str = "auto",
    attention: str = "auto",
    load_weights: bool = True,
    moe_aux_loss_coeff: float = 0.0,
) -> tuple[GPTModel, ModelSpec]:
    """GPTModel for `hf_dir` at the current TP size, with this rank's shard of the weights.

    `spec`: "auto" (TE with CUDA and an importable transformer_engine, else local),
    "te" or "local". `attention` (local spec): "sdpa" (`SDPAttention`), "megatron"
    (`DotProductAttention`), or "auto" (SDPA on GPU). Needs `init_parallel()` first.
    MoE checkpoints (qwen3_moe) take the expert-parallel size `init_parallel(ep=...)` set;
    `moe_aux_loss_coeff` > 0 turns on megatron's load-balancing loss (off for RL).
    """
    if not ps.model_parallel_is_initialized():
        raise RuntimeError("call tsync_mcore.model.parallel.init_parallel() before build_model")
    mspec = load_hf_config(hf_dir)
    tp = ps.get_tensor_model_parallel_world_size()
    if mspec.vocab_size % tp:
        raise ValueError(
            f"vocab_size {mspec.vocab_size} is not divisible by tensor-parallel size {tp}"
        )
    if mspec.kv_heads % tp or mspec.heads % mspec.kv_heads:
        raise ValueError(
            f"need kv_heads ({mspec.kv_heads}) % tp ({tp}) == 0 and heads ({mspec.heads}) "
            f"% kv_heads == 0"
        )
    if mspec.ffn % tp:
        raise ValueError(f"intermediate_size {mspec.ffn} is not divisible by tp {tp}")
    _, ep, _, etp = expert_parallel_layout()
    if mspec.moe and (mspec.num_experts % ep or mspec.moe_ffn % etp):
        raise ValueError(f"num_experts {mspec.num_experts} must be divisible by ep {ep} and "
                         f"moe_intermediate_size {mspec.moe_ffn} by expert tp {etp}")
    if not mspec.moe and ep > 1:
        raise ValueError(f"expert parallelism (ep {ep}) needs a mixture-of-experts model")
    if mspec.moe:
        _router_gemm_without_te()
    config = _transformer_config(mspec, dtype, tp, moe_aux_loss_coeff)
    config.perform_initialization = not load_weights  # loaded weights overwrite it anyway
    model = GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(mspec, spec, attention),
        vocab_size=mspec.vocab_size,
        max_sequence_length=mspec.max_position,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=mspec.tie,
        position_embedding_type="rope",
        rotary_base=mspec.rope_theta,  # default 10000 is wrong for 1e6 models
    )
    # why: WrappedTorchNorm (local spec RMSNorm) is built without a dtype.
    model = model.to(device=platform.device(), dtype=dtype)
    if load_weights:
        _mark_tensor_parallel(model)
        load_hf_weights(model, hf_dir, mspec)
    if mspec.moe and tp > 1:
        _moe_without_sequence_parallel(model)
    return model, mspec


def _mark_tensor_parallel(model: GPTModel) -> None:
    """Give TP-sharded weights megatron's tensor-parallel attributes.

    why: megatron 0.16 sets them only inside its weight initialisers, which do not run with
    perform_initialization=False (the weights are loaded instead). Without them every
    sharded weight counts as a TP replica, and the optimizer's global grad norm (so the
    clipping) took only TP rank 0's shards: at TP = 2 it read about 1/√2 of the true norm."""
    from megatron.core import tensor_parallel as tpl

    for m in model.modules():
        if isinstance(m, (tpl.ColumnParallelLinear, tpl.VocabParallelEmbedding)):
            dims = {"weight": 0, "bias": 0}
        elif isinstance(m, tpl.RowParallelLinear):
            dims = {"weight": 1}  # a row-parallel bias is whole on every rank
        else:
            continue
        for name, dim in dims.items():
            p = getattr(m, name, None)
            if isinstance(p, torch.nn.Parameter) and not getattr(p, "tensor_model_parallel",
                                                                 False):
                tpl.set_tensor_model_parallel_attributes(p, True, dim, 1)


def _moe_without_sequence_parallel(model: GPTModel) -> None:
    """Let MoE layers train at TP > 1 without sequence parallelism.

    why: megatron 0.16's MoELayer.forward raises in training mode at TP > 1 without
    sequence parallelism, a performance guard ("performance may degrade"): every TP rank
    then routes the whole sequence instead of its slice. The learner's span and packed
    forwards do not run sequence-parallel. With the aux and z losses off (config check),
    `training` changes nothing else in a MoE layer, so its forward runs with it False."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for layer in model.modules():
        if isinstance(layer, MoELayer):
            layer.forward = _eval_mode_forward(layer, layer.forward)


def _eval_mode_forward(layer, forward):
    def run(*args, **kwargs):
        was, layer.training = layer.training, False
        try:
            return forward(*args, **kwargs)
        finally:
            layer.training = was
    return run
