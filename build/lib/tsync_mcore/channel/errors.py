"""Channel errors: every failure names the link, the message and what is wrong."""

from __future__ import annotations


class ChannelError(RuntimeError):
    """A malformed or unexpected message, or a link used after it ended; names the problem."""


class ChannelTimeout(ChannelError):
    """Nothing arrived (or could be delivered) within the timeout."""


class PeerGone(ChannelError):
    """The other side died, closed its link or sent Shutdown."""
