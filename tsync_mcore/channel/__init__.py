"""Readiness channel: rollout process ⇄ learner ranks, over authenticated TCP links.

Ready sources and batch events go rollout → learner; Hello, Publish and Rejected go
learner → rollout. `open_rollout_side` listens on the channel address and returns one `Link`
per learner rank; each learner rank calls `open_learner_side`. Both need the run's shared
secret (`channel_secret(cfg)`, secret.py); handshake.py authenticates a join and keys the
per-message MACs. The messages and their wire fields are declared once in `messages.py`;
docs/design/wire.md describes handshake, framing, header, checksums, link semantics and the security
model, with the layout table generated from the declarations
(`python -m tsync_mcore.channel --table`). `decode` checks structure only; the learner
validates content through `tsync_mcore.channel.sources`.
"""

from tsync_mcore.channel import schema
from tsync_mcore.channel.errors import ChannelError, ChannelTimeout, PeerGone
from tsync_mcore.channel.link import Link, Prepared, open_learner_side, open_rollout_side
from tsync_mcore.channel.messages import (
    LEARNER_SENDS, MESSAGES, ROLLOUT_SENDS, Ack, CloseBatch, DropGroup, GroupRewards, Hello,
    Message, Publish, PublishGroup, RegisterBatch, Rejected, Shutdown, TrajectoryMsg, TurnMsg,
)
from tsync_mcore.channel.secret import channel_secret, load_or_create_secret, secret_path
from tsync_mcore.channel.wire import (
    DEFAULT_LIMITS, MAGIC, WIRE_VERSION, Limits, MsgType, check_header, check_header_values,
    decode, decode_arrays, encode, schema_table,
)

__all__ = [
    "schema",
    "ChannelError", "ChannelTimeout", "PeerGone", "Link", "Prepared", "open_rollout_side",
    "open_learner_side", "encode", "decode", "check_header", "check_header_values",
    "decode_arrays", "schema_table", "Limits", "DEFAULT_LIMITS", "MAGIC", "WIRE_VERSION",
    "MsgType", "Message", "MESSAGES", "Hello", "RegisterBatch", "TrajectoryMsg", "TurnMsg",
    "GroupRewards", "CloseBatch", "Publish", "PublishGroup", "Ack", "Shutdown", "Rejected", "DropGroup",
    "ROLLOUT_SENDS", "LEARNER_SENDS", "channel_secret", "load_or_create_secret", "secret_path",
]
