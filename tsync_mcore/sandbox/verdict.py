"""Assert-style tests whose verdict the answer under test cannot fake.

An answer run in one process with its tests owns that process: it can shadow or patch any
name the tests use (`eval`, `repr`, `bool`, `sorted`, `math.isclose`), return objects whose
`__eq__` says yes, forge the program's report, exit early. So no expected value, no
comparison and no truth test ever runs there. `plan` reads the test code (top-level
asserts; HumanEval's `def check(candidate)` + `check(f)` inlined first) and cuts each
assert at the answer:

  - holes: the smallest pieces that need the answer — a chain rooted at one of its names
    (`f(x)`, `obj.m(1)[0]`, a name a setup line bound from it), widened through a
    builtin conversion (`sorted(f(x))`, `set(f(x))`, `len(...)`). Only the holes run in
    the answer's process (sandbox/harness.py, "solution" mode), after the setup lines they
    need and no other; each comes back as a plain value (`dump_value`), or fails — but a
    hole whose truth alone is tested (`assert m(x)`, `not m(x)`) may be any object: its
    `bool()` crosses (the answer decides it either way; which way passes stays here).
  - leaves: operands that are not literals (`sorted([3, 1])`, `math.isclose(f(x), 1.5)`
    with the hole's value bound in, `abs(f(x) - 0.5)`): run in a second sandboxed process
    that never loads the answer ("clean" mode), one per call for all tests.
  - the assert's own shape — `==`, `!=`, `<`, `in`, `is None`, chains, `not`, `and`/`or`,
    a bare truth test — is evaluated here (`judge`), on plain values only.

So a bare `assert f(x)` and `assert not f(x)` show the answer the same hole, and the
answer's report can only pass what its values pass. Test code that cannot be cut this way
is refused in one line (`TestCodeError`): an assert nested in a loop (but a `for` over a
literal sequence, a name bound once to one or a range of constants with only asserts in
its body is unrolled), branch, `with`, `try` or function other than HumanEval's check (it
would run in the answer's process), an operand that hands the answer's value to
`eval`/`exec`, a star import (it hides which names are the answer's), a hole that uses a
comprehension's or a lambda's variable. Setup lines (imports, assignments) all run before
the asserts, as before.
"""

from __future__ import annotations

import ast
import builtins
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tsync_mcore.sandbox import harness
from tsync_mcore.sandbox.harness import RESULTS, dump_value, parse_value

__all__ = ["HARNESS", "RESULTS", "Plan", "TestCodeError", "check", "harness_files", "judge",
           "plan", "read_results"]

_BUILTINS = frozenset(dir(builtins))
# builtin conversions a hole is widened through: they reveal nothing the test expects
_WRAPPERS = frozenset({"set", "frozenset", "sorted", "list", "tuple", "dict", "len", "abs",
                       "str", "int", "float", "bool", "min", "max", "sum", "any", "all",
                       "round", "repr", "callable", "isinstance"})
_HOLE = "__tsync_h"
_RUNS_CODE = frozenset({"eval", "exec", "compile", "__import__", "breakpoint"})
_OPS = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">",
        ast.GtE: ">=", ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not"}
_SINGLETONS = (None, True, False, ...)
with open(harness.__file__, encoding="utf-8") as _f:
    HARNESS = _f.read()  # the program every harness run executes


class TestCodeError(ValueError):
    """The test code cannot be judged outside the answer's process (one line, naming why)."""


Node = tuple  # ("lit", v) | ("hole", k) | ("leaf", j) | ("not", n) | ("and"|"or", [n]) |
#               ("cmp", [op], [n])


@dataclass(frozen=True)
class Plan:
    """One test: what runs with the answer, what runs without it, and what is decided here."""
    names: list[str]  # the answer's names the solution side uses
    solution_setup: list[str]
    holes: list[str]  # expressions evaluated in the answer's process
    clean_setup: list[str]
    leaves: list[str]  # expressions of the clean process (hole k bound as __tsync_h<k>)
    leaf_holes: list[list[int]]
    asserts: list[Node] = field(default_factory=list)
    truth: list[int] = field(default_factory=list)  # holes whose truth alone is tested

    def solution_spec(self, module: str | None = None) -> dict[str, Any]:
        return {"mode": "solution", "module": module, "names": self.names,
                "tests": [{"setup": self.solution_setup, "exprs": self.holes,
                           "truth": self.truth}]}


