"""run.loggers: config checks, the metric-name table, and what each backend writes, read back
with the backend's own reader (TensorBoard's EventAccumulator, the W&B offline run file,
MLflow's client on the file store). No network: W&B offline, MLflow on local files."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers.tracking_shared import RECORDS, expected, log_all
from tsync_mcore.config import ConfigError, load_config
from tsync_mcore.observability.metrics import TRACKER_NAMES, tracker_scalars
from tsync_mcore.observability.tracking import Tracker, TrackingError


def test_tracker_names():
    for r in RECORDS:
        assert tracker_scalars(r) == pytest.approx(expected(r), rel=1e-15)
    assert all("/" in name for name, _ in TRACKER_NAMES.values())
    assert tracker_scalars({"ok": True, "skipped": "why", "step": 3}) == {}


def test_loggers_default_and_names(tmp_path):
    cfg = load_config(None, {"run.dir": str(tmp_path / "exp7")})
    assert cfg.run.loggers == ["console", "jsonl"]
    assert (cfg.run.project, cfg.run.name) == ("tsync-mcore", "exp7")
    cfg = load_config(None, {"run.loggers": ["jsonl", "tensorboard", "wandb", "mlflow"],
                             "run.project": "p", "run.name": "n"})
    assert cfg.run.loggers == ["jsonl", "tensorboard", "wandb", "mlflow"]
    assert (cfg.run.project, cfg.run.name) == ("p", "n")


@pytest.mark.parametrize("value,says", [
    ("wandb", "config key 'run.loggers': must be a list"),
    (["jsonl", 3], "config key 'run.loggers[1]': must be a string"),
    (["jsonl", "neptune"], "config key 'run.loggers': unknown logger 'neptune'"),
    (["jsonl", "jsonl"], "config key 'run.loggers': ['jsonl'] listed more than once"),
    ({"a": 1}, "config key 'run.loggers': must be a list"),
])
def test_bad_loggers(value, says):
    with pytest.raises(ConfigError) as e:
        load_config(None, {"run.loggers": value})
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


def test_loggers_from_a_yaml_override(tmp_path):
    from tsync_mcore.config import parse_overrides
    cfg = load_config(None, parse_overrides(["run.loggers=[jsonl, tensorboard]"]))
    assert cfg.run.loggers == ["jsonl", "tensorboard"]


@pytest.mark.parametrize("logger,package", [("wandb", "wandb"), ("mlflow", "mlflow"),
                                            ("tensorboard", "tensorboard")])
def test_missing_package_is_a_config_error(monkeypatch, tmp_path, logger, package):
    monkeypatch.setitem(sys.modules, package, None)  # how Python blocks an import
    with pytest.raises(ConfigError) as e:
        load_config(None, {"run.loggers": ["jsonl", logger]})
    msg = str(e.value)
    assert msg.startswith(f"config key 'run.loggers': '{logger}' needs the Python package "
                          f"'{package}'") and "\n" not in msg
    with pytest.raises(TrackingError) as e:
        Tracker(str(tmp_path), ["jsonl", logger])
    assert "\n" not in str(e.value) and "not installed" in str(e.value)


def test_jsonl_and_console(tmp_path, capsys):
    log_all(Tracker(str(tmp_path), ["console", "jsonl"]))
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows[:2] == RECORDS  # the whole record, flat keys kept
    assert rows[2] == dict(step=2, policy_version=2, ok=False, skipped="non-finite")
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("step:")]
    assert len(lines) == 2  # the skipped batch has no scalars
    fields = dict(f.split(":", 1) for f in lines[0].split(" - "))
    assert fields["step"] == "1" and float(fields["timing_s/step"]) == 1.25
    assert float(fields["perf/max_memory_allocated_gb"]) == 3.0


def test_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    log_all(Tracker(str(tmp_path), ["tensorboard"]))
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    for name in expected(RECORDS[0]):
        want = [(r["step"], expected(r)[name]) for r in RECORDS if name in expected(r)]
        got = [(e.step, e.value) for e in acc.Scalars(name)]
        assert got == [(s, pytest.approx(v, rel=1e-7)) for s, v in want], name


def test_tensorboard_resume_drops_the_interrupted_runs_later_points(tmp_path):
    """A run logged updates 1..3 and was checkpointed at θ_1; the resumed run logs 2..3
    again: TensorBoard shows each step once, with the resumed run's values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    first = Tracker(str(tmp_path), ["tensorboard"])
    for step in (1, 2, 3):
        first.log(dict(step=step, reward_mean=0.1 * step), step=step)
    first.finish()
    again = Tracker(str(tmp_path), ["tensorboard"], resumed_at=1)
    for step in (2, 3):
        again.log(dict(step=step, reward_mean=0.5 * step), step=step)
    again.finish()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("reward/mean")]
    assert got == [(1, pytest.approx(0.1)), (2, pytest.approx(1.0)), (3, pytest.approx(1.5))]


