"""Several replays in one launch: `python -m tsync_mcore.learner.replay`'s own main() once per job.

Usage (under torchrun or plain python): replay_many_worker.py JOBS.json
JOBS.json holds a list of replay argument lists. Each job is a whole replay (its own config,
Policy, Learner; init_parallel re-seeds), so its outputs are the command's; the launch only
saves the interpreter, torch and megatron start-up, paid once instead of once per job.
Prints RESULT with the jobs' summaries, in order.
"""

import sys

from tsync_mcore.util import quiet

quiet.install()  # as the replay command does before its imports

from tests.helpers.dist_util import report  # noqa: E402
from tests.helpers.replay import run_jobs  # noqa: E402
from tsync_mcore.model.parallel import destroy_parallel  # noqa: E402


def main(jobs_path: str) -> None:
    report({"summaries": run_jobs(jobs_path)})
    destroy_parallel()


if __name__ == "__main__":
    from tests.helpers.dist_util import exit_now

    main(sys.argv[1])
    exit_now()  # the ranks' results are out: skip the interpreter's teardown