def plan(test_code: str) -> Plan:
    """The plan of assert-style test code (TestCodeError: it cannot be judged outside)."""
    try:
        tree = ast.parse(test_code)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise TestCodeError(f"test code does not parse ({type(e).__name__})") from None
    try:
        entries = {c.value.args[0].id for c in tree.body if _is_check_call(c)}
        return _Planner(_split_assigns(_unroll(_inline_checks(tree.body))), entries).plan()
    except RecursionError:
        raise TestCodeError("test code nests too deeply") from None


class _Planner:
    def __init__(self, body: list[ast.stmt], entries: set[str]):
        self.setup = [n for n in body if not isinstance(n, ast.Assert)]
        self.asserts = [n for n in body if isinstance(n, ast.Assert)]
        for node in self.setup:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Assert):
                    raise TestCodeError(
                        f"test code line {sub.lineno}: an assert inside "
                        f"{_kind(node)} would run in the answer's process; write it as a "
                        f"top-level assert")
                if isinstance(sub, ast.ImportFrom) and any(a.name == "*" for a in sub.names):
                    raise TestCodeError(f"test code line {sub.lineno}: `from {sub.module} "
                                        f"import *` hides which names are the answer's")
        if not self.asserts:
            raise TestCodeError("test code has no assert to check")
        self.binds = [_bound(n) for n in self.setup]
        self.loads = [_free(n) for n in self.setup]
        bound = set().union(*self.binds)
        used = set().union(*self.loads, *(_free(a.test) for a in self.asserts))
        # the answer's: what the test reads and does not bind, builtins aside (a builtin's
        # name is the harness's) unless it is the entry point handed to check()
        self.answer = (used - bound - _BUILTINS) | (entries & used)
        self.tainted = set(self.answer)  # names whose value depends on the answer
        self.dirty = [False] * len(self.setup)
        # values a line that runs the answer may have changed in place (`sort_it(lst)`
        # then `assert lst == [...]`); not modules: `math.isclose` stays the test's
        values = set().union(*(b for n, b in zip(self.setup, self.binds)
                               if not isinstance(n, (ast.Import, ast.ImportFrom))))
        changed = True
        while changed:
            changed = False
            for i, node in enumerate(self.setup):
                if not self.dirty[i] and self.loads[i] & self.tainted:
                    self.dirty[i] = changed = True
                    self.tainted |= self.binds[i] | (self.loads[i] & values)
        self.holes: list[ast.expr] = []
        self.truth: set[int] = set()
        self.leaves: list[str] = []
        self.leaf_holes: list[list[int]] = []

    def plan(self) -> Plan:
        trees = [self._tree(a.test) for a in self.asserts]
        need = set().union(*(_free(h) for h in self.holes)) if self.holes else set()
        # the answer's side: setup lines that need it, bind what a hole needs, or bind
        # nothing (side effects: a seed); never a line that only binds expected values
        keep, grew = set(), True
        while grew:
            grew = False
            for i in range(len(self.setup)):
                if i not in keep and (self.dirty[i] or not self.binds[i] or
                                      self.binds[i] & need):
                    keep.add(i)
                    need |= self.loads[i]
                    grew = True
        sol = [ast.unparse(self.setup[i]) for i in sorted(keep)]
        clean = [ast.unparse(n) for i, n in enumerate(self.setup) if not self.dirty[i]]
        names = sorted(self.answer & need)
        return Plan(names, sol, [ast.unparse(h) for h in self.holes], clean if self.leaves
                    else [], self.leaves, self.leaf_holes, trees, sorted(self.truth))

    def _tree(self, e: ast.expr) -> Node:
        if isinstance(e, ast.BoolOp):
            return ("and" if isinstance(e.op, ast.And) else "or",
                    [self._tree(v) for v in e.values])
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
            return ("not", self._tree(e.operand))
        if isinstance(e, ast.Compare) and all(type(op) in _OPS for op in e.ops):
            sides = [e.left, *e.comparators]
            identity_ok = all(
                not isinstance(op, (ast.Is, ast.IsNot)) or _singleton(a) or _singleton(b)
                for op, a, b in zip(e.ops, sides, sides[1:]))
            if identity_ok:  # `x is y` of two computed values is no value comparison
                return ("cmp", [_OPS[type(op)] for op in e.ops],
                        [self._operand(s) for s in sides])
        node = self._operand(e)
        if node[0] == "hole":  # only its truth is tested: `assert f(x)`, `not f(x)`
            self.truth.add(node[1])
        return node

    def _operand(self, e: ast.expr) -> Node:
        try:
            return ("lit", ast.literal_eval(e))
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            pass
        first = len(self.holes)
        cut = _Cut(self).visit(_copy(e))
        mine = list(range(first, len(self.holes)))
        local = _scoped(e)
        for k in mine:
            if _free(self.holes[k]) & local:
                raise TestCodeError(
                    f"test code line {e.lineno}: `{ast.unparse(self.holes[k])}` uses a name "
                    f"bound inside the assert (a comprehension or lambda); it cannot be "
                    f"evaluated apart from the test")
        if isinstance(cut, ast.Name) and cut.id == f"{_HOLE}{first}" and len(mine) == 1:
            return ("hole", first)
        if mine and _free(cut) & _RUNS_CODE:
            raise TestCodeError(
                f"test code line {e.lineno}: `{ast.unparse(e)}` would run the answer's value "
                f"as code outside its process")
        self.leaves.append(ast.unparse(cut))
        self.leaf_holes.append(mine)
        return ("leaf", len(self.leaves) - 1)


