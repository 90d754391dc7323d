"""A non-editable install works without the checkout: the wheel of this tree installed into
a fresh virtual environment (its dependencies borrowed from the running one), then its
console scripts run from a directory outside the checkout."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig

from tests.helpers.paths import ROOT


def test_wheel_in_a_fresh_venv_runs_its_console_scripts_outside_the_checkout(tmp_path):
    wheels, venv, outside = tmp_path / "wheels", tmp_path / "venv", tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the checkout
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(wheels), ROOT], capture_output=True, text=True, env=env, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheels.glob("tsync_mcore-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    # the dependencies: the running environment's site-packages, after the venv's own
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    deps = [p for p in site.getsitepackages() if os.path.isdir(p)] or [sysconfig.get_paths()["purelib"]]
    with open(os.path.join(purelib, "deps.pth"), "w") as f:
        f.write("\n".join(deps) + "\n")
    inst = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                           "--no-deps", str(wheel)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert inst.returncode == 0, inst.stderr[-3000:]
    where = subprocess.run([py, "-c", "import tsync_mcore; print(tsync_mcore.__file__)"],
                           cwd=outside, capture_output=True, text=True, env=env, check=True)
    assert where.stdout.startswith(purelib), where.stdout  # the installed copy, not the checkout
    for script in ("tsync-run", "tsync-learner", "tsync-rollout", "tsync-demo", "tsync-replay",
                   "tsync-export", "tsync-report", "tsync-predict", "tsync-ledger"):
        out = subprocess.run([venv / "bin" / script, "--help"], cwd=outside, capture_output=True,
                             text=True, env=env, timeout=120)
        assert out.returncode == 0 and "usage" in out.stdout.lower(), (script, out.stderr[-2000:])
    # the demo's config ships inside the package: the demo resolves it from there
    cfg = subprocess.run([venv / "bin" / "tsync-demo", "--print-config"], cwd=outside,
                         capture_output=True, text=True, env=env, timeout=120)
    assert cfg.returncode == 0, cfg.stderr[-2000:]
    assert "hf_dir: runs/demo/model" in cfg.stdout
