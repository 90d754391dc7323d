"""The package's shape: imports point down the layer list, no import cycles, the kernels
never answer to `triton_kernels`, and docs/design/code-map.md is current."""

from __future__ import annotations

import ast
import os

import pytest

from tests.helpers.paths import ROOT
from tsync_mcore import LAYERS  # bottom to top: each may import those before it only
from tsync_mcore.cli import codemap

PKG = os.path.join(ROOT, "tsync_mcore")


def _modules() -> dict[str, str]:
    out = {}
    for dp, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dp, f)
                mod = os.path.relpath(path[:-3], ROOT).replace(os.sep, ".")
                out[mod.removesuffix(".__init__")] = path
    return out


def _imports(path: str, mod: str, top_level_only: bool) -> set[str]:
    """tsync_mcore modules `mod` imports (with `from X import y`, X.y when it is a module)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # also the bodies of module-level if/try (TYPE_CHECKING excluded)
        extra = []
        for n in tree.body:
            if isinstance(n, ast.Try):
                extra += n.body
            elif isinstance(n, ast.If) and "TYPE_CHECKING" not in ast.unparse(n.test):
                extra += n.body
        nodes = nodes + extra
    found = set()
    for n in nodes:
        if isinstance(n, ast.Import):
            found |= {a.name for a in n.names if a.name.startswith("tsync_mcore")}
        elif isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("tsync_mcore"):
            found.add(n.module)
            found |= {f"{n.module}.{a.name}" for a in n.names}
    return found


def _package(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_top_level_entry_is_a_layered_package():
    entries = sorted(e for e in os.listdir(PKG) if e not in ("__init__.py", "__pycache__"))
    assert entries == sorted(LAYERS), "top level of tsync_mcore/ and LAYERS differ"
    for e in entries:
        init = os.path.join(PKG, e, "__init__.py")
        assert os.path.isfile(init), f"{e} is not a package"
        doc = ast.get_docstring(ast.parse(open(init, encoding="utf-8").read()))
        assert doc and len(doc) > 40, f"tsync_mcore/{e}/__init__.py has no docstring saying what it owns"


def test_imports_point_down_the_layers():
    mods = _modules()
    upward = []
    for mod, path in mods.items():
        me = _package(mod)
        if me is None:
            continue
        for target in _imports(path, mod, top_level_only=False):
            other = _package(target)
            if other in LAYERS and LAYERS.index(other) > LAYERS.index(me):
                upward.append(f"{mod} imports {target}")
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    """Among module-level imports (lazy imports inside functions may point sideways)."""
    mods = _modules()
    graph = {m: {t for t in _imports(p, m, top_level_only=True) if t in mods and t != m}
             for m, p in mods.items()}
    # a package's __init__ imported by its own modules is not a cycle of code; drop the edge
    # from an __init__ to its children so `pkg -> pkg.a -> pkg` (re-exports) does not count
    for m in graph:
        graph[m] = {t for t in graph[m] if not t.startswith(m + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (c := visit(t)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_nothing_answers_to_triton_kernels_from_the_repo_root(monkeypatch):
    """vLLM probes for OpenAI Triton's `triton_kernels`; a folder of ours by that name on
    sys.path (the repository root is, where `make test` and `python -m` run) would be found
    as a namespace package."""
    import importlib
    import importlib.util

    monkeypatch.syspath_prepend(ROOT)
    importlib.invalidate_caches()
    spec = importlib.util.find_spec("triton_kernels")
    assert spec is None or (spec.origin and "site-packages" in spec.origin), spec


def test_code_map_is_current():
    """docs/design/code-map.md is generated from the packages' docstrings."""
    assert codemap.main(["--check"]) == 0, "run python -m tsync_mcore.cli.codemap"