class _Cut(ast.NodeTransformer):
    """Each hole replaced by the name `__tsync_h<k>` (its expression kept by the planner)."""

    def __init__(self, p: _Planner):
        self.p = p

    def _hole(self, node: ast.expr) -> ast.Name:
        self.p.holes.append(node)
        return ast.Name(f"{_HOLE}{len(self.p.holes) - 1}", ast.Load())

    def _builtin(self, n: ast.AST) -> bool:  # `int` in isinstance(f(x), int)
        return isinstance(n, ast.Name) and n.id in _BUILTINS and n.id not in self.p.tainted \
            and not any(n.id in b for b in self.p.binds)

    def _is_hole_name(self, n: ast.AST) -> int | None:
        if isinstance(n, ast.Name) and n.id.startswith(_HOLE):
            return int(n.id[len(_HOLE):])
        return None

    def visit(self, node: ast.AST) -> ast.AST:
        if isinstance(node, (ast.Name, ast.Attribute, ast.Subscript, ast.Call)):
            root = node
            while isinstance(root, (ast.Call, ast.Attribute, ast.Subscript)):
                root = root.func if isinstance(root, ast.Call) else root.value
            if isinstance(root, ast.Name) and root.id in self.p.tainted:
                return self._hole(node)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in _WRAPPERS and node.func.id not in self.p.tainted \
                    and not any(node.func.id in b for b in self.p.binds) \
                    and node.args and not node.keywords \
                    and all(isinstance(a, ast.Constant) or self._builtin(a)
                            for a in node.args[1:]):
                inner = self.visit(node.args[0])
                k = self._is_hole_name(inner)
                if k is not None and k == len(self.p.holes) - 1:  # widen: f(x) -> set(f(x))
                    self.p.holes[k] = ast.Call(node.func, [self.p.holes[k], *node.args[1:]], [])
                    return inner
                node.args[0] = inner
                return node
        return self.generic_visit(node)


def _copy(e: ast.expr) -> ast.expr:
    return ast.parse(ast.unparse(e), mode="eval").body


def _singleton(e: ast.expr) -> bool:
    return isinstance(e, ast.Constant) and any(e.value is s for s in _SINGLETONS)


