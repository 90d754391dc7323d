"""The general sandbox (tsync_mcore.sandbox.jail), the agents' tools (tsync_mcore.sandbox.tools) and the
terminal task env (rollout.env: terminal). Fast: no vLLM, no model; a tiny tokenizer.

What must hold: a tool call that loops forever, forks without end, allocates 10 GB, writes
a huge file or opens a socket is stopped or refused — each returns a result — and the next
sandbox call works."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time

import pytest

from tests.helpers.sandbox_tools_shared import tok  # noqa: F401  (shared with the unit tests)
from tsync_mcore.rollout.engine import GenOut
from tsync_mcore.rollout.envs import observation_ids
from tsync_mcore.rollout.loop import run_trajectory
from tsync_mcore.rollout.terminal_env import TerminalConfig, TerminalTaskEnv, _task
from tsync_mcore.sandbox import cgroups
from tsync_mcore.sandbox import jail as sb
from tsync_mcore.sandbox.tools import ToolBox, format_tool_call

LIM = sb.Limits(timeout_s=5.0, memory_mb=256, nproc=16)
ROOT = os.geteuid() == 0


def next_call_works() -> None:
    r = sb.run_shell("echo still-here", limits=LIM)
    assert r.returncode == 0 and r.stdout == "still-here\n", r


def gone(pid: int) -> bool:
    """Not running: no such process, or a zombie that init has not reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_infinite_loop_is_stopped_by_cpu_then_wall():
    # CPU limit (1 s) well before the wall limit: SIGXCPU
    r = sb.run_python("while True:\n    pass\n", limits=sb.Limits(timeout_s=20, cpu_s=1))
    assert r.returncode is not None and r.returncode < 0 and r.limit == "cpu", r
    assert r.wall_s < 15
    # a loop that sleeps uses no CPU: the wall timeout kills its group
    r = sb.run_shell("while true; do sleep 1; done", limits=sb.Limits(timeout_s=2))
    assert r.timed_out and r.returncode is None and r.limit == "wall", r
    assert 1.9 < r.wall_s < 10
    next_call_works()


@pytest.mark.parametrize("bomb", ["python", "bash", "python-rlimit-only"])
def test_fork_bomb_is_stopped_and_leaves_nothing(bomb, monkeypatch):
    if bomb == "python-rlimit-only":  # no pids cgroup: RLIMIT_NPROC of the user bounds it
        monkeypatch.setitem(cgroups._ROOTS, "pids", None)

    def busy() -> set[str]:  # this process's cgroups that hold processes (named with its pid)
        root = sb.pids_cgroup_root()
        out = set()
        for d in os.listdir(root) if root else ():
            try:
                if d.startswith(f"run-p{os.getpid()}-") and \
                        open(os.path.join(root, d, "cgroup.procs")).read():
                    out.add(d)
            except OSError:
                pass  # removed meanwhile
        return out

    # jails this process started before (an earlier test's scorer workers, agents) may live on
    before = busy()
    t0 = time.monotonic()
    if bomb.startswith("python"):
        r = sb.run_python("import os, time\nwhile True:\n    try:\n        os.fork()\n"
                          "    except OSError:\n        time.sleep(0.01)\n", limits=LIM)
    else:
        r = sb.run_shell(":(){ :|:& };:; sleep 30", limits=LIM)
    assert r.timed_out and time.monotonic() - t0 < 30, r
    assert r.pids_cgroup == (bomb != "python-rlimit-only")
    if r.pids_cgroup:  # this run's cgroup held at most nproc processes and is gone
        deadline = time.monotonic() + 15
        while busy() - before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not busy() - before
    next_call_works()


def test_10_gb_allocation_is_refused():
    r = sb.run_python("x = bytearray(10 << 30)\nprint('allocated')\n", limits=LIM)
    assert r.returncode == 1 and "MemoryError" in r.stderr and "allocated" not in r.stdout
    assert r.wall_s < 10
    next_call_works()


