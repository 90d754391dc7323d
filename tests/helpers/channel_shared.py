"""Shared by the tests of channel: tests/unit/test_channel.py,
tests/unit/test_channel_security.py."""

from __future__ import annotations

from tests.helpers.workers import channel_worker as cw
from tsync_mcore.channel import GroupRewards, Shutdown, TurnMsg
from tsync_mcore.channel.sources import TurnSource


ALL_MESSAGES = [cw.HELLO, cw.PUBLISH, Shutdown(""), Shutdown("bye ✓"),
                *cw.sample_rollout_messages(), cw.bench_message(0),
                TurnMsg(TurnSource("t", "g", 0, 1, 0, (1, 2), (0, 0), (None, None), 0)),
                GroupRewards(4, "g ✓", {"a": 0.1, "b": -2.5e300, "c": 0.0})]
