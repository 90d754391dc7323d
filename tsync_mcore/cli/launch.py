"""How a process that stopped unexpectedly says so: one line, the traceback in the run dir."""

from __future__ import annotations

import os
import sys
import traceback

from tsync_mcore.util import cpus
from tsync_mcore.util.net import free_port  # noqa: F401  (launchers import it from here)
from tsync_mcore.util.safe_files import BadFile, private_dir


def config_or_exit(who: str, path: str | None, overrides: list[str]):
    """The validated config, or one `error:` line naming the key or file and exit code 2."""
    from tsync_mcore.config import ConfigError, load_config, parse_overrides
    try:
        return load_config(path, parse_overrides(overrides))
    except ConfigError as e:
        print(f"error: {who}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def secret_or_exit(who: str, cfg) -> None:
    """Create (or check) the run's channel secret file, or one `error:` line and exit 2."""
    from tsync_mcore.channel import ChannelError, channel_secret
    try:
        channel_secret(cfg)
    except ChannelError as e:
        print(f"error: {who}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def say(line: str) -> None:
    """One line to stderr in one write: ranks sharing a stderr pipe do not split each
    other's lines (print writes the text and the newline separately, two writes when
    unbuffered, as under `python -u`; a pipe keeps a write of up to 4096 bytes whole)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def stopped(who: str, e: BaseException, run_dir: str) -> int:
    """Print one line naming what stopped, why and where the state and traceback are;
    returns the exit code (130 for an interrupt, 4 otherwise)."""
    if isinstance(e, KeyboardInterrupt):
        print(f"{who} interrupted; the last checkpoint under {run_dir}/checkpoints is intact",
              file=sys.stderr, flush=True)
        return 130
    if isinstance(e, SystemExit):
        return e.code if isinstance(e.code, int) else 1
    if isinstance(e, BadFile):  # an input file the message names; no traceback needed
        print(f"error: {who}: {e}", file=sys.stderr, flush=True)
        return 2
    log = os.path.join(run_dir, "logs", f"{who.replace(' ', '_')}.traceback")
    try:
        os.makedirs(os.path.dirname(log), exist_ok=True)
        with open(log, "w") as f:
            traceback.print_exception(e, file=f)
    except OSError:
        log = "(not written: run dir not writable)"
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else ""
    say(f"error: {who} stopped: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        f"{where}. The last checkpoint under {run_dir}/checkpoints is intact; traceback: {log}")
    return 4


# --------------------------------------------------------------------------- command lines


def add_config_args(p, config_default: str | None = None) -> None:
    """--config, --set (repeatable) and --print-config, the same in every launcher."""
    p.add_argument("--config", required=config_default is None, default=config_default,
                   metavar="YAML", help="the run's config file (keys: docs/guide/config.md)"
                   + (f"; default {config_default}" if config_default else ""))
    p.add_argument("--set", action="append", nargs="+", default=[], metavar="KEY=VALUE",
                   help="override config keys, e.g. --set run.updates=4 learner.k_open=2; may "
                        "repeat (--set a=1 --set b=2); each VALUE is read as YAML")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (every auto made concrete) as YAML and exit")


def set_items(args) -> list[str]:
    """The --set items of all occurrences, in order."""
    return [item for group in args.set for item in group]


def config_from_args(who: str, args, extra: list[str] = (), log: bool = True):
    """The resolved config of a launcher's arguments (`extra` overrides first, so the user's
    --set wins); with --print-config prints it and exits 0. `log`: print the choices that
    `resolve` made, one line each, to stderr."""
    cfg = config_or_exit(who, args.config, [*extra, *set_items(args)])
    if getattr(args, "print_config", False):
        import yaml

        from tsync_mcore.config import to_dict
        for line in getattr(cfg, "choices", []):
            print(f"# {line}")
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="", flush=True)
        raise SystemExit(0)
    if log:
        for line in getattr(cfg, "choices", []):
            print(f"[config] {line}", flush=True)  # stdout: stderr is for errors
    return cfg


# --------------------------------------------------------------------------- one node, one job


def bar(done: int, total: int, width: int = 30) -> str:
    n = int(width * done / total) if total else width
    return f"[{'#' * n}{'.' * (width - n)}] {done}/{total}"


def resume_version(run_dir: str, who: str = "", nnodes: int = 1) -> int:
    """--resume's checkpoint: the policy version its `latest` pointer names (step_N). One
    `error:` line and exit 2 when the run directory or a checkpoint is missing, before any
    process starts; the learner checks the checkpoint itself fully before it changes
    anything. `nnodes` > 1: the line says that every learner node must see run.dir (a node
    that does not would otherwise start from another state than the others)."""
    import re
    def refuse(why: str) -> None:
        hint = (f"; all {nnodes} learner nodes resume from the checkpoints in run.dir, so it "
                f"must be on a filesystem every node shares (docs/guide/multihost.md)"
                if nnodes > 1 else " (start a fresh run without --resume)")
        print(f"error: {who + ': ' if who else ''}--resume: {why}{hint}", file=sys.stderr,
              flush=True)
        raise SystemExit(2)

    if not os.path.isdir(run_dir):
        refuse(f"run directory {run_dir} does not exist (run.dir)")
    path = os.path.join(run_dir, "checkpoints", "latest")
    try:
        with open(path, encoding="ascii") as f:
            name = f.read(65).strip()
    except (OSError, UnicodeDecodeError):
        refuse(f"no checkpoint under {run_dir}/checkpoints")
    m = re.fullmatch(r"step_(0|[1-9][0-9]{0,17})", name)
    if m is None:
        refuse(f"checkpoint pointer {path}: {name[:40]!r} is not a step_N name")
    return int(m.group(1))


def _metrics_before(path: str, version: int) -> list[dict]:
    """Rows of metrics.jsonl for updates up to `version`: what a resumed run keeps (the
    learner itself drops the later rows from the file, run_files.py)."""
    import json
    rows = []
    if not os.path.exists(path):
        return rows
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut by the interruption
            if isinstance(row, dict) and isinstance(row.get("step"), int) \
                    and row["step"] <= version:
                rows.append(row)
    return rows


def _gpu_env(env: dict, gpus: str) -> dict:
    return dict(env, CUDA_VISIBLE_DEVICES=gpus) if gpus.strip() else dict(env)


def _ifname_env(env: dict, ifname: str) -> dict:
    """torch.distributed's sockets on one interface: gloo (CPU) and NCCL (GPU) read these."""
    if not ifname:
        return env
    return dict(env, GLOO_SOCKET_IFNAME=ifname, NCCL_SOCKET_IFNAME=ifname)


def _cpu_env(env: dict, spec: str, threads_per_process: int, vllm: bool = False) -> dict:
    """A side's cores (util/cpus.py: each process pins itself to TSYNC_CPUS) and its
    thread counts: torch's intra-op threads per process, and vLLM's CPU worker threads
    bound to exactly those cores."""
    if not spec.strip():
        return env
    env = dict(env, **{cpus.ENV: spec, "OMP_NUM_THREADS": str(max(1, threads_per_process))})
    if vllm:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus.parse(spec)))
    return env