def test_huge_file_is_stopped_at_fsize():
    lim = sb.Limits(timeout_s=10, fsize_mb=4)
    # a shell program dies of SIGXFSZ (the launcher restores its default action)
    r = sb.run_shell("head -c 1G /dev/zero > big; echo rc=$?; stat -c %s big", limits=lim)
    assert r.returncode == 0 and "rc=153" in r.stdout  # 128 + SIGXFSZ (25)
    assert r.stdout.split()[-1] == str(4 << 20), r
    r = sb.run_shell("exec head -c 1G /dev/zero > big", limits=lim)
    assert r.limit == "fsize" and r.returncode == -25, r
    # Python ignores SIGXFSZ: the write fails with EFBIG
    r = sb.run_python("open('big', 'wb').write(b'x' * (64 << 20))", limits=lim)
    assert r.returncode == 1 and "File too large" in r.stderr, r
    # the captured output is bounded too, and cut with a marker
    r = sb.run_shell("yes | head -c 1M", limits=sb.Limits(max_output=1000))
    assert r.truncated and r.stdout.endswith(f"[... output truncated: {(1 << 20) - 1000} "
                                             f"more bytes]")
    next_call_works()


def test_socket_to_the_outside_is_refused():
    prefix, why = sb.netns_prefix()
    if not prefix:
        pytest.skip(f"no network namespace here: {why}")
    if ROOT:  # as root here, the netns path must be the one in use
        assert prefix == [sb.UNSHARE, "--net", "--"]
    prog = ("import socket\ntry:\n    socket.create_connection(('1.1.1.1', 80), timeout=3)\n"
            "    print('connected')\nexcept OSError as e:\n    print('refused', e.errno)\n")
    r = sb.run_python(prog, limits=LIM)
    assert r.network_isolated and r.stdout.startswith("refused"), r
    r = sb.run_shell("cat /proc/net/dev | tail -n +3 | cut -d: -f1; "
                     "exec 3<>/dev/tcp/127.0.0.1/22 && echo open", limits=LIM)
    assert r.stdout.split() == ["lo"] and "open" not in r.stdout, r  # loopback only, down
    # "host" keeps the host's network and says so
    assert not sb.run_shell("true", limits=sb.Limits(network="host")).network_isolated
    next_call_works()


def test_isolation_unavailable_is_said_not_hidden(monkeypatch):
    monkeypatch.setitem(sb._NETNS, ROOT, ([], "unshare --net not permitted: test"))
    with pytest.warns(RuntimeWarning, match="WITH network access"):
        r = sb.run_shell("true", limits=LIM)
    assert r.returncode == 0 and not r.network_isolated
    with pytest.raises(sb.SandboxError, match="network isolation required"):
        sb.run_shell("true", limits=sb.Limits(network="require"))


def _host_pids(marker: str) -> list[int]:
    """Host pids whose command line holds `marker` (a sandbox's pids are its namespace's)."""
    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if marker.encode() in f.read() and not gone(int(d)):
                    out.append(int(d))
        except (OSError, ValueError):
            continue  # gone meanwhile, or not a process
    return out


