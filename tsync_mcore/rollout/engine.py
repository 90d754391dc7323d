"""Rollout side: a vLLM generation engine with in-place weight reload, and a frozen teacher.

`RolloutEngine` wraps vLLM's `AsyncLLM` for a local Hugging Face directory. In vLLM 0.32
`AsyncLLM` always runs its engine core in a child process; `VLLM_ENABLE_V1_MULTIPROCESSING=0`
keeps the model executor inside that child instead of a third process. Weights reach the
child as a path to an HF-named safetensors file (tensors sent through `collective_rpc` would
arrive as Python lists), a LoRA adapter as a PEFT directory vLLM loads itself
(`load_adapter`, docs/guide/lora.md).

The engine core is forked, not spawned, where vLLM runs the model inside it on a CPU
(`start_method`): vLLM's CPU platform always asks for spawn, for the OpenMP set-up of the
worker processes of its multiprocessing executor, which this engine does not use; a
spawned core imports vLLM and torch again, a forked one inherits them
(docs/measured/engine-start.md). The fork is made from a thread of its own: a child forked
by a thread that ran an OpenMP parallel region deadlocks in its first one (libgomp keeps
its thread pool per thread, and the pool's threads do not survive the fork). The forked
core lets go of the sockets it inherited (a spawned one inherits none), and a process in a
torch.distributed group keeps the spawn (a forked core would take the group for its own),
as does a caller's `VLLM_WORKER_MULTIPROC_METHOD=spawn` (scripts then need the
`if __name__ == "__main__":` guard).

`EngineThread` owns an event loop in a background thread so that a non-async caller (the
launcher, pytest) can drive the engine and the agent coroutines: `et.run(coro)`.

`TeacherScorer` is the frozen OPD teacher, in plain PyTorch on the HF model (fp32, no
grad). A second in-process vLLM engine driven from another thread gives wrong outputs or
crashes (vLLM's forward context is process-global), and vLLM's `prompt_logprobs` never
reads the prefix cache, so it is no cheaper per turn. The vLLM alternative, when the
teacher is large: an `LLM` in its own process scoring with
`SamplingParams(max_tokens=1, prompt_logprobs=0)` and reading
`out.prompt_logprobs[p][ids[p]].logprob`.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import stat
import threading
import time
import uuid
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch

from tsync_mcore.model.lora_spec import VLLM_LORA_RANKS

T = TypeVar("T")

WORKER_EXTENSION = "tsync_mcore.publication.worker_ext.ReloadExtension"


def _set_cpu_env() -> None:
    # vLLM reads it at engine creation; an explicit value from the caller's env wins.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


_START_LOCK = threading.Lock()  # one engine start at a time: it sets a process-wide variable
_core_forker: int | None = None  # the thread forking an engine core, while it does


def _release_inherited_sockets() -> None:
    """In a forked engine core: every socket of the parent (its learner links, servers,
    vLLM's client sockets) now points at /dev/null, so that the core holds none of them
    open: a peer sees the parent's connections close when the parent does, as with a
    spawned core. dup2, not close: a parent's socket object still in the child's heap may
    close its number later, and that number must not be one the child reused."""
    if _core_forker != threading.get_ident() or not os.path.isdir("/proc/self/fd"):
        return
    null = os.open(os.devnull, os.O_RDWR)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if fd > 2 and fd != null and stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.dup2(null, fd)
        except OSError:  # the listing's own descriptor, closed since
            pass
    os.close(null)


os.register_at_fork(after_in_child=_release_inherited_sockets)


def start_method(vllm_config: Any, caller: str | None = None) -> str | None:
    """How the engine core of `vllm_config` is started: "fork" where vLLM runs the model
    inside it on a CPU (the uniprocess executor), `caller` (the caller's
    VLLM_WORKER_MULTIPROC_METHOD) does not ask for spawn and this process is in no
    torch.distributed group (a forked core would take it for its own); None elsewhere:
    vLLM's own choice (spawn on a CPU, for the OpenMP set-up of its multiprocessing
    executor's workers; fork or spawn on a GPU)."""
    from vllm.platforms import current_platform

    if caller == "spawn" or not current_platform.is_cpu():
        return None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return None
    return "fork" if vllm_config.parallel_config.distributed_executor_backend == "uni" else None


def start_async_llm(args: Any) -> Any:
    """`AsyncLLM.from_engine_args(args)`, its engine core forked where `start_method` says so
    (see the module docstring)."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    key = "VLLM_WORKER_MULTIPROC_METHOD"
    with _START_LOCK:
        caller = os.environ.get(key)
        try:
            # vLLM's CPU platform sets the variable to spawn here, for the whole process
            config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)

            def start() -> Any:
                return AsyncLLM.from_vllm_config(config, disable_log_stats=args.disable_log_stats,
                                                 enable_log_requests=args.enable_log_requests)

            if start_method(config, caller) != "fork":
                return start()
            os.environ[key] = "fork"
            return _in_own_thread(_frozen_heap(start))
        finally:
            if caller is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = caller


def _frozen_heap(fn):
    """`fn` with the heap frozen while it forks: the child's garbage collections (vLLM
    collects and freezes its heap once started) then skip every object inherited, which
    they would otherwise visit and copy page by page (Python's gc.freeze docs)."""
    def call() -> Any:
        if gc.get_freeze_count():  # someone else's freeze: leave it alone
            return fn()
        gc.freeze()
        try:
            return fn()
        finally:
            gc.unfreeze()
    return call


def _in_own_thread(fn):
    """fn() on a new thread (one that never ran an OpenMP parallel region), the forks it
    makes releasing the parent's sockets; its result or its exception."""
    box: list[Any] = []

    def run() -> None:
        global _core_forker
        _core_forker = threading.get_ident()
        try:
            box.append((True, fn()))
        except BaseException as e:  # re-raised in the caller's thread
            box.append((False, e))
        finally:
            _core_forker = None

    t = threading.Thread(target=run, name="vllm-engine-start")
    t.start()
    t.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value


@dataclass(frozen=True)
class GenOut:
    """One completion: sampled ids, their log-probs under the sampling policy, why it stopped.

    `logprobs` are raw (temperature-free) log-softmax values of the model's logits, vLLM's
    default `logprobs_mode`; at temperature 1 they are the behaviour policy's log-probs.
    `token_versions[i]` is the weight version that sampled token i: a completion that
    straddles an in-flight swap (`reload_weights(mode="abort")`) has two or more.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS or a stop id) or "length"
    policy_version: int  # engine weight version when the request finished
    # per token; [] (a test double): every token is policy_version's
    token_versions: list[int] = field(default_factory=list)


def lora_args(rank: int) -> dict[str, Any]:
    """vLLM engine arguments that serve one adapter of rank <= `rank` at a time (0: none)."""
    if not rank:
        return {}
    fit = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fit:
        raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank "
                         f"{VLLM_LORA_RANKS[-1]}")
    # One slot: every request of a version uses its adapter, and a swap drops the old
    # one only after the new one loaded (vLLM's LRU cache holds two for that moment).
    return {"enable_lora": True, "max_lora_rank": fit[0], "max_loras": 1, "max_cpu_loras": 2}


class RolloutEngine:
    """vLLM `AsyncLLM` over a local HF checkpoint, generating from token ids.

    All coroutines must run on one event loop (the one that first calls `generate`);
    build it on that loop too (see `EngineThread`). `max_model_len` defaults to the
    checkpoint's; `kv_cache_gib` is the KV cache's size on CPU (passed to vLLM as
    `kv_cache_memory_bytes`, per engine); `gpu_memory_utilization` is passed
    through on GPU. `enforce_eager` skips torch.compile of the model (a long warm-up on a CPU;
    docs/measured/engine-start.md).
    """

    def __init__(
        self,
        model_dir: str,
        *,
        max_model_len: int | None = None,
        seed: int = 0,
        dtype: str = "float32",
        kv_cache_gib: float = 1.0,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        enforce_eager: bool = True,
        enable_prefix_caching: bool = True,
        gpu_memory_utilization: float | None = None,
        tensor_parallel_size: int = 1,
        lora_rank: int = 0,
        structured_regex: str = "",
    ) -> None:
        _set_cpu_env()
        from vllm.engine.arg_utils import AsyncEngineArgs

        gpu = torch.cuda.is_available()

        args = AsyncEngineArgs(
            model=model_dir,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            # On CPU a chunked prefill discards the partial step's sampled token and rewinds
            # a seeded request's generator with `set_offset`, which CPU generators lack:
            # the engine core dies ("CPU Generator does not use offset"). Whole prompts per
            # step avoid it; vLLM then raises the token budget to at least max_model_len.
            enable_chunked_prefill=None if gpu else False,
            max_num_batched_tokens=max_num_batched_tokens,
            worker_extension_cls=WORKER_EXTENSION,
            disable_log_stats=True,
            tensor_parallel_size=tensor_parallel_size,
            **lora_args(lora_rank),
            **({} if gpu_memory_utilization is None
               else {"gpu_memory_utilization": gpu_memory_utilization}),
            # vLLM's CPU default asks for most of RAM and fails on small machines
            **({} if gpu else {"kv_cache_memory_bytes": int(kv_cache_gib * 2**30)}),
        )
        self.model_dir = model_dir
        self.structured_regex = structured_regex  # every request's (rollout.structured_regex)
        # vLLM may seed the global RNGs of the launching process; keep the caller's streams.
        cpu_rng, py_rng = torch.get_rng_state(), random.getstate()
        try:
            self._llm: Any = start_async_llm(args)
        finally:
            torch.set_rng_state(cpu_rng)
            random.setstate(py_rng)
        self.max_model_len: int = self._llm.model_config.max_model_len
        self.vocab_size: int = self._llm.model_config.get_vocab_size()
        self.version = 0  # bumped by every reload_weights
        self._reload_lock: asyncio.Lock | None = None
        # In-flight swaps (see `generate`): a request is admitted only through the gate,
        # and a reload waits until no admission is half-way, so every request the engine
        # holds was admitted under the version it read at the gate.
        self._gate: asyncio.Event | None = None  # set: no reload in progress
        self._admitting = 0  # requests between the gate and the engine's queue
        self._admitted: asyncio.Event | None = None  # set while _admitting == 0
        self.swaps = 0  # reloads that aborted requests in flight (mode="abort")
        self._ended_tokens = 0  # tokens of requests no longer in flight (see tokens_produced)
        self._closed = False
        # Publication over torch.distributed (receive_weights): group ranks this engine's
        # workers take (one per vLLM worker), and what the last receive reported per worker.
        self.publish_ranks = tensor_parallel_size
        self.checksums: list[str] = []
        self.bytes_received = 0
        # Adapter publication (publish.lora: adapter): every request is served with the
        # adapter of the version it was admitted under; None: the weights alone.
        self.lora_rank = lora_rank
        self._lora: Any = None  # vllm LoRARequest of the current version
        self._lora_ids = 0  # vLLM caches adapters by id: a fresh one per publication

    def tokens_produced(self) -> int:
        """Tokens this engine has sampled so far, those of requests in flight included: a
        hang watch reads it (ReplicaSet). vLLM's output processor keeps each in-flight
        request's ids as every step's output arrives, even for FINAL_ONLY requests, so
        reading them costs the serving path nothing."""
        return self._ended_tokens + sum(n for _, n in self._in_flight())

    def _in_flight(self) -> list[tuple[str, int]]:
        """(our request id, tokens sampled so far) for each request the engine holds."""
        states = getattr(getattr(self._llm, "output_processor", None), "request_states", {})
        out = []
        for st in list(states.values()):
            detok = getattr(st, "detokenizer", None)
            if detok is not None:
                out.append((getattr(st, "external_req_id", ""), detok.num_output_tokens()))
        return out

    def _live(self) -> Any:
        if self._llm is None:
            raise RuntimeError("RolloutEngine: used after shutdown")
        return self._llm

    async def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        top_p: float = 1.0,
        stop: Sequence[str] | None = None,
    ) -> GenOut:
        """Sample one completion of `prompt_ids`; EOS of the checkpoint always stops it.

        `stop` strings end sampling at the token that completes one (finish_reason "stop");
        the ids returned still include that token (vLLM cuts only its text, which this
        method does not return: a caller cuts the decoded text itself).

        A weight swap with mode="abort" ends the request with the tokens sampled so far
        (vLLM 0.32 returns them, with their log-probs, as finish_reason "abort"); it then
        continues under the new weights from the prompt plus those tokens, for the tokens
        left of `max_tokens` (AReaL's interruptible generation). Each token keeps the
        version and log-prob it was sampled with, so both are exact per token. A
        continuation searches for stop strings only in its own text: one that straddles
        the swap is not seen.
        """
        if not prompt_ids:
            raise ValueError("generate: empty prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"generate: prompt of {len(prompt_ids)} tokens leaves no room in "
                             f"max_model_len={self.max_model_len}")
        if max_tokens < 1:
            raise ValueError(f"generate: max_tokens must be >= 1, got {max_tokens}")
        ids: list[int] = []
        lps: list[float] = []
        versions: list[int] = []
        while True:
            swaps = self.swaps
            # A continuation gets its own seed: the same one would replay the first draws.
            part_seed = seed if seed is None or not ids else (seed * 7919 + len(ids)) % 2**31
            (part_ids, part_lps), version, reason = await self._request(
                [*prompt_ids, *ids], max_tokens - len(ids), temperature, top_p, part_seed,
                stop_token_ids, stop)
            ids += part_ids
            lps += part_lps
            versions += [version] * len(part_ids)
            if reason != "abort":
                break
            if self.swaps == swaps and self._gate.is_set():
                raise RuntimeError("generate: request aborted outside a weight swap")
            if len(ids) >= max_tokens:
                reason = "length"
                break
        return GenOut(ids, lps, reason, versions[-1] if versions else self.version, versions)

    async def _request(self, prompt_ids: list[int], max_tokens: int, temperature: float,
                       top_p: float, seed: int | None, stop_token_ids,
                       stop: Sequence[str] | None = None) -> tuple[tuple[list[int], list[float]], int, str]:
        """One vLLM request: ((ids, log-probs), the version that sampled them, finish
        reason). Admitted through the swap gate, so the version read is the one that runs."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            logprobs=0,  # the sampled token's own log-prob only
            stop_token_ids=list(stop_token_ids) if stop_token_ids else None,
            stop=list(stop) if stop else None,
            # ids in, ids out: skip detokenizer work, unless stop strings need the text
            # (vLLM refuses them without it)
            detokenize=bool(stop),
            output_kind=RequestOutputKind.FINAL_ONLY,
            structured_outputs=StructuredOutputsParams(regex=self.structured_regex)
            if self.structured_regex else None,
        )
        # Unique per call: a multi-turn trajectory issues one request per turn.
        request_id = f"tsync-{uuid.uuid4().hex}"
        llm = self._live()
        self._swap_events()
        await self._gate.wait()
        # no await until the engine has the request (see reload)
        version, lora = self.version, self._lora
        self._admitting += 1
        self._admitted.clear()
        try:
            q = await llm.add_request(request_id, TokensPrompt(prompt_token_ids=prompt_ids),
                                      params, lora_request=lora)
        finally:
            self._admitting -= 1
            if not self._admitting:
                self._admitted.set()
        # As AsyncLLM.generate: drain the request's queue until its final output.
        final = None
        try:
            while final is None or not final.finished:
                final = q.get_nowait() or await q.get()
        except asyncio.CancelledError:
            # its tokens so far stay counted (a hang watch reads the count)
            self._ended_tokens += sum(n for r, n in self._in_flight() if r == request_id)
            await llm.abort(request_id, internal=True)
            raise
        if not final.outputs:
            raise RuntimeError(f"generate: request {request_id} returned no output")
        comp = final.outputs[0]
        ids = list(comp.token_ids)
        self._ended_tokens += len(ids)
        lps = [float(comp.logprobs[i][t].logprob) for i, t in enumerate(ids)] if ids else []
        return (ids, lps), version, str(comp.finish_reason)

    def _swap_events(self) -> None:
        if self._gate is None:  # created on the engine's loop
            self._gate, self._admitted = asyncio.Event(), asyncio.Event()
            self._gate.set()
            self._admitted.set()

    async def reload_weights(
        self, path: str, *, mode: Literal["keep", "wait", "abort"] = "keep",
        version: int | None = None,
    ) -> float:
        """Load an HF-named safetensors file into the running engine; return seconds taken.
        `version` labels the new weights (what `GenOut` reports); default: the old + 1.

        `mode` says what happens to requests in flight: "keep" freezes them and, after the
        update, preempts them so that their K/V is recomputed with the new weights (their
        earlier tokens stay; later ones sample from the new policy); "wait" drains them
        first; "abort" ends them, and `generate` continues each under the new weights (its
        versions per token stay exact; with "keep" a request in flight cannot tell which of
        its tokens each version sampled). The prefix cache is always cleared: its blocks
        hold K/V of the old weights. A file may hold a subset of parameters, but whole
        layers only. An adapter being served (`load_adapter`) is dropped: whole weights are
        the policy.
        """
        path = os.path.abspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(path)

        async def load(llm) -> None:
            await llm.collective_rpc("tsync_reload_from_file", args=(path,))
            await self._drop_adapter(llm)

        return await self._swap(load, mode, version)

    async def load_adapter(self, path: str, *, mode: Literal["keep", "wait", "abort"] = "keep",
                           version: int | None = None) -> float:
        """Serve every later request with the PEFT adapter directory `path` on the base
        weights the engine holds (publish.lora: adapter); returns seconds taken.

        The swap is `reload_weights`' (same gate, pause and prefix-cache reset), except
        that "keep" acts as "abort": a vLLM request keeps the adapter it was admitted with,
        so a request frozen across the swap would go on sampling from the old one. Aborted
        requests continue under the new adapter (`generate`), versions exact per token.
        vLLM loads the directory in its worker (checking rank, targets and shapes) before
        the old adapter is dropped, so a refused adapter leaves the old one serving.
        """
        from vllm.lora.request import LoRARequest

        if not self.lora_rank:
            raise RuntimeError("load_adapter: this engine was started without LoRA "
                               "(lora_rank=0)")
        path = os.path.abspath(path)
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise FileNotFoundError(f"{path}: no adapter_config.json (not a PEFT adapter "
                                    f"directory)")

        async def load(llm) -> None:
            self._lora_ids += 1
            label = self.version + 1 if version is None else version
            new = LoRARequest(f"tsync-v{label}-{self._lora_ids}", self._lora_ids, path)
            if not await llm.add_lora(new):
                raise RuntimeError(f"vLLM did not load the adapter {path}")
            old, self._lora = self._lora, new
            if old is not None:
                await llm.remove_lora(old.lora_int_id)

        return await self._swap(load, "abort" if mode == "keep" else mode, version)

    async def _drop_adapter(self, llm) -> None:
        """Whole weights were loaded: they are the policy, served without an adapter."""
        old, self._lora = self._lora, None
        if old is not None:
            await llm.remove_lora(old.lora_int_id)

    async def join_publish_group(self, addr: str, port: int, rank: int, world: int, *,
                                 token: str = "", timeout_s: float = 120.0,
                                 ifname: str = "", backend: str = "", key: str = "") -> list[int]:
        """Join the publication group (tsync_mcore.publication.dist): this engine's workers
        take ranks `rank`, `rank` + 1, ... (one per vLLM worker; one on CPU). A collective:
        returns once the learner and every other member joined; the group ranks taken.
        `backend`: gloo or nccl; "": nccl on GPU, gloo on CPU. `key`: the group key (hex,
        publication.dist.group_key) every member proves it holds ("": no proof)."""
        ranks = await self._live().collective_rpc(
            "tsync_join_publish_group",
            args=(addr, port, rank, world, token, timeout_s, ifname, backend, key))
        return list(ranks)

    async def receive_weights(self, msg, *, mode: Literal["keep", "wait", "abort"] = "keep"
                              ) -> float:
        """Receive θ_msg.version (a Publish with method "dist") from the publication group
        straight into the running model, as `reload_weights` does with a file (same
        `mode`s); a collective with the learner's broadcast. Returns seconds taken; the
        checksum each worker computed (delta publications) is in `self.checksums`, the
        bytes it received in `self.bytes_received`."""
        results: list = []

        async def receive(llm):
            results.extend(await llm.collective_rpc(
                "tsync_receive", args=(msg.version, msg.n_buckets, msg.delta)))
            await self._drop_adapter(llm)

        seconds = await self._swap(receive, mode, msg.version)
        self.checksums = [str(r["checksum"]) for r in results]
        self.bytes_received = int(results[0]["bytes"]) if results else 0
        return seconds

    async def param_digest(self) -> dict[str, str]:
        """Name → SHA-256 of each parameter and buffer the model holds now (vLLM's own
        names and layout; worker 0)."""
        return (await self._live().collective_rpc("tsync_param_digest"))[0]

    async def _swap(self, load, mode: str, version: int | None) -> float:
        """Run `load(llm)` with generation paused per `mode` (see reload_weights), reset
        the prefix cache, label the new weights `version`; seconds taken."""
        if self._reload_lock is None:
            self._reload_lock = asyncio.Lock()
        self._swap_events()
        async with self._reload_lock:
            t0 = time.perf_counter()
            llm = self._live()
            self._gate.clear()
            try:
                # A request that passed the gate reaches the engine before the pause does
                # (one ordered input queue), so the pause finds it under the old version.
                await self._admitted.wait()
                if mode == "abort":
                    self.swaps += 1
                await llm.pause_generation(mode=mode, clear_cache=False)
                try:
                    await load(llm)
                    # Frozen requests hold K/V blocks; without preempting them the reset
                    # fails and later prompts could hit stale prefix blocks.
                    ok = await llm.reset_prefix_cache(reset_running_requests=True)
                    if not ok:
                        raise RuntimeError("reload_weights: prefix cache could not be reset")
                    self.version = self.version + 1 if version is None else version
                finally:
                    await llm.resume_generation()
            finally:
                self._gate.set()
            return time.perf_counter() - t0

    async def warmup(self, prompt_len: int = 8, batch: int = 8, max_tokens: int = 4) -> float:
        """Run one small seeded batch with log-probs: the first such call compiles vLLM's
        log-prob kernels, a cost no batch should carry."""
        t0 = time.perf_counter()
        ids = [i % max(2, self.vocab_size - 1) + 1 for i in range(prompt_len)]
        await asyncio.gather(*[self.generate(ids, max_tokens=max_tokens, seed=i)
                               for i in range(batch)])
        return time.perf_counter() - t0

    def shutdown(self) -> None:
        """Stop the engine-core process. From its event loop prefer `await aclose()`."""
        if not self._closed:
            self._closed = True
            llm, self._llm = self._llm, None
            llm.shutdown()
            # Drop the last reference now: AsyncLLM.__del__ shuts down again, which fails
            # at interpreter exit once vLLM's module globals are gone.
            del llm

    async def aclose(self) -> None:
        """`shutdown` on the engine's loop, then let vLLM's output task finish cancelling."""
        handler = getattr(self._llm, "output_handler", None)
        self.shutdown()
        if isinstance(handler, asyncio.Task):
            await asyncio.gather(handler, return_exceptions=True)


class EngineThread:
    """An event loop in a daemon thread, for callers that are not async themselves.

    Create the engine and run every coroutine that touches it through `run` (or `submit`
    for a concurrent.futures.Future), so that they all share this loop.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rollout-loop",
                                        daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        """Cancel what still runs on the loop, then stop and close it."""
        if self.loop.is_running():
            async def cancel_rest() -> None:
                rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in rest:
                    t.cancel()
                await asyncio.gather(*rest, return_exceptions=True)

            self.run(cancel_rest(), timeout=10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        if not self.loop.is_running():
            self.loop.close()


class TeacherScorer:
    """Frozen teacher log-probs log π_T(ids[p] | ids[:p]) from the HF model, fp32, no grad.

    Each call is one full forward over `token_ids` (exact, simple). Scoring every turn of
    a trajectory in its growing context is therefore quadratic in the number of turns; a
    per-trajectory K/V cache would make it linear if teachers grow large.
    """

    def __init__(self, model_dir: str, *, dtype: torch.dtype = torch.float32,
                 device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
        self.model.eval()
        self.model.requires_grad_(False)
        self.device = device
        self.vocab_size: int = int(self.model.config.vocab_size)
        self._lock = threading.Lock()  # one forward at a time: torch already uses all cores

    @torch.no_grad()
    def score(self, token_ids: Sequence[int], positions: Sequence[int]) -> list[float]:
        n = len(token_ids)
        if any(not 1 <= p < n for p in positions):
            raise ValueError(f"TeacherScorer.score: positions must lie in [1, {n}) "
                             f"(position 0 has no context), got {list(positions)[:5]}...")
        if not positions:
            return []
        end = max(positions)  # logits past the last scored position are not needed
        ids = torch.tensor([list(token_ids[:end])], dtype=torch.long, device=self.device)
        with self._lock:
            logits = self.model(input_ids=ids).logits[0].float()
        pos = torch.tensor(list(positions), dtype=torch.long, device=self.device)
        tgt = torch.tensor([token_ids[p] for p in positions], dtype=torch.long,
                           device=self.device)
        # log_softmax over only the rows needed: [len(positions), V]
        rows = torch.log_softmax(logits[pos - 1], dim=-1)
        return rows.gather(1, tgt[:, None])[:, 0].tolist()

    async def ascore(self, token_ids: Sequence[int], positions: Sequence[int]) -> list[float]:
        """`score` in a worker thread, so the rollout loop keeps serving other trajectories."""
        return await asyncio.to_thread(self.score, list(token_ids), list(positions))