def _kind(node: ast.stmt) -> str:
    names = {ast.For: "a for loop", ast.AsyncFor: "a for loop", ast.While: "a while loop",
             ast.If: "an if", ast.With: "a with", ast.Try: "a try",
             ast.FunctionDef: "a function", ast.AsyncFunctionDef: "a function",
             ast.ClassDef: "a class"}
    return names.get(type(node), f"a {type(node).__name__}")


def _bound(node: ast.AST) -> set[str]:
    """Names a top-level statement binds (assignment and loop targets, imports, defs)."""
    out: set[str] = set()
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)):
            out.add(sub.id)
        elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(sub.name)
        elif isinstance(sub, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in sub.names}
    return out - _scoped(node)


def _scoped(node: ast.AST) -> set[str]:
    """Names bound inside a function, lambda or comprehension of `node` (not at its level)."""
    out: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = sub.args
            out |= {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs,
                                    *([a.vararg] if a.vararg else []),
                                    *([a.kwarg] if a.kwarg else [])]}
            body = sub.body if isinstance(sub.body, list) else [sub.body]
            for st in body:
                out |= {n.id for n in ast.walk(st)
                        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        elif isinstance(sub, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            for g in sub.generators:
                out |= {n.id for n in ast.walk(g.target) if isinstance(n, ast.Name)}
    return out


def _free(node: ast.AST) -> set[str]:
    """Names `node` reads that it does not bind itself (an over-approximation)."""
    loads = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)
             and isinstance(n.ctx, ast.Load)}
    return loads - _scoped(node)


def _reparse(st: ast.stmt) -> ast.stmt:
    """A fresh copy of `st` that keeps its line numbers (for the messages)."""
    copy = ast.parse(ast.unparse(st)).body[0]
    return ast.increment_lineno(copy, st.lineno - 1)


def _is_check_call(node: ast.stmt) -> bool:
    """`check(NAME)`: HumanEval's call of its check function with the entry point."""
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) \
        and isinstance(node.value.func, ast.Name) and len(node.value.args) == 1 \
        and not node.value.keywords and isinstance(node.value.args[0], ast.Name)


def _unroll(body: list[ast.stmt], most: int = 1000) -> list[ast.stmt]:
    """`for x, y in [(1, 2), (3, 4)]: assert f(x) == y` (a literal sequence, a name bound
    once to one, or a range of constants; asserts only in the body) as one top-level
    assert per item."""
    counts: dict[str, int] = {}
    for node in body:
        for name in _bound(node):
            counts[name] = counts.get(name, 0) + 1
    consts = {n.targets[0].id: n.value for n in body if isinstance(n, ast.Assign)
              and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
              and counts.get(n.targets[0].id) == 1}
    out: list[ast.stmt] = []
    for node in body:
        items = _loop_items(node, most, consts) if isinstance(node, ast.For) else None
        if items is None:
            out.append(node)
            continue
        for item in items:
            names = _bind_target(node.target, item)
            if names is None:
                out.append(node)  # a target that does not unpack: left whole (refused)
                break
            for st in node.body:
                copy = _reparse(st)
                for name, value in names.items():
                    copy = _Substitute(name, ast.parse(repr(value), mode="eval").body
                                       ).visit(copy)
                out.append(ast.fix_missing_locations(ast.copy_location(copy, st)))
    return out


def _loop_items(node: ast.For, most: int, consts: dict[str, ast.expr]) -> list[Any] | None:
    if node.orelse or not node.body or not all(isinstance(s, ast.Assert) for s in node.body):
        return None
    it = node.iter
    if isinstance(it, ast.Name) and it.id in consts:
        it = consts[it.id]
    try:
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) \
                and it.func.id == "range" and not it.keywords:
            args = [ast.literal_eval(a) for a in it.args]
            if not all(type(a) is int for a in args) or not 1 <= len(args) <= 3:
                return None
            r = range(*args)
            return list(r) if len(r) <= most else None
        items = ast.literal_eval(it)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None
    if not isinstance(items, (list, tuple)) or len(items) > most:
        return None
    try:
        return items if all(ast.literal_eval(repr(x)) == x for x in items) else None
    except (ValueError, SyntaxError, RecursionError, MemoryError):
        return None