def learner_env(cfg, env: dict) -> dict:
    """The learner ranks' environment: their GPUs or cores and the interface of their
    collectives."""
    per_node = cfg.rollout.n_learners // cfg.launch.nnodes
    n = len(cpus.parse(cfg.launch.learner_cpus) or [])
    env = _cpu_env(env, cfg.launch.learner_cpus, n // max(1, per_node))
    return _ifname_env(_gpu_env(env, cfg.launch.learner_gpus), cfg.launch.ifname)


def rollout_env(cfg, env: dict) -> dict:
    """The rollout's environment: its GPUs or cores, and the interface of the publication
    group (publish.ifname, when the config has it; docs/guide/multihost.md)."""
    n = len(cpus.parse(cfg.launch.rollout_cpus) or [])
    env = _cpu_env(env, cfg.launch.rollout_cpus, n, vllm=True)
    return _ifname_env(_gpu_env(env, cfg.launch.rollout_gpus),
                       getattr(getattr(cfg, "publish", None), "ifname", ""))


def check_cpu_placement(cfg, who: str) -> None:
    """Both sides on this host: their cores must not overlap (one `error:` line, exit 2)."""
    shared = set(cpus.parse(cfg.launch.learner_cpus) or []) & set(
        cpus.parse(cfg.launch.rollout_cpus) or [])
    if shared:
        print(f"error: {who}: launch.rollout_cpus {cfg.launch.rollout_cpus!r} and "
              f"launch.learner_cpus {cfg.launch.learner_cpus!r} share cores "
              f"{sorted(shared)}: give each side its own", file=sys.stderr, flush=True)
        raise SystemExit(2)


def learner_command(cfg, common: list[str], *, node_rank: int = 0, master_port: int = 0,
                    resume: bool = False) -> list[str]:
    """torchrun for this learner node: launch.nnodes nodes of rollout.n_learners /
    launch.nnodes ranks each, meeting at launch.master_addr:master_port (static rendezvous,
    node `node_rank`; its timeout is launch.dist_timeout_s)."""
    lc = cfg.launch
    port = master_port or lc.master_port
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(lc.nnodes),
            "--node-rank", str(node_rank),
            "--nproc-per-node", str(cfg.rollout.n_learners // lc.nnodes),
            "--master-addr", lc.master_addr, "--master-port", str(port),
            "--rdzv-conf", f"timeout={max(1, round(lc.dist_timeout_s))}",
            "-m", "tsync_mcore.cli.learner", *common, *(["--resume"] if resume else [])]


def check_publish_reach(cfg, who: str) -> None:
    """File publication with the node-local default directory (/dev/shm) works only when
    the rollout runs on the host that writes it (learner rank 0's, learner node 0). One
    `error:` line and exit 2 otherwise, before anything starts."""
    from tsync_mcore.channel import nodes
    pub = getattr(cfg, "publish", None)
    if getattr(pub, "method", "file") != "file" or getattr(pub, "dir", ""):
        return
    rollout = cfg.channel.addr
    if nodes.is_local_address(rollout):
        return
    print(f"error: {who}: publish.dir: the rollout (channel.addr {rollout}) is on another "
          f"host, and file publication's default directory is node-local shared memory it "
          f"cannot read: set publish.dir to a directory both hosts share, or "
          f"publish.method: dist (docs/guide/multihost.md)", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _last_error(*paths: str) -> str:
    """The last `error:` line of these logs (the one-line reason a launcher printed)."""
    found = ""
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if line.startswith("error:"):
                        found = line.strip()
        except OSError:
            pass
    return found


def _stop(proc, grace_s: float = 10.0) -> None:
    """End a child this launcher started and its process group (torchrun's workers,
    vLLM's engine core): SIGTERM, then SIGKILL after `grace_s`."""
    import signal
    import subprocess
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


ROLES = ("both", "rollout", "learner")


def run_job(config: str | None, overrides: list[str], cfg, *, who: str = "run",
            resume: bool = False, role: str = "both", node_rank: int = 0) -> list[dict]:
    """Start this host's share of the job for `cfg` and watch it: `both` (one node: the
    rollout launcher and the learner ranks under torchrun), `rollout` (the rollout host),
    or `learner` (learner node `node_rank` of launch.nnodes). Streams one line per update
    where learner rank 0 runs and returns the metrics rows seen (a resumed run's earlier
    rows included). Each side gets its CUDA_VISIBLE_DEVICES from launch.*_gpus and its
    torch.distributed interface from launch.ifname / publish.ifname; logs go to
    RUN/logs. If a side dies the others started here are stopped, and the job ends with
    one `error:` line and exit 1."""
    import json
    import queue
    import subprocess
    import threading

    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    nnodes = cfg.launch.nnodes
    if role == "both" and nnodes > 1:
        print(f"error: {who}: launch.nnodes = {nnodes}: start each host's share itself, "
              f"--role rollout on the rollout host and --role learner --node-rank I on each "
              f"learner node (docs/guide/multihost.md)", file=sys.stderr, flush=True)
        raise SystemExit(2)
    if not 0 <= node_rank < nnodes:
        print(f"error: {who}: --node-rank {node_rank} is outside [0, launch.nnodes = {nnodes})",
              file=sys.stderr, flush=True)
        raise SystemExit(2)
    if role == "learner" and node_rank == 0:
        check_publish_reach(cfg, who)  # rank 0 publishes; the rollout must read it
    if role == "both":
        check_cpu_placement(cfg, who)
    secret_or_exit(who, cfg)  # one secret for every launcher, created before any starts
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    common = ["--config", config] if config else []
    if overrides:
        common += ["--set", *overrides]
    log_dir = os.path.join(private_dir(cfg.run.dir), "logs")
    os.makedirs(log_dir, exist_ok=True)
    metrics_path = os.path.join(cfg.run.dir, "metrics.jsonl")
    rows: list[dict] = []
    reports = role != "rollout" and node_rank == 0  # learner rank 0 prints the updates
    if resume and reports:  # a fresh run's learner replaces the earlier files itself
        rows = _metrics_before(metrics_path, resume_version(cfg.run.dir, who, nnodes))
    node = f".node{node_rank}" if nnodes > 1 else ""
    rollout_log = os.path.join(log_dir, "rollout.log")
    learner_err, learner_out = (os.path.join(log_dir, f"learner{node}.{x}") for x in ("err", "out"))
    rollout = learner = None
    if role in ("both", "rollout"):
        rollout = subprocess.Popen(
            [sys.executable, "-m", "tsync_mcore.cli.rollout", *common],
            stdout=open(rollout_log, "w"), stderr=subprocess.STDOUT,
            env=rollout_env(cfg, env), start_new_session=True)
    lines: queue.Queue = queue.Queue()
    if role in ("both", "learner"):
        master_port = free_port() if nnodes == 1 and not cfg.launch.master_port else 0
        learner = subprocess.Popen(
            learner_command(cfg, common, node_rank=node_rank, master_port=master_port,
                            resume=resume),
            stdout=subprocess.PIPE, stderr=open(learner_err, "w"), text=True,
            env=learner_env(cfg, env), start_new_session=True)

        def pump() -> None:  # the learner's stdout, teed to its log
            with open(learner_out, "w") as out:
                for line in learner.stdout:
                    out.write(line)
                    out.flush()
                    lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, name="learner-stdout", daemon=True).start()
    else:
        lines.put(None)  # no learner here: watch the rollout alone
    total = cfg.run.updates
    ch = cfg.channel
    if role == "rollout":
        print(f"rollout: hosting the channel at {ch.listen_addr or ch.addr}:{ch.port} for "
              f"{cfg.rollout.n_learners} learner ranks; log {rollout_log}", flush=True)
    elif role == "learner":
        print(f"learner node {node_rank} of {nnodes}: {cfg.rollout.n_learners // nnodes} ranks, "
              f"rendezvous {cfg.launch.master_addr}:{cfg.launch.master_port}, channel "
              f"{ch.addr}:{ch.port}; logs in {log_dir}", flush=True)
    if reports:
        print(f"training {total} updates: {cfg.learner.objective}/{cfg.learner.schedule}, "
              f"{cfg.rollout.n_learners} learner ranks, logs in {log_dir}", flush=True)
        print(f"{bar(len(rows), total)}", flush=True)
    failed = ""
    try:
        while True:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                line = ""
            if line is None:
                break
            if line.startswith("STEP "):
                try:
                    m = json.loads(line[5:])
                except ValueError:
                    continue  # not the trainer's line (it is in learner.out all the same)
                rows.append(m)
                r = "-" if m["reward_mean"] is None else f"{m['reward_mean']:.3f}"
                print(f"{bar(len(rows), total)} step {m['step']:3d}  version "
                      f"{m['policy_version']:3d}  reward {r}  step {m['step_wall_time_s']:.2f}s"
                      f"  rollout {m['rollout_time_s']:.2f}s  tail {m['learner_tail_s']:.2f}s"
                      f"  publish {m['publish_time_s']:.2f}s", flush=True)
            if rollout is not None and rollout.poll() not in (None, 0):
                failed = "rollout"  # the rollout died: the learner would wait
                break
        if not failed and learner is not None:
            failed = "learner" if learner.wait() != 0 else ""
        if not failed and rollout is not None:
            try:  # after a learner's clean finish its rollout ends on its own
                rollout.wait(timeout=60 if learner is not None else None)
            except subprocess.TimeoutExpired:
                pass
            failed = "rollout" if rollout.poll() != 0 else ""
    except KeyboardInterrupt:
        failed = "interrupted"
    finally:
        for proc in (learner, rollout):
            if proc is not None:
                _stop(proc)
    here = "" if role == "both" else f" ({role}" + (f" node {node_rank})" if role == "learner"
                                                    else ")")
    if failed == "interrupted":
        print(f"{who}{here} interrupted: stopped; the last checkpoint under "
              f"{cfg.run.dir}/checkpoints is intact (continue with --resume)", file=sys.stderr,
              flush=True)
        raise SystemExit(130)
    if failed:
        rc = ", ".join(f"{n} exit {p.returncode}" for n, p in (("learner", learner),
                                                               ("rollout", rollout)) if p)
        logs = [rollout_log, learner_err] if rollout is not None else [learner_err]
        if failed == "learner":
            logs.reverse()  # the side that died says why
        if learner is not None:
            logs.append(learner_out)
        why = _last_error(logs[0]) or _last_error(*logs[1:]) or f"the {failed} side stopped first"
        print(f"error: {who}{here} failed ({rc}): {why.removeprefix('error: ')}; logs in "
              f"{log_dir}", file=sys.stderr, flush=True)
        raise SystemExit(1)
    return rows
