"""The trainable policy as the learner sees it: Megatron model + DDP grad buffers + optimizer.

Everything Megatron-specific the learner needs sits behind this small surface:
`backward_source` (one source's forward, fused LM head + scored log-prob, backward into
the FP32 grad buffers), `grad_buffers`/`zero_grads`, and `apply_and_step` (write the batch
direction into the buffers, distributed reduction, global-norm clip, one optimizer step).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

import tsync_mcore.kernels as K
from tsync_mcore.kernels import lm_head
from tsync_mcore.config import Config
from tsync_mcore.model import bridge, lora, optimizer, packed, span
from tsync_mcore.model.parallel import ParallelInfo, init_parallel
from tsync_mcore.objectives.off_policy import (OffPolicy, behaviour_at, scored_positions,
                                               weighted_logp_sum)
from tsync_mcore.platform import upload

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class StepResult:
    ok: bool  # False when the optimizer skipped the step (non-finite gradient)
    grad_norm: float  # global norm before clipping
    grad: dict[str, torch.Tensor] | None  # g_k (ascent direction), HF names, when asked
    lr: float = 0.0  # the learning rate of this step (applied or not)


def all_finite(vectors: list[torch.Tensor], device) -> torch.Tensor:
    """A bool scalar (on `device`): is every element of these vectors finite? Each vector's
    min and max: NaN propagates to both, ±inf reaches one, so they are finite exactly when
    every element is. One reduction pass, no vector-sized temporary (a float64 sum, exact
    too, costs a cast per element: an order of magnitude slower on CPU)."""
    ends = [x.to(torch.float64) for v in vectors if v.numel() for x in torch.aminmax(v)]
    if not ends:
        return torch.ones((), dtype=torch.bool, device=device)
    return torch.isfinite(torch.stack(ends)).all()


class Policy:
    def __init__(self, cfg: Config, par: ParallelInfo | None = None):
        self.cfg = cfg
        self.par = par or init_parallel(tp_size=cfg.model.tp, seed=cfg.seed,
                                        timeout_s=cfg.launch.dist_timeout_s,
                                        ep_size=cfg.model.ep)
        self.model, self.spec = bridge.build_model(
            cfg.model.hf_dir, dtype=DTYPES[cfg.model.dtype], spec=cfg.model.spec,
            attention=cfg.model.attention, moe_aux_loss_coeff=cfg.model.moe_aux_loss_coeff)
        # LoRA (model/lora.py): freeze the base, adapters on the targeted linears. From here
        # on DDP, the optimizer and every gradient-sized buffer hold the adapters only.
        self.lora: lora.LoraSpec | None = None
        if cfg.model.use_lora:
            self.lora, init = _lora_spec(cfg, self.spec)
            lora.attach(self.model, self.spec, self.lora, init=init, seed=cfg.seed)
        self.attention_mode = bridge.attention_mode(self.model)  # what the FLOP ledger counts
        o = cfg.optim
        # A single process has nothing to shard: the distributed optimizer would still
        # reduce-scatter the gradient and all-gather θ through the collective each step.
        self.sharded = o.distributed and self.par.world_size > 1
        self.ddp = optimizer.wrap_ddp(self.model, use_distributed_optimizer=self.sharded)
        # constant: Megatron's constant style keeps max_lr; min_lr = lr says so in its state
        min_lr = o.lr if o.lr_schedule == "constant" else o.min_lr
        self.optimizer = optimizer.build_optimizer(
            self.ddp, lr=o.lr, min_lr=min_lr, betas=(o.beta1, o.beta2), eps=o.eps,
            weight_decay=o.weight_decay, clip_grad=o.clip_grad,
            use_distributed_optimizer=self.sharded, bf16=cfg.model.dtype == "bf16")
        # One scheduler step per applied update (a skipped update leaves it, as θ and Adam).
        self.scheduler = optimizer.build_scheduler(
            self.optimizer, lr=o.lr, min_lr=min_lr, style=o.lr_schedule,
            warmup_steps=o.warmup_updates, decay_steps=o.decay_updates or cfg.run.updates,
            weight_decay=o.weight_decay)
        self.device = next(self.model.parameters()).device
        self.vocab_local = self.spec.vocab_size // self.par.tp_size
        self.vocab_start = self.par.tp_rank * self.vocab_local
        self._tp_group = self.par.tp_group if self.par.tp_size > 1 else None
        self._buffers = optimizer.grad_buffers(self.ddp)
        self._buffer_groups = optimizer.grad_buffer_groups(self.ddp)  # each one's DP reduction
        self._reduced = optimizer.reduced_grad_ranges(self.ddp)  # this rank's part after the reduce
        self._grad_slices = self._map_grad_slices()
        # MoE at TP > 1 (no sequence parallelism, model/bridge/): megatron's dispatcher
        # gathers every TP rank's tokens for the experts, and each rank holds the whole
        # sequence, so each token reaches its experts tp times and their weight gradients
        # come out tp times over; the step takes them back to one.
        self._expert_slices = [] if not (self.spec.moe and self.par.tp_size > 1) else [
            (i, a, b) for n, (i, a, b, _) in self._grad_slices.items()
            if bridge.is_expert_param(n)]
        # Entropy of the scored tokens served since the last take_entropy() (a metric).
        self._entropy_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._entropy_tokens = 0
        # learner.fused_lm_head: sources and spans hand the scorer final hidden states, not
        # logits (kernels/lm_head.py); its estimated peak bytes since take_head_peak().
        self.fused_head = cfg.learner.fused_lm_head
        # model.autocast: the transformer's forward (and so its backward) in BF16 products
        # from the FP32 weights; the LM head and log-probs are computed outside it, in FP32
        self.autocasts = cfg.model.autocast == "bf16"
        self._autocast = (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) \
            if self.autocasts else nullcontext
        self.head_chunk = cfg.learner.lm_head_chunk
        self._head_peak = 0

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step applies."""
        return optimizer.current_lr(self.optimizer)

    @property
    def gathers_to_export(self) -> bool:
        """Whether exporting θ (publication, export_params) is a collective: at TP > 1 each
        TP group gathers its shards, at EP > 1 each EP group its experts; else rank 0 alone
        holds everything."""
        return self.par.tp_size > 1 or self.ep_size > 1

    @property
    def ep_size(self) -> int:
        """Expert-parallel size (megatron's, as model.ep set it): > 1, every MoE forward and
        backward is a collective over the EP group."""
        return ps.get_expert_model_parallel_world_size()

    @property
    def n_grad_elements(self) -> int:
        return sum(b.numel() for b in self._buffers)

    # --- one source ---------------------------------------------------------------------

    def backward_source(self, tokens: list[int], scored_mask: list[int], weight: float,
                        off_policy: OffPolicy | None = None, behaviour=()) -> torch.Tensor:
        """grad buffers += ∇_θ [−weight · Σ_{t∈M} ρ_t log π_θ(a_t | h_t)]; returns Σ log π
        (a device scalar: read it once per batch, not per source).

        ρ_t = 1, or the truncated IS weight from the source's `behaviour` log-probs (one per
        token) when `off_policy` corrects (objectives/off_policy.py)."""
        logp = self.forward_source(tokens, scored_mask)
        rho = off_policy.weights(logp, behaviour_at(behaviour, scored_mask)) if off_policy \
            else None
        (-weight * weighted_logp_sum(logp, rho)).backward()
        return logp.detach().sum()

    def forward_source(self, tokens: list[int], scored_mask: list[int],
                       with_entropy: bool = False):
        """log π_θ of the scored tokens (and with `with_entropy` their entropies), with the
        graph: the caller's loss backpropagates through them."""
        # built on the host and copied asynchronously (no per-source sync)
        ids = upload(tokens, torch.long, self.device)
        pos = self.positions(scored_mask)
        with self._autocast():
            if self.fused_head:
                head = bridge.final_hidden(self.ddp, ids[None])
                out = replace(head, hidden=head.hidden[0])  # [S, H]
            else:
                out = bridge.logits(self.ddp, ids[None])[0]  # [S, V_local]
        return self.scored_logprob(out, ids, pos, with_entropy=with_entropy)

    def dummy_pass(self) -> None:
        """A forward + backward of two tokens with loss weight 0: at ep > 1 it makes the
        collectives of a real pass (MoE all-to-alls each way) on a rank with nothing to
        serve, so its EP peers' passes complete. Its own gradient is dropped (the dense
        buffers are zeroed: weight 0 leaves any router aux-loss gradient); the expert
        buffers keep what the peers' tokens routed to this rank's experts put there, for
        the caller to fold. Entropy and LM head metrics are left as they were."""
        entropy, tokens, peak = self._entropy_sum.clone(), self._entropy_tokens, self._head_peak
        self.backward_source([0, 0], [0, 1], 0.0)
        for buf in self._buffers[:len(self.ddp.buffers)]:  # the dense ones come first
            buf.zero_()
        self._entropy_sum.copy_(entropy)
        self._entropy_tokens, self._head_peak = tokens, peak

    def positions(self, scored_mask: list[int]) -> torch.Tensor:
        """Indices of the scored tokens, found on the host: no device sync (torch.nonzero of
        a device tensor waits for the device)."""
        return upload(scored_positions(scored_mask), torch.long, self.device)

    def scored_logprob(self, out: torch.Tensor | bridge.HeadInput, ids: torch.Tensor,
                       pos: torch.Tensor, with_entropy: bool = False):
        """log π(ids[pos] | ids[:pos]) from position pos − 1's output (vocab-parallel safe):
        logits [S, V_local], or with the fused head the final hidden states [S, H] and the
        output weight (`bridge.HeadInput`), scored chunk by chunk without the logits.

        The same pass adds the entropy of π(· | ids[:pos]) at each scored position to the
        sums `take_entropy` returns (its TP partials share the SUM collective); with
        `with_entropy` it returns (logp, entropy), the entropy differentiable (a bonus)."""
        if isinstance(out, bridge.HeadInput):
            # (model.autocast: BF16 hidden states meet the FP32 output weight in FP32)
            hidden = out.hidden[pos - 1].to(out.weight.dtype)
            logp, ent = K.fused_lm_head_logprob(
                hidden, out.weight, ids[pos], vocab_start=self.vocab_start,
                tp_group=self._tp_group, chunk=self.head_chunk, with_entropy=True)
            peak = lm_head.peak_bytes(len(pos), hidden.shape[-1], self.vocab_local,
                                      self.head_chunk, hidden.dtype)
        else:
            rows = out[pos - 1].float() if self.autocasts else out[pos - 1]
            logp, ent = K.scored_logprob(rows, ids[pos],
                                         vocab_start=self.vocab_start,
                                         tp_group=self._tp_group, with_entropy=True)
            peak = lm_head.unfused_peak_bytes(out.shape[0], len(pos), self.vocab_local,
                                              out.dtype)
        self._head_peak = max(self._head_peak, peak)
        self._entropy_sum += ent.detach().sum(dtype=torch.float64)
        self._entropy_tokens += ent.numel()
        return (logp, ent) if with_entropy else logp

    def take_head_peak(self) -> int:
        """The LM head's estimated peak bytes (per call, max) since the last call, and reset."""
        out, self._head_peak = self._head_peak, 0
        return out

    def take_entropy(self) -> tuple[float, int]:
        """(Σ entropy, scored tokens) since the last call, and reset (one host sync)."""
        out = float(self._entropy_sum), self._entropy_tokens
        self._entropy_sum.zero_()
        self._entropy_tokens = 0
        return out

    def span_forward(self, ids: torch.Tensor, offset: int, past: list[span.KV] | None,
                     *, want_logits: bool = True, stop_after_kv: bool = False):
        """Forward of tokens at offset.. against context K/V (per-turn OPD, shared prefixes).

        Its output (logits, or the fused head's `bridge.HeadInput`) goes to `scored_logprob`."""
        with self._autocast():
            out = span.span_forward(self.ddp, ids, offset, past, want_logits=want_logits,
                                    stop_after_kv=stop_after_kv, fused_head=self.fused_head)
        return out

    # --- several sources in one pass (packed serving, docs/design/learner.md) --------------------

    @property
    def packable(self) -> str | None:
        """None when the model can run packed forwards (model/packed.py), else why not."""
        return packed.supported(self.ddp)

    def packed_kv(self, segments: list[packed.Segment]) -> list[list[span.KV]]:
        """One packed forward of `segments` up to the last layer's K/V (graph-attached),
        per segment and layer: the shared prompts of several groups at once."""
        with self._autocast():
            return packed.packed_forward(self.ddp, segments, stop_after_kv=True).kv

    def packed_logprobs(self, segments: list[packed.Segment], scored: list[list[int]],
                        with_entropy: bool = False):
        """One packed forward of `segments`: per segment, log π of its tokens at positions
        `scored[i]` (indices into the segment, each ≥ 1: scored from the row before, with
        the graph), and its K/V per layer (graph-attached). The caller sums the segments'
        losses and backpropagates once; the gradient is the sum of the one-by-one ones.
        `with_entropy`: (log-probs, entropies, K/V), each per segment."""
        with self._autocast():
            out = packed.packed_forward(self.ddp, segments)
        ids = torch.cat([s.tokens for s in segments])
        pos = upload([a + p for a, ps in zip(out.starts, scored) for p in ps], torch.long,
                     self.device)
        # the LM head: fused (only the scored rows, chunk by chunk), or the output layer
        hidden = out.hidden.float() if self.autocasts else out.hidden
        head = bridge.head_input(self.ddp, hidden[:, 0]) if self.fused_head \
            else packed.lm_head(self.ddp, hidden)
        sizes = [len(ps) for ps in scored]
        if with_entropy:
            logp, ent = self.scored_logprob(head, ids, pos, with_entropy=True)
            return list(logp.split(sizes)), list(ent.split(sizes)), out.kv
        logp = self.scored_logprob(head, ids, pos)
        return list(logp.split(sizes)), out.kv

    def grad_buffers(self) -> list[torch.Tensor]:
        return self._buffers

    def zero_grads(self) -> None:
        self.ddp.zero_grad_buffer()
        if not self.sharded:
            # Megatron's plain optimizer points each param.grad at its main_grad for the
            # step; left there, autograd would accumulate the next backward into the buffer
            # a second time (through param.grad) besides DDP's hook
            self.optimizer.zero_grad(set_to_none=True)

    # --- the barrier ----------------------------------------------------------------------

    def apply_and_step(self, descent: list[torch.Tensor], scale: float,
                       export_grad: bool = False, schedule_step: bool = True) -> StepResult:
        """Buffers ← scale·descent, reduce over data-parallel ranks, clip, one step.
        `schedule_step`: the LR schedule advances (once per update: not after a PPO
        mini-batch that is not the update's last)."""
        lr = self.lr
        for buf, acc in zip(self._buffers, descent):
            buf.copy_(acc.mul_(scale))  # scale in the accumulator's precision; it is reset next batch
        for i, a, b in self._expert_slices:
            self._buffers[i][a:b].div_(self.par.tp_size)
        grad = None
        if export_grad:
            full = [b.clone() for b in self._buffers]
            # Dense buffers sum over DP; expert buffers over expert-DP (at ep > 1 each rank
            # holds other experts, which export_hf gathers over EP), as DDP reduces them.
            for t, group in zip(full, self._buffer_groups):
                if group.size() > 1:
                    dist.all_reduce(t, group=group)
            named = {n: -full[i][a:b].view(shape)
                     for n, (i, a, b, shape) in self._grad_slices.items()}
            # LoRA: PEFT's names (its replicated adapter grads are whole on every TP rank)
            grad = lora.export_adapter(self.model, named) if self.lora else \
                bridge.export_hf(named, self.spec, tp_partial_grads=self.par.tp_size > 1)
        optimizer.finish_grad_sync(self.ddp)
        if not self.reduced_grads_finite():
            # Megatron's Adam steps on whatever it is given (it checks only under a loss
            # scaler): one NaN would reach every parameter and both moments for good.
            self.zero_grads()
            return StepResult(ok=False, grad_norm=float("nan"), grad=grad, lr=lr)
        ok, grad_norm = optimizer.optimizer_step(self.optimizer)
        if ok and schedule_step:
            self.scheduler.step(1)
        self.zero_grads()
        return StepResult(ok=ok, grad_norm=grad_norm, grad=grad, lr=lr)

    def reduced_grads_finite(self) -> bool:
        """Collective over every learner rank: is the reduced gradient finite everywhere?

        One min/max pass per range (`all_finite`), no gradient-sized mask."""
        ok = all_finite([buf[a:b] for buf, ranges in zip(self._buffers, self._reduced)
                         for a, b in ranges], self.device)
        bad = (~ok).to(torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad)  # DP and TP ranks skip together, or step together
        return float(bad) == 0.0

    def sums_finite(self, vectors: list[torch.Tensor]) -> bool:
        """This rank only: are these (gradient-sized) vectors finite? One host read."""
        return bool(all_finite(vectors, self.device))

    def dp_sum(self, x: float) -> float:
        """Sum a host scalar over data-parallel ranks (e.g. the global scored-token count)."""
        return self.dp_sum_vector([x])[0]

    def dp_max_vector(self, xs: list[float]) -> list[float]:
        """Elementwise max of a host vector over data-parallel ranks (one all-reduce)."""
        if self.par.dp_size == 1 or not xs:
            return list(xs)
        t = torch.tensor(xs, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.par.dp_group)
        return t.tolist()

    def dp_sum_vector(self, xs: list[float]) -> list[float]:
        """Elementwise sum of a host vector over data-parallel ranks (one all-reduce)."""
        if self.par.dp_size == 1 or not xs:
            return list(xs)
        t = torch.tensor(xs, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.par.dp_group)
        return t.tolist()

    def export_params(self) -> dict[str, torch.Tensor]:
        """θ in HF names; with LoRA the merged weights W + s·B·A (what vLLM serves)."""
        return bridge.export_hf(dict(self.model.named_parameters()), self.spec,
                                transform=self._merge)

    def iter_params(self):
        """`export_params` one tensor at a time (a collective per tensor at TP > 1)."""
        return bridge.iter_hf(dict(self.model.named_parameters()), self.spec,
                              transform=self._merge)

    @property
    def _merge(self):
        return lora.merged_weight(self.model) if self.lora else None

    def export_adapter(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter in PEFT's saved names, full tensors (collective at TP > 1)."""
        if self.lora is None:
            raise ValueError("export_adapter: this policy has no LoRA adapters")
        return lora.export_adapter(self.model, {n: p for n, p in self.model.named_parameters()
                                                if lora.is_adapter_param(n)})

    def _map_grad_slices(self) -> dict[str, tuple[int, int, int, torch.Size]]:
        """Megatron param name → (buffer index, start, end, shape) of its main_grad view
        (trainable parameters only: a frozen LoRA base has no main_grad)."""
        out = {}
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            mg = p.main_grad
            for i, buf in enumerate(self._buffers):
                if mg.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr():
                    start = mg.storage_offset() - buf.storage_offset()
                    out[name] = (i, start, start + mg.numel(), p.shape)
                    break
            else:
                raise RuntimeError(f"parameter {name} has no main_grad in the DDP buffers")
        return out


def _lora_spec(cfg: Config, spec: bridge.ModelSpec
               ) -> tuple[lora.LoraSpec, dict[str, torch.Tensor] | None]:
    """model.lora as a LoraSpec, and the initial adapter when model.lora_init names one (its
    adapter_config.json gives r, α and targets; a different model.lora.rank is refused)."""
    c = cfg.model.lora
    if not cfg.model.lora_init:
        return lora.LoraSpec(c.rank, c.alpha, tuple(c.targets), c.rslora), None
    got, tensors = lora.read_peft_dir(cfg.model.lora_init, spec)
    if c.rank and c.rank != got.rank:
        raise lora.LoraDirError(f"{cfg.model.lora_init}: r = {got.rank}, but model.lora.rank "
                                f"= {c.rank} (leave model.lora.rank 0 to take the adapter's)")
    return got, tensors
