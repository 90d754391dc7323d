"""Config reference, resolve step, launcher command lines, channel port errors, launch/run.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from tests.helpers.paths import ROOT


def _tiny_model(path: str) -> None:
    from tsync_mcore.model.tiny import make_tiny_checkpoint
    make_tiny_checkpoint(path, arch="qwen2", vocab_size=320, hidden=64, layers=2, heads=2,
                         kv_heads=1, intermediate=128, seed=0)  # as make demo's


def test_run_with_a_taken_port_stops_both_sides_with_the_rollouts_line(tmp_path):
    _tiny_model(str(tmp_path / "model"))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        p = subprocess.run(
            [sys.executable, os.path.join(ROOT, "launch/run.py"), "--config",
             os.path.join(ROOT, "tsync_mcore/cli/demo.yaml"), "--keep-port", "--set",
             f"run.dir={tmp_path}/run", f"model.hf_dir={tmp_path}/model",
             f"channel.port={port}", "channel.timeout_s=300", "--set",
             f"publish.dir={tmp_path}/publish"],
            cwd=ROOT, capture_output=True, text=True, timeout=200)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 1, p.stderr[-3000:]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0] and "channel.port" in errors[0]
    assert os.path.exists(tmp_path / "run" / "logs" / "rollout.log")
