"""Replay recorded batches through the learner: the equivalence harness
(docs/design/replay.md; the ThunderSyncRL paper's appendix G).

    python -m tsync_mcore.learner.replay --model HF_DIR --batch FILE.jsonl --objective grpo \
        --schedule thundersync --dtype fp32 --out DIR
    torchrun --nproc-per-node 2 -m tsync_mcore.learner.replay ...   (same flags)

FILE.jsonl holds one trajectory per line (docs/design/replay.md). Lines are grouped into batches by
`update` (optional; default: `policy_version`, the on-policy case); updates must run
K, K+1, … from `--start-version K` (default 0; the model is θ_K), and each batch is one
update. A source with policy_version < update is off-policy: the schedule's lag bound
applies (0 for sync/group_ready/thundersync, 1 for one_step_off, --max-staleness for
fully_async) and `--is-correction tis` weights its tokens by its `behaviour_logprobs`
(docs/design/async.md#off-policy-correction-and-the-lag-and-mismatch-figures). Sources are ingested in `ready_order`. Writes
DIR/grad.safetensors (g_k of the last update before clipping, FP32, HF names),
DIR/params.safetensors (θ after the last step, HF names) and DIR/trace_rank{R}.jsonl, and
prints a one-line JSON summary on rank 0. With `--lora-adapter PEFT_DIR` the base is frozen
and the adapter trains (its adapter_config.json gives r, α and targets); both files then hold
the adapter, keyed by PEFT's saved names (`base_model.model.<module>.lora_A.weight`, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from typing import Iterable

if __name__ == "__main__":  # a CLI process: known-harmless warnings off before the imports
    from tsync_mcore.util import quiet
    quiet.install()

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from tsync_mcore.observability import trace
from tsync_mcore.config import ConfigError, load_config
from tsync_mcore.learner.update import Learner, max_lag
from tsync_mcore.observability.metrics import OFF_POLICY_FIELDS, UPDATE_EXTRAS
from tsync_mcore.model.parallel import destroy_parallel
from tsync_mcore.objectives import OBJECTIVES
from tsync_mcore.objectives.grpo import STD_DDOF
from tsync_mcore.objectives.off_policy import CORRECTIONS
from tsync_mcore.objectives.token_norm import DEPRECATED, TOKEN_NORMS
from tsync_mcore.learner.policy import Policy
from tsync_mcore.channel.routing import BalancedRouter
from tsync_mcore.util.safe_files import BadFile
from tsync_mcore.learner.schedule import SCHEDULES
from tsync_mcore.channel.sources import (GRPO_FIELDS, OPD_FIELDS, BatchPlan, SourceError,
                                 TrajectorySource, check_off_policy, opd_turns_from_json)


# One JSON Lines record → its sources, per source kind (tsync_mcore.learner.serving).
PARSERS = {"trajectory": lambda obj: [TrajectorySource.from_json(obj)],
           "turn": opd_turns_from_json}
# A record of the other kind: the objective does not match the file, say so.
OTHER = {"trajectory": (OPD_FIELDS, "an OPD record? run with --objective opd"),
         "turn": (GRPO_FIELDS, "a GRPO record? --objective opd reads OPD records")}


def _unique_keys(pairs: list) -> dict:
    """json object hook: a repeated key would silently keep only its last value."""
    obj = {}
    for k, v in pairs:
        if k in obj:
            raise SourceError(f"field {k[:100]!r} appears twice")
        obj[k] = v
    return obj


def parse_line(raw: bytes, source: str = "trajectory", first: bool = False) -> tuple[dict, list]:
    """One line of a replay file → (record, its sources). Pure: no model, no file; a bad
    line is a SourceError saying what is wrong (the caller adds FILE:LINE)."""
    try:
        text = raw.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as e:
        raise SourceError(f"not UTF-8 text (byte {e.start} is {raw[e.start:e.start + 1]!r}); "
                          f"a replay file is JSON Lines, is this a binary file?") from None
    try:
        obj = json.loads(text, object_pairs_hook=_unique_keys)
    except SourceError:  # a repeated key
        raise
    except json.JSONDecodeError as e:
        raise SourceError(f"invalid JSON at column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise SourceError("invalid JSON: nested too deeply") from None
    except ValueError as e:  # e.g. an integer past the interpreter's digit limit
        raise SourceError(f"invalid JSON: {str(e).split(':')[0][:120]}") from None
    if isinstance(obj, dict) and "update" in obj:  # the replay's own key, not the source's
        u = obj["update"]
        if isinstance(u, bool) or not isinstance(u, int):
            raise SourceError(f"update must be an integer, got {str(u)[:40]!r}")
        obj = {k: v for k, v in obj.items() if k != "update"}
    else:
        u = None
    try:
        srcs = PARSERS[source](obj)
    except SourceError as e:
        fields, hint = OTHER[source]
        if isinstance(obj, dict) and set(obj) >= set(fields[0]):
            raise SourceError(f"{e} ({hint})") from None
        raise
    for s in srcs:  # needs no model: a bad off-policy field stops the run before it starts
        name = f"trajectory {s.traj_id[:40]!r}" + (f" turn {s.turn}" if source == "turn" else "")
        check_off_policy(name, s, getattr(s, "start", 0))
    return (obj if u is None else {**obj, "update": u}), srcs


def batches_from_lines(path: str, lines: Iterable[bytes], source: str = "trajectory",
                       start: int = 0, max_lag: int = 0) -> list[list]:
    """The batches of a replay file's lines, each in arrival order: updates start,
    start + 1, ... Every line's syntax, key set and field types, off-policy fields, policy
    versions (within `max_lag` updates behind the update that trains it) and arrival order
    are checked here, before any model exists; a problem is a SourceError `FILE:LINE: what`.

    Arrival: GRPO lines carry `ready_order` on every line, or on none (then file order);
    OPD lines carry `turn_ready_order`. Within an update no two sources share a place, and
    no trajectory appears twice."""
    by_version: dict[int, list] = {}
    first_line: dict[int, int] = {}          # version → its first line
    place: dict[tuple[int, int], int] = {}   # (version, ready_order) → line
    trajs: dict[tuple[int, str], int] = {}   # (version, traj_id) → line
    ordered: dict[bool, int] = {}            # GRPO: has ready_order → first such line
    keyed = False                            # some line says its update

    def fail(lineno: int, msg: str) -> SourceError:
        return SourceError(f"{path}:{lineno}: {msg}")

    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            obj, srcs = parse_line(raw, source, first=lineno == 1)
        except SourceError as e:
            raise fail(lineno, str(e)) from None
        pv, tid = srcs[0].policy_version, srcs[0].key  # a segment: "id/s"
        v = obj.get("update", pv)  # the update that trains it: batches are keyed by it
        keyed = keyed or "update" in obj
        if pv > v:
            raise fail(lineno, f"policy_version {pv} is after update {v}; a source is never "
                               f"trained by a policy older than the one that sampled it")
        if pv < v - max_lag:
            raise fail(lineno, f"policy_version {pv} is {v - pv} updates behind update {v}; "
                               f"this schedule trains on lag 0..{max_lag} only (--schedule, "
                               f"--max-staleness)")
        if (v, tid) in trajs:
            what = "update" if keyed else "policy_version"
            raise fail(lineno, f"trajectory {tid[:40]!r} appears twice in {what} {v} "
                               f"(first at line {trajs[v, tid]})")
        trajs[v, tid] = lineno
        has = source != "trajectory" or "ready_order" in obj  # OPD: required by the parser
        if source == "trajectory":
            ordered.setdefault(has, lineno)
            if not has and True in ordered:
                raise fail(lineno, f"missing field 'ready_order' (line {ordered[True]} has one; "
                                   f"give every line its arrival place, or none for file order)")
            if has and False in ordered:
                raise fail(lineno, f"ready_order given, but line {ordered[False]} has none; "
                                   f"give every line its arrival place, or none for file order")
        if has:
            for s in srcs:
                if (v, s.ready_order) in place:
                    at = place[v, s.ready_order]
                    field = f"turn_ready_order[{s.turn}]" if source == "turn" else "ready_order"
                    where = "an earlier turn of this line" if at == lineno else f"line {at}"
                    raise fail(lineno, f"{field} {s.ready_order} duplicates {where} "
                                       f"(policy_version {v}); each source of an update "
                                       f"arrives at its own place")
                place[v, s.ready_order] = lineno
        first_line.setdefault(v, lineno)
        by_version.setdefault(v, []).extend(srcs)
    if not by_version:
        raise SourceError(f"{path}: no sources (the file is empty)")
    what = "update" if keyed else "policy_version"
    for i, v in enumerate(sorted(by_version), start):
        if v != i:
            why = (f"is before --start-version {start}" if v < start
                   else f"but no line has {what} {i}")
            if v < 0:
                why = "is negative"
            raise fail(first_line[v], f"{what} {v} {why}; {what}s must run "
                                      f"{start}, {start + 1}, ... without gaps (one update each)")
    return [sorted(by_version[v], key=lambda s: s.ready_order) for v in sorted(by_version)]


def read_batches(path: str, source: str = "trajectory", start: int = 0,
                 max_lag: int = 0) -> list[list]:
    """The batches of a replay file, each in readiness order; `source`: the objective's
    source kind. See batches_from_lines."""
    try:
        with open(path, "rb") as f:
            return batches_from_lines(path, f, source, start, max_lag)
    except OSError as e:
        raise SourceError(f"{path}: cannot read the batch file: {e.strerror or e}") from None


class OutError(ValueError):
    """The output location cannot take the run's outputs."""


