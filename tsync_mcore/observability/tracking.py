"""Experiment tracking: one `Tracker` fans each update's metrics out to the configured backends.

    run.loggers: [console, jsonl, tensorboard, wandb, mlflow]

In the shape of verl's `verl/utils/tracking.py`: `log(record, step)` and `finish()`, each
backend imported only when selected. `jsonl` writes the whole record to RUN_DIR/metrics.jsonl
(the learner's own keys, which report, predict and the launchers read); the others get the
scalars under verl's names (tsync_mcore.observability.metrics.TRACKER_NAMES, docs/guide/metrics.md).

Nothing needs a network: W&B runs offline (files under RUN_DIR/wandb, `wandb sync` uploads
them later) unless WANDB_API_KEY or WANDB_MODE say otherwise; MLflow writes a file store
under RUN_DIR/mlruns unless MLFLOW_TRACKING_URI names another. A backend that fails while
logging is reported on stderr once and turned off: tracking never stops training.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from tsync_mcore.observability.metrics import tracker_scalars

# logger name → the Python package it imports (None: nothing beyond the standard library)
BACKENDS: dict[str, str | None] = {
    "console": None, "jsonl": None, "tensorboard": "tensorboard", "wandb": "wandb",
    "mlflow": "mlflow",
}
PIP_NAMES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny"}


class TrackingError(RuntimeError):
    """A selected backend cannot start; the message is one line naming it."""


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # ValueError: blocked in sys.modules (None)
        return False


def check_loggers(names: list[str]) -> str | None:
    """Why `run.loggers` cannot be used here, or None."""
    for name in names:
        if name not in BACKENDS:
            return f"unknown logger {name!r} (allowed: {list(BACKENDS)})"
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        return f"{dup} listed more than once"
    for name in names:
        package = BACKENDS[name]
        if package is not None and not _installed(package):
            return (f"{name!r} needs the Python package {package!r}, which is not installed "
                    f"(pip install {PIP_NAMES[name]}, pinned in requirements.txt)")
    return None


class Tracker:
    def __init__(self, run_dir: str, loggers: list[str], project: str = "tsync-mcore",
                 name: str = "", config: dict | None = None, resumed_at: int | None = None):
        """`resumed_at`: the checkpoint's policy version of a resumed run; backends that can
        drop what an earlier run logged after it (TensorBoard) do."""
        why = check_loggers(list(loggers))
        if why is not None:
            raise TrackingError(f"config key 'run.loggers': {why}")
        self.run_dir = run_dir
        name = name or os.path.basename(os.path.normpath(os.path.abspath(run_dir)))
        self.backends: dict[str, Any] = {}
        try:
            for logger in loggers:
                self.backends[logger] = _BUILD[logger](run_dir, project, name, config or {},
                                                       resumed_at)
        except Exception as e:
            self.finish()  # what started already
            raise TrackingError(f"config key 'run.loggers': {logger} could not start: "
                                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                                ) from None

    @classmethod
    def from_config(cls, cfg, resumed_at: int | None = None) -> Tracker:
        import dataclasses
        r = cfg.run
        return cls(r.dir, r.loggers, project=r.project, name=r.name,
                   config=dataclasses.asdict(cfg),
                   resumed_at=resumed_at)

    def log(self, record: dict, step: int) -> None:
        """`record`: one metrics.jsonl row; `step`: the policy version it produced."""
        scalars = tracker_scalars(record)
        for name, backend in list(self.backends.items()):
            data = record if backend.whole_record else scalars
            if not data:
                continue
            try:
                backend.log(data, step)
            except Exception as e:
                print(f"[tracking] {name} failed at step {step} and is turned off for this run: "
                      f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
                self._close(name)

    def finish(self) -> None:
        for name in list(self.backends):
            self._close(name)

    def _close(self, name: str) -> None:
        backend = self.backends.pop(name)
        try:
            backend.finish()
        except Exception as e:
            print(f"[tracking] {name} did not finish cleanly: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)


# --- backends ---------------------------------------------------------------------------

class _Console:
    """verl's console line: `step:3 - timing_s/step:1.23 - reward/mean:0.5 - ...`."""
    whole_record = False

    def __init__(self, run_dir, project, name, config, resumed_at=None):
        pass

    def log(self, data: dict, step: int) -> None:
        print(f"step:{step} - " + " - ".join(f"{k}:{v:.4g}" for k, v in data.items()),
              flush=True)

    def finish(self) -> None:
        pass


class _Jsonl:
    """RUN_DIR/metrics.jsonl, one record per line, appended (opened per line: a crash
    leaves whole lines)."""
    whole_record = True

    def __init__(self, run_dir, project, name, config, resumed_at=None):
        self.path = os.path.join(run_dir, "metrics.jsonl")

    def log(self, data: dict, step: int) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(data) + "\n")

    def finish(self) -> None:
        pass


class _TensorBoard:
    whole_record = False

    def __init__(self, run_dir, project, name, config, resumed_at=None):
        from torch.utils.tensorboard import SummaryWriter
        # A resumed run's first step is resumed_at + 1: purge_step makes TensorBoard drop the
        # points an interrupted run logged from there on (they are trained again). A fresh
        # run's learner removed the earlier run's event files (run_files.py).
        purge = None if resumed_at is None else resumed_at + 1
        self.writer = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=purge)

    def log(self, data: dict, step: int) -> None:
        for k, v in data.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()  # one small write per update; a killed run keeps its curves

    def finish(self) -> None:
        self.writer.close()


class _Wandb:
    whole_record = False

    def __init__(self, run_dir, project, name, config, resumed_at=None):
        import wandb
        # Offline unless the user set a key or a mode: a run never waits on a network.
        mode = os.environ.get("WANDB_MODE") or (
            "online" if os.environ.get("WANDB_API_KEY") else "offline")
        # console="off": W&B must not wrap stdout, which the launchers parse (STEP lines).
        self.run = wandb.init(project=project, name=name, dir=run_dir, config=config,
                              mode=mode, settings=wandb.Settings(console="off", quiet=True))

    def log(self, data: dict, step: int) -> None:
        self.run.log(data, step=step)

    def finish(self) -> None:
        self.run.finish()


# MLflow metric names allow alphanumerics, '_', '-', '.', ' ', ':' and '/'.
_MLFLOW_BAD = re.compile(r"[^/\w.\- :]")


def mlflow_key(name: str) -> str:
    """A tracker name as MLflow stores it (`eval/pass@k` → `eval/pass_at_k`)."""
    return _MLFLOW_BAD.sub("_", name.replace("@", "_at_"))


class _Mlflow:
    whole_record = False

    def __init__(self, run_dir, project, name, config, resumed_at=None):
        uri = os.environ.get("MLFLOW_TRACKING_URI") or Path(run_dir, "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 keeps the file store in maintenance mode behind this opt-in; it is the
            # store that needs no server and no database package (mlflow-skinny has neither).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        self.client = MlflowClient(uri)
        exp = self.client.get_experiment_by_name(project)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(project)
        self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in _flatten(config).items()]
        for i in range(0, len(params), 100):  # log_batch takes at most 100 params
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, data: dict, step: int) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_key(k), v, now, step)
                                                    for k, v in data.items()])

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


_BUILD = {"console": _Console, "jsonl": _Jsonl, "tensorboard": _TensorBoard, "wandb": _Wandb,
          "mlflow": _Mlflow}
