"""What a user meets first at the command line: a missing model or run directory is one
`error:` line and exit 2 (no traceback, no warnings around it), every option of the CLIs
has a help text, and the known-harmless warnings are filtered by exact message (quiet.py)."""

import argparse
import json
import os
import subprocess
import sys

from tests.helpers.paths import ROOT

REPO = ROOT
PY = sys.executable
CFG = os.path.join(REPO, "configs", "grpo_cpu_tiny.yaml")


NAMES = ["predict trace", "report", "ledger", "replay", "channel", "learner",
         "learner --resume", "rollout", "demo --resume"]


def missing_dir_commands(tmp):
    nope = os.path.join(tmp, "nope")
    batch = os.path.join(tmp, "batch.jsonl")
    with open(batch, "w") as f:
        f.write(json.dumps(dict(traj_id="t0", group_id="g0", tokens=[1, 2, 3],
                                scored_mask=[0, 1, 1], reward=0.5, policy_version=0)) + "\n")
    return {
        "predict trace": [PY, "-m", "tsync_mcore.observability.predict", "trace", nope],
        "report": [PY, "-m", "tsync_mcore.observability.report", nope],
        "ledger": [PY, "-m", "tsync_mcore.observability.ledger", "--model", nope, "--seq-lens", "16"],
        "replay": [PY, "-m", "tsync_mcore.learner.replay", "--model", nope, "--batch", batch,
                   "--out", os.path.join(tmp, "out")],
        "channel": [PY, "-m", "tsync_mcore.channel", "--update-docs", nope],
        "learner": [PY, "launch/learner.py", "--config", CFG, "--set",
                    f"model.hf_dir={nope}", f"run.dir={tmp}/run"],
        "learner --resume": [PY, "launch/learner.py", "--config", CFG, "--resume", "--set",
                             f"run.dir={nope}"],
        "rollout": [PY, "launch/rollout.py", "--config", CFG, "--set", f"model.hf_dir={nope}",
                    f"run.dir={tmp}/run"],
        "demo --resume": [PY, "launch/demo.py", "--resume", "--set", f"run.dir={nope}"],
    }


def test_missing_directory_is_one_error_line(tmp_path):
    # all at once: each process spends its time importing torch and Megatron
    env = dict(os.environ, PYTHONPATH=REPO)
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, cwd=REPO, env=env)
             for name, cmd in missing_dir_commands(str(tmp_path)).items()}
    bad = []
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=600)
        if not (proc.returncode == 2 and err.startswith("error: ") and err.count("\n") == 1
                and "nope" in err):  # one line, naming the directory
            bad.append(f"{name}: exit {proc.returncode}: {err[-1500:]}")
    assert not bad, "\n".join(bad)
    assert sorted(procs) == sorted(NAMES)


def parsers():
    """Every CLI's argparse parser, captured where its main() parses."""
    from tsync_mcore.channel import __main__ as channel
    from tsync_mcore.learner import replay
    from tsync_mcore.observability import predict, report
    from tsync_mcore.observability.ledger import __main__ as ledger

    class Got(Exception):
        pass

    def capture(fn, *args):
        seen = []

        def parse(self, *a, **k):
            seen.append(self)
            raise Got
        orig = argparse.ArgumentParser.parse_args
        argparse.ArgumentParser.parse_args = parse
        try:
            fn(*args)
        except Got:
            pass
        finally:
            argparse.ArgumentParser.parse_args = orig
        return seen[0]
    return {"predict": predict._parser(), "report": capture(report.main, []),
            "ledger": capture(ledger.main, []), "replay": capture(replay.parse_args, []),
            "channel": capture(channel.main)}


def test_every_option_has_a_help_text():
    n = 0
    for name, p in parsers().items():
        todo = [p]
        while todo:
            parser = todo.pop()
            for a in parser._actions:
                if isinstance(a, argparse._SubParsersAction):
                    todo += list(a.choices.values())
                    continue
                if isinstance(a, argparse._HelpAction):
                    continue
                assert a.help and a.help.strip(), f"{name}: {a.option_strings or a.dest} has no help"
                n += 1
    assert n >= 40


def test_quiet_filters_exact_known_warnings_only():
    code = """
from tsync_mcore.util import quiet
quiet.install()
import logging, warnings
import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs  # warn on import
warnings.warn("Apex is not installed. Falling back to Torch Norm")  # same text, other module
logging.basicConfig()
log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
log.warning("%s: Failed to load weights", "RotaryEmbedding")  # the reload notice
log.warning("%s: Failed to load weights", "QKVParallelLinear")  # a real failure
"""
    proc = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=REPO,
                          timeout=300, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert "megatron" not in err and "Transformer Engine and Apex" not in err
    assert err.count("Apex is not installed") == 1 and "<string>:6" in err
    assert "RotaryEmbedding" not in err and "QKVParallelLinear: Failed to load weights" in err
    # without install() megatron's fallbacks show: the filter is what removed them
    plain = subprocess.run([PY, "-c", "import megatron.core.optimizer"], capture_output=True,
                           text=True, cwd=REPO, timeout=300)
    assert "Falling back to Torch optimizers" in plain.stderr