def _bind_target(target: ast.expr, item: Any) -> dict[str, Any] | None:
    if isinstance(target, ast.Name):
        return {target.id: item}
    if isinstance(target, (ast.Tuple, ast.List)) and isinstance(item, (list, tuple)) \
            and len(item) == len(target.elts):
        out: dict[str, Any] = {}
        for t, x in zip(target.elts, item):
            sub = _bind_target(t, x)
            if sub is None:
                return None
            out.update(sub)
        return out
    return None


def _split_assigns(body: list[ast.stmt]) -> list[ast.stmt]:
    """`x, want = 3, 9` as `x = 3` and `want = 9`: a hole that needs x does not carry the
    expected value into the answer's process (when no value reads a target)."""
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], (ast.Tuple, ast.List)) \
                and isinstance(node.value, (ast.Tuple, ast.List)) \
                and len(node.targets[0].elts) == len(node.value.elts) \
                and all(isinstance(t, ast.Name) for t in node.targets[0].elts) \
                and not {t.id for t in node.targets[0].elts} & _free(node.value):
            out += [ast.fix_missing_locations(ast.copy_location(ast.Assign([t], v), node))
                    for t, v in zip(node.targets[0].elts, node.value.elts)]
        else:
            out.append(node)
    return out


def _inline_checks(body: list[ast.stmt]) -> list[ast.stmt]:
    """HumanEval's layout, `def check(candidate): assert candidate(..) == ..` then
    `check(f)`: the check's statements at top level with `candidate` replaced by `f`."""
    defs = {n.name: n for n in body if isinstance(n, ast.FunctionDef)
            and len(n.args.args) == 1 and not n.args.vararg and not n.args.kwarg}
    out: list[ast.stmt] = []
    for node in body:
        call = node.value if isinstance(node, ast.Expr) else None
        if isinstance(node, ast.FunctionDef) and node.name in defs:
            continue  # inlined where it is called (or dropped: never called)
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) \
                and call.func.id in defs and len(call.args) == 1 and not call.keywords:
            fn = defs[call.func.id]
            sub = _Substitute(fn.args.args[0].arg, call.args[0])
            out += [ast.fix_missing_locations(sub.visit(_reparse(st))) for st in fn.body]
            continue
        out.append(node)
    return out


class _Substitute(ast.NodeTransformer):
    """Every use of the name `param` replaced by the expression `arg`."""

    def __init__(self, param: str, arg: ast.expr):
        self.param, self.arg = param, arg

    def visit_Name(self, n: ast.Name) -> ast.AST:
        return ast.copy_location(self.arg, n) if n.id == self.param else n


# --- reading and deciding -----------------------------------------------------------------

Value = tuple[bool, Any]  # (produced, the plain value)


def read_results(stdout: str | None, counts: list[int]) -> list[list[Value]] | None:
    """The values of a harness run, from its last RESULTS line: per test, per expression
    (False, None) where it failed; None where the line is missing or malformed (the answer
    did not load, exited early, or the run was cut)."""
    rows: Any = None
    for line in reversed((stdout or "").splitlines()):
        if line.startswith(RESULTS):
            try:
                rows = json.loads(line[len(RESULTS):])
            except (ValueError, RecursionError):
                rows = None
            break
    if not isinstance(rows, list) or [len(r) if isinstance(r, list) else -1
                                      for r in rows] != counts:
        return None
    out: list[list[Value]] = [[(False, None)] * n for n in counts]
    for t, row in enumerate(rows):
        for j, cell in enumerate(row):
            if isinstance(cell, dict) and set(cell) == {"v"}:
                try:
                    out[t][j] = (True, parse_value(cell["v"]))
                except ValueError:
                    pass
    return out


def clean_spec(plans: list[Plan], holes: list[list[Value] | None]) -> dict[str, Any] | None:
    """The clean process's spec for the tests with leaves whose answer reported, or None
    when there is none."""
    tests = []
    for p, hv in zip(plans, holes):
        if not p.leaves or hv is None:
            continue
        binds = {f"{_HOLE}{k}": dump_value(hv[k][1]) for k in range(len(p.holes)) if hv[k][0]}
        exprs = [e if all(hv[k][0] for k in ks) else "1/0"  # fails there as here
                 for e, ks in zip(p.leaves, p.leaf_holes)]
        tests.append({"setup": p.clean_setup, "exprs": exprs, "binds": binds})
    return {"mode": "clean", "tests": tests} if tests else None


