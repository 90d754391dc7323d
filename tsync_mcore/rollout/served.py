"""The policy the rollout's engines serve: its version, and loading the learner's
publications into them (await, check, reload, acknowledge: tsync_mcore.publication.receive)."""

from __future__ import annotations

from typing import Any

from tsync_mcore.channel import Link, Publish
from tsync_mcore.publication import receive
from tsync_mcore.publication.receive import check_publish
from tsync_mcore.rollout.engine import EngineThread
from tsync_mcore.rollout.replicas import ReplicaError


class ServedPolicy:
    """θ_loaded in every replica of `engine`; publications come from learner rank 0's
    `link`, in `publish_dir` by `method` (publish.resolve_dir, publish.method_of)."""

    def __init__(self, link: Link, engine: Any, et: EngineThread, *, timeout_s: float,
                 publish_dir: str, method: str):
        self.link, self.engine, self.et = link, engine, et
        self.timeout_s, self.publish_dir, self.method = timeout_s, publish_dir, method
        self.loaded = 0  # the policy version the engine serves
        self.swaps = 0  # weight reloads since the last CloseBatch (async/weight_swaps)

    def serve(self, version: int, kept: int | None = None) -> int | None:
        """receive.serve: wait for θ_version, reload it, acknowledge; the version now served
        (`kept` again for a dropped batch), None once the learner says it finished."""
        return receive.serve(self.link, version, self.timeout_s, self.publish_dir,
                             lambda msg: self.et.run(self.reload(msg)), kept=kept,
                             method=self.method)

    async def reload(self, msg: Publish, mode: str = "keep") -> None:
        """receive.reload into every replica, acknowledged; a failed reload is told to the
        learner (naming the replica) and stops the rollout."""
        def loaded(version: int) -> None:
            self.loaded = version
            print(f"[rollout] serving θ_{version}", flush=True)
            self.swaps += 1  # once per publication, however many replicas loaded it

        await receive.reload(self.engine, self.link, msg, mode=mode, on_loaded=loaded,
                             named=(ReplicaError,))

    def check(self, msg) -> Publish:
        """A notice taken between or during batches: θ_{loaded+1}, checked."""
        return check_publish(self.link, msg, self.loaded + 1, self.publish_dir,
                             method=self.method)

    def take_swaps(self) -> int:
        """The reloads since the last call."""
        swaps, self.swaps = self.swaps, 0
        return swaps
