"""The program the sandbox runs for an assert test (sandbox/verdict.py plans what it runs).

Run as `python -I harness.py` in the sandbox's run directory, next to `spec.json` and, in
"solution" mode, the answer (`solution.py`, or a module importable from the working
directory, as a terminal repo's). Standard library only: the sandbox's interpreter need not
be the trainer's.

Every name the harness uses is bound before the answer runs: the builtins are copied into a
dict of its own, and test expressions are evaluated with globals whose `__builtins__` is that
copy, holding the answer's names the test uses and nothing else of its module. So an answer
that defines or patches `eval`, `repr`, `sorted`, `set`, `json` or the `builtins` module
changes its own code, not the test's. That is for honest answers: an answer owns its
process and could still forge this program's report, which is why the report carries only
values (`dump_value`: plain builtin values, sized) and never a verdict — the expected values
and the comparisons stay in the rollout process or run in "clean" mode, a second process
that never sees the answer.

Modes (spec.json):
  solution: {"mode": "solution", "module": NAME | null, "names": [...], "tests": [
             {"setup": [stmt, ...], "exprs": [expr, ...], "truth": [k, ...]}, ...]}
             the answer runs: solution.py as `__main__`, or NAME.py of the working
             directory as module NAME (other files there are not importable); then per
             test the setup and each expression, with `names` taken from the answer's
             (an expression `truth` lists that is no plain value: its bool());
  clean:    {"mode": "clean", "tests": [{"setup": [...], "exprs": [...],
             "binds": {name: value text}}]}  no answer: binds are the answer's values.
The last stdout line is RESULTS + JSON: per test, per expression {"v": text} or {"e": why}.
"""

import ast
import builtins
import importlib.util
import json
import math
import os
import sys
import traceback
import types

RESULTS = "@@tsync-probe-results@@ "
MAX_VALUE = 1 << 16  # characters of one value's text
MAX_DEPTH = 64  # nesting of one value
_SCALARS = (bool, int, float, complex, str, bytes, type(None), type(Ellipsis))


def dump_value(v):
    """`v` as the text of a plain value: builtin scalars and containers only (subclasses
    of them, an OrderedDict or a namedtuple, become their base type; a numpy value its
    `tolist()`), no cycles; a ValueError for anything else — an object of the answer's
    own class never crosses — or past MAX_VALUE characters."""
    budget = [MAX_VALUE]
    return _dump(v, 0, budget)


def _dump(v, depth, budget):
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    text = _text(v, depth, budget)
    budget[0] -= len(text)
    if budget[0] < 0:  # checked as it grows: a value of 10**7 items stops early
        raise ValueError(f"value longer than {MAX_VALUE} characters")
    return text


def _text(v, depth, budget):
    t = type(v)
    if t in _SCALARS:
        return _scalar(v, t)
    for base in (int, float, complex, str, bytes):
        if isinstance(v, base):  # a subclass: its base value, never its own __repr__
            return _scalar(v, base)
    d = depth + 1
    if isinstance(v, (list, tuple)):
        parts = [_dump(x, d, budget) for x in list(v)]
        if isinstance(v, list):
            return "[" + ", ".join(parts) + "]"
        return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"
    if isinstance(v, (set, frozenset)):
        parts = [_dump(x, d, budget) for x in v]
        body = "{" + ", ".join(parts) + "}" if parts else "set()"
        return body if isinstance(v, set) else f"frozenset({body})"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_dump(k, d, budget)}: {_dump(x, d, budget)}"
                               for k, x in dict(v).items()) + "}"
    if t.__module__ == "numpy" and hasattr(v, "tolist"):  # np.int64(3), np.array([1])
        return _dump(v.tolist(), d, budget)
    raise ValueError(f"a {t.__name__} is not a plain value")


def _scalar(v, base):
    if base is float and math.isnan(v):
        return "nan"
    if base is float and math.isinf(v):
        return "inf" if math.copysign(1.0, v) > 0 else "-inf"
    if base is int and int.bit_length(v) > 4 * MAX_VALUE:
        raise ValueError("integer too large")
    return base.__repr__(v)


