"""sandbox/verdict.py: assert tests split into probes whose expected values stay with the
verifier; the verdict from the probe program's last results line."""

import pytest

from tsync_mcore.sandbox import verdict as v


def test_split_keeps_literal_expectations_out_of_the_program():
    setup, probes = v.split("import math\nx = 3\nassert f(x) == 9, 'msg'\nassert ok(1)\n"
                            "assert f(1) == g(1)\n")
    assert setup == "import math\nx = 3"
    assert probes == [v.Probe("f(x)", None, 9), v.Probe("bool(ok(1))", None, True),
                      v.Probe("f(1)", "g(1)", None, literal=False)]
    prog = v.probe_program("def f(x): return x", setup, probes)
    assert "9" not in prog.replace("f(x)", "")  # the expected value is not in the program
    # HumanEval's check(candidate) is inlined
    _, probes = v.split("def check(candidate):\n    assert candidate(2) == 4\n\ncheck(sq)\n")
    assert probes == [v.Probe("sq(2)", None, 4)]
    for bad, why in (("def f(:", "does not parse"), ("x = 1\n", "no assert")):
        with pytest.raises(v.TestCodeError, match=why):
            v.split(bad)


def test_decide_reads_only_the_last_results_line_and_compares_here():
    _, probes = v.split("assert f(1) == 1\nassert g() == [1, 2]\nassert h()\n")
    line = v.RESULTS + '[{"left": "1"}, {"left": "[1, 2]"}, {"left": "True"}]'
    assert v.decide(f"noise\n{line}\n", probes) == [True, True, True]
    forged = v.RESULTS + '[{"left": "True"}, {"left": "0"}, {"left": "True"}]'
    assert v.decide(f"{forged}\n", probes) == [False, False, True]  # True is not 1
    assert v.decide(f"{line}\n{forged}\n", probes) == [False, False, True]  # the last one
    assert v.decide("", probes) == [False] * 3
    assert v.decide(v.RESULTS + "[1, 2]", probes) == [False] * 3
    code = v.RESULTS + '[{"left": "__import__(\'os\')"}, {"error": "X"}, {"left": "1"}]'
    assert v.decide(code, probes) == [False, False, False]  # parsed as literals only
