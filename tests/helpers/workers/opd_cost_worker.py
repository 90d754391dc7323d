"""Learner cost of per-turn OPD on one 20-turn trajectory, recompute vs retain.

FLOPs (FlopCounterMode) of the per-turn work and of the deferred replay, against one plain
forward+backward over the whole trajectory; peak bytes of activations saved for backward
(saved-tensor hooks: a holder per saved tensor, released when its graph is freed) and of
the context K/V leaves + adjoints.
"""

import random
import sys

import torch
from torch.utils.flop_counter import FlopCounterMode

from tests.helpers.dist_util import emit  # noqa: E402
from tsync_mcore.channel.sources import BatchPlan, TurnSource
from tsync_mcore.config import load_config
from tsync_mcore.learner.policy import Policy
from tsync_mcore.learner.update import Learner
from tsync_mcore.observability.ledger.account import update_flops


class SavedBytes:
    """Live bytes of tensors saved for backward (parameters and leaves excluded)."""

    def __init__(self):
        self.live = 0
        self.peak = 0

    def hooks(self):
        meter = self

        class Holder:
            def __init__(self, t):
                self.t = t
                self.n = 0 if (t.is_leaf and t.requires_grad) else t.numel() * t.element_size()
                meter.live += self.n
                meter.peak = max(meter.peak, meter.live)

            def __del__(self):
                meter.live -= self.n

        return torch.autograd.graph.saved_tensors_hooks(Holder, lambda h: h.t)


def trajectory(vocab: int, turns: int = 20, obs: int = 4, act: int = 12):
    rng = random.Random(0)
    out, start = [], 0
    for j in range(turns):
        toks = tuple(rng.randrange(vocab) for _ in range(obs + act))
        mask = (0,) * obs + (1,) * act
        teacher = (None,) * obs + tuple(-rng.uniform(0.1, 4.0) for _ in range(act))
        out.append(TurnSource("t", "g", j, turns, start, toks, mask, teacher, 0, ready_order=j))
        start += obs + act
    return out


def measure(policy, cfg, mode, turns):
    cfg.learner.opd_replay = mode
    learner = Learner(cfg.learner, policy)
    learner.begin(BatchPlan(groups={"g": ["t"]}, n_turns={"t": len(turns)}))
    pending, replay = [], learner.kind._replay
    # run the deferred part separately, to count it apart
    learner.kind._replay = lambda *args: pending.append(args)
    saved = SavedBytes()
    with saved.hooks(), FlopCounterMode(display=False) as per_turn:
        for t in turns:
            learner.submit(t)
    with saved.hooks(), FlopCounterMode(display=False) as deferred:
        for args in pending:
            replay(*args)
    result = learner.close()
    ledger = update_flops(policy.spec, result.trace)
    counted = per_turn.get_total_flops() + deferred.get_total_flops()
    return dict(per_turn_flops=per_turn.get_total_flops(), deferred_flops=deferred.get_total_flops(),
                saved_peak_bytes=saved.peak, kv_peak_bytes=result.summary.kv_peak_bytes,
                ledger_err=abs(ledger.total + ledger.recompute_flops - counted) / counted,
                ledger_recompute_flops=ledger.recompute_flops)


def main(hf_dir: str) -> None:
    cfg = load_config(None, {"model.hf_dir": hf_dir, "learner.objective": "opd"})
    policy = Policy(cfg)
    turns = trajectory(policy.vocab_size)
    tokens = [x for t in turns for x in t.tokens]
    mask = [x for t in turns for x in t.scored_mask]
    saved = SavedBytes()
    with saved.hooks(), FlopCounterMode(display=False) as plain:
        policy.backward_source(tokens, mask, 1.0)
    policy.zero_grads()
    res = {"plain_flops": plain.get_total_flops(), "plain_saved_peak_bytes": saved.peak,
           "tokens": len(tokens), "turns": len(turns)}
    for mode in ("recompute", "retain"):
        m = measure(policy, cfg, mode, turns)
        m["total_over_plain"] = (m["per_turn_flops"] + m["deferred_flops"]) / res["plain_flops"]
        m["deferred_over_plain"] = m["deferred_flops"] / res["plain_flops"]
        res[mode] = m
    emit(res)


if __name__ == "__main__":
    from tests.helpers.dist_util import exit_now

    main(sys.argv[1])
    exit_now()  # the ranks' results are out: skip the interpreter's teardown
