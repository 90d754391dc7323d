"""Serve an agent pool (rollout.agent_pool > 0) with a one-episode function: the worker loop
of docs/guide/agents.md ("Agent pools").

    from tsync_mcore.rollout.openai.agents import pool
    pool.serve(run)        # run(client: openai.OpenAI, task: dict) -> anything
    pool.main(run)         # an agent's entry point: a pool worker, or one episode

Loop: POST $TSYNC_POOL_URL/next {"worker": $TSYNC_WORKER_ID, "wait_s": 30} — 204: poll
again; 410: the rollout is stopping, return; 200: a handout {"trajectory", "base_url",
"api_key", "task" (+ "tools_url")} — then run(openai.OpenAI(base_url=handout["base_url"],
api_key=handout["api_key"]), task) and POST <base_url>/done (with that key): what it
returned when that is a dict (e.g. {"reward": x}), else {}; {"error": "<exception>"} when it
raised (the trajectory is failed). One trajectory at a time; an async worker may hold
several.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import httpx
import openai

WAIT_S = 30.0


def serve(run_fn: Callable[[openai.OpenAI, dict[str, Any]], Any]) -> int:
    """Pull trajectories until the rollout stops; the process's exit code (0)."""
    url, key = os.environ["TSYNC_POOL_URL"], os.environ["OPENAI_API_KEY"]
    worker = os.environ["TSYNC_WORKER_ID"]
    http = httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=WAIT_S + 30)
    while True:
        r = http.post(f"{url}/next", json={"worker": worker, "wait_s": WAIT_S})
        if r.status_code == 410:
            return 0
        if r.status_code == 204:
            continue
        r.raise_for_status()  # 401/404: not a worker of this rollout; exit non-zero
        h = r.json()
        body: dict[str, Any] = {}
        with openai.OpenAI(base_url=h["base_url"], api_key=h["api_key"]) as client:
            try:
                out = run_fn(client, h["task"])
                body = out if isinstance(out, dict) else {}
            except Exception as e:
                traceback.print_exc(file=sys.stderr)
                body = {"error": f"{type(e).__name__}: {e}"[:2000]}
        httpx.post(f"{h['base_url']}/done", json=body, timeout=30,  # 409: timed out already
                   headers={"Authorization": f"Bearer {h['api_key']}"})


def main(run_fn: Callable[[openai.OpenAI, dict[str, Any]], Any]) -> int:
    """A bundled agent's entry point: a pool worker when TSYNC_POOL_URL is set, else one
    episode of TSYNC_TASK (OPENAI_BASE_URL, OPENAI_API_KEY from the environment); a dict it
    returns is posted as the trajectory's done body."""
    if os.environ.get("TSYNC_POOL_URL"):
        return serve(run_fn)
    client = openai.OpenAI()
    out = run_fn(client, json.loads(os.environ["TSYNC_TASK"]))
    if isinstance(out, dict):
        r = httpx.post(f"{client.base_url}".rstrip("/") + "/done", json=out, timeout=30,
                       headers={"Authorization": f"Bearer {client.api_key}"})
        r.raise_for_status()
    return 0