def harness_files(spec: dict[str, Any], answer: str | None = None) -> dict[str, str]:
    """The files of a harness run beside its program (`HARNESS`): the spec, and in
    "solution" mode the answer's code as solution.py (None: a module of the work dir)."""
    files = {"spec.json": json.dumps(spec)}
    if spec["mode"] == "solution" and answer is not None:
        files["solution.py"] = answer
    return files


def check(plans: list[Plan], run: Callable[[dict[str, Any]], str | None],
          module: str | None = None) -> list[bool]:
    """Which tests pass. `run(spec)` runs `HARNESS` in a fresh sandbox with
    `harness_files(spec, ...)` and returns its stdout, or None when it could not run (out
    of time). The answer is solution.py, or `module` importable from the work directory.
    A test passes only when the answer loaded and reported, even a test with no hole."""
    holes: list[list[Value] | None] = []
    for p in plans:
        got = read_results(run(p.solution_spec(module)), [len(p.holes)])
        holes.append(got[0] if got else None)
    leaves: list[list[Value]] = [[] for _ in plans]
    spec = clean_spec(plans, holes)
    if spec is not None:
        counts = [len(t["exprs"]) for t in spec["tests"]]
        got = read_results(run(spec), counts) or [[(False, None)] * n for n in counts]
        it = iter(got)
        leaves = [next(it) if p.leaves and h is not None else [] for p, h in zip(plans, holes)]
    return [h is not None and judge(p, h, lv) for p, h, lv in zip(plans, holes, leaves)]


class _Fail(Exception):
    pass


def judge(p: Plan, holes: list[Value], leaves: list[Value]) -> bool:
    """Whether every assert of the plan holds, given its holes' and leaves' values."""
    try:
        return all(_truth(_eval(t, holes, leaves)) for t in p.asserts)
    except (_Fail, TypeError, ValueError, ArithmeticError, RecursionError, MemoryError):
        return False


def _eval(n: Node, holes: list[Value], leaves: list[Value]) -> Any:
    kind = n[0]
    if kind == "lit":
        return n[1]
    if kind in ("hole", "leaf"):
        ok, v = (holes if kind == "hole" else leaves)[n[1]] if n[1] < len(
            holes if kind == "hole" else leaves) else (False, None)
        if not ok:
            raise _Fail
        return v
    if kind == "not":
        return not _truth(_eval(n[1], holes, leaves))
    if kind in ("and", "or"):
        v = None
        for sub in n[1]:  # Python's short circuit: a value not reached is not needed
            v = _eval(sub, holes, leaves)
            if _truth(v) == (kind == "or"):
                return v
        return v
    ops, sides = n[1], n[2]
    left = _eval(sides[0], holes, leaves)
    for op, side in zip(ops, sides[1:]):
        right = _eval(side, holes, leaves)
        if not _compare(op, left, right):
            return False
        left = right
    return True


def _truth(v: Any) -> bool:
    return bool(v)  # a plain value's: no code of the answer's runs here


def _compare(op: str, a: Any, b: Any) -> bool:
    if op == "==":
        # True == 1 in Python: an answer reporting True for every hole passes no `== 1`
        return _has_bool(a) == _has_bool(b) and bool(a == b)
    if op == "!=":
        return bool(a != b)
    if op == "is":
        return a is b
    if op == "is not":
        return a is not b
    return bool({"<": lambda: a < b, "<=": lambda: a <= b, ">": lambda: a > b,
                 ">=": lambda: a >= b, "in": lambda: a in b,
                 "not in": lambda: a not in b}[op]())


def _has_bool(x: Any) -> bool:
    if isinstance(x, bool):
        return True
    if isinstance(x, (list, tuple, set, frozenset)):
        return any(_has_bool(v) for v in x)
    if isinstance(x, dict):
        return any(_has_bool(k) or _has_bool(v) for k, v in x.items())
    return False
