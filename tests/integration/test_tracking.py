"""run.loggers: config checks, the metric-name table, and what each backend writes, read back
with the backend's own reader (TensorBoard's EventAccumulator, the W&B offline run file,
MLflow's client on the file store). No network: W&B offline, MLflow on local files."""

from __future__ import annotations

import glob
import json
import os
import struct

import pytest

from tests.helpers.tracking_shared import (  # noqa: F401  (shared with the unit tests)
    RECORDS,
    expected,
    log_all,
)
from tsync_mcore.observability.tracking import Tracker, mlflow_key


def wandb_records(path: str):
    """Every protobuf Record of a W&B run file: a LevelDB-style log (7-byte file header
    ':W&B' + magic + version; 32 KiB blocks of chunks: crc32c, length, type, data)."""
    from wandb.proto import wandb_internal_pb2 as pb
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", data[:8]
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            continue
        pending += chunk
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(pending)
            yield rec
            pending = b""


def test_wandb_offline(tmp_path, monkeypatch):
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    log_all(Tracker(str(tmp_path), ["wandb"], project="proj", name="run-a",
                    config={"optim": {"lr": 1e-5}}))
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, os.listdir(tmp_path)
    # W&B's own service process writes the file; on a loaded machine it may still be
    # flushing when finish() returns, so read until the run record is there (bounded).
    import time
    deadline = time.monotonic() + 60
    while True:
        history, run = {}, None
        try:
            for rec in wandb_records(runs[0]):
                kind = rec.WhichOneof("record_type")
                if kind == "run":
                    run = rec.run
                elif kind == "history":
                    items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                             for i in rec.history.item}
                    history[items.pop("_step")] = items
        except Exception:  # a record still being written
            if time.monotonic() > deadline:
                raise
        if run is not None and len(history) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert run is not None, f"no run record in {runs[0]} ({os.path.getsize(runs[0])} bytes)"
    assert (run.project, run.display_name) == ("proj", "run-a")
    assert sorted(history) == [1, 2]
    for r in RECORDS:
        got = {k: v for k, v in history[r["step"]].items() if not k.startswith("_")}
        assert got == pytest.approx(expected(r), rel=1e-12)


# MLflow's client runs `uname -p` (platform.processor) when it starts a run: a process.
def test_mlflow_file_store(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    from mlflow.tracking import MlflowClient
    log_all(Tracker(str(tmp_path), ["mlflow"], project="proj", name="run-a",
                    config={"optim": {"lr": 1e-5}, "run": {"loggers": ["mlflow"]}}))
    client = MlflowClient((tmp_path / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("proj")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "run-a" and run.info.status == "FINISHED"
    assert run.data.params["optim.lr"] == "1e-05"
    for name in expected(RECORDS[0]):
        want = [(r["step"], expected(r)[name]) for r in RECORDS if name in expected(r)]
        hist = client.get_metric_history(run.info.run_id, mlflow_key(name))
        assert sorted((m.step, m.value) for m in hist) == want, name
    assert mlflow_key("eval/pass@k") == "eval/pass_at_k"


def test_a_failing_backend_is_turned_off(tmp_path, monkeypatch, capsys):
    """MLflow refuses metrics for a deleted run: it is reported once and dropped; the
    other backends (and the run) go on."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from mlflow.tracking import MlflowClient
    tracker = Tracker(str(tmp_path), ["jsonl", "mlflow"])
    tracker.log(RECORDS[0], step=1)
    MlflowClient((tmp_path / "mlruns").resolve().as_uri()).delete_run(
        tracker.backends["mlflow"].run_id)
    tracker.log(RECORDS[1], step=2)
    tracker.log(RECORDS[1], step=3)
    tracker.finish()
    err = capsys.readouterr().err
    assert err.count("[tracking] mlflow failed at step 2") == 1 and "step 3" not in err
    assert len(open(tmp_path / "metrics.jsonl").readlines()) == 3
