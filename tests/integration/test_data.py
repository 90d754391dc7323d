"""Dataset loading (JSONL, Parquet, save_to_disk), bad inputs, chat rendering, the epoch
sampler behind data_pos, and SkyRL-Gym envs fed from dataset rows."""

import os

from tests.helpers.data_shared import write_jsonl  # noqa: F401  (shared with the unit tests)
from tests.helpers.paths import ROOT


def test_rollout_launcher_names_a_bad_row_in_one_line(tmp_path, tiny_qwen2):
    import subprocess
    import sys
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "label": "1"},
                                              {"prompt": [{"role": "user"}], "label": "2"}])
    root = ROOT
    p = subprocess.run(
        [sys.executable, os.path.join(root, "launch/rollout.py"), "--config",
         os.path.join(root, "configs/grpo_cpu_tiny.yaml"), "--set", f"model.hf_dir={tiny_qwen2}",
         f"run.dir={tmp_path}/run", "rollout.env=dataset", f"data.train={data}",
         "reward.function=exact_match"], cwd=root, capture_output=True, text=True, timeout=300)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and errors == [
        f"error: rollout: {data} row 1: column 'prompt': message 0 has no 'content' string"], \
        p.stderr[-2000:]
    assert "Traceback" not in p.stderr
