"""The `rollout` section: the vLLM engines and their replicas, the agent loop (built-in, or
agents talking to the OpenAI-compatible endpoint) and the environment it runs."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from tsync_mcore.channel.sources import MAX_SEGMENTS
from tsync_mcore.config.checks import check


RolloutDType = Literal["auto", "fp32", "bf16"]
ENV_PREFIXES = ("skyrl:", "reasoning_gym:", "verifiers:")  # rollout.env values that name an env or task


@dataclass
class RolloutConfig:
    """The rollout process: vLLM engine, agent loop, environments."""

    n_learners: int = 2  # learner ranks (world size of the learner torchrun)
    # "toy" (built-in task), "dataset" (data.train's prompts, one answer scored by
    # reward.function), "terminal" (make a failing test pass in a generated repo with the
    # sandboxed bash/python tools; docs/guide/tools.md), "skyrl:<env name>" (a SkyRL-Gym env
    # fed data.train's rows), "reasoning_gym:<task>" (a reasoning-gym task's generated
    # questions, each answer scored by the task's own scorer; see reasoning_gym.*) or
    # "verifiers:<module>" (a verifiers environment: the module's
    # load_environment(**verifiers.args), its dataset's rows, its rollout run by an agent
    # against the endpoint, its rubric's score the reward; rollout.agent: openai)
    env: str = "toy"
    groups_per_batch: int = 8  # prompts (groups) per batch, i.e. per optimizer step
    group_size: int = 4  # trajectories sampled per prompt (GRPO group size m)
    max_turns: int = 3  # agent turns per trajectory at most (over all its segments)
    max_tokens_per_turn: int = 8  # tokens generated per turn at most
    # a trajectory's length cap (prompt + turns + tool output); a trajectory whose history
    # was rewritten: each segment's, and its sampled tokens over all segments at most this
    # less its first prompt (docs/guide/agents.md#per-trajectory-limits)
    max_total_tokens: int = 96
    # segments one trajectory may be cut into by history rewrites (a rewrite past it is
    # refused: HTTP 400); at most 256, what a source carries
    max_segments: int = 256
    # tokens one trajectory trains, prompt and completion of every segment summed (a
    # rewrite re-trains the history it repeats); a request past it is refused (HTTP 400).
    # 0: no bound of its own (at most max_turns × max_total_tokens, one segment per turn)
    max_trained_tokens: int = 0
    temperature: float = 1.0  # sampling temperature (0: greedy)
    eval_temperature: float = 0.0  # sampling temperature of evaluation (0: greedy)
    # vLLM structured outputs: every completion the policy samples matches this regular
    # expression (vLLM's `structured_outputs.regex`; xgrammar's dialect, a subset of
    # Python's); "": free sampling. A continuation after an abort-mode swap starts it again
    structured_regex: str = ""
    tool_latency_s: float = 0.05  # median of the long-tailed (log-normal) tool latency
    tool_timeout_s: float = 1.0  # a tool call taking longer fails its turn
    teacher_dir: str = ""  # OPD: the frozen teacher's HF directory
    kv_cache_gib: float = 1.0  # CPU only: vLLM's KV cache size per engine (fractions honoured)
    # Sequences each vLLM engine decodes at once (vLLM's max_num_seqs, verl's
    # rollout.max_num_seqs); the rest wait their turn, as they do on an engine whose KV
    # cache holds fewer contexts than a batch has trajectories
    max_num_seqs: int = 256
    # vLLM weights/activations precision; auto: model.dtype (bf16 for GPU recipes)
    dtype: RolloutDType = "auto"
    tp: int = 1  # vLLM tensor_parallel_size (GPUs of the rollout engine)
    # vLLM engines behind the rollout (each its own engine-core process, rollout.tp GPUs and
    # on CPU its own kv_cache_gib); a group's requests stay on one replica, new groups go to
    # the least busy one; every replica loads every publication (docs/guide/running.md#rollout-replicas)
    replicas: int = 1
    # Replica restarts (docs/guide/running.md#replica-restarts): a replica whose engine core
    # dies or hangs is killed, restarted with the current θ and its requests re-run; a
    # restart past this many in the run stops it (0: a replica that dies stops the run)
    max_replica_restarts: int = 3
    # a replica whose engine samples no token for this many seconds while it has requests
    # outstanding is hung (then restarted as a dead one); 0: no hang check
    replica_hang_s: float = 600.0
    # GPU only: fraction of each rollout GPU's memory vLLM may take (weights + KV cache)
    gpu_memory_utilization: float = 0.9
    # Which learner rank serves a finished trajectory (tsync_mcore.channel.routing). auto: GRPO
    # family "balanced" (per trajectory, least-loaded rank), OPD "static" (by group).
    routing: Literal["auto", "static", "balanced"] = "auto"
    # fully_async: groups generated at once at most (0: groups_per_batch); AReaL's staleness
    # bound (learner.max_staleness) may hold fewer back (docs/design/async.md)
    max_groups_in_flight: int = 0
    # DAPO dynamic sampling (learner.filter_groups: zero_std): up to this many reserve groups
    # per batch, each started when a group ends with uniform rewards, so the batch keeps
    # groups_per_batch informative groups (rollout/oversample.py); 0: none
    max_oversample: int = 0
    # Who runs the trajectories (docs/guide/agents.md): "builtin" (the agent loop in this
    # process) or "openai" (rollout.agent_command, one process per trajectory or a pool of
    # them (agent_pool), talking to the OpenAI-compatible endpoint at rollout.serve_openai;
    # the server records the exact ids it sampled, the learner trains on those)
    agent: Literal["builtin", "openai"] = "builtin"
    # agent: openai: the endpoint's HOST:PORT (port 0: a free one); agents get
    # OPENAI_BASE_URL=http://HOST:PORT/t/<trajectory id>/v1
    serve_openai: str = "127.0.0.1:0"
    # agent: openai: a shell command run per trajectory with OPENAI_BASE_URL,
    # OPENAI_API_KEY, TSYNC_TRAJECTORY_ID and TSYNC_TASK (JSON) in its environment (with
    # agent_pool: the pool's workers' command) ("": the bundled demo agent, python -m tsync_mcore.rollout.openai.agents.digits; for env terminal
    # python -m tsync_mcore.rollout.openai.agents.terminal)
    agent_command: str = ""
    # an agent process running longer is killed (failed); with agent_pool: a trajectory
    # not done this long after its handout (its worker is killed and restarted)
    agent_timeout_s: float = 120.0
    agent_failed_reward: float = 0.0  # the reward of a crashed or timed-out agent's trajectory
    # agent processes at once (0: every trajectory of the batch); with agent_pool, the
    # trajectories queued or handed out at once
    agent_concurrency: int = 0
    # agent: openai: 0 runs agent_command once per trajectory; N > 0 starts N long-lived
    # workers of it (TSYNC_POOL_URL, OPENAI_API_KEY, TSYNC_WORKER_ID in their environment)
    # that pull trajectories from the endpoint (docs/guide/agents.md, "Agent pools"); kept across
    # batches, restarted when they exit (the bundled agents serve a pool)
    agent_pool: int = 0
    # A request whose messages are not the trajectory so far plus the returned answer (the
    # agent rewrote history, or the chat template renders earlier turns differently):
    # "segment" (start a new segment; every segment trains with the trajectory's reward)
    # or "reject" (HTTP 400); both counted (rollout/openai_rewrites)
    openai_history: Literal["segment", "reject"] = "segment"
    # The built-in loop's prompts (agent: builtin): "tokens" appends each observation's ids
    # to the exact ids so far; "template" renders every turn's prompt with the model's chat
    # template over the conversation, as a deployed model sees it (prime-rl's renderers) —
    # a template that rewrites earlier turns (Qwen3 drops their reasoning) starts a new
    # segment, and every segment trains (docs/guide/agents.md#rewritten-histories)
    render: Literal["tokens", "template"] = "tokens"
    # render: template: variables for the chat template (vLLM's chat_template_kwargs),
    # e.g. {enable_thinking: false} for Qwen3
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # agent processes see only PATH, HOME, locale, TMPDIR, PYTHONPATH, VIRTUAL_ENV and TLS
    # variables of the rollout's environment (rollout/openai/pool.py AGENT_ENV), plus
    # the variables named here (e.g. [HF_HOME]); never the tracker or cloud keys by default
    agent_env: list[str] = field(default_factory=list)
    # agent: openai, run as root: each agent process (each pool worker) in the jail
    # (docs/guide/agents.md#agents-run-jailed): a uid of its own, its own PID, mount, IPC
    # and network namespaces, the system read-only, no run directory, the endpoint its only
    # network. "isolate": so where permitted, else as the rollout's user with a warning;
    # "require": the rollout refuses to start where not permitted; "none": not jailed
    agent_isolation: Literal["isolate", "require", "none"] = "isolate"
    # host paths a jailed agent sees read-only besides the system (its code or data where
    # the jail hides them: under /tmp or /root, e.g. an HF cache); never the run directory
    agent_expose: list[str] = field(default_factory=list)
    openai_max_body_mb: float = 8.0  # the endpoint's largest request body (HTTP 413 past it)
    openai_max_messages: int = 4096  # messages in one chat request (HTTP 400 past it)
    # a request's headers, and then its body, must each arrive within this (a slow or
    # silent connection is closed; a slow body is HTTP 408)
    openai_read_timeout_s: float = 30.0
    # connections the endpoint holds at once (0: half the open-file limit, at most 4096);
    # at the cap an idle unauthenticated one gives way to a new one, else the new one: 503
    openai_max_connections: int = 0

    def validate(self) -> None:
        check(self.n_learners >= 1, "rollout.n_learners", "must be >= 1")
        if self.structured_regex:
            try:
                re.compile(self.structured_regex)
            except re.error as e:
                check(False, "rollout.structured_regex", f"is not a regular expression: {e}")
        check(self.openai_max_body_mb > 0, "rollout.openai_max_body_mb",
              f"must be > 0, got {self.openai_max_body_mb}")
        check(self.openai_max_messages >= 1, "rollout.openai_max_messages",
              f"must be >= 1, got {self.openai_max_messages}")
        check(self.openai_read_timeout_s > 0, "rollout.openai_read_timeout_s",
              f"must be > 0, got {self.openai_read_timeout_s}")
        check(self.openai_max_connections == 0 or self.openai_max_connections >= 2,
              "rollout.openai_max_connections",
              f"must be 0 (half the open-file limit) or >= 2, got "
              f"{self.openai_max_connections}")
        check(self.agent_timeout_s > 0, "rollout.agent_timeout_s",
              f"must be > 0, got {self.agent_timeout_s}")
        check(self.agent_concurrency >= 0, "rollout.agent_concurrency",
              f"must be >= 0 (0: every trajectory at once), got {self.agent_concurrency}")
        bad = [p for p in self.agent_expose if not isinstance(p, str) or not p.startswith("/")]
        check(not bad, "rollout.agent_expose",
              f"must list absolute paths (what a jailed agent sees read-only), got {bad[:3]}")
        check(self.agent_pool >= 0, "rollout.agent_pool",
              f"must be >= 0 (0: one agent process per trajectory), got {self.agent_pool}")
        check(math.isfinite(self.agent_failed_reward), "rollout.agent_failed_reward",
              "must be finite")
        host, _, port = self.serve_openai.rpartition(":")
        check(bool(host) and port.isdigit() and int(port) < 65536, "rollout.serve_openai",
              f"must be HOST:PORT (port 0: a free one), got {self.serve_openai!r}")
        check(self.agent == "builtin" or self.env in ("toy", "dataset", "terminal") or
              self.env.startswith(("reasoning_gym:", "verifiers:")), "rollout.env",
              f"rollout.agent: openai runs rollout.env: toy, dataset, terminal, "
              f"reasoning_gym:<task> or verifiers:<module>, got {self.env!r}")
        check(self.agent == "openai" or not self.env.startswith("verifiers:"), "rollout.agent",
              f"{self.env!r} runs the environment's own rollout in an agent process against "
              f"the OpenAI-compatible endpoint: set rollout.agent: openai")
        check(self.max_oversample >= 0, "rollout.max_oversample",
              f"must be >= 0 (0: no reserve groups), got {self.max_oversample}")
        check(self.max_groups_in_flight >= 0, "rollout.max_groups_in_flight",
              f"must be >= 0 (0: groups_per_batch), got {self.max_groups_in_flight}")
        check(self.groups_per_batch >= 1, "rollout.groups_per_batch", "must be >= 1")
        check(self.group_size >= 1, "rollout.group_size", "must be >= 1")
        check(self.max_turns >= 1, "rollout.max_turns", "must be >= 1")
        check(self.max_tokens_per_turn >= 1, "rollout.max_tokens_per_turn", "must be >= 1")
        check(self.env in ("toy", "dataset", "terminal") or
              any(self.env.startswith(p) and len(self.env) > len(p) for p in ENV_PREFIXES),
              "rollout.env", f"must be 'toy', 'dataset', 'terminal', 'skyrl:<name>', "
                             f"'reasoning_gym:<task>' or 'verifiers:<module>', got {self.env!r}")
        check(not self.env.startswith("verifiers:") or
              re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", self.env.split(":", 1)[1])
              is not None, "rollout.env",
              f"'verifiers:<module>' names an importable Python module (dotted identifiers, "
              f"e.g. verifiers:my_env; a hub id my-env installs as module my_env), got "
              f"{self.env!r}")
        check(self.max_total_tokens >= 1, "rollout.max_total_tokens", "must be >= 1")
        check(1 <= self.max_segments <= MAX_SEGMENTS, "rollout.max_segments",
              f"must be in [1, {MAX_SEGMENTS}] (the segments a source carries), got "
              f"{self.max_segments}")
        check(self.max_trained_tokens == 0 or self.max_trained_tokens >= self.max_total_tokens,
              "rollout.max_trained_tokens",
              f"must be 0 (no bound of its own) or >= rollout.max_total_tokens="
              f"{self.max_total_tokens} (else it cuts trajectories that never rewrite), got "
              f"{self.max_trained_tokens}")
        check(self.temperature >= 0, "rollout.temperature",
              f"must be >= 0 (0: greedy), got {self.temperature}")
        check(self.eval_temperature >= 0, "rollout.eval_temperature",
              f"must be >= 0 (0: greedy), got {self.eval_temperature}")
        check(self.tool_latency_s >= 0, "rollout.tool_latency_s", "must be >= 0")
        check(self.tool_timeout_s > 0, "rollout.tool_timeout_s", "must be > 0")
        check(self.kv_cache_gib > 0, "rollout.kv_cache_gib", "must be > 0")
        check(self.max_num_seqs >= 1, "rollout.max_num_seqs",
              f"must be >= 1, got {self.max_num_seqs}")
        check(self.tp >= 1, "rollout.tp", f"must be >= 1, got {self.tp}")
        check(self.replicas >= 1, "rollout.replicas", f"must be >= 1, got {self.replicas}")
        check(self.render == "tokens" or (self.agent == "builtin" and self.env == "toy"),
              "rollout.render", "'template' renders the built-in loop's turns from chat "
              "messages: it needs rollout.agent builtin and an env that steps in messages "
              f"(toy), got agent {self.agent!r}, env {self.env!r}")
        bad = [k for k, v in self.chat_template_kwargs.items()
               if not (isinstance(k, str) and k.isidentifier())
               or not (v is None or isinstance(v, (bool, int, float, str)))]
        check(not bad, "rollout.chat_template_kwargs", f"must map template variable names "
              f"to booleans, numbers, strings or null; {bad[:3]} do not")
        check(self.max_replica_restarts >= 0, "rollout.max_replica_restarts",
              f"must be >= 0 (0: a replica that dies stops the run), got "
              f"{self.max_replica_restarts}")
        check(math.isfinite(self.replica_hang_s) and self.replica_hang_s >= 0,
              "rollout.replica_hang_s",
              f"must be a finite number of seconds >= 0 (0: no hang check), got "
              f"{self.replica_hang_s}")
        check(0 < self.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization",
              f"must be in (0, 1], got {self.gpu_memory_utilization}")