OUT_FILES = re.compile(r"grad(_\d+(_mb\d+)?)?\.safetensors|params(_\d+_mb\d+)?\.safetensors"
                       r"|trace_rank\d+\.jsonl")


def check_out(out: str) -> None:
    """Fail now, not after the whole run, where the outputs could not be written: DIR must
    be (or be creatable as) a writable directory, and no output name in it a directory."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise OutError(f"--out {out}: exists and is not a directory")
    d = os.path.abspath(out)
    while not os.path.exists(d):
        d = os.path.dirname(d)
    if not os.path.isdir(d):
        raise OutError(f"--out {out}: {d} is not a directory, so {out} cannot be created")
    try:  # a real probe, not os.access: root passes any mode bits, ACLs and mounts differ
        with tempfile.TemporaryFile(dir=d):
            pass
    except OSError as e:
        raise OutError(f"--out {out}: cannot write in {d}: {e.strerror or e}") from None
    if d != os.path.abspath(out):
        return
    for entry in os.scandir(out):
        if not OUT_FILES.fullmatch(entry.name):
            continue
        if entry.is_dir() or not os.access(entry.path, os.W_OK):
            what = "a directory" if entry.is_dir() else "not writable"
            raise OutError(f"--out {out}: {entry.name} is {what}; the run writes a file there")


def _gather(x: int) -> list[int]:
    """One value per rank (memory figures are per rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [x]
    dev = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([x], dtype=torch.int64, device=dev)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)  # a tensor, not all_gather_object: no pickle between ranks
    return [int(v.item()) for v in out]


