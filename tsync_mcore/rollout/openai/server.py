"""An OpenAI-compatible HTTP endpoint on the rollout side, for agents written against the
OpenAI API (docs/guide/agents.md).

    POST /t/<traj>/v1/chat/completions   POST /v1/chat/completions  (X-Tsync-Trajectory: <traj>)
    POST /t/<traj>/v1/completions        POST /v1/completions       (same header)
    POST /t/<traj>/v1/reward             POST /v1/trajectories/<traj>/reward   {"reward": x}
    GET  /t/<traj>/v1/models             GET  /v1/models
    GET  /t/<traj>/v1/tools              GET  /v1/trajectories/<traj>/tools
    POST /t/<traj>/v1/tools/<name>       POST /v1/trajectories/<traj>/tools/<name>
                                                              {"arguments": {...}}
    POST /t/<traj>/v1/done               POST /v1/trajectories/<traj>/done
                                         {} | {"reward": x} | {"error": "why"}
                                         | {"reward_error": "why"}
    POST /v1/pool/next                   {"worker": id, "wait_s": s}  (rollout.agent_pool)

Every request belongs to a trajectory the rollout registered (`register`); the agent gets
`OPENAI_BASE_URL=http://HOST:PORT/t/<traj>/v1`, so an existing agent needs only its base
URL. Bearer auth with the run's random key (`OPENAI_API_KEY`). The server runs on the
engine's event loop and calls the same engine (`RolloutEngine` or `ReplicaSet`) as the
built-in agent loop; each trajectory's `Session` records the exact ids (rollout.openai.session).

A trajectory registered with `tools` (a `ToolBox`: rollout.env: terminal, whose box runs in
the episode's repo) serves them: GET lists their OpenAI schemas (pass them as `tools=`),
POST runs one call in the episode's sandbox and returns its output for the agent's `tool`
message. As in the built-in loop, at most `max_calls_per_turn` calls run per model turn;
later ones return an error text without running. Such a task is scored by its verifier when
the agent exits, so its reward route answers 409.

`stream: true` answers with Server-Sent Events as OpenAI's (chunks, then `data: [DONE]`),
but the stream carries the turn once it is sampled: the engine returns whole completions,
so the chunks (role, content, each tool call, finish reason and the `tsync` object, usage
with `stream_options.include_usage`) are cut from the response the non-streamed request
gets, and the record is the same either way. Every error comes before a stream's first
byte, so it is a plain JSON error with its status.

`stop` strings end sampling at the token that completes one (vLLM's stop check): the
returned text ends before the earliest stop string, finish_reason "stop"; the record, the
log-probs and `usage` keep every sampled id, the stop string's too (the next turn closes
the completion with EOS, as one cut by max_tokens).

Errors are OpenAI's error objects with one-line messages: 400 a request this endpoint does
not take (n > 1, a history rewrite under `reject`, a budget spent, a prompt longer in bytes
than any prompt that fits: refused before tokenizing), 401 a wrong key, 404 an unknown
trajectory, 409 a closed or stale trajectory (its batch's policy is no longer served), a
second reward or a second done, 413 a body past max_body_bytes (before it is parsed), 503
a new connection at the cap with no idle unauthenticated one to give way
(rollout.openai.connection).

`done` ends a trajectory from the agent's side (its reward, the error that failed it, or
`reward_error`: the episode ran but the agent's own scorer failed, which the rollout
handles under reward.on_error):
an agent pool's worker (rollout.openai.pool, rollout.agent_pool > 0) posts it for each trajectory
it pulled from /v1/pool/next (200 a handout, 204 none within wait_s, 410 stopping).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import os
import secrets
import shutil
import socket
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tsync_mcore.rollout.openai import params
from tsync_mcore.rollout.openai.connection import (Acceptor, Connections, connection_cap,
                                                   header_deadline_protocol, raise_open_files)
from tsync_mcore.rollout.openai.params import ApiError, cut_at_stop
from tsync_mcore.rollout.openai.session import Session, SessionError, assistant_message
from tsync_mcore.rollout.openai.streaming import chat_chunks, sse, text_chunks

MAX_BODY_BYTES = 8 << 20  # a request body: a long conversation fits, a flood does not
MAX_MESSAGES = 4096  # messages in one chat request
READ_TIMEOUT_S = 30.0  # a request's headers, then its body, each arrive within this
ENDED_KEPT = 4096  # forgotten trajectory ids remembered (their late requests: 409)
# one trajectory's requests in flight (they run one at a time under its lock): past it 429,
# so no agent holds the connection cap busy with requests queued behind its own
MAX_IN_FLIGHT = 8
WHY_CHARS = 2000  # an agent's done error or reward_error as kept: the record's and the log's


def one_line(why: str, limit: int = WHY_CHARS) -> str:
    """An agent's text as one line of at most `limit` characters (its length said when
    cut): a megabyte of error stays out of records and logs."""
    cut = " ".join(why[:limit * 2].split())
    if len(cut) <= limit and len(why) <= limit * 2:
        return cut
    return f"{cut[:limit - 40]}… ({len(why)} characters, cut)"


@dataclass
class _Tools:
    """A trajectory's tools: its box, and the calls run in its current model turn."""

    box: Any  # tsync_mcore.sandbox.tools.ToolBox
    per_turn: int
    turn: int = 0
    calls: int = 0


