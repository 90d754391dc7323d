"""Session fixtures: tiny random HF checkpoints (built once) and a 1-rank parallel state."""

from __future__ import annotations

import os

import pytest

from tests.helpers.paths import ROOT

# Worker scripts the tests start import `tests.helpers` and `tsync_mcore` from the checkout.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)


# The files with the longest live runs, longest first (docs/measured/suite.md, issue 46).
# `make test` runs `-n 3 --dist loadfile`: a worker takes the next file when it runs low,
# so a long file that starts last runs alone at the end while the other workers idle.
LONGEST_FIRST = [f"integration/test_{name}.py" for name in (
    "multihost", "moe", "e2e", "openai_live", "data_live", "async_live", "lora_publish",
    "checkpoint", "replica_restart_live", "judge_live", "real_model", "segments_live",
    "verifiers_live", "reasoning_gym_live", "dynamic_sampling_live", "trl_compare",
    "nonfinite_live", "replicas", "rollout", "openai_server")]


def pytest_configure(config) -> None:
    # megatron warns at import about missing TE/apex and deprecated defaults: noise on CPU
    for cat in ("UserWarning", "DeprecationWarning", "FutureWarning"):
        config.addinivalue_line("filterwarnings", f"ignore::{cat}:megatron.*")
    # xdist's loadfile hands out files by their number of tests, most first (its
    # --loadscope-reorder default), which puts the one-test live runs last: keep the order
    # pytest_collection_modifyitems gives instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """TSYNC_CPU_REPORT=FILE: append each test's CPU seconds (this process and the processes
    it waited for, setup and teardown included), wall seconds, the test's id and the epoch
    second it ended, to find where the suite's CPU goes and when (`make test` is CPU-bound
    on two cores)."""
    path = os.environ.get("TSYNC_CPU_REPORT")
    if not path:
        yield
        return
    import resource
    import time

    def cpu() -> float:
        return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                     resource.getrusage(resource.RUSAGE_CHILDREN)))
    c0, t0 = cpu(), time.perf_counter()
    yield
    with open(path, "a") as f:
        f.write(f"{cpu() - c0:.1f}\t{time.perf_counter() - t0:.1f}\t{item.nodeid}\t{time.time():.0f}\n")


def pytest_collection_modifyitems(config, items) -> None:
    # longest files first (a stable sort: the rest keep their order, integration before unit)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_tests_relpath(item), len(rank)))
    # `multihost` (tests/integration/test_multihost.py: network namespaces, root) is opt-in: `make test`
    # and CI opt in with TSYNC_MULTIHOST=1, a user with `-m multihost`.
    if os.environ.get("TSYNC_MULTIHOST") == "1" or "multihost" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="multi-host tests are opt-in: TSYNC_MULTIHOST=1 (make test "
                                   "sets it) or -m multihost")
    for item in items:
        if "multihost" in item.keywords:
            item.add_marker(skip)


def _tests_relpath(item) -> str:
    path = str(item.path)
    return path[path.rfind("/tests/") + len("/tests/"):]


# Checkpoint variants used by the model tests: name -> make_tiny_checkpoint kwargs.
TINY_VARIANTS: dict[str, dict] = {
    "qwen2": dict(arch="qwen2"),
    "llama": dict(arch="llama"),
    # Qwen3: qk-norm and head_dim (32) != hidden / heads (16), as in real Qwen3 models.
    "qwen3": dict(arch="qwen3", head_dim=32),
    "qwen2_tied": dict(arch="qwen2", tie=True, seed=1),
    # also a sharded checkpoint (index + several safetensors files)
    "llama_tied": dict(arch="llama", tie=True, seed=2, max_shard_size="40KB"),
    "qwen3_tied": dict(arch="qwen3", tie=True, seed=3, head_dim=32),
}


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("tiny_ckpts"))


def _tiny(root: str, name: str) -> str:
    from tsync_mcore.model.tiny import make_tiny_checkpoint

    out = os.path.join(root, name)
    if not os.path.exists(os.path.join(out, "config.json")):
        make_tiny_checkpoint(out, **TINY_VARIANTS[name])
    return out


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_root) -> str:
    """Qwen2 (QKV bias), untied, vocab 256, hidden 64, 2 layers, 4 heads / 2 KV heads."""
    return _tiny(tiny_root, "qwen2")


@pytest.fixture(scope="session")
def tiny_llama(tiny_root) -> str:
    """Llama, untied, same sizes as tiny_qwen2."""
    return _tiny(tiny_root, "llama")


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_root) -> str:
    """Qwen3 (qk-norm, head_dim 32 != hidden/heads), untied."""
    return _tiny(tiny_root, "qwen3")


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tiny_root) -> str:
    """Qwen3-MoE: 4 experts, top-2, normalised top-k probabilities, every layer sparse."""
    from tsync_mcore.model.tiny import make_tiny_checkpoint

    out = os.path.join(tiny_root, "qwen3_moe")
    if not os.path.exists(os.path.join(out, "config.json")):
        make_tiny_checkpoint(out, arch="qwen3_moe", seed=4)
    return out


@pytest.fixture(scope="session")
def tiny_ckpts(tiny_root) -> dict[str, str]:
    """All TINY_VARIANTS (tied ones included): name -> checkpoint dir."""
    return {name: _tiny(tiny_root, name) for name in TINY_VARIANTS}


@pytest.fixture(scope="module")
def parallel1():
    """Single-process torch.distributed + megatron state (TP=1), shared by a module's tests.

    Torn down after the module: a pytest worker left in a process group would make every
    vLLM engine a later file starts in process spawn its core instead of forking it
    (rollout/engine.py's start_method), and test_rollout's fork check skip."""
    from tsync_mcore.model.parallel import destroy_parallel, init_parallel

    yield init_parallel(tp_size=1)
    destroy_parallel()


@pytest.fixture(scope="session")
def golden(tiny_qwen2, tmp_path_factory) -> dict:
    """One clean live run, shared by every file that reads one (test_e2e, test_run_files,
    test_learner_metrics, test_multihost): the learner launcher under torchrun (2 ranks, 2
    updates, loggers console + jsonl + tensorboard) fed by test_e2e's scripted rollout.
    Returns the weights published per version, the run directory and the learner's stdout.
    Under xdist the first worker that needs it runs it and the others read it (a file lock
    in the run's shared temporary directory): one launch per `make test`, not one per worker."""
    from filelock import FileLock
    from safetensors.torch import load_file, save_file

    from tests.helpers.scripted import run_scripted
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "golden"
    with FileLock(f"{shared}.lock"):
        if not (shared / "done").exists():
            run = shared / "run"
            run.mkdir(parents=True, exist_ok=True)
            rc, out, err, published = run_scripted(
                tiny_qwen2, str(run), extra=["run.loggers=[console,jsonl,tensorboard]"])
            assert rc == 0, err[-4000:]
            for v, tensors in published.items():
                save_file(tensors, str(shared / f"published_v{v}.safetensors"))
            (shared / "out.txt").write_text(out)
            (shared / "done").touch()
    published = {int(p.stem.rsplit("_v", 1)[1]): load_file(str(p))
                 for p in shared.glob("published_v*.safetensors")}
    return dict(published=published, run=str(shared / "run"), out=(shared / "out.txt").read_text())
