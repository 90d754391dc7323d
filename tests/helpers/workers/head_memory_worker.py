"""One replay in this process, then its peak resident memory (tests/test_lm_head.py).

Usage: python tests/helpers/workers/head_memory_worker.py <replay arguments>
Prints `RESULT {"peak_rss_bytes": ..., "summary": ...}`.
"""

import sys

from tsync_mcore.util import quiet

quiet.install()

from tests.helpers.dist_util import report  # noqa: E402
from tsync_mcore.learner import replay  # noqa: E402
from tsync_mcore.observability.ledger.memory import peak_rss_bytes  # noqa: E402

if __name__ == "__main__":
    from tests.helpers.dist_util import exit_now

    summary = replay.main(sys.argv[1:])
    report({"peak_rss_bytes": peak_rss_bytes(), "summary": summary})
    exit_now()  # the ranks' results are out: skip the interpreter's teardown
