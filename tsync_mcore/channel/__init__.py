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

import importlib

# name -> the submodule that holds it. Loaded on first use (PEP 562): the launchers import
# nodes, secret and errors to check their arguments, and link, schema and wire import torch.
_WHERE = {
    **dict.fromkeys(("ChannelError", "ChannelTimeout", "PeerGone"), "errors"),
    **dict.fromkeys(("Link", "Prepared", "open_learner_side", "open_rollout_side"), "link"),
    **dict.fromkeys((
        "LEARNER_SENDS", "MESSAGES", "ROLLOUT_SENDS", "Ack", "CloseBatch", "DropGroup",
        "GroupRewards", "Hello", "Message", "Publish", "PublishGroup", "RegisterBatch",
        "Rejected", "Shutdown", "TrajectoryMsg", "TurnMsg"), "messages"),
    **dict.fromkeys(("channel_secret", "load_or_create_secret", "secret_path"), "secret"),
    **dict.fromkeys((
        "DEFAULT_LIMITS", "MAGIC", "WIRE_VERSION", "Limits", "MsgType", "check_header",
        "check_header_values", "decode", "decode_arrays", "encode", "schema_table"), "wire"),
}


def __getattr__(name: str):
    if name == "schema":
        return importlib.import_module(f"{__name__}.schema")
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "schema",
    "ChannelError", "ChannelTimeout", "PeerGone", "Link", "Prepared", "open_rollout_side",
    "open_learner_side", "encode", "decode", "check_header", "check_header_values",
    "decode_arrays", "schema_table", "Limits", "DEFAULT_LIMITS", "MAGIC", "WIRE_VERSION",
    "MsgType", "Message", "MESSAGES", "Hello", "RegisterBatch", "TrajectoryMsg", "TurnMsg",
    "GroupRewards", "CloseBatch", "Publish", "PublishGroup", "Ack", "Shutdown", "Rejected", "DropGroup",
    "ROLLOUT_SENDS", "LEARNER_SENDS", "channel_secret", "load_or_create_secret", "secret_path",
]
