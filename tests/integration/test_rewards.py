"""Reward functions: loading specs, calling conventions (sync, async, extras), failures
under both reward.on_error modes, pass@k, and the built-ins (math-verify, code sandbox)."""

import os
import textwrap
import time

import pytest

from tests.helpers.paths import ROOT
from tsync_mcore.config import RewardConfig
from tsync_mcore.rewards import load_reward_fn
from tsync_mcore.rewards.builtins import code_tests, extract_code
from tsync_mcore.rewards.sandbox import SandboxLimits, run_python

LIM = SandboxLimits(timeout_s=3.0, memory_mb=256, nproc=16)
# the same bounds with time to finish: for programs that must run to the end (a loaded
# machine starts a namespaced interpreter in more than LIM's 3 s)
DONE = SandboxLimits(timeout_s=30.0, memory_mb=256, nproc=16)


def run_tests(code, tests, limits=DONE, **kw):
    """Programs that must run to the end get DONE's time (the attacks: LIM's)."""
    return code_tests(response=code, label=tests, meta={}, limits=limits, total_timeout_s=60,
                      **kw)


def test_code_tests_pass_and_fail():
    code = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"
    assert extract_code(code).strip().startswith("def add")
    assert run_tests(code, ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]) == \
        {"reward": 1.0, "all_passed": 1.0}
    assert run_tests(code, ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]) == \
        {"reward": 0.5, "all_passed": 0.0}
    io = {"inputs": ["2\n", "5\n"], "outputs": ["4\n", "10"]}
    assert run_tests("print(int(input()) * 2)", io)["reward"] == 1.0
    assert run_tests("print(int(input()) + 2)", io)["reward"] == 0.5
    # an early exit(0) skips the tests and the marker behind them: no pass
    assert run_tests("import sys\nsys.exit(0)", "assert False")["reward"] == 0.0
    assert code_tests(response="x=1", label=None, meta={"tests": ["assert x == 1"]},
                      limits=DONE, total_timeout_s=60)["reward"] == 1.0
    with pytest.raises(ValueError, match="tests must be"):
        run_tests("x=1", 3)


