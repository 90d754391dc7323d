"""A TP learner publishing its θ over the publication group (publish.method: dist).

Usage (under torchrun): publish_worker.py HF_DIR TP ADDR PORT WORLD TOKEN BUCKET_BYTES
Every rank builds the policy from HF_DIR at model.tp=TP and takes its part in the per-tensor
TP gathers; rank 0 joins the group as its rank 0, puts the bucket count in the store (the
test's notice needs it) and broadcasts θ as version 1. Prints RESULT.
"""

import datetime
import sys

from tests.helpers.dist_util import report  # noqa: E402
from tsync_mcore.config import load_config
from tsync_mcore.learner.policy import Policy
from tsync_mcore.publication import dist as publish_dist


def main(hf_dir, tp, addr, port, world, token, bucket_bytes):
    cfg = load_config(None, {"model.hf_dir": hf_dir, "model.tp": int(tp),
                             "model.dtype": "fp32", "run.dir": "/tmp/unused"})
    policy = Policy(cfg)
    params = publish_dist.params_of(policy.iter_params())  # as Publisher: one pass first
    named = policy.iter_params()
    if policy.par.rank != 0:
        for _ in named:
            pass
        return report({"sent": 0})
    pg = publish_dist.join_group(addr, int(port), 0, int(world), token=token, timeout_s=60)
    sender = publish_dist.Sender(pg, params, int(bucket_bytes))
    from torch.distributed import TCPStore
    TCPStore(addr, int(port), is_master=False,
             timeout=datetime.timedelta(seconds=60)).set("n_buckets", str(len(sender.buckets)))
    st = sender.publish(1, named)
    report({"sent": st.bytes, "buckets": st.buckets})


if __name__ == "__main__":
    from tests.helpers.dist_util import exit_now

    main(*sys.argv[1:])
    exit_now()  # the ranks' results are out: skip the interpreter's teardown
