"""Readiness channel: rollout process ⇄ learner ranks, over torch.distributed gloo links.

Ready sources and batch events go rollout → learner; Hello and Publish go learner → rollout.
`open_rollout_side` hosts a TCPStore at (addr, port) and returns one `Link` per learner rank;
each learner rank calls `open_learner_side`. A link is a 2-party `ProcessGroupGloo`
(rollout = rank 0, learner = rank 1) built directly on `PrefixStore("tsync/link{i}", store)`,
so the default process group (torchrun's, Megatron's) is neither used nor required.
Payloads are CPU tensors over gloo TCP even with CUDA: they are a few bytes per token, and
NCCL would tie the channel to CUDA streams and communicator lifetimes of the learner.

Wire format (WIRE_VERSION 4). One message = a header tensor int64[16], then its payloads:

    [0] MAGIC 0x7473796E63 (b"tsync")   [1] WIRE_VERSION   [2] message type (MsgType)
    [3] policy version (-1 for Shutdown) [4] n payloads     [5..13] payload j descriptor:
    numel << 8 | dtype code (1 int64, 2 uint8, 3 float64); unused slots 0
    [14] payload checksum: Σ_j (j+1)·crc32(payload j)          mod 2^62
    [15] header checksum:  Σ header[0..14]                    mod 2^62

Payloads per type (fixed order and dtype; `T` ≤ Limits.max_tokens, `B` ≤ Limits.max_bytes):

    Hello          data_pos int64[1]
    RegisterBatch  data_pos int64[1], utf-8 JSON {"objective","groups","n_turns","routing"[,
                   "schedule"]} uint8[B]
    TrajectoryMsg  tokens int64[T], scored_mask uint8[T], reward float64[1],
                   [ready_order, has_prompt_len, prompt_len] int64[3], JSON [traj_id, group_id]
    TurnMsg        tokens int64[T], scored_mask uint8[T], teacher_logprobs float64[T] (NaN =
                   None), [turn, n_turns, start, ready_order, has_prompt_len, prompt_len]
                   int64[6], JSON [traj_id, group_id]
    GroupRewards   rewards float64[T], JSON [group_id, [traj_id per reward]]
    CloseBatch     n_sources int64[1], [rollout_time_s, reward_mean] float64[2]
    Publish        path uint8[B]
    Ack            ok int64[1], reload_time_s float64[1], error uint8[B]
    Shutdown       reason uint8[B]

On a link a message opens with one frame of exactly FRAME_BYTES (32 KiB) on tag 0: the
header's 128 bytes, then the payloads packed (each padded to 8 bytes) when they fit, which
all but trajectories of more than ~1.8k tokens do; a larger body follows on tag 1. One gloo
op per message: the reader has the next frame's recv posted, so the send needs no round
trip to the receiver's Python thread. Header then body (wire format 3) cost each side
~0.2 ms of CPU per message more (OPD turns on the 2-core CPU machine: sender ~0.55 →
~0.35 ms, receiver ~0.5 → ~0.3 ms).
`decode` checks structure only; the learner validates content through `tsync_mcore.sources`.
A link also rejects a message type from the wrong side (`ROLLOUT_SENDS`, `LEARNER_SENDS`).

Link semantics:
- Each link has a reader thread that always has the next frame's recv posted (a gloo send
  completes only when the peer has posted its recv). `send` therefore returns once the peer
  process took the message, whatever its main loop is doing; it may be called from several
  threads (one message at a time on the wire).
- `recv(timeout_s)` waits on the reader's queue: `ChannelTimeout` leaves the link usable.
  `None` means the link's timeout_s, `math.inf` no limit. `poll()` returns the next
  message if one is there, else None.
- A peer that dies closes its sockets: `PeerGone` within milliseconds on the next/pending
  recv and send. A peer that hangs with its sockets open (host lost, process stopped) is
  seen only as `ChannelTimeout` of recv, or of a send (that one closes the gloo pair: the
  link is dead afterwards).
- `Shutdown` ends a link: the receiver's reader answers with its own Shutdown and stops;
  later recv/send raise `PeerGone`. `close()` sends Shutdown and waits ≤ 5 s for the answer.
  A protocol error (malformed message) is final too; the reader tells the peer with
  Shutdown('protocol error: …'), which is not answered.
- Rendezvous keys (under the rollout's TCPStore): `tsync/wire_version`, `tsync/n_learners`
  (both checked by learners on join), and gloo's own under `tsync/link{i}/`. A store serves
  one set of links: a restarted learner needs a restarted rollout side (new store).
- Addresses: learners connect to (addr, port) and to the gloo listener the rollout binds on
  addr (so addr must be the rollout's reachable address, not 0.0.0.0); a learner binds the
  local address that routes to addr. `GLOO_SOCKET_IFNAME` overrides both.
"""

from tsync_mcore.channel.errors import ChannelError, ChannelTimeout, PeerGone
from tsync_mcore.channel.link import Link, Prepared, open_learner_side, open_rollout_side
from tsync_mcore.channel.messages import (
    LEARNER_SENDS, ROLLOUT_SENDS, Ack, CloseBatch, GroupRewards, Hello, Message, Publish,
    RegisterBatch, Shutdown, TrajectoryMsg, TurnMsg,
)
from tsync_mcore.channel.wire import (
    DEFAULT_LIMITS, MAGIC, WIRE_VERSION, Limits, MsgType, check_header, decode, encode,
)

__all__ = [
    "ChannelError", "ChannelTimeout", "PeerGone", "Link", "Prepared", "open_rollout_side",
    "open_learner_side", "encode", "decode", "check_header", "Limits", "DEFAULT_LIMITS",
    "MAGIC", "WIRE_VERSION", "MsgType", "Message", "Hello", "RegisterBatch", "TrajectoryMsg",
    "TurnMsg", "GroupRewards", "CloseBatch", "Publish", "Ack", "Shutdown", "ROLLOUT_SENDS", "LEARNER_SENDS",
]
