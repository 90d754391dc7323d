"""Files and directories the learner trusts only after checking: the publication directory
and Hugging Face model directories (checkpoints: test_checkpoint.py)."""

import os
import subprocess
import sys

from tests.helpers.paths import ROOT
from tests.helpers.safe_files_shared import (  # noqa: F401  (shared with the unit tests)
    model_copy,
    truncate,
)


def _learner(hf_dir: str, run: str, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch/learner.py"), "--config",
         os.path.join(ROOT, "configs/grpo_cpu_tiny.yaml"), "--set", f"model.hf_dir={hf_dir}",
         f"run.dir={run}", *extra], env=env, capture_output=True, text=True, timeout=300)


def test_learner_refuses_an_open_publish_dir_in_one_line(tiny_qwen2, tmp_path):
    pub = tmp_path / "pub"
    pub.mkdir()
    pub.chmod(0o777)
    proc = _learner(tiny_qwen2, str(tmp_path / "run"), "publish.method=file",
                    f"publish.dir={pub}")
    assert proc.returncode == 3, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (f"error: learner stopped: publish directory {pub}: writable by group or others "
                    f"(mode 777)"), last


def test_learner_names_a_truncated_model_file_in_one_line(model_copy, tmp_path):
    d = model_copy("qwen2")
    path = os.path.join(d, "model.safetensors")
    truncate(path)
    proc = _learner(d, str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: learner rank 0: {path}: not a readable safetensors"), last
