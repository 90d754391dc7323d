"""What the KL term's reference costs per source: its forward's FLOPs (the ledger) and time,
beside the source's own forward + backward, on this machine.

    python -m perf.studies.reference_cost [HF_DIR] [--tokens 256,1024] [--reps 5]

One process, one rank. For each length: the policy's service of one source (forward, fused
scored log-prob, backward) with learner.kl_coef 0, the same with the KL term (the
reference's forward added), and the reference's forward alone (`Reference.logprobs`);
median of --reps after a warm-up. HF_DIR defaults to the overlap benchmark's model shape.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

from perf.bench.model import bench_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("hf_dir", nargs="?", default=None)
    p.add_argument("--tokens", default="256,1024")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    import torch

    from tsync_mcore.config import load_config
    from tsync_mcore.learner.policy import Policy
    from tsync_mcore.learner.reference import Reference
    from tsync_mcore.model.parallel import init_parallel
    from tsync_mcore.objectives.regularizers import Regularizer
    from tsync_mcore.observability.ledger.flops import span_flops

    hf = args.hf_dir
    if hf is None:
        hf = bench_model(os.path.join(tempfile.mkdtemp(prefix="refcost-"), "model"))
    par = init_parallel(tp_size=1)
    cfg = load_config(None, {"model.hf_dir": hf, "learner.kl_coef": 0.1})
    policy = Policy(cfg, par=par)
    ref = Reference(cfg, policy)
    reg = Regularizer(0.1, "k3", 0.0)
    rng = random.Random(0)
    print(f"model {hf} ({policy.spec.layers} layers, hidden {policy.spec.hidden}, vocab "
          f"{policy.spec.vocab_size}); reference {ref.nbytes / 2**20:.1f} MiB; torch threads "
          f"{torch.get_num_threads()}")
    for n in (int(x) for x in args.tokens.split(",")):
        n = min(n, policy.spec.max_position)
        tokens = [rng.randrange(policy.spec.vocab_size) for _ in range(n)]
        mask = [0] * (n // 4) + [1] * (n - n // 4)  # a prompt, then the scored response

        def service(kl: bool) -> None:
            logp, ent = policy.forward_source(tokens, mask, with_entropy=True)
            loss = -logp.sum()
            if kl:
                loss = loss + reg.loss(logp, ent, ref.logprobs(tokens, mask))[0]
            loss.backward()
            policy.zero_grads()

        def timed(fn) -> float:
            fn()  # warm-up
            ts = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)

        plain, with_kl = timed(lambda: service(False)), timed(lambda: service(True))
        alone = timed(lambda: ref.logprobs(tokens, mask))
        scored = sum(mask)
        f_ref = span_flops(policy.spec, n, 0, logits_positions=scored).forward
        f_src = span_flops(policy.spec, n, 0, logits_positions=scored)
        print(f"{n} tokens ({scored} scored): source fwd+bwd {plain * 1e3:.1f} ms, with the "
              f"KL term {with_kl * 1e3:.1f} ms (+{100 * (with_kl / plain - 1):.0f}%); reference "
              f"forward alone {alone * 1e3:.1f} ms; FLOPs: reference {f_ref / 1e9:.3f} GF, "
              f"source fwd+bwd {(f_src.forward + f_src.backward) / 1e9:.3f} GF "
              f"({100 * f_ref / (f_src.forward + f_src.backward):.0f}%)", flush=True)


if __name__ == "__main__":
    main()