def test_setsid_escapee_secrets_user_and_workdir(tmp_path):
    marker = f"{300 + os.getpid() % 1000}.5"
    r = sb.run_shell(f"setsid sleep {marker} > /dev/null 2>&1 & echo $!", limits=LIM)
    if r.pids_cgroup or r.fs_isolated:  # the cgroup, or the PID namespace's end, kills it
        deadline = time.monotonic() + 5
        while _host_pids(f"sleep\0{marker}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _host_pids(f"sleep\0{marker}")
    else:
        os.kill(int(r.stdout.split()[0]), 9)
    os.environ["TSYNC_TEST_SECRET"] = "hunter2"
    try:
        r = sb.run_shell("env; id -u; pwd", limits=LIM)
    finally:
        del os.environ["TSYNC_TEST_SECRET"]
    assert "hunter2" not in r.stdout and "tsync-sandbox-" in r.stdout
    if ROOT:
        assert "\n65534\n" in r.stdout
    # a persistent working directory keeps files between calls; the template seeds one
    (tmp_path / "seed.txt").write_text("seeded\n")
    wd = tmp_path / "wd"
    wd.mkdir()
    sb.run_shell("echo one > a.txt", limits=LIM, workdir=str(wd))
    r = sb.run_shell("cat a.txt; python -c 'print(2)'", limits=LIM, workdir=str(wd))
    assert r.stdout == "one\n2\n", r
    assert sb.run_shell("cat seed.txt", limits=LIM, template=str(tmp_path)).stdout == "seeded\n"


def test_tool_calls_never_raise_on_bad_model_output():
    box = ToolBox(LIM)
    bad = [("bash", "{not json"), ("bash", "[1, 2]"), ("bash", "{}"),
           ("bash", '{"command": 3}'), ("bash", '{"command": "ls", "rm": "-rf"}'),
           ("nope", "{}"), (None, None), ("python", '"print(1)"')]
    for name, args in bad:
        out = asyncio.run(box.call(name, args))
        assert isinstance(out, str) and out.startswith("error:"), (name, args, out)
    assert asyncio.run(box.call("python", '{"code": "print(6 * 7)"}')) == \
        "exit code: 0\nstdout:\n42"
    assert box.call_sync("bash", {"command": "exit 3"}) == "exit code: 3"
    assert "killed: wall time limit" in ToolBox(sb.Limits(timeout_s=1)).call_sync(
        "bash", {"command": "sleep 10"})


def test_tool_calls_do_not_block_the_event_loop():
    box = ToolBox(LIM)

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        t = asyncio.create_task(ticker())
        t0 = time.monotonic()
        outs = await asyncio.gather(*[box.call("bash", {"command": "sleep 1; echo done"})
                                      for _ in range(2)])
        t.cancel()
        return outs, ticks, time.monotonic() - t0

    outs, ticks, wall = asyncio.run(main())
    assert outs == ["exit code: 0\nstdout:\ndone"] * 2
    assert ticks >= 5 and wall < 1.9 + 3  # concurrent, and the loop ran meanwhile


class ScriptedEngine:
    """An "agent" that emits the given texts, one per turn (then nothing)."""

    max_model_len = 1 << 16

    def __init__(self, tok, texts):
        self.tok, self.texts, self.n = tok, list(texts), 0

    async def generate(self, prompt_ids, *, max_tokens, temperature=1.0, seed=None):
        text = self.texts[self.n] if self.n < len(self.texts) else "done"
        self.n += 1
        ids = list(self.tok(text, add_special_tokens=False).input_ids)[:max_tokens - 1]
        ids.append(self.tok.eos_token_id)
        return GenOut(ids, [-0.5] * len(ids), "stop", 0)


def episode(tok, seed, texts, max_turns=4):
    env = TerminalTaskEnv(tok, TerminalConfig(max_turns=max_turns), LIM)
    res = asyncio.run(run_trajectory(ScriptedEngine(tok, texts), env, seed=0, env_seed=seed,
                                     max_turns=max_turns, max_tokens_per_turn=4096,
                                     max_total_tokens=60000))
    return env, res


def fix_calls(task):
    return (format_tool_call("python", {"code": f"open({task.module + '.py'!r}, 'w')"
                                                f".write({task.fixed!r})"}) +
            format_tool_call("bash", {"command": f"python test_{task.module}.py"}))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_terminal_env_rewards_a_fix_and_not_a_miss(tok, seed):
    task = _task(seed)
    look = format_tool_call("bash", {"command": f"cat {task.module}.py; "
                                                f"python test_{task.module}.py"})
    env, res = episode(tok, seed, [look, fix_calls(task), "Fixed."])
    assert res.reward == 1.0 and res.n_turns == 3 and res.stop_reason == "done"
    assert env.workdir is None  # the episode's repo is removed once verified
    text = tok.decode(res.tokens)
    assert "AssertionError" in text and "all tests passed" in text
    # wrong: only looks, then stops
    env, res = episode(tok, seed, [look, "I give up."])
    assert res.reward == 0.0 and res.n_turns == 2
    # wrong: edits the visible test to pass, the hidden tests still fail
    cheat = format_tool_call("bash", {"command": f"echo 'print(1)' > test_{task.module}.py"})
    assert episode(tok, seed, [cheat, "Done."])[1].reward == 0.0
    # wrong: a module that exits 0 on import passes nothing
    plant = format_tool_call("bash", {"command": f"echo 'import os; os._exit(0)' > "
                                                 f"{task.module}.py"})
    assert episode(tok, seed, [plant, "Done."])[1].reward == 0.0
    # wrong: a module that forges the verifier's results line, or reads its program
    forge = ("import os, sys\nos.write(1, open(sys.argv[0], 'rb').read()[-300:])\n"
             "os.write(1, b'\\n@@tsync-probe-results@@ [{\"left\": \"True\"}]\\n')\n"
             "os._exit(0)\n")
    plant = format_tool_call("python", {"code": f"open({task.module + '.py'!r}, 'w')"
                                                f".write({forge!r})"})
    env, res = episode(tok, seed, [plant, "Done."])
    forged = env.verify_result.stdout + env.verify_result.stderr  # (its stdout is stderr)
    assert res.reward == 0.0 and "@@tsync-probe-results@@" in forged


def test_terminal_verifier_harness_names_cannot_be_shadowed(tok):
    """Issue 47: the target fixed but `is_even` broken, the module shadows the names the
    verifier used (`bool`, `eval`, `repr`) so that the truth test `assert is_even(6)`
    passed; it also patches builtins (and sys.modules). The verifier's harness binds its
    names before the import and judges the values here: 0. The same shims beside a full
    fix change nothing."""
    task = _task(1)
    shims = ("import builtins, sys\n_e = builtins.eval\n"
             "def eval(e, g=None, *a):\n    return True if e.startswith('bool(') else _e(e, g)\n"
             "bool = lambda x: True\nrepr = builtins.repr\nbuiltins.bool = bool\n")
    broken = task.fixed.replace("return n % 2 == 0", "return False")
    assert broken != task.fixed
    kill = "sys.modules['json'] = sys.modules['ast'] = None\n"
    for module, want in ((broken + shims, 0.0), (task.fixed + shims + kill, 1.0)):
        plant = format_tool_call("python", {"code": f"open({task.module + '.py'!r}, 'w')"
                                                    f".write({module!r})"})
        assert episode(tok, 1, [plant, "Done."])[1].reward == want


def test_terminal_verifier_ignores_planted_startup_files_links_and_fifos(tok):
    """Without a fix, none of these passes: start-up hooks planted in the repo
    (sitecustomize, usercustomize, conftest, a .pth) that would forge the results or swallow
    failures, deleting the tests, the module as a symlink to a fixed copy elsewhere, the
    module as a FIFO (the verifier neither follows nor blocks). With the fix, the same
    plants change nothing."""
    task = _task(2)
    hook = ("import os, sys\nsys.excepthook = lambda *a: None\n"
            "os.write(1, b'@@tsync-probe-results@@ []\\n')\n")
    plant = "".join(format_tool_call("python", {"code": f"open({n!r}, 'w').write({hook!r})"})
                    for n in ("sitecustomize.py", "usercustomize.py", "conftest.py", "x.pth"))
    rm_tests = format_tool_call("bash", {"command": "rm -f test_*.py"})
    assert episode(tok, 2, [plant, rm_tests, "Done."])[1].reward == 0.0
    assert episode(tok, 2, [plant, fix_calls(task), "Done."])[1].reward == 1.0
    outside = tempfile.mkdtemp(prefix="tsync-fixed-copy-")
    try:
        with open(os.path.join(outside, "fixed.py"), "w") as f:
            f.write(task.fixed)
        os.chmod(outside, 0o755)
        link = format_tool_call("bash", {"command": f"rm {task.module}.py && "
                                                    f"ln -s {outside}/fixed.py {task.module}.py"})
        assert episode(tok, 2, [link, "Done."])[1].reward == 0.0
    finally:
        shutil.rmtree(outside, ignore_errors=True)
    fifo = format_tool_call("bash", {"command": f"rm {task.module}.py && mkfifo {task.module}.py"})
    t0 = time.monotonic()
    env, res = episode(tok, 2, [fifo, "Done."])
    assert res.reward == 0.0 and time.monotonic() - t0 < 30


def test_terminal_env_tasks_and_observations(tok):
    tasks = {(_task(s).module, _task(s).fixed) for s in range(12)}
    assert len(tasks) >= 6  # different per seed
    env = TerminalTaskEnv(tok, TerminalConfig(max_turns=3, max_calls_per_turn=1), LIM)
    prompt = env.reset(5)
    assert tok.decode(prompt).rstrip().endswith("<|im_start|>assistant")
    action = list(tok(format_tool_call("bash", {"command": "echo hi"}) +
                      format_tool_call("bash", {"command": "echo no"}),
                      add_special_tokens=False).input_ids)
    obs, done = asyncio.run(env.step(action))
    assert not done
    want = observation_ids(tok, [{"role": "tool", "content": "exit code: 0\nstdout:\nhi"},
                                 {"role": "tool", "content": "error: at most 1 tool calls "
                                                             "per turn; this one did not run"}],
                           action)
    assert obs == want  # token ids via the chat template
    # the last turn's calls still run, then the verifier: the fix at max_turns counts
    obs, done = asyncio.run(env.step(list(tok(fix_calls(env.task)).input_ids)))
    assert not done
    obs, done = asyncio.run(env.step(list(tok(fix_calls(env.task)).input_ids)))
    assert done and obs == [] and env.reward() == 1.0
    # an episode stopped early (token budget) is verified by reward()
    env.reset(6)
    assert env.reward() == 0.0 and env.workdir is None


def test_concurrent_terminal_episodes_do_not_interfere(tok):
    async def main():
        envs, runs = [], []
        for seed in range(8):
            task = _task(seed)
            env = TerminalTaskEnv(tok, TerminalConfig(max_turns=3), LIM)
            envs.append(env)
            runs.append(run_trajectory(ScriptedEngine(tok, [fix_calls(task), "Fixed."]), env,
                                       seed=0, env_seed=seed, max_turns=3,
                                       max_tokens_per_turn=4096, max_total_tokens=60000))
        return await asyncio.gather(*runs)

    t0 = time.monotonic()
    res = asyncio.run(main())
    assert [r.reward for r in res] == [1.0] * 8 and time.monotonic() - t0 < 60


def test_model_text_that_cannot_reach_a_program_is_the_tools_own_error():
    """A NUL byte in a command (execve would cut it there) or a lone surrogate in code, stdin
    or a command (not encodable) is the tool's error text, exit status 2, nothing started
    (the python tool first probes its interpreter)."""
    from tsync_mcore.sandbox import jail

    cases = [
        (lambda: jail.run_shell("echo a\x00b"), "argument 4 of the command contains a NUL"),
        (lambda: jail.run_shell("echo \ud800"), "lone surrogate '\\ud800' at character 5"),
        (lambda: jail.run_python("print('\ud800')"), "file 'prog.py' is not valid Unicode"),
        (lambda: jail.run_python("print(1)", stdin="\udfff"), "the stdin is not valid Unicode"),
    ]
    for call, why in cases:
        r = call()
        assert (r.returncode, r.stdout, r.wall_s) == (2, "", 0.0)
        assert r.stderr.startswith("error: ") and why in r.stderr and r.stderr.count("\n") == 1


@pytest.mark.skipif(not ROOT, reason="the sandbox drops to another user only when run as root")
def test_a_work_directory_swapped_for_a_symlink_is_not_followed(tok, tmp_path):
    """A call owns its kept work directory and may put a symlink to a root-only directory in
    its place: the next call refuses to run there and root chowns nothing through it; the
    terminal verifier reads no source through it and scores 0."""
    import shutil
    import tempfile

    secret = tmp_path / "root-only"
    secret.mkdir(mode=0o700)
    (secret / "keys.py").write_text("KEY = 'hunter2'\n")
    wd = tempfile.mkdtemp(prefix="tsync-test-wd-")  # in sticky /tmp, as episode repos are
    cleanup = [wd, wd + ".old"]
    try:
        swap = f"mv {wd} {wd}.old && ln -s {secret} {wd}"
        if not sb.fs_isolation():  # in its mount namespace the call cannot reach the host's
            r = sb.run_shell(swap, limits=LIM, workdir=wd)  # /tmp: the directory stays
            assert r.fs_isolated and r.returncode != 0 and os.path.isdir(wd), r
            assert not os.path.islink(wd) and not os.path.exists(wd + ".old")
        # without namespaces (isolation: none, or a host that permits none) root follows
        # no link the call left
        lim = sb.Limits(**{**LIM.__dict__, "isolation": "none"})
        r = sb.run_shell(swap, limits=lim, workdir=wd)
        assert r.returncode == 0 and os.path.islink(wd), r
        _swapped_checks(wd, secret, tok, lim)
    finally:
        for p in cleanup:
            if os.path.islink(p):
                os.unlink(p)
            else:
                shutil.rmtree(p, ignore_errors=True)


def _swapped_checks(wd, secret, tok, lim):
    with pytest.raises(sb.SandboxError, match="no longer a directory"):
        sb.run_shell("cat keys.py", limits=lim, workdir=wd)
    assert os.stat(secret).st_uid == 0 and os.stat(secret / "keys.py").st_uid == 0
    out = ToolBox(lim, workdir=wd).call_sync("bash", {"command": "cat keys.py"})
    assert out.startswith("error: ") and "hunter2" not in out
    env = TerminalTaskEnv(tok, TerminalConfig(), limits=lim)
    env.reset(0)
    os.rename(env.workdir, env.workdir + ".old")
    os.symlink(secret, env.workdir)
    try:
        assert env._sources() == {}
    finally:
        os.unlink(env.workdir)
        os.rename(env.workdir + ".old", env.workdir)
        env.close()


@pytest.mark.skipif(not ROOT, reason="mount, PID and IPC namespaces are made as root")
def test_a_call_sees_a_read_only_system_a_private_bounded_tmp_and_its_own_processes():
    """In its namespaces a call writes nothing of the host but its own directories, sees
    no other episode's directory nor the host's /tmp, fills at most its private /tmp (bytes
    and inodes), sees only its own processes, and runs under its episode's own uid."""
    import shutil
    import tempfile

    assert sb.fs_isolation() == ""  # root here: the namespaces must be made
    canary = tempfile.mkdtemp(prefix="tsync-canary-", dir="/")  # outside /tmp: visible
    os.chmod(canary, 0o777)  # world-writable, and still untouched: the mount is read-only
    with open(os.path.join(canary, "file"), "w") as f:
        f.write("keep\n")
    mine, other = (tempfile.mkdtemp(prefix="tsync-test-wd-") for _ in range(2))
    lim = sb.Limits(**{**LIM.__dict__, "uid_base": 1 << 24, "disk_mb": 4, "disk_inodes": 64})
    prog = (f"ls -a /tmp; echo ---; "
            f"for p in /etc/passwd {canary}/file {canary}/new /usr/tsync-x /var/tmp/../x; do "
            f"(echo x >> $p) 2>/dev/null && echo wrote $p; done; "
            f"rm {canary}/file 2>/dev/null && echo removed; ls {other} 2>/dev/null && echo seen; "
            f"cat {canary}/file; "
            f"echo pids $(ls /proc | grep -c '^[0-9]'); "
            f"for n in mnt pid ipc net; do readlink /proc/self/ns/$n; done; "
            f"for i in 1 2 3 4 5 6; do head -c 1000000 /dev/zero > /tmp/b$i || "
            f"{{ echo tmp-full; break; }}; done 2>/dev/null; rm -f /tmp/b*; "
            f"for i in $(seq 1 100); do : > /dev/shm/f$i || {{ echo inodes-full; break; }}; "
            f"done 2>/dev/null; echo mine > ./ok && cat ./ok; id -u")
    try:
        r = sb.run_shell(prog, limits=lim, workdir=mine)
        listing, rest = r.stdout.split("---\n")
        assert r.returncode == 0 and r.fs_isolated, r
        # the host's /tmp is not there: only this call's run directory and work directory
        # (a checkout under /tmp shows its own top directory: the interpreter view binds
        # the venv and the sources back, read-only)
        view = {p.split("/")[2] for p in (sys.prefix, os.path.dirname(sb.__file__))
                if p.startswith("/tmp/")}
        assert sorted(listing.split()) == sorted(
            [".", "..", os.path.basename(mine), *view, *[x for x in listing.split()
                                                         if x.startswith("tsync-sandbox-")]])
        lines = rest.split("\n")
        assert not [x for x in lines if x.startswith(("wrote", "removed", "seen"))], r.stdout
        assert lines[0] == "keep"  # readable (the system is visible), not writable
        assert int(lines[1].split()[1]) <= 6  # PID 1, the shell, its subshell, ls, grep
        host = [os.readlink(f"/proc/self/ns/{n}") for n in ("mnt", "pid", "ipc", "net")]
        assert all(a != b for a, b in zip(lines[2:6], host)), (lines[2:6], host)
        assert "tmp-full" in lines and "inodes-full" in lines and "mine" in lines
        uid = int(lines[-2])
        assert (1 << 24) <= uid < (1 << 24) + sb.UID_SPAN and os.stat(mine).st_uid == uid
        with open(os.path.join(canary, "file")) as f:
            assert f.read() == "keep\n" and os.listdir(canary) == ["file"]
        # the episode keeps its uid; another episode (and a call without one) gets another
        again = sb.run_shell("id -u", limits=lim, workdir=mine)
        there = sb.run_shell("id -u", limits=lim, workdir=other)
        assert int(again.stdout) == uid and int(there.stdout) != uid
        next_call_works()
    finally:
        for d in (canary, mine, other):
            shutil.rmtree(d, ignore_errors=True)


def test_filesystem_isolation_unavailable_is_said_not_hidden(monkeypatch):
    monkeypatch.setattr(sb, "_FS_NS", ["not running as root (test)"])
    with pytest.warns(RuntimeWarning, match="WITHOUT mount/PID/IPC namespaces"):
        r = sb.run_shell("true", limits=LIM)
    assert r.returncode == 0 and not r.fs_isolated
    with pytest.raises(sb.SandboxError, match="filesystem isolation required but not running"):
        sb.run_shell("true", limits=sb.Limits(isolation="require"))


@pytest.mark.skipif(not ROOT, reason="an episode's tmpfs is mounted as root")
def test_an_episode_repo_is_bounded_in_bytes_and_files(tok):
    """The terminal task's repo is a tmpfs of its own: its calls fill at most disk_mb and
    disk_inodes, the episode goes on, and closing it leaves no mount and no directory."""
    lim = sb.Limits(**{**LIM.__dict__, "disk_mb": 2, "disk_inodes": 32, "uid_base": 1 << 24})
    env = TerminalTaskEnv(tok, TerminalConfig(), limits=lim)
    env.reset(0)
    wd = env.workdir
    try:
        assert os.path.ismount(wd)
        r = sb.run_shell("head -c 3000000 /dev/zero > big; echo $?; for i in $(seq 1 50); do "
                         ": > f$i || { echo full at $i; break; }; done 2>/dev/null; rm -f big f*",
                         limits=lim, workdir=wd)
        assert r.stdout.split("\n")[0] != "0" and "full at" in r.stdout, r
        out = env.box.call_sync("bash", {"command": "ls | wc -l"})
        assert out.startswith("exit code: 0")  # the episode's next call works
    finally:
        env.close()
    assert not os.path.exists(wd)
