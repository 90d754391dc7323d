"""What starting an agent process costs in the jail (rollout.agent_isolation: isolate) beside
today's unjailed start (none): the median wall time of N starts, each to its exit, and the
CPU seconds per start (this process and its children), for two agent commands — `true`
(the start alone) and a Python agent that asks the endpoint for its models once through its
OPENAI_BASE_URL (the forwarder's, when jailed). docs/measured/agent-jail.md.

    python -m perf.studies.agent_start [--n 100]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import tempfile
import time

from tsync_mcore.rollout.openai.launch import Launcher, why_not_jailed
from tsync_mcore.rollout.openai.pool import agent_env
from tsync_mcore.rollout.openai.processes import run_agent
from tsync_mcore.rollout.openai.server import OpenAIServer

KEY = "bench-key"
ASK = (f"{sys.executable} -c \"import os, urllib.request as u; u.urlopen(u.Request("
       f"os.environ['OPENAI_BASE_URL'] + '/models', headers={{'Authorization': "
       f"'Bearer ' + os.environ['OPENAI_API_KEY']}})).read()\"")


def cpu() -> float:
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


async def measure(server: OpenAIServer, isolation: str, command: str, n: int, run_dir: str
                  ) -> tuple[float, float]:
    """(median wall seconds, CPU seconds per start) of n starts of `command`."""
    launcher = Launcher(server, isolation, hide=(run_dir,))
    env = agent_env(OPENAI_BASE_URL=launcher.base_url("bench"), OPENAI_API_KEY=KEY)
    log = os.path.join(run_dir, "agent.log")
    walls = []
    c0 = cpu()
    for _ in range(n):
        t0 = time.perf_counter()
        status, code = await run_agent(command, env, 60, log, launcher)
        walls.append(time.perf_counter() - t0)
        if status != "ok":
            raise SystemExit(f"{isolation} {command!r}: {status} ({code}): "
                             f"{open(log).read()[-500:]}")
    return statistics.median(walls), (cpu() - c0) / n


async def main(n: int) -> None:
    why = why_not_jailed()
    if why:
        raise SystemExit(f"agents cannot run jailed here: {why}")
    server = OpenAIServer(None, None, api_key=KEY)
    await server.start("127.0.0.1", 0)
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            print("| agent command | none: median wall | none: CPU s/start | "
                  "isolate: median wall | isolate: CPU s/start |")
            print("|---|---|---|---|---|")
            for name, command in (("`true`", "true"), ("python, one request", ASK)):
                row = []
                for isolation in ("none", "isolate"):
                    await measure(server, isolation, command, 3, run_dir)  # warm caches
                    wall, c = await measure(server, isolation, command, n, run_dir)
                    row += [f"{wall * 1e3:.0f} ms", f"{c:.3f}"]
                print(f"| {name} | " + " | ".join(row) + " |", flush=True)
    finally:
        await server.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100, help="starts per cell (default 100)")
    asyncio.run(main(ap.parse_args().n))
