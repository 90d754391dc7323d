"""The package's shape: imports point down the layer list; no import cycle, counting the
imports inside functions; no `_private` name taken from another module; no file in
tsync_mcore/ over 800 lines; no `sys.path` edits; the kernels never answer to
`triton_kernels`; docs/design/code-map.md is current."""

from __future__ import annotations

import ast
import functools
import importlib.machinery
import os

import pytest

from tests.helpers.paths import ROOT
from tsync_mcore import LAYERS  # bottom to top: each may import those before it only
from tsync_mcore.cli import codemap

PKG = os.path.join(ROOT, "tsync_mcore")
MAX_LINES = 800
# the repository's own Python: the package, the benchmarks, the launchers, the tests
OUR_PYTHON = ("tsync_mcore", "perf", "launch", "tests")


def _walk(top: str, suffix: str = ".py"):
    for dp, dirs, files in os.walk(top):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            if f.endswith(suffix):
                yield os.path.join(dp, f)


@functools.cache
def _modules() -> dict[str, str]:
    out = {}
    for path in _walk(PKG):
        mod = os.path.relpath(path[:-3], ROOT).replace(os.sep, ".")
        out[mod.removesuffix(".__init__")] = path
    return out


@functools.cache
def _tree(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _source(node: ast.ImportFrom, mod: str, path: str) -> str:
    """The module a `from ... import` reads, a relative one resolved against `mod`."""
    if not node.level:
        return node.module or ""
    base = mod.split(".") if path.endswith("__init__.py") else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


_TYPE_CHECKING = (["TYPE_CHECKING"], ["typing", "TYPE_CHECKING"])


def _dotted(node: ast.AST) -> list[str] | None:
    """`a.b.c` as ["a", "b", "c"]; None for anything but a name and its attributes."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _import_nodes(tree: ast.Module, typing: bool):
    """Every import statement of the module: top level, in classes, inside functions. Without
    `typing`, those under `if TYPE_CHECKING:` (never run) are left out."""
    todo: list[ast.AST] = [tree]
    while todo:
        n = todo.pop()
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            yield n
        elif isinstance(n, ast.If) and not typing and _dotted(n.test) in _TYPE_CHECKING:
            todo.extend(n.orelse)
        else:
            todo.extend(ast.iter_child_nodes(n))


def _imports(mod: str, typing: bool = True) -> set[str]:
    path = _modules()[mod]
    return _imports_in(mod, path, _tree(path), typing)


def _imports_in(mod: str, path: str, tree: ast.Module, typing: bool) -> set[str]:
    """tsync_mcore modules `mod` imports anywhere in its file (with `from X import y`, X.y
    too, which is a module when y is one)."""
    found = set()
    for n in _import_nodes(tree, typing):
        if isinstance(n, ast.Import):
            found |= {a.name for a in n.names if a.name.startswith("tsync_mcore")}
        else:
            src = _source(n, mod, path)
            if src.startswith("tsync_mcore"):
                found.add(src)
                found |= {f"{src}.{a.name}" for a in n.names}
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
        doc = ast.get_docstring(_tree(init))
        assert doc and len(doc) > 40, f"tsync_mcore/{e}/__init__.py has no docstring saying what it owns"


def test_imports_point_down_the_layers():
    upward = []
    for mod in _modules():
        me = _package(mod)
        if me is None:
            continue
        for target in _imports(mod):
            other = _package(target)
            if other in LAYERS and LAYERS.index(other) > LAYERS.index(me):
                upward.append(f"{mod} imports {target}")
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def _import_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports when run: at top level or inside a function (a lazy
    import that closes a circle still ties the two modules into one)."""
    mods = _modules()
    graph = {m: {t for t in _imports(m, typing=False) if t in mods and t != m} for m in mods}
    # a package's __init__ imported by its own modules is not a cycle of code; drop the edge
    # from an __init__ to its children so `pkg -> pkg.a -> pkg` (re-exports) does not count
    return {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the path, 2 done
    for root in sorted(graph):
        if root in state:
            continue
        path, todo = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while todo:
            t = next(todo[-1], None)
            if t is None:
                state[path.pop()] = 2
                todo.pop()
            elif state.get(t) == 1:
                return path[path.index(t):] + [t]
            elif t not in state:
                state[t] = 1
                path.append(t)
                todo.append(iter(sorted(graph[t])))
    return None


def test_cycle_finder_sees_a_lazy_import_circle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    # imports inside functions, relative ones, a submodule taken with `from . import`
    session = ast.parse("import json\n\ndef seed():\n    from ..loop import _turn_seed\n"
                        "    from . import server\n")
    found = _imports_in("tsync_mcore.rollout.openai.session",
                        "tsync_mcore/rollout/openai/session.py", session, typing=False)
    assert found == {"tsync_mcore.rollout.loop", "tsync_mcore.rollout.loop._turn_seed",
                     "tsync_mcore.rollout.openai", "tsync_mcore.rollout.openai.server"}
    loop = ast.parse("class Loop:\n    def run(self):\n"
                     "        from tsync_mcore.rollout.openai.session import Session\n")
    graph = {"tsync_mcore.rollout.loop": _imports_in(
                 "tsync_mcore.rollout.loop", "tsync_mcore/rollout/loop.py", loop, typing=False),
             "tsync_mcore.rollout.openai.session": found}
    graph = {m: {t for t in ts if t in graph} for m, ts in graph.items()}
    assert _find_cycle(graph) == ["tsync_mcore.rollout.loop", "tsync_mcore.rollout.openai.session",
                                  "tsync_mcore.rollout.loop"]
    # `if TYPE_CHECKING:` never runs; `if not TYPE_CHECKING:` does
    hidden = ast.parse("import typing\nif typing.TYPE_CHECKING:\n    import a\n"
                       "else:\n    import b\nif not TYPE_CHECKING:\n    import c\n")
    names = [a.name for n in _import_nodes(hidden, typing=False) for a in n.names]
    assert sorted(names) == ["b", "c", "typing"]


def test_no_import_cycles():
    """Among all imports that run, module-level and inside functions (`TYPE_CHECKING` ones
    never run and are left out)."""
    if cycle := _find_cycle(_import_graph()):
        pytest.fail("import cycle: " + " -> ".join(cycle))


def _module_names(mod: str, path: str, tree: ast.Module, mods) -> dict[str, str]:
    """Names bound in `mod`'s file to tsync_mcore modules -> the module (`import a.b as c`,
    `from a import b` with a.b a module; plain `import a.b` binds `a`)."""
    names = {}
    for n in _import_nodes(tree, typing=True):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name.startswith("tsync_mcore"):
                    names[a.asname or "tsync_mcore"] = a.name if a.asname else "tsync_mcore"
        else:
            src = _source(n, mod, path)
            for a in n.names:
                if f"{src}.{a.name}" in mods:
                    names[a.asname or a.name] = f"{src}.{a.name}"
    return names


def _private_uses(mod: str, path: str, tree: ast.Module, mods) -> list[str]:
    """`from X import _y`, and `X._y` through a name bound to module X, for X another
    tsync_mcore module."""
    out = []
    for n in _import_nodes(tree, typing=True):
        if isinstance(n, ast.ImportFrom):
            src = _source(n, mod, path)
            if src.startswith("tsync_mcore") and src != mod:
                out += [f"{mod}:{n.lineno} imports {src}.{a.name}" for a in n.names
                        if _is_private(a.name)]
    bound = _module_names(mod, path, tree, mods)
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and _is_private(n.attr):
            parts = _dotted(n.value)
            if parts and parts[0] in bound:
                owner = ".".join([bound[parts[0]], *parts[1:]])
                if owner in mods and owner != mod:
                    out.append(f"{mod}:{n.lineno} uses {owner}.{n.attr}")
    return out


def test_private_use_finder():
    mods = {"tsync_mcore.model", "tsync_mcore.model.span", "tsync_mcore.model.packed",
            "tsync_mcore.model.bridge", "tsync_mcore.model.bridge.weights"}
    src = ("import tsync_mcore.model.bridge.weights as w\n"
           "from .span import _check, span_mask\n"
           "def f():\n    from tsync_mcore.model import bridge, span\n"
           "    span._hidden(); bridge.weights._rule(); w._to_local(); span_mask._x\n"
           "    self._own()\n")
    found = _private_uses("tsync_mcore.model.packed", "tsync_mcore/model/packed.py",
                          ast.parse(src), mods)
    me = "tsync_mcore.model.packed"
    assert sorted(found) == [f"{me}:2 imports tsync_mcore.model.span._check",
                             f"{me}:5 uses tsync_mcore.model.bridge.weights._rule",
                             f"{me}:5 uses tsync_mcore.model.bridge.weights._to_local",
                             f"{me}:5 uses tsync_mcore.model.span._hidden"]


def test_no_private_names_across_modules():
    """A name with a leading underscore belongs to its module: another module that needs it
    gets a public name (or the code moves)."""
    mods = _modules()
    found = [f for mod, path in sorted(mods.items())
             for f in _private_uses(mod, path, _tree(path), mods)]
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_no_file_over_800_lines():
    long = []
    for path in _walk(PKG, suffix=""):
        with open(path, "rb") as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES:
            long.append(f"{os.path.relpath(path, ROOT)}: {n} lines")
    assert not long, f"files over {MAX_LINES} lines:\n" + "\n".join(long)


_SYS_PATH_READS = {"index", "count", "copy", "__contains__", "__iter__", "__len__"}


def _sys_path_edits(tree: ast.Module) -> list[int]:
    """Lines that change `sys.path` (a method call other than a read, an assignment, `+=`,
    `del`) or call `site.addsitedir`. Code is read from the AST, so a program held in a
    string (one written into a sandbox for a task's tests) is not ours and is not seen."""
    def is_sys_path(n: ast.AST) -> bool:
        if isinstance(n, ast.Subscript):
            n = n.value
        return _dotted(n) == ["sys", "path"]

    lines = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            if (is_sys_path(n.func.value) and n.func.attr not in _SYS_PATH_READS
                    or _dotted(n.func) == ["site", "addsitedir"]):
                lines.append(n.lineno)
        elif isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = n.targets if isinstance(n, (ast.Assign, ast.Delete)) else [n.target]
            if any(is_sys_path(t) for t in targets):
                lines.append(n.lineno)
        elif isinstance(n, ast.ImportFrom) and n.module == "sys" and any(
                a.name == "path" for a in n.names):
            lines.append(n.lineno)  # a bare `path` bound to sys.path hides later edits
    return sorted(lines)


def test_sys_path_edit_finder():
    src = ("import sys, site\nsys.path.insert(0, 'x')\nsys.path[:] = []\nsys.path += ['y']\n"
           "del sys.path[0]\nsite.addsitedir('z')\nsys.path = ['w']\n"
           "i = sys.path.index('x')\n"
           "prog = 'import sys\\nsys.path.insert(0, \"/sandbox\")\\n'\n")
    assert _sys_path_edits(ast.parse(src)) == [2, 3, 4, 5, 6, 7]


def test_no_sys_path_edits():
    """Our modules import each other as installed (or from the checkout's root, which pytest
    and `python -m` put on the path): none of them rewrites the import path. (pytest's
    `monkeypatch.syspath_prepend`, undone after its test, is how a test imports a user's
    module from a temporary directory; it is not a `sys.path` edit of ours.)"""
    edits = []
    for top in OUR_PYTHON:
        for path in _walk(os.path.join(ROOT, top)):
            rel = os.path.relpath(path, ROOT)
            edits += [f"{rel}:{line}" for line in _sys_path_edits(_tree(path))]
    assert not edits, "sys.path edited at:\n" + "\n".join(sorted(edits))


def test_nothing_answers_to_triton_kernels_from_the_repo_root():
    """vLLM probes for OpenAI Triton's `triton_kernels`; a folder of ours by that name at the
    repository root (on the path where `make test` and `python -m` run) would be found as a
    namespace package."""
    assert importlib.machinery.PathFinder.find_spec("triton_kernels", [ROOT]) is None


def test_code_map_is_current():
    """docs/design/code-map.md is generated from the packages' docstrings."""
    assert codemap.main(["--check"]) == 0, "run python -m tsync_mcore.cli.codemap"