def _running(marker: str) -> bool:
    """A live host process whose command line holds `marker`."""
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if marker.encode() not in f.read():
                    continue
            with open(f"/proc/{d}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    return True
        except OSError:
            continue  # gone meanwhile, or not a process
    return False


def test_sandbox_contains_loops_memory_hogs_and_fork_bombs():
    t0 = time.monotonic()
    r = run_python("while True:\n    pass\n", "", LIM)
    # cut by the wall-time kill or by RLIMIT_CPU, whichever comes first (loose time bound: a
    # loaded machine is slow to reap; uncut, it never ends)
    assert (r.timed_out or r.returncode in (-9, -24)) and time.monotonic() - t0 < 30
    r = run_python("import time\ntime.sleep(60)\n", "", LIM)
    assert r.timed_out
    r = run_python("x = bytearray(1 << 30)\nprint('allocated')\n", "", LIM)
    assert r.returncode != 0 and "MemoryError" in r.stderr and "allocated" not in r.stdout
    t0 = time.monotonic()
    r = run_python("import os, time\nfor _ in range(10000):\n    os.fork()\n"
                   "time.sleep(30)\n", "", LIM)
    assert time.monotonic() - t0 < 30 and r.returncode != 0 or r.timed_out
    assert "Resource temporarily unavailable" in r.stderr or r.timed_out
    # a background child does not outlive the program: its process group is killed
    # (in a PID namespace its ids are the namespace's: look for its command line instead)
    marker = f"time.sleep({60 + os.getpid() % 1000})"
    r = run_python("import os, subprocess, sys, time\n"
                   f"p = subprocess.Popen([sys.executable, '-c', 'import time; {marker}'])\n"
                   "print(os.getpgid(p.pid), flush=True)\n", "", DONE)
    assert r.returncode == 0 and r.stdout.split()[0].isdigit(), r
    deadline = time.monotonic() + 5
    while _running(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(marker)
    # output files are bounded (RLIMIT_FSIZE), the run's secrets are not inherited
    os.environ["TSYNC_TEST_SECRET"] = "hunter2"
    try:
        r = run_python("import os\nprint(sorted(os.environ))\nprint(os.getcwd())\n", "", DONE)
    finally:
        del os.environ["TSYNC_TEST_SECRET"]
    assert "TSYNC_TEST_SECRET" not in r.stdout and "tsync-sandbox-" in r.stdout
    if os.geteuid() == 0:  # root drops to a uid of this program's own: RLIMIT_NPROC binds
        uids = [int(run_python("import os\nprint(os.getuid())\n", "", DONE).stdout)
                for _ in range(2)]
        assert all(DONE.uid_base <= u < DONE.uid_base + (1 << 20) for u in uids), uids
        assert uids[0] != uids[1]


def test_code_tests_builtin_from_config_and_deadline():
    cfg = RewardConfig(function="code_tests", timeout_s=4.0, sandbox_timeout_s=8.0,
                       sandbox_memory_mb=256)
    fn = load_reward_fn("code_tests", cfg)
    t0 = time.monotonic()
    out = fn(prompt="p", response="while True:\n    pass",
             label=["assert True"] * 5, meta={})
    # each test would take its 8 s (40 s in all); the call stops at reward.timeout_s (loose
    # bound for a loaded machine)
    assert out["reward"] == 0.0 and time.monotonic() - t0 < 20


def test_a_hung_sync_call_does_not_hold_up_the_process_exit():
    import subprocess
    import sys
    code = textwrap.dedent("""
        import asyncio, time
        from tsync_mcore.rewards import RewardRunner
        r = RewardRunner(lambda **kw: time.sleep(1000), spec="hang", timeout_s=0.2,
                         on_error="zero")
        res = asyncio.run(r.score("t", prompt="p", response="r", label=None, meta={}))
        print(res.reward, "timed out" in res.error)
        """)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert p.returncode == 0 and p.stdout.split() == ["0.0", "True"], p.stderr[-2000:]
    assert time.monotonic() - t0 < 30


ATTACKS = {  # each leaves add() wrong and tries to pass anyway
    "marker from argv[0]": "import os, sys, re\nsrc = open(sys.argv[0]).read()\n"
                           "print(re.findall(r'[0-9a-f]{32}', src)[-1:])\nos._exit(0)\n",
    "forged results line": "import os\nos.write(1, b'\\n@@tsync-probe-results@@ "
                           "[{\"left\": \"True\"}, {\"left\": \"True\"}]\\n')\nos._exit(0)\n",
    "excepthook": "import sys\nsys.excepthook = lambda *a: None\ndef add(a, b):\n"
                  "    return 0\n",
    "os._exit(0)": "import os\nos._exit(0)\n",
    "builtins patched": "import builtins\nbuiltins.eval = lambda *a, **k: True\n"
                        "builtins.repr = lambda x: 'True'\n",
    "frame reading": "import sys\ndef add(a, b):\n    f = sys._getframe(1)\n"
                     "    return [c for c in f.f_code.co_consts if isinstance(c, int)][-1:]\n",
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_code_tests_cannot_be_fooled(name):
    """The expected values never reach the answer's process, so none of these passes."""
    tests = ["assert add(1, 2) == 3", "assert add(20, 5) == 25\nassert add(0, 0) == 0"]
    assert run_tests("def add(a, b):\n    return a + b\n", tests)["reward"] == 1.0
    assert run_tests(ATTACKS[name], tests, limits=LIM)["reward"] == 0.0, name


# --- issue 47: an answer's names, objects and report cannot stand in for a solution -------

SHAPES = [  # one test per shape that an answer could pass with no solution before
    "assert is_prime(7)\nassert not is_prime(8)",  # bare truth tests
    "assert sort_it([3, 1, 2]) == sorted([2, 3, 1])",  # a right side that is not a literal
    "assert uniq([1, 1, 2]) == set([2, 1])",
    "import math\nassert math.isclose(area(2), 12.566, rel_tol=1e-3)",  # isclose
]
HONEST = ("import math\n\ndef is_prime(n):\n    return n > 1 and all(n % d for d in "
          "range(2, n))\n\ndef sort_it(xs):\n    print('x' * 200000)  # chatty: still judged\n"
          "    return sorted(xs)\n\ndef uniq(xs):\n    return set(xs)\n\ndef area(r):\n"
          "    return math.pi * r * r\n")
WRONG = ("def is_prime(n):\n    return True\n\ndef sort_it(xs):\n    return xs\n\n"
         "def uniq(xs):\n    return xs\n\ndef area(r):\n    return 0\n")
FORGER = (  # writes the report every harness it knows would read, to every descriptor
    "import ast, json, os, re, sys\nsrc = open(sys.argv[0]).read()\n"
    "if os.path.exists('spec.json'):\n"
    "    spec = json.load(open('spec.json'))\n"
    "    rows = [[{'v': 'True'} for _ in t['exprs']] for t in spec['tests']]\n"
    "else:\n"
    "    pairs = ast.literal_eval(re.search(r'for _l, _r in (\\[.*?\\]):', src).group(1))\n"
    "    rows = [dict(left='True', right='True') if r else dict(left='True') "
    "for _, r in pairs]\n"
    "line = ('\\n@@tsync-probe-results@@ ' + json.dumps(rows) + '\\n').encode()\n"
    "for fd in range(1, 10):\n    try:\n        os.write(fd, line)\n    except OSError:\n"
    "        pass\nos._exit(0)\n")
EXPLOITS = {
    "eval and repr defined": "def eval(*a, **k):\n    return True\n\n"
                             "def repr(x):\n    return 'True'\n",
    "bool, sorted, set shadowed, math.isclose patched":
        "import math\nbool = lambda x: True\nsorted = set = lambda *a, **k: 1\n"
        "math.isclose = lambda *a, **k: True\n" + WRONG +
        "sort_it = uniq = sorted\n",
    "objects that say yes to ==, bool(), in":
        "class Yes(float):\n    def __bool__(self):\n        return True\n"
        "    def __eq__(self, other):\n        return True\n    __hash__ = float.__hash__\n"
        "    def __contains__(self, x):\n        return True\n\n"
        "def is_prime(n):\n    return Yes(1.0)\n\nsort_it = uniq = area = is_prime\n",
    "forged report on every descriptor": FORGER,
}


def _code_tests(timeout_s=60.0):
    """code_tests as the rollout builds it from the reward config."""
    return load_reward_fn("code_tests", RewardConfig(
        function="code_tests", timeout_s=timeout_s, sandbox_timeout_s=20.0,
        sandbox_memory_mb=256))


@pytest.mark.parametrize("name", ["honest", *sorted(EXPLOITS)])
def test_code_tests_answer_names_objects_and_reports_pass_nothing(name):
    """Issue 47 finding 2: the answers that define eval/repr, shadow bool/sorted/set and
    patch math.isclose, or forge the report scored 1.0 with no solution; now 0. Objects
    that say yes cross as their plain value (a float subclass: its float) or fail. The
    honest answer keeps its 1.0, its 200 KB of prints notwithstanding. (An answer whose
    state changes from call to call can still pass a run of truth tests; so can a plain
    function: no harness tells them apart.)"""
    fn = _code_tests()
    code = HONEST if name == "honest" else EXPLOITS[name]
    out = fn(prompt="p", response=f"```python\n{code}```", label=SHAPES, meta={})
    assert out["reward"] == (1.0 if name == "honest" else 0.0), (name, out)


def test_code_tests_hostile_values_and_untestable_code():
    """Values that are not plain, bombs and floods fail their test only; the honest tests
    beside them pass. Test code whose asserts would run in the answer's process (a
    loop's assert, where an always-equal object passed before) is refused in one line; a
    loop over a literal sequence is unrolled and judged."""
    fn = _code_tests()
    code = ("import sys\nsys.setrecursionlimit(10 ** 6)\n\ndef rec(n):\n    return rec(n)\n\n"
            "def deep(n):\n    x = []\n    for _ in range(n):\n        x = [x]\n    return x\n\n"
            "def huge(n):\n    return 'x' * n\n\ndef big(n):\n    return 7 ** n\n\n"
            "def ok(n):\n    import re\n    return re.match('a', 'ab') and n + 1\n\n"
            "def inplace(xs):\n    xs.sort()\n\ndef found(s):\n    import re\n"
            "    return re.search('b', s)\n")
    tests = ["assert rec(1) == 1", "assert deep(100000) == []", "assert huge(10 ** 7) == ''",
             "assert big(10 ** 6) == 1", "assert ok(1) == 2",
             "xs = [3, 1]\ninplace(xs)\nassert xs == [1, 3]",  # changed in place: judged
             "assert found('abc')\nassert not found('a')"]  # a match object's truth
    t0 = time.monotonic()
    assert fn(prompt="p", response=code, label=tests, meta={})["reward"] == 3 / 7
    assert time.monotonic() - t0 < 60
    eq = "class Y:\n    def __eq__(self, o):\n        return True\n\ndef f(x):\n    return Y()\n"
    for test, why in (("for x, y in zip([1, 3], [2, 4]):\n    assert f(x) == y\nassert True",
                       "line 2: an assert inside a for loop"),
                      ("from math import *\nassert isclose(f(1), 2)", "import \\*"),
                      ("assert all(f(i) == i for i in range(3))", "comprehension")):
        with pytest.raises(ValueError, match=why):
            fn(prompt="p", response=eq, label=[test], meta={})
    loop = "for x, y in [(1, 2), (3, 4)]:\n    assert f(x) == y\n"
    assert fn(prompt="p", response=eq, label=[loop], meta={})["reward"] == 0.0
    assert fn(prompt="p", response="def f(x):\n    return x + 1\n", label=[loop],
              meta={})["reward"] == 1.0
