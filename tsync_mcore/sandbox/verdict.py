"""Assert-style tests whose verdict the answer under test cannot fake.

A test such as `assert f(3) == 9` run in the answer's own process can be fooled: the answer
can read a pass marker from the program (`sys.argv[0]`, a frame), install an excepthook,
`os._exit(0)` early, or patch builtins. So the expected values never reach that process.
`split` parses the test code: each `assert LEFT == RIGHT` with a literal RIGHT becomes a
probe LEFT, its expected value kept here; `assert EXPR` a probe `bool(EXPR)` expected True;
other statements (imports, assignments) are setup run before the probes; HumanEval's
`def check(candidate): ...` + `check(f)` is inlined first. `probe_program`
is what the sandbox runs: the answer's code, the setup, then each probe's value as `repr`,
on one last stdout line after RESULTS. `decide` reads that line here, in the verifier's
process, and compares each value (parsed with `ast.literal_eval`, never executed) with its
expectation. An answer that exits early, crashes, or prints lines of its own passes only
the probes whose values it produced — which it can only do by computing them.

A RIGHT that is not a literal (`assert f(x) == g(x)`) cannot be kept out of the answer's
process: both sides are probed there and compared here, so such a test is only as strong as
the answer's honesty (`Probe.literal` is False; `split` callers may refuse them).
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from typing import Any

RESULTS = "@@tsync-probe-results@@ "  # starts the probe program's last stdout line


class TestCodeError(ValueError):
    """The test code cannot be split into probes (one line, naming why)."""


@dataclass(frozen=True)
class Probe:
    left: str  # an expression evaluated in the answer's process
    right: str | None  # None: compare with `expected`; else a second expression probed too
    expected: Any = True
    literal: bool = True  # the expectation never reaches the answer's process


def split(test_code: str) -> tuple[str, list[Probe]]:
    """(setup code, probes) of assert-style test code."""
    try:
        tree = ast.parse(test_code)
    except (SyntaxError, ValueError, RecursionError) as e:
        raise TestCodeError(f"test code does not parse ({type(e).__name__})") from None
    setup, probes = [], []
    for node in _inline_checks(tree.body):
        if not isinstance(node, ast.Assert):
            setup.append(ast.unparse(node))
            continue
        t = node.test
        if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq):
            left, right = ast.unparse(t.left), t.comparators[0]
            try:
                probes.append(Probe(left, None, ast.literal_eval(right)))
            except (ValueError, TypeError, SyntaxError, RecursionError):
                probes.append(Probe(left, ast.unparse(right), None, literal=False))
        else:
            probes.append(Probe(f"bool({ast.unparse(t)})", None, True))
    if not probes:
        raise TestCodeError("test code has no assert to check")
    return "\n".join(setup), probes


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
            out += [ast.fix_missing_locations(sub.visit(ast.parse(ast.unparse(st)).body[0]))
                    for st in fn.body]
            continue
        out.append(node)
    return out


class _Substitute(ast.NodeTransformer):
    """Every use of the name `param` replaced by the expression `arg`."""

    def __init__(self, param: str, arg: ast.expr):
        self.param, self.arg = param, arg

    def visit_Name(self, n: ast.Name) -> ast.AST:
        return ast.copy_location(self.arg, n) if n.id == self.param else n


def probe_program(answer: str, setup: str, probes: list[Probe]) -> str:
    """The program the sandbox runs: the answer, the setup, then each probe's value."""
    exprs = [(p.left, p.right) for p in probes]
    return (f"{answer}\n\n{setup}\n\n"
            "def __tsync_probe():\n"
            "    import json as _j, os as _o\n"
            "    _rows = []\n"
            f"    for _l, _r in {exprs!r}:\n"
            "        _row = {}\n"
            "        for _k, _e in (('left', _l), ('right', _r)):\n"
            "            if _e is None:\n"
            "                continue\n"
            "            try:\n"
            "                _row[_k] = repr(eval(_e, globals()))\n"
            "            except BaseException as _x:\n"
            "                _row['error'] = type(_x).__name__\n"
            "        _rows.append(_row)\n"
            f"    _o.write(1, ('\\n' + {RESULTS!r} + _j.dumps(_rows) + '\\n').encode())\n"
            "__tsync_probe()\n")


def decide(stdout: str, probes: list[Probe]) -> list[bool]:
    """Which probes passed, from the program's stdout: its last RESULTS line (none, or a
    malformed one: every probe failed)."""
    rows: Any = []
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULTS):
            try:
                rows = json.loads(line[len(RESULTS):])
            except (ValueError, RecursionError):
                rows = []
            break
    if not isinstance(rows, list) or len(rows) != len(probes):
        return [False] * len(probes)
    return [isinstance(r, dict) and _passed(p, r) for p, r in zip(probes, rows)]


def _value(text: Any) -> tuple[bool, Any]:
    if not isinstance(text, str) or len(text) > 1 << 16:
        return False, None
    try:
        return True, ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _passed(p: Probe, row: dict) -> bool:
    if "error" in row:
        return False
    ok, left = _value(row.get("left"))
    if not ok:
        return False
    if p.right is None:
        want = p.expected
    else:
        ok, want = _value(row.get("right"))
        if not ok:
            return False
    if _has_bool(left) != _has_bool(want):
        return False  # True == 1 in Python: a patched eval returning True passes no `== 1`
    try:
        return bool(left == want)
    except Exception:  # a literal's comparison (deep nesting): no pass
        return False


def _has_bool(x: Any) -> bool:
    if isinstance(x, bool):
        return True
    if isinstance(x, (list, tuple, set, frozenset)):
        return any(_has_bool(v) for v in x)
    if isinstance(x, dict):
        return any(_has_bool(k) or _has_bool(v) for k, v in x.items())
    return False
