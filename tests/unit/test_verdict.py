"""sandbox/verdict.py and sandbox/harness.py: assert tests cut at the answer — only the
pieces that call it run in its process, the expected values and comparisons stay with the
verifier; the verdict from the harness's last results line, on plain values only."""

import json

import numpy as np
import pytest

from tsync_mcore.sandbox import harness as h
from tsync_mcore.sandbox import verdict as v


def test_plan_keeps_expectations_and_comparisons_out_of_the_answer():
    p = v.plan("import math\nx, want = 3, 9\nassert f(x) == want, 'msg'\nassert ok(1)\n"
               "assert not ok(2)\nassert f(1) == g(1)\nassert math.isclose(f(2), 1.5)\n"
               "assert sorted(f(4)) == sorted([2, 1])\n")
    # the answer's process sees the holes and the setup they need, nothing else
    assert p.holes == ["f(x)", "ok(1)", "ok(2)", "f(1)", "g(1)", "f(2)", "sorted(f(4))"]
    assert p.solution_setup == ["x = 3"] and p.names == ["f", "g", "ok"]
    spec = json.dumps(p.solution_spec())
    assert "9" not in spec and "1.5" not in spec and "isclose" not in spec and "not" not in spec
    # the clean process computes what is not the answer's, with the holes' values bound
    assert p.leaves == ["want", "math.isclose(__tsync_h5, 1.5)", "sorted([2, 1])"]
    assert p.clean_setup == ["import math", "x = 3", "want = 9"]
    # HumanEval's check(candidate) is inlined
    p = v.plan("def check(candidate):\n    assert candidate(2) == 4\n\ncheck(sq)\n")
    assert p.holes == ["sq(2)"] and p.asserts == [("cmp", ["=="], [("hole", 0), ("lit", 4)])]
    # what the answer may change in place is the answer's
    p = v.plan("import math\nlst = [3, 1]\nsort_it(lst)\nassert lst == [1, 3]\n"
               "assert math.isclose(lst[0], 1)")
    assert p.holes == ["lst", "lst[0]"] and p.solution_setup == ["lst = [3, 1]", "sort_it(lst)"]
    assert p.leaves == ["math.isclose(__tsync_h1, 1)"]
    # a loop over a literal sequence is unrolled: its expectations stay here too
    p = v.plan("for x, (y, z) in [(1, (2, 'a')), (3, (4, 'b'))]:\n    assert f(x) == y\n"
               "    assert g(x) != z\nfor i in range(2):\n    assert f(i) >= 0\n")
    assert p.holes == ["f(1)", "g(1)", "f(3)", "g(3)", "f(0)", "f(1)"]
    assert [t[2][1] for t in p.asserts] == [("lit", 2), ("lit", "a"), ("lit", 4), ("lit", "b"),
                                            ("lit", 0), ("lit", 0)]
    p = v.plan("cases = [(1, 2), (3, 4)]\nfor x, y in cases:\n    assert f(x) == y\n")
    assert p.holes == ["f(1)", "f(3)"] and p.solution_setup == []
    # the entry point is the answer's even where it is a builtin's name
    p = v.plan("def check(candidate):\n    assert candidate([1]) == 1\n\ncheck(sum)\n")
    assert p.names == ["sum"] and p.holes == ["sum([1])"]
    for bad, why in (("def f(:", "does not parse"), ("x = 1\n", "no assert"),
                     ("for i in [1]:\n    y = i\n    assert f(i) == y", "line 3: an assert "
                      "inside a for loop"),
                     ("for i in range(n):\n    assert f(i)", "inside a for loop"),
                     ("def t():\n    assert f(1)\nt()\nassert True", "inside a function"),
                     ("def check(c):\n    x = 1\n    for i in range(x):\n        assert c(i)"
                      "\n\ncheck(f)", "line 4: an assert inside a for loop"),
                     ("from m import *\nassert f(1)", r"import \*"),
                     ("assert [f(i) for i in range(3)] == [0, 1, 2]", "comprehension"),
                     ("assert eval(f(1)) == 2", "as code outside")):
        with pytest.raises(v.TestCodeError, match=why):
            v.plan(bad)


def test_judge_decides_here_on_plain_values():
    p = v.plan("assert f(1) == 1\nassert g() == [1, 2]\nassert h()\nassert not h2()\n"
               "assert f(2) < 3 <= f(3)\nassert f(4) is None or f(4) in [7, 8]\n")
    good = [(True, 1), (True, [1, 2]), (True, "x"), (True, 0), (True, 2), (True, 3),
            (True, 7), (True, 7)]
    assert v.judge(p, good, [])
    for k, bad in ((0, True), (1, [1, "2"]), (2, ""), (3, [0]), (4, 3), (7, 9)):
        assert not v.judge(p, [*good[:k], (True, bad), *good[k + 1:]], []), k
    assert not v.judge(p, [*good[:2], (False, None), *good[3:]], [])  # the hole failed
    # a short circuit does not need what it skips
    p = v.plan("assert f(0) or f(1)\n")
    assert v.judge(p, [(True, 1), (False, None)], [])


def test_read_results_reads_only_the_last_line_and_parses_values_without_running_them():
    line = v.RESULTS + json.dumps([[{"v": "1"}, {"v": "[1, 2]"}, {"e": "TypeError"}]])
    want = [[(True, 1), (True, [1, 2]), (False, None)]]
    assert v.read_results(f"noise\n{line}\n", [3]) == want
    forged = v.RESULTS + json.dumps([[{"v": "True"}, {"v": "0"}, {"v": "0"}]])
    assert v.read_results(f"{forged}\n{line}\n", [3]) == want  # the last one
    for bad in ("", v.RESULTS + "[1, 2]", v.RESULTS + "[[]]", v.RESULTS + "{"):
        assert v.read_results(bad, [3]) is None
    code = v.RESULTS + json.dumps([[{"v": "__import__('os')"}, {"v": "f()"}, {"v": "1"}]])
    assert v.read_results(code, [3]) == [[(False, None), (False, None), (True, 1)]]


def test_values_cross_only_as_plain_builtins():
    from collections import Counter, OrderedDict, namedtuple

    class Lying(int):
        def __repr__(self):
            return "999"

    P = namedtuple("P", "x y")
    for value, text in ((Lying(3), "3"), (P(1, 2), "(1, 2)"), (Counter("aa"), "{'a': 2}"),
                        (OrderedDict(a=[1]), "{'a': [1]}"), (float("nan"), "nan"),
                        (-float("inf"), "-inf"), ({1}, "{1}"), (set(), "set()"),
                        (frozenset({2}), "frozenset({2})"), ((1,), "(1,)"), (1 + 2j, "(1+2j)"),
                        (b"\x00", "b'\\x00'"), (None, "None"), (True, "True"),
                        (np.int64(3), "3"), (np.array([[1.5], [2.0]]), "[[1.5], [2.0]]"),
                        (np.bool_(True), "True")):
        assert h.dump_value(value) == text
        back = h.parse_value(text)
        assert h.dump_value(back) == text  # the same plain value both ways
        assert type(value).__module__ == "numpy" or back == value or value != value
    deep: list = []
    for _ in range(1000):
        deep = [deep]

    class Mine:
        pass
    for bad in (Mine(), [Mine()], deep, "x" * (1 << 17), 7 ** 100000, print, iter([1]),
                list(range(10 ** 6))):
        with pytest.raises(ValueError):
            h.dump_value(bad)
    for bad in ("__import__('os')", "f()", "[1" * 10000, "x", "set([1])", "{**a}"):
        with pytest.raises(ValueError):
            h.parse_value(bad)
