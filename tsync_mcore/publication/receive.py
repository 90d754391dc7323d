"""The rollout's side of publication: await θ_version from learner rank 0, check the
notice, reload every engine, acknowledge; and, for publish.method: dist, open the
publication group the learner broadcasts into.

The rollout driver (tsync_mcore.rollout.driver) calls these with what they need: learner
rank 0's link, the engine (a ReplicaSet, or anything with its reload methods), the
engine thread and the config. Nothing here imports the rollout package.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from tsync_mcore.channel import Ack, Link, PeerGone, Publish, PublishGroup, Rejected, Shutdown
from tsync_mcore.publication import send as publish

FINISHED = "learner finished"  # reason prefix of the learner's Shutdown after its last update


class RolloutStopped(RuntimeError):
    """The rollout stopped before the learner finished; the message says why."""


def serve(link: Link, version: int, timeout_s: float, publish_dir: str,
          load: Callable[[Publish], None], kept: int | None = None,
          method: str = "file") -> int | None:
    """Wait for θ_version from learner rank 0, reload it (`load`, which acknowledges),
    returns the version now served, None once the learner says it finished. A notice for
    `kept` (the version already loaded) means the learner dropped the batch without
    stepping (a non-finite gradient): the weights stay, and the next batch is for `kept`
    again."""
    msg = await_publish(link, version, timeout_s, publish_dir, kept=kept, method=method)
    if msg is None:
        return None
    if msg.version == kept:
        print(f"[rollout] learner dropped the batch of version {kept} (non-finite "
              f"gradient); θ_{kept} stays loaded", flush=True)
        link.send(Ack(version=kept, ok=True, reload_time_s=0.0))
        return kept
    load(msg)
    return version


async def reload(engine, link: Link, msg: Publish, mode: str = "keep",
                 on_loaded: Callable[[int], None] = lambda version: None,
                 named: tuple[type[BaseException], ...] = ()) -> None:
    """Load θ_msg.version (checked by `await_publish`/`check_publish`) into `engine` from
    its file or the publication group, and acknowledge it on `link`; `on_loaded(version)`
    runs once every engine serves it, before the Ack. A failed reload is told to the
    learner, which must not go on: errors of the `named` types (the replica set's, which
    name the replica) as they are, any other as "reload failed: ..."."""
    checksum, received = "", 0
    try:
        if msg.method == "dist":
            seconds = await engine.receive_weights(msg, mode=mode)
            checksum = ",".join(engine.checksums)
            received = engine.bytes_received
        elif msg.method == "adapter":
            seconds = await engine.load_adapter(msg.path, mode=mode, version=msg.version)
        else:
            seconds = await engine.reload_weights(msg.path, mode=mode, version=msg.version)
    except named as e:  # names the replica; every replica must load every version
        link.send(Ack(version=msg.version, ok=False, error=str(e)[:4000]))
        raise RolloutStopped(str(e)) from e
    except Exception as e:  # tell the learner; it must not train on the old policy
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        link.send(Ack(version=msg.version, ok=False, error=f"reload failed: {why}"))
        where = msg.path or "the publication group"
        raise RolloutStopped(f"reload of θ_{msg.version} from {where} failed: {why}") from e
    on_loaded(msg.version)
    link.send(Ack(version=msg.version, ok=True, reload_time_s=seconds,
                  checksum=checksum, bytes_received=received))


def open_group(cfg, link: Link, engine, et):
    """publish.method: dist: serve the group's rendezvous store at channel.addr, tell
    learner rank 0 (`link`) where (and the group's random name), and join every engine
    worker (group ranks 1..) on the engine thread `et`; once the learner joined too (rank
    0), returns the store and its Seal (keep both)."""
    import secrets

    import torch

    from tsync_mcore.channel import channel_secret
    from tsync_mcore.publication import dist as publish_dist

    pub, ch = cfg.publish, cfg.channel
    try:
        store = publish_dist.host_store(ch.addr, pub.port, ch.ack_timeout_s)
    except publish_dist.PublishError as e:
        raise RolloutStopped(f"publish.method: dist: {e}") from None
    token = secrets.token_hex(16)
    world = 1 + int(getattr(engine, "publish_ranks", cfg.rollout.tp))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    link.send(PublishGroup(port=store.port, world=world, token=token, backend=backend))
    try:
        et.run(engine.join_publish_group(
            ch.addr, store.port, 1, world, token=token,
            timeout_s=ch.ack_timeout_s, ifname=pub.ifname, backend=backend,
            key=publish_dist.group_key(channel_secret(cfg), token).hex()))
    except Exception as e:  # the group's own error says who did not come
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RolloutStopped(f"publish.method: dist: joining the publication group at "
                             f"{ch.addr}:{store.port} failed: {why}") from None
    # formed and authenticated: nothing left to list, nothing to park there
    return store, publish_dist.Seal(store)


def await_publish(link: Link, version: int, timeout_s: float, publish_dir: str,
                  kept: int | None = None, method: str = "file") -> Publish | None:
    """The Publish of θ_version (or of `kept`, a dropped batch's θ_k again) from learner
    rank 0's link, checked: its version, and exactly this version's file in the private
    `publish_dir` (publish.resolve_dir), so a learner can only make the rollout load what the
    learners publish. None once the learner says it finished; RolloutStopped for anything
    else (a wrong version or path is told to the learner with a failed Ack)."""
    try:
        msg = link.recv(timeout_s=timeout_s)
        while isinstance(msg, Rejected):  # after the close: the learners agree on it
            print(f"[rollout] learner rejected {msg.source} of update {msg.version} after "
                  f"the batch closed: {msg.reason}", flush=True)
            msg = link.recv(timeout_s=timeout_s)
    except PeerGone:
        if (link.peer_shutdown or "").startswith(FINISHED):
            return None
        raise
    if isinstance(msg, Shutdown):
        if msg.reason.startswith(FINISHED):
            return None
        raise RolloutStopped(f"learner shut down: {msg.reason}")
    return check_publish(link, msg, version, publish_dir, kept, method=method)


def check_publish(link: Link, msg, version: int, publish_dir: str,
                  kept: int | None = None, method: str = "file") -> Publish:
    """`msg` is the Publish of θ_version (or of `kept`) by this run's `method`: for "file",
    with exactly that version's file in the private `publish_dir` ("adapter": its PEFT
    directory there); for "dist", with no path and its buckets announced. Else the learner
    is told (a failed Ack) and RolloutStopped."""
    if not isinstance(msg, Publish):
        raise RolloutStopped(f"expected Publish, got {type(msg).__name__}")
    if msg.version != version and msg.version != kept:
        link.send(Ack(version=msg.version, ok=False, error=f"rollout expected version {version}"))
        raise RolloutStopped(f"learner published version {msg.version}, expected {version}")
    if msg.method != method:
        why = (f"learner published θ_{msg.version} by {msg.method}, this rollout runs "
               f"publish.method: {method} (both must run the same config)")
        link.send(Ack(version=msg.version, ok=False, error=why))
        raise RolloutStopped(why)
    if method == "dist":
        if msg.path or (msg.n_buckets < 1 and msg.version != kept):
            why = (f"Publish of θ_{msg.version} by dist with path {msg.path!r} and "
                   f"{msg.n_buckets} buckets (expected no path and >= 1 bucket)")
            link.send(Ack(version=msg.version, ok=False, error=why))
            raise RolloutStopped(why)
        return msg
    why = _outside(msg.path, publish_dir)
    want = (publish.adapter_path_for if method == "adapter" else publish.path_for)(
        publish_dir, msg.version)
    if not why and os.path.realpath(msg.path) != os.path.realpath(want):
        why = (f"learner published {msg.path}, this rollout loads {want} (both must run the "
               f"same config from the same directory)")
    if not why:
        try:
            publish.check_private_dir(publish_dir)
        except publish.PublishDirError as e:
            why = str(e)
    if why:
        link.send(Ack(version=msg.version, ok=False, error=why))
        raise RolloutStopped(why)
    return msg


def _outside(path: str, publish_dir: str) -> str | None:
    """Why `path` is not a file name under `publish_dir` (realpaths compared), or None."""
    if not path or "\0" in path:
        return f"published path {path!r} is not a file name; expected one under publish.dir"
    root, real = os.path.realpath(publish_dir), os.path.realpath(path)
    if real == root or os.path.commonpath([real, root]) != root:
        return (f"published path {path!r} resolves to {real}, outside publish.dir {root}: "
                f"refusing to load it")
    return None
