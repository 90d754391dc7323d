"""Launch a script on N local ranks with torchrun and collect each rank's JSON result."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from tests.helpers.paths import ROOT as REPO_ROOT
from tsync_mcore.util.net import free_port  # noqa: E402

RESULT_PREFIX = "RESULT "




def run_dist(
    script_path_or_module_args: list[str],
    nproc: int,
    timeout: float = 300,
    env: dict[str, str] | None = None,
) -> list[dict]:
    """Run `torchrun --nproc-per-node nproc <args>`; return the ranks' results by rank.

    Each rank reports by printing one line `RESULT {json}` (see `report`). Fails with the
    tail of stderr/stdout when the launch fails, times out, or a rank reports nothing.
    """
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (REPO_ROOT, full_env.get("PYTHONPATH", "")) if p
    )
    full_env.setdefault("OMP_NUM_THREADS", "1")  # 2 cores shared by all ranks
    full_env.setdefault("PYTHONWARNINGS", "ignore")
    full_env.update(env or {})
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()),
        *script_path_or_module_args,
    ]  # fmt: skip
    try:
        proc = subprocess.run(
            cmd, cwd=REPO_ROOT, env=full_env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        err = e.stderr or ""
        tail = (err.decode(errors="replace") if isinstance(err, bytes) else err)[-6000:]
        raise AssertionError(f"{cmd} timed out after {timeout}s; stderr tail:\n{tail}") from e
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed (rc={proc.returncode})\n"
            f"--- stderr tail ---\n{proc.stderr[-8000:]}\n"
            f"--- stdout tail ---\n{proc.stdout[-3000:]}"
        )
    results = parse_results(proc.stdout)
    if len(results) != nproc:
        raise AssertionError(
            f"expected {nproc} RESULT lines, got {len(results)}\n"
            f"--- stdout tail ---\n{proc.stdout[-4000:]}\n"
            f"--- stderr tail ---\n{proc.stderr[-4000:]}"
        )
    return sorted(results, key=lambda r: r.get("rank", 0))


def parse_results(stdout: str) -> list:
    """Every RESULT object in a launch's stdout, wherever it starts: ranks share the pipe, so
    another rank's output may end up on the same line (under PYTHONUNBUFFERED, print's text
    and its newline are two writes)."""
    decoder, results = json.JSONDecoder(), []
    for m in re.finditer(re.escape(RESULT_PREFIX), stdout):
        try:
            results.append(decoder.raw_decode(stdout, m.end())[0])
        except json.JSONDecodeError:
            pass
    return results


def emit(obj) -> None:
    """Worker side: write `RESULT {json}` and its newline in one system call, so ranks that
    share a pipe cannot split a line (writes up to PIPE_BUF are atomic)."""
    sys.stdout.flush()
    data = (RESULT_PREFIX + json.dumps(obj) + "\n").encode()
    while data:
        data = data[os.write(sys.stdout.fileno(), data):]


def report(result: dict) -> None:
    """Worker side: print this rank's result (with its rank) as one RESULT line."""
    emit({"rank": int(os.environ.get("RANK", "0")), **result})


def exit_now() -> None:
    """Worker side, once everything is reported and written: end the process without the
    interpreter's teardown, which takes seconds with torch and Megatron loaded (every
    launch's ranks pay it, on the 2 shared cores). Only after a normal return: an exception
    still ends the process the usual way, with its traceback and exit code."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