def parse_value(text):
    """The plain value `dump_value` wrote (never executed: literals, `set()`,
    `frozenset({...})`, `nan`, `inf`); ValueError for anything else."""
    if not isinstance(text, str) or len(text) > MAX_VALUE:
        raise ValueError("not a value text, or too long")
    try:
        node = ast.parse(text, mode="eval").body
        return _literal(node, 0)
    except (SyntaxError, RecursionError, MemoryError, TypeError) as e:
        raise ValueError(f"not a plain value ({type(e).__name__})") from None


def _literal(n, depth):
    if depth > MAX_DEPTH + 2:
        raise ValueError("value nested too deeply")
    d = depth + 1
    if isinstance(n, ast.Constant) and type(n.value) in _SCALARS:
        return n.value
    if isinstance(n, ast.Name) and n.id in ("nan", "inf", "Ellipsis"):
        return ... if n.id == "Ellipsis" else float(n.id)
    if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd)):
        x = _literal(n.operand, d)
        if type(x) in (int, float, complex):
            return -x if isinstance(n.op, ast.USub) else x
    if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Add, ast.Sub)):  # complex: (1+2j)
        a, b = _literal(n.left, d), _literal(n.right, d)
        if type(a) in (int, float) and type(b) is complex:
            return a + b if isinstance(n.op, ast.Add) else a - b
    if isinstance(n, (ast.List, ast.Tuple)):
        items = [_literal(x, d) for x in n.elts]
        return items if isinstance(n, ast.List) else tuple(items)
    if isinstance(n, ast.Set):
        return {_literal(x, d) for x in n.elts}
    if isinstance(n, ast.Dict) and None not in n.keys:
        return {_literal(k, d): _literal(x, d) for k, x in zip(n.keys, n.values)}
    if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and not n.keywords:
        if n.func.id == "set" and not n.args:
            return set()
        if n.func.id == "frozenset" and len(n.args) <= 1:
            return frozenset(_literal(n.args[0], d) if n.args else ())
    raise ValueError("not a plain value")


def _report(fd, rows):
    os.write(fd, ("\n" + RESULTS + json.dumps(rows) + "\n").encode())


def main():
    # Everything below is bound now, before the answer runs.
    B = dict(vars(builtins))
    compile_, eval_, exec_, bool_ = compile, eval, exec, bool
    name_of = lambda e: type(e).__name__  # noqa: E731
    with open("spec.json", encoding="utf-8") as f:
        spec = json.load(f)
    out = os.dup(1)  # the report's own descriptor: what the answer prints goes to stderr
    os.dup2(2, 1)
    module = None
    if spec["mode"] == "solution":
        module = types.ModuleType("__main__")
        module.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = module
        try:
            if spec.get("module"):
                # from its file: the import path stays as -I made it (no work dir)
                name = spec["module"]
                found = importlib.util.spec_from_file_location(name, f"{name}.py")
                module = importlib.util.module_from_spec(found)
                sys.modules[name] = module
                found.loader.exec_module(module)
            else:
                with open("solution.py", encoding="utf-8") as f:
                    src = f.read()
                module.__file__ = os.path.abspath("solution.py")
                exec_(compile_(src, "solution.py", "exec"), module.__dict__)
        except BaseException:  # the answer does not load (or exits): no report, no pass
            traceback.print_exc()
            return
    rows = []
    for test in spec["tests"]:
        g = {"__builtins__": B, "__name__": "__tsync_test__"}
        for n in spec.get("names", ()):
            if module is not None and n in vars(module):
                g[n] = vars(module)[n]
        row = []
        try:
            for k, text in test.get("binds", {}).items():
                g[k] = parse_value(text)
            for stmt in test["setup"]:
                exec_(compile_(stmt, "<test>", "exec"), g)
        except BaseException as e:
            rows.append([{"e": f"setup: {name_of(e)}"} for _ in test["exprs"]])
            continue
        for k, expr in enumerate(test["exprs"]):
            try:
                value = eval_(compile_(expr, "<test>", "eval"), g)
                try:
                    row.append({"v": dump_value(value)})
                except ValueError:
                    if k not in test.get("truth", ()):
                        raise
                    row.append({"v": "True" if bool_(value) else "False"})  # a match object
            except BaseException as e:
                row.append({"e": name_of(e)})
        rows.append(row)
    _report(out, rows)


if __name__ == "__main__":
    main()