def _feed(learner: Learner, sources: list, plan: BatchPlan, routing: str, par) -> None:
    """Submit a GRPO batch in readiness order as the channel would deliver it to this rank."""
    if routing == "static":
        for src in sources:
            learner.submit(src)
        return
    router = BalancedRouter(plan.groups, par.dp_size)  # the same decisions on every rank
    # A segmented trajectory goes to one rank whole, routed at its first segment with all
    # its tokens as the cost; its group's rewards follow its last segment.
    cost: dict[str, int] = {}
    for src in sources:
        cost[src.traj_id] = cost.get(src.traj_id, 0) + len(src.tokens)
    routed: dict[str, tuple] = {}
    for src in sources:
        t = src.traj_id
        if t not in routed:
            routed[t] = (router.route(t, src.group_id, src.reward, cost[t]), src.n_segments)
        to, left = routed[t]
        routed[t] = (to, left - 1)
        if to.rank == par.dp_rank:
            learner.submit(src)
        if left == 1 and par.dp_rank in to.announce_to:
            learner.group_rewards(src.group_id, to.rewards)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tsync_mcore.learner.replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--batch", required=True, help="JSON Lines batch file")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--objective", default="grpo", choices=sorted(OBJECTIVES),
                   help="learner.objective (default grpo; opd reads one turn per line)")
    p.add_argument("--opd-replay", default=None, choices=["recompute", "retain"],
                   help="learner.opd_replay: how an OPD trajectory's context is replayed")
    p.add_argument("--schedule", default="thundersync", choices=list(SCHEDULES),
                   help="learner.schedule: when a source is served, and how far behind the "
                        "update its policy_version may be (default thundersync: 0)")
    p.add_argument("--max-staleness", type=int, default=None,
                   help="learner.max_staleness: fully_async's lag bound")
    p.add_argument("--is-correction", default=None, choices=list(CORRECTIONS),
                   help="learner.is_correction: tis weights each scored token by "
                        "min(π_θ/π_behaviour, --is-cap) from its behaviour_logprobs; mis, "
                        "seq_tis, seq_mis, seq_reject as docs/design/objectives.md")
    p.add_argument("--is-cap", type=float, default=None, help="learner.is_cap")
    p.add_argument("--is-low", type=float, default=None, help="learner.is_low")
    p.add_argument("--start-version", type=int, default=0,
                   help="the policy version of --model: the first update is this one "
                        "(default 0); e.g. 1 to replay update 1 of a one_step_off run")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                   help="model.dtype (default fp32)")
    p.add_argument("--config", default=None, help="optional YAML config; flags override it")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size")
    p.add_argument("--ep", type=int, default=None,
                   help="model.ep: expert-parallel size (MoE); > 1 serves the ranks in "
                        "lockstep and needs --no-shared-prefix and static routing (docs/guide/moe.md)")
    p.add_argument("--no-shared-prefix", action="store_true",
                   help="learner.shared_prefix false: each trajectory forwards its own prompt")
    p.add_argument("--k-open", type=int, default=None,
                   help="learner.k_open: groups per rank holding open state at once")
    p.add_argument("--routing", default="static", choices=["static", "balanced"],
                   help="GRPO: every source to every rank, each serving its groups (static), "
                        "or each trajectory to one DP rank as the rollout routes it, with "
                        "group rewards announced after a group's last member (balanced)")
    p.add_argument("--token-norm", default=None,
                   choices=[*TOKEN_NORMS, *DEPRECATED],
                   help="per-token weight (docs/design/objectives.md); 'global' is the deprecated "
                        "name of group_scaled_token_mean (token_mean for OPD)")
    p.add_argument("--token-norm-constant", type=float, default=None,
                   help="H of --token-norm seq_mean_token_sum_norm")
    p.add_argument("--adv-std", default=None, choices=sorted(STD_DDOF),
                   help="grpo's group std: population (÷ m) or unbiased (÷ m − 1, verl/TRL)")
    p.add_argument("--accum", default=None, choices=["device", "host"],
                   help="learner.accum: where the accumulators live")
    p.add_argument("--accum-dtype", default=None, choices=["fp32", "fp64"],
                   help="learner.accum_dtype (fp64: independent of arrival order)")
    p.add_argument("--max-tokens-per-pass", type=int, default=None,
                   help="learner.max_tokens_per_pass (0: one source per forward/backward)")
    p.add_argument("--routing-replay", default=None, choices=["off", "learner", "rollout"],
                   help="learner.routing_replay (MoE): 'rollout' takes each record's "
                        "routed_experts")
    p.add_argument("--lr", type=float, default=None, help="optim.lr")
    p.add_argument("--lora-adapter", default=None, metavar="PEFT_DIR",
                   help="model.lora_init: train this PEFT LoRA adapter on the frozen model")
    p.add_argument("--seed", type=int, default=None, help="seed (config key `seed`)")
    p.add_argument("--save-grads", default="last", choices=["last", "all"],
                   help="'all' also writes grad_{k}.safetensors for every update k")
    args = p.parse_args(argv)
    if args.ep and args.ep > 1 and args.routing != "static":
        p.error(f"--routing {args.routing} with --ep {args.ep}: expert-parallel ranks serve in "
                f"lockstep, so every rank must be handed every source (static)")
    if args.routing not in OBJECTIVES[args.objective].routings:
        p.error(f"--routing {args.routing}: the {args.objective} objective routes "
                f"{' or '.join(OBJECTIVES[args.objective].routings)} (a trajectory's turns "
                f"and its group's prompt stay on one rank)")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    check_out(args.out)  # before any work: a run that cannot save its results is not started
    overrides = {"model.hf_dir": args.model, "model.dtype": args.dtype,
                 "learner.objective": args.objective, "learner.schedule": args.schedule}
    if args.no_shared_prefix:
        overrides["learner.shared_prefix"] = False
    for key, val in [("model.tp", args.tp), ("model.ep", args.ep),
                     ("learner.k_open", args.k_open),
                     ("learner.token_norm", args.token_norm), ("learner.accum", args.accum),
                     ("learner.token_norm_constant", args.token_norm_constant),
                     ("learner.adv_std", args.adv_std),
                     ("learner.accum_dtype", args.accum_dtype),
                     ("learner.opd_replay", args.opd_replay),
                     ("learner.max_staleness", args.max_staleness),
                     ("learner.is_correction", args.is_correction),
                     ("learner.is_cap", args.is_cap),
                     ("learner.is_low", args.is_low),
                     ("learner.max_tokens_per_pass", args.max_tokens_per_pass),
                     ("learner.routing_replay", args.routing_replay),
                     ("optim.lr", args.lr), ("seed", args.seed),
                     ("model.lora_init", args.lora_adapter)]:
        if val is not None:
            overrides[key] = val
    cfg = load_config(args.config, overrides, replay=True)
    if args.start_version < 0:
        raise SourceError(f"--start-version {args.start_version}: must be >= 0")
    batches = read_batches(args.batch, OBJECTIVES[cfg.learner.objective].source,
                           args.start_version, max_lag(cfg.learner))

    t0 = time.perf_counter()
    policy = Policy(cfg)
    learner = Learner(cfg.learner, policy, policy_version=args.start_version)
    results = []
    for k, sources in enumerate(batches, args.start_version):
        tokens: dict[str, int] = {}
        for s in sources:
            tokens[s.group_id] = tokens.get(s.group_id, 0) + len(s.tokens)
        plan = BatchPlan.from_sources(sources)
        learner.begin(plan, group_tokens=tokens, routing=args.routing)
        _feed(learner, sources, plan, args.routing, policy.par)
        last = k == args.start_version + len(batches) - 1
        results.append(learner.close(export_grad=last or args.save_grads == "all"))
        done = results[-1].summary
        if not done.ok:  # collective: every rank skipped the step and stops here
            named = "; ".join(done.nonfinite_sources) or \
                "learner.check_finite: source in --config names the source that broke the sums"
            raise NonFiniteUpdate(f"{args.batch}: update {k}: the reduced gradient is not "
                                  f"finite, the step was skipped and nothing is written "
                                  f"({named})")
    # LoRA: what trains is the adapter (the merged weights are what publication serves)
    params = policy.export_adapter() if policy.lora else policy.export_params()
    elapsed = time.perf_counter() - t0

    par = policy.par
    os.makedirs(args.out, exist_ok=True)
    trace.write(os.path.join(args.out, f"trace_rank{par.rank}.jsonl"),
                [rec for r in results for rec in r.trace], mode="w")
    done = [r.summary for r in results]
    summary = {
        "updates": len(results), "objective": cfg.learner.objective,
        "schedule": cfg.learner.schedule, "dtype": cfg.model.dtype,
        "world_size": par.world_size, "tp": par.tp_size, "dp": par.dp_size,
        "ep": policy.ep_size,
        "grad_norm": [r.grad_norm for r in done], "ok": all(r.ok for r in done),
        "scored_tokens": [r.scored_tokens for r in done],
        "first_update": args.start_version,
        **{k: [getattr(r, k) for r in done] for k in OFF_POLICY_FIELDS},
        "rejected_sources": [len(r.rejected_sources) for r in done],
        "sources": sum(len(b) for b in batches),
        "accum_peak_bytes": max(r.accum_peak_bytes for r in done),
        "accum_bound_bytes": done[0].accum_bound_bytes,
        "accum_params": done[0].accum_params,
        **{k: [getattr(r, k) for r in done] for k in UPDATE_EXTRAS},
        "reference_bytes_per_rank": _gather(done[0].reference_bytes),
        "kv_peak_bytes_per_rank": _gather(max(r.kv_peak_bytes for r in done)),
        "head_peak_bytes_per_rank": _gather(max(r.head_peak_bytes for r in done)),
        "accum_peak_bytes_per_rank": _gather(max(r.accum_peak_bytes for r in done)),
        "open_peak_bytes_per_rank": _gather(max(r.open_peak_bytes for r in done)),
        "open_groups_peak_per_rank": _gather(max(
            (rec.open_groups for r in results for rec in trace.sources(r.trace)), default=0)),
        "open_bound": done[0].open_bound,
        "time_s": round(elapsed, 3), "out": args.out,
    }
    if par.rank == 0:
        for k, r in enumerate(results, args.start_version):
            if r.grad is not None:
                grad = {n: v.float().contiguous() for n, v in r.grad.items()}
                if args.save_grads == "all":
                    save_file(grad, os.path.join(args.out, f"grad_{k}.safetensors"))
                    # learner.minibatches > 1: each step's g, and θ after each step but
                    # the last (where the next step's gradient was taken)
                    for j, g in enumerate(r.minibatch_grads[1:], start=2):
                        save_file({n: v.float().contiguous() for n, v in g.items()},
                                  os.path.join(args.out, f"grad_{k}_mb{j}.safetensors"))
                    for j, p in enumerate(r.minibatch_params, start=1):
                        save_file({n: v.contiguous() for n, v in p.items()},
                                  os.path.join(args.out, f"params_{k}_mb{j}.safetensors"))
        save_file(grad, os.path.join(args.out, "grad.safetensors"))
        save_file({k: v.contiguous() for k, v in params.items()},
                  os.path.join(args.out, "params.safetensors"))
        print(json.dumps(summary), flush=True)
    if dist.is_initialized():
        dist.barrier()
    return summary


class NonFiniteUpdate(RuntimeError):
    """An update's reduced gradient was not finite: the step did not run."""


def cli() -> None:
    """The command line (`tsync-replay`, `python -m tsync_mcore.learner.replay`): one
    `error:` line and exit 2 on bad input, 3 on a non-finite update."""
    try:
        main()
    except (SourceError, ConfigError, OutError, OSError, BadFile) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except NonFiniteUpdate as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(3)
    destroy_parallel()  # clean finish: every rank passed the final barrier


if __name__ == "__main__":
    cli()