class OpenAIServer:
    """Sessions + the FastAPI app. `register` a trajectory before its agent starts,
    `close` it when the agent is done; `current_version()` is the policy version the
    engine serves (a session of another version is stale)."""

    def __init__(self, engine: Any, tokenizer: Any, *, api_key: str, model: str = "tsync",
                 history: str = "segment", temperature: float = 1.0,
                 current_version: Callable[[], int] | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, max_messages: int = MAX_MESSAGES,
                 max_connections: int = 0, read_timeout_s: float = READ_TIMEOUT_S) -> None:
        self.engine, self.tok, self.api_key, self.model = engine, tokenizer, api_key, model
        self.token_bytes = params.token_bytes_ceiling(tokenizer)  # prompts' byte bound
        self.max_body_bytes, self.max_messages = max_body_bytes, max_messages
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections  # 0: connection_cap() once started
        self.connections = Connections(max_connections or connection_cap())
        self.history, self.temperature = history, temperature
        self.current_version = current_version or (lambda: int(getattr(engine, "version", 0)))
        self.sessions: dict[str, Session] = {}
        # Agents never get api_key (the rollout's own): each trajectory's agent gets a key
        # of its own, valid for its routes while it is registered, and each pool worker one
        # for /v1/pool/next (and the trajectories' keys in its handouts).
        self.traj_keys: dict[str, str] = {}
        self.worker_keys: dict[str, str] = {}  # worker id -> its current life's key
        self._locks: dict[str, asyncio.Lock] = {}
        self.routes: dict[str, str] = {}
        self.tools: dict[str, _Tools] = {}
        self.done: dict[str, str | None] = {}  # trajectories whose agent posted done: error
        # trajectories whose agent ran the episode but could not score it: why
        self.reward_errors: dict[str, str] = {}
        self.pool: Any = None  # pool.AgentPool (rollout.agent_pool > 0)
        self.ended: OrderedDict[str, str] = OrderedDict()  # forgotten trajectories: why (409)
        self.counts = dict(requests=0, rewrites=0, rejected=0, stale=0, bad=0, tool_calls=0)
        self.host, self.port = "", 0
        self.unix_path = ""
        self._server = self._task = None
        self._acceptors: list[Acceptor] = []
        self.in_flight: dict[str, int] = {}  # requests of each trajectory being served
        self.app = self._make_app()

    # --- trajectories -----------------------------------------------------------------

    def register(self, traj_id: str, *, version: int, seed: int | None = None,
                 route: str | None = None, tools: Any = None, max_calls_per_turn: int = 4,
                 **limits: int) -> Session:
        """A new trajectory. `tools`: a ToolBox its agent may call (the task's verifier then
        fixes its reward: none may be posted)."""
        if traj_id in self.sessions:
            raise ValueError(f"trajectory {traj_id} is registered already")
        self.ended.pop(traj_id, None)
        # a prompt past this many bytes cannot fit: refused before it is tokenized
        fits = min(limits.get("max_total_tokens", 1 << 30),
                   int(getattr(self.engine, "max_model_len", 1 << 30)))
        s = Session(self.tok, traj_id, version=version, seed=seed, history=self.history,
                    prompt_bound=(fits, fits * self.token_bytes), **limits)
        self.sessions[traj_id] = s
        self.traj_keys[traj_id] = secrets.token_urlsafe(24)
        self._locks[traj_id] = asyncio.Lock()
        if route is not None:
            self.routes[traj_id] = route
        if tools is not None:
            self.tools[traj_id] = _Tools(tools, max_calls_per_turn)
        return s

    async def settle(self, traj_id: str) -> None:
        """Wait for the trajectory's request or tool call in flight, if any (after `close`,
        none starts)."""
        async with self._locks[traj_id]:
            pass

    def close(self, traj_id: str, why: str) -> Session:
        """No more requests for it (they get 409 `why`); the session, for its record."""
        s = self.sessions[traj_id]
        s.closed = why
        return s

    def forget(self, traj_id: str) -> None:
        s = self.sessions.pop(traj_id, None)
        if s is not None:  # a late request of its agent: 409 (it ended), not 404
            self.ended[traj_id] = s.closed or "its agent ended"
            while len(self.ended) > ENDED_KEPT:
                self.ended.popitem(last=False)
        self._locks.pop(traj_id, None)
        self.traj_keys.pop(traj_id, None)
        self.routes.pop(traj_id, None)
        self.tools.pop(traj_id, None)
        self.done.pop(traj_id, None)
        self.reward_errors.pop(traj_id, None)

    def base_url(self, traj_id: str) -> str:
        return f"http://{self.host}:{self.port}/t/{traj_id}/v1"

    def trajectory_key(self, traj_id: str) -> str:
        """The key its agent authenticates with: valid for this trajectory only."""
        return self.traj_keys[traj_id]

    def new_worker_key(self, worker_id: str) -> str:
        """A fresh key for a pool worker's new life (the previous life's stops working)."""
        self.worker_keys[worker_id] = secrets.token_urlsafe(24)
        return self.worker_keys[worker_id]

    def _caller(self, token: str, traj_id: str | None) -> str:
        """Who holds `token`: "run" (the rollout's own key), "trajectory" (the key of
        `traj_id`), "worker:<id>"; else 401."""
        def same(key: str | None) -> bool:
            return key is not None and hmac.compare_digest(token.encode(), key.encode())
        if same(self.api_key):
            return "run"
        if traj_id is not None and same(self.traj_keys.get(traj_id)):
            return "trajectory"
        for worker, key in self.worker_keys.items():
            if same(key):
                return f"worker:{worker}"
        raise ApiError(401, "invalid API key (this trajectory's OPENAI_API_KEY, as "
                            "'Authorization: Bearer <key>'; a key serves its own trajectory "
                            "only)", kind="authentication_error")

    def take_metrics(self) -> dict[str, float]:
        out = {f"rollout/openai_{k}": float(v) for k, v in self.counts.items()}
        out.update({f"rollout/openai_connections_{k}": float(v)
                    for k, v in self.connections.counts.items()})
        self.counts = {k: 0 for k in self.counts}
        self.connections.counts = {k: 0 for k in self.connections.counts}
        return out

    def set_reward(self, traj_id: str, value: Any) -> None:
        s = self._session(traj_id)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value) or abs(value) > 1e6:
            raise ApiError(400, f"reward must be a finite number with |reward| <= 1e6, "
                                f"got {value!r}", param="reward")
        if s.closed:
            raise ApiError(409, f"trajectory {traj_id} is closed: {s.closed}")
        if traj_id in self.tools:
            raise ApiError(409, f"trajectory {traj_id} is scored by its task's verifier when "
                                f"its agent exits: it takes no posted reward",
                           kind="conflict_error")
        if s.reward is not None:
            raise ApiError(409, f"trajectory {traj_id} has its reward already ({s.reward})")
        s.reward = float(value)

    def _session(self, traj_id: str | None) -> Session:
        if not traj_id:
            raise ApiError(404, "no trajectory: use the base URL /t/<trajectory id>/v1, or "
                                "send the X-Tsync-Trajectory header")
        s = self.sessions.get(traj_id)
        if s is None and traj_id in self.ended:
            raise ApiError(409, f"trajectory {traj_id} has ended: {self.ended[traj_id]}",
                           kind="conflict_error")
        if s is None:
            raise ApiError(404, f"unknown trajectory {traj_id!r}", kind="not_found_error")
        return s

    # --- serving ----------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Serve on this event loop; port 0: a free one. Returns (host, port). Also on a
        Unix socket (`unix_path`, in a directory of its own): jailed agents reach the
        endpoint through it (rollout/openai/launch.py)."""
        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.set_inheritable(True)
        self.host, self.port = host, sock.getsockname()[1]
        # A cap well under the descriptor limit (tool calls and agent processes keep
        # theirs), enforced by our own accept loop (connection.py); an idle keep-alive
        # connection closes after 5 s.
        raise_open_files()
        self.connections.cap = self.max_connections or connection_cap()
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off",
                                access_log=False, timeout_keep_alive=5,
                                backlog=min(2048, 2 * self.connections.cap),
                                http=header_deadline_protocol(self.read_timeout_s,
                                                              self.connections))
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # older uvicorn
        self._task = asyncio.ensure_future(self._server.serve(sockets=[]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the start's error
                raise RuntimeError("the OpenAI endpoint stopped while starting")
            await asyncio.sleep(0.01)
        self._listen(sock)
        self._listen(self._unix_socket())
        return self.host, self.port

    def _listen(self, sock: socket.socket) -> None:
        """Serve connections on the bound socket `sock` (the started uvicorn server's
        protocol, accepted by connection.Acceptor within the cap)."""
        server, config = self._server, self._server.config

        def protocol():
            return config.http_protocol_class(config=config, server_state=server.server_state,
                                              app_state=server.lifespan.state)

        sock.listen(config.backlog)
        acceptor = Acceptor(sock, protocol, self.connections, asyncio.get_running_loop())
        acceptor.start()
        self._acceptors.append(acceptor)

    def _unix_socket(self) -> socket.socket:
        """A listening Unix socket any uid may connect to (the key still decides what a
        connection may do, as on the TCP port), in a directory only root may change."""
        d = tempfile.mkdtemp(prefix="tsync-endpoint-")
        os.chmod(d, 0o755)
        self.unix_path = os.path.join(d, "endpoint.sock")
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(self.unix_path)
        os.chmod(self.unix_path, 0o666)
        return sock

    async def stop(self) -> None:
        for acceptor in self._acceptors:
            acceptor.close()
        self._acceptors = []
        if self.unix_path:
            shutil.rmtree(os.path.dirname(self.unix_path), ignore_errors=True)
            self.unix_path = ""
        if self._server is not None:
            self._server.should_exit = True
            try:
                await asyncio.wait_for(self._task, 10)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._task.cancel()
            self._server = None

    async def _read_json(self, request: Request) -> Any:
        """The body, at most max_body_bytes (413 past it, before the rest is read), parsed
        off the event loop when large (a 10 MB body would hold every agent's requests)."""
        limit = self.max_body_bytes
        too_big = ApiError(413, f"request body larger than {limit} bytes "
                                f"(rollout.openai_max_body_mb)", kind="invalid_request_error")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0

        async def read() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)

        try:  # a body trickled in byte by byte would hold its connection for ever
            await asyncio.wait_for(read(), self.read_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(408, f"request body not received within {self.read_timeout_s:g} s",
                           kind="invalid_request_error") from None
        raw = b"".join(chunks)
        try:
            return json.loads(raw) if size < (64 << 10) else await asyncio.to_thread(
                json.loads, raw)
        except RecursionError:
            raise ApiError(400, "the request body is nested too deeply") from None
        except ValueError:  # JSONDecodeError, UnicodeDecodeError
            raise ApiError(400, "the request body is not JSON") from None

    def _make_app(self):
        app = FastAPI(title="tsync-mcore rollout (OpenAI-compatible)", docs_url=None,
                      redoc_url=None, openapi_url=None)

        def error(e: ApiError) -> JSONResponse:
            return JSONResponse({"error": {"message": e.message, "type": e.kind,
                                           "param": e.param, "code": e.status}},
                                status_code=e.status)

        async def handle(request: Request, fn) -> Response:
            params = dict(request.path_params)
            traj_id = params.pop("traj_id", None)
            counted = None  # the trajectory whose in-flight count this request holds
            try:
                auth = request.headers.get("authorization", "")
                token = auth[7:] if auth.startswith("Bearer ") else ""
                traj_id = traj_id or request.headers.get("x-tsync-trajectory")
                caller = self._caller(token, traj_id)
                self.connections.trust(request.scope)  # its connection gives way last
                pool = fn == self._pool_next
                if caller.startswith("worker:") != pool and caller != "run":
                    raise ApiError(401, "invalid API key for this route (a trajectory's key "
                                        "serves its trajectory, a pool worker's key "
                                        "/v1/pool/next)", kind="authentication_error")
                if caller == "trajectory":
                    counted = self._enter(traj_id)
                if request.method == "GET":
                    return JSONResponse(await fn(traj_id, None, **params))
                body = await self._read_json(request)
                if not isinstance(body, dict):
                    raise ApiError(400, "the request body must be a JSON object")
                msgs = body.get("messages")
                if isinstance(msgs, list) and len(msgs) > self.max_messages:
                    raise ApiError(400, f"{len(msgs)} messages, more than this endpoint takes "
                                        f"({self.max_messages})", param="messages")
                if pool and caller != "run" and body.get("worker") != caller[7:]:
                    raise ApiError(403, f"this key belongs to worker {caller[7:]!r}, not "
                                        f"{body.get('worker')!r}", kind="permission_error")
                out = await fn(traj_id, body, **params)  # sampled before any byte of a stream
                return out if isinstance(out, Response) else JSONResponse(out)
            except ApiError as e:
                if e.status == 400:
                    self.counts["bad"] += 1
                return error(e)
            finally:
                if counted is not None:
                    self._leave(counted)

        def bind(fn):
            async def route(request: Request):
                return await handle(request, fn)
            return route

        for prefix in ("/t/{traj_id}/v1", "/v1"):
            app.post(prefix + "/chat/completions")(bind(self._chat))
            app.post(prefix + "/completions")(bind(self._completion))
            app.get(prefix + "/models")(bind(self._models))
        for prefix in ("/t/{traj_id}/v1", "/v1/trajectories/{traj_id}"):
            app.post(prefix + "/reward")(bind(self._reward))
            app.get(prefix + "/tools")(bind(self._tool_list))
            app.post(prefix + "/tools/{name}")(bind(self._tool_call))
            app.post(prefix + "/done")(bind(self._done))
        app.post("/v1/pool/next")(bind(self._pool_next))
        return app

    def _enter(self, traj_id: str) -> str:
        """Count a request of `traj_id` in flight; 429 past MAX_IN_FLIGHT."""
        n = self.in_flight.get(traj_id, 0)
        if n >= MAX_IN_FLIGHT:
            raise ApiError(429, f"trajectory {traj_id} has {n} requests in flight already "
                                f"(its requests are served one at a time)",
                           kind="rate_limit_error")
        self.in_flight[traj_id] = n + 1
        return traj_id

    def _leave(self, traj_id: str) -> None:
        self.in_flight[traj_id] -= 1
        if not self.in_flight[traj_id]:
            del self.in_flight[traj_id]

    async def _models(self, traj_id, body) -> dict:
        return {"object": "list", "data": [{"id": self.model, "object": "model",
                                            "created": 0, "owned_by": "tsync-mcore"}]}

    async def _reward(self, traj_id, body) -> dict:
        if "reward" not in body:
            raise ApiError(400, 'the body must be {"reward": <number>}', param="reward")
        self.set_reward(traj_id, body["reward"])
        return {"trajectory": traj_id, "reward": self.sessions[traj_id].reward}

    async def _done(self, traj_id, body) -> dict:
        """The agent is done with the trajectory: ok (with the reward it posts, else its
        task's), failed with `error`, or ok without a reward: `reward_error` (its scorer
        failed; reward.on_error decides). No more requests are served for it."""
        s = self._session(traj_id)
        if traj_id in self.done:
            raise ApiError(409, f"trajectory {traj_id} is done already", kind="conflict_error")
        keys = {"reward", "error", "reward_error"}
        if set(body) - keys or len(set(body) & keys) > 1:
            raise ApiError(400, 'the body must be {}, {"reward": <number>}, {"error": '
                                '"<why>"} or {"reward_error": "<why>"}')
        for key in ("error", "reward_error"):
            why = body.get(key)
            if key in body and not (isinstance(why, str) and why.strip()):
                raise ApiError(400, f"{key} must be a non-empty string", param=key)
        error = None if body.get("error") is None else one_line(body["error"])
        if s.closed:
            raise ApiError(409, f"trajectory {traj_id} is closed: {s.closed}",
                           kind="conflict_error")
        if "reward" in body:
            self.set_reward(traj_id, body["reward"])
        if "reward_error" in body:
            if traj_id in self.tools:
                raise ApiError(409, f"trajectory {traj_id} is scored by its task's verifier "
                                    f"when its agent exits", kind="conflict_error")
            if s.reward is not None:
                raise ApiError(409, f"trajectory {traj_id} has its reward already "
                                    f"({s.reward})", kind="conflict_error")
            self.reward_errors[traj_id] = one_line(body["reward_error"])
        self.done[traj_id] = error
        s.closed = f"its agent posted done{'' if error is None else ' (failed)'}"
        if self.pool is not None:
            self.pool.finish(traj_id)
        return {"trajectory": traj_id, "status": "ok" if error is None else "failed"}

    async def _pool_next(self, traj_id, body) -> dict | Response:
        if self.pool is None:
            raise ApiError(404, "no agent pool here (rollout.agent_pool: 0 runs one process "
                                "per trajectory)", kind="not_found_error")
        handout = await self.pool.next(body)
        return Response(status_code=204) if handout is None else handout

    def _tools_of(self, traj_id) -> _Tools:
        self._session(traj_id)
        t = self.tools.get(traj_id)
        if t is None:
            raise ApiError(404, f"trajectory {traj_id} has no tools (rollout.env: terminal "
                                f"serves them)", kind="not_found_error")
        return t

    async def _tool_list(self, traj_id, body) -> dict:
        return {"object": "list", "data": self._tools_of(traj_id).box.schemas()}

    async def _tool_call(self, traj_id, body, name: str) -> dict:
        """Run one call in the episode's sandbox; bad arguments or an unknown tool are the
        model's mistakes: an "error: ..." output (200), as in the built-in loop."""
        t = self._tools_of(traj_id)
        s = self.sessions[traj_id]
        args = body.get("arguments", {})
        if not isinstance(args, (dict, str)):
            raise ApiError(400, "arguments must be a JSON object or its JSON text",
                           param="arguments")
        async with self._locks[traj_id]:
            if s.closed:
                raise ApiError(409, f"trajectory {traj_id} is closed: {s.closed}",
                               kind="conflict_error")
            if t.turn != s.n_turns:  # a model turn since the last call
                t.turn, t.calls = s.n_turns, 0
            t.calls += 1
            if t.calls > t.per_turn:
                out = (f"error: at most {t.per_turn} tool calls per turn; this one did not "
                       f"run")
            else:
                out = await t.box.call(name, args)
                self.counts["tool_calls"] += 1
        return {"trajectory": traj_id, "name": name, "content": out}

    def _sampling(self, body: dict) -> dict:
        stream, include_usage = params.stream_flags(body)
        n = params.integer(body, "n", 1)
        if n not in (None, 1):
            raise ApiError(400, f"n must be 1 (one completion per request: each is a turn of "
                                f"the trajectory), got {n}", param="n")
        if params.integer(body, "best_of", 1) not in (None, 1):
            raise ApiError(400, "best_of must be 1", param="best_of")
        if body.get("top_logprobs"):
            raise ApiError(400, "top_logprobs is not supported (logprobs: true gives each "
                                "sampled token's)", param="top_logprobs")
        rf = body.get("response_format")
        if rf not in (None, {"type": "text"}):
            raise ApiError(400, "response_format is not supported", param="response_format")
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        if mt is not None:
            mt = params.integer({"max_tokens": mt}, "max_tokens", 1)
        return dict(temperature=params.number(body, "temperature", self.temperature, 0, 2),
                    top_p=params.number(body, "top_p", 1.0, 0, 1, lo_open=True),
                    seed=params.integer(body, "seed", 0, params.SEED_MAX), max_tokens=mt,
                    logprobs=bool(body.get("logprobs")), stop=params.stop_strings(body), stream=stream,
                    include_usage=include_usage)

    async def _generate(self, s: Session, plan_fn, sp: dict, record):
        """Plan, sample, check, and `record(pending, out)`, under the trajectory's lock:
        (pending, GenOut)."""
        async with self._locks[s.traj_id]:
            if s.closed:
                raise ApiError(409, f"trajectory {s.traj_id} is closed: {s.closed}",
                               kind="conflict_error")
            now = self.current_version()
            if now != s.version:
                self.counts["stale"] += 1
                raise ApiError(409, f"trajectory {s.traj_id} is stale: it belongs to the batch "
                                    f"of θ_{s.version}, the engine serves θ_{now}",
                               kind="conflict_error")
            rewrites = s.rewrites
            try:
                # rendering and tokenizing a long conversation takes seconds: in a worker
                # thread, so the loop serves every other agent meanwhile (this
                # trajectory's lock keeps its session to this request)
                pending = await asyncio.to_thread(plan_fn, sp["max_tokens"])
            except SessionError as e:
                if s.rewrites > rewrites:
                    self.counts["rewrites"] += 1
                    self.counts["rejected"] += 1
                raise ApiError(400, str(e), param=getattr(e, "param", None)) from None
            if pending.rewritten:
                self.counts["rewrites"] += 1
            seed = sp["seed"] if sp["seed"] is not None else (
                s.sampling_seed(0 if pending.new_segment else None))
            kw = {"route": self.routes[s.traj_id]} if s.traj_id in self.routes and \
                hasattr(self.engine, "route") else {}
            if sp["stop"]:
                kw["stop"] = sp["stop"]
            try:
                out = await self.engine.generate(pending.prompt_ids, max_tokens=pending.max_tokens,
                                                 temperature=sp["temperature"], seed=seed,
                                                 top_p=sp["top_p"], **kw)
            except ValueError as e:
                raise ApiError(400, f"the engine refused the request: {e}") from None
            versions = list(out.token_versions) or [out.policy_version] * len(out.token_ids)
            if any(v != s.version for v in versions):
                # a publication happened while it waited at the engine's gate: never record
                # tokens of another version under this trajectory
                self.counts["stale"] += 1
                raise ApiError(409, f"trajectory {s.traj_id} is stale: θ_{out.policy_version} "
                                    f"was published while the request waited (its batch is "
                                    f"θ_{s.version}'s)", kind="conflict_error")
            self.counts["requests"] += 1
            record(pending, out)
            return pending, out

    def _logprob_entries(self, out) -> list[dict]:
        entries = []
        for t, lp in zip(out.token_ids, out.logprobs):
            text = self.tok.decode([t], skip_special_tokens=False)
            entries.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                            "top_logprobs": []})
        return entries

    @staticmethod
    def _usage(pending, out) -> dict:
        return {"prompt_tokens": len(pending.prompt_ids),
                "completion_tokens": len(out.token_ids),
                "total_tokens": len(pending.prompt_ids) + len(out.token_ids)}

    def _answer_text(self, out, stop: list[str]) -> tuple[str, str]:
        """The completion's text as returned, and its finish reason: cut before the
        earliest stop string (the ids keep it: vLLM stops at the token completing it)."""
        text, cut = cut_at_stop(self.tok.decode(out.token_ids, skip_special_tokens=True), stop)
        return text, "stop" if cut else out.finish_reason

    def _ext(self, s: Session, out) -> dict:
        return {"trajectory": s.traj_id, "turn": s.n_turns - 1, "segment": len(s.segments),
                "policy_version": out.policy_version, "token_ids": list(out.token_ids)}

    async def _chat(self, traj_id, body) -> dict | Response:
        s = self._session(traj_id)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", param="messages")
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise ApiError(400, "tools must be a list", param="tools")
        choice = body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise ApiError(400, "tool_choice must be 'auto' or 'none' (the model decides, in "
                                "its chat template's format)", param="tool_choice")
        if body.get("parallel_tool_calls") is False:
            pass  # the model's text decides; several calls are parsed in order
        sp = self._sampling(body)
        kwargs = params.template_kwargs(body)
        answers = []

        def record(pending, out) -> None:
            text, finish = self._answer_text(out, sp["stop"])
            answers.append((assistant_message(text, tools is not None and choice != "none",
                                              s.n_turns), finish))
            s.commit(pending, out, answers[0][0])

        pending, out = await self._generate(
            s, lambda mt: s.plan_chat(messages, tools, mt, kwargs), sp, record)
        answer, finish = answers[0]
        if answer.get("tool_calls"):
            finish = "tool_calls"
        resp = {"id": f"chatcmpl-{s.traj_id}-{s.n_requests}", "object": "chat.completion",
                "created": int(time.time()), "model": self.model,
                "choices": [{"index": 0, "message": answer, "finish_reason": finish,
                             "logprobs": {"content": self._logprob_entries(out)}
                             if sp["logprobs"] else None}],
                "usage": self._usage(pending, out), "tsync": self._ext(s, out)}
        return sse(chat_chunks(resp, sp["include_usage"])) if sp["stream"] else resp

    async def _completion(self, traj_id, body) -> dict | Response:
        s = self._session(traj_id)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        fits = s.prompt_bound[0] if s.prompt_bound else 1 << 62
        if isinstance(prompt, list) and len(prompt) > fits:  # before checking every id
            raise ApiError(400, f"the prompt is {len(prompt)} token ids, more than fit "
                                f"({fits}: max_model_len, rollout.max_total_tokens)",
                           param="prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < len(self.tok)
                for t in prompt))):
            raise ApiError(400, "prompt must be a string or a list of token ids (one prompt)",
                           param="prompt")
        if body.get("echo") or body.get("suffix"):
            raise ApiError(400, "echo and suffix are not supported")
        sp = self._sampling(body)
        if body.get("logprobs") not in (None, False, 0, 1, True):
            raise ApiError(400, "logprobs > 1 (top alternatives) is not supported",
                           param="logprobs")
        pending, out = await self._generate(s, lambda mt: s.plan_text(prompt, mt), sp,
                                            lambda p, o: s.commit(p, o))
        text, finish = self._answer_text(out, sp["stop"])
        lp = None
        if sp["logprobs"]:
            toks = [self.tok.decode([t], skip_special_tokens=False) for t in out.token_ids]
            offs, o = [], 0
            for t in toks:
                offs.append(o)
                o += len(t)
            lp = {"tokens": toks, "token_logprobs": list(out.logprobs), "top_logprobs": None,
                  "text_offset": offs}
        resp = {"id": f"cmpl-{s.traj_id}-{s.n_requests}", "object": "text_completion",
                "created": int(time.time()), "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": lp,
                             "finish_reason": finish}],
                "usage": self._usage(pending, out), "tsync": self._ext(s, out)}
        return sse(text_chunks(resp, sp["include_usage"])) if sp["stream"] else resp
