"""Channel links with both ends in the test process."""

import threading
from contextlib import contextmanager

from tests.helpers.workers import channel_worker as cw
from tsync_mcore.channel import Limits, open_learner_side, open_rollout_side
from tsync_mcore.util.net import free_port


@contextmanager
def link_pair(timeout_s: float = 10, limits: Limits = Limits(), realtime_io: bool = False):
    """(rollout link, learner link) for one learner, both ends in this process."""
    port, box = free_port(), {}
    th = threading.Thread(target=lambda: box.update(
        links=open_rollout_side("127.0.0.1", port, 1, timeout_s, limits, realtime_io,
                                secret=cw.SECRET)))
    th.start()
    learner = open_learner_side("127.0.0.1", port, 0, 1, timeout_s, limits, realtime_io,
                                secret=cw.SECRET)
    th.join()
    (rollout,) = box["links"]
    try:
        yield rollout, learner
    finally:
        rollout.close()
        learner.close()
