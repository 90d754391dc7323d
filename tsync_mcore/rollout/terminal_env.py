"""`rollout.env: terminal` — make a failing test pass in a generated repo, with the
sandboxed bash/python tools (tsync_mcore.sandbox.tools, docs/guide/tools.md).

Each episode (`reset(seed)`) writes a small git-less repo into a fresh temporary
directory: a module with a few functions, one of them buggy (which, and its constants,
follow the seed), a visible failing test (`python test_<module>.py`) and a README. The
agent acts by writing tool calls in its text, in the Qwen/Hermes convention

    <tool_call>{"name": "bash", "arguments": {"command": "python test_calc.py"}}</tool_call>

(tools: `bash` {command}, `python` {code, stdin?}); they run in the sandbox with the repo as
working directory (files persist between calls). The observation is one `tool` message per
call, rendered with the chat template. The episode ends when a turn has no tool call, or
at `max_turns` (that turn's calls still run), and is then verified: the repo's regular
top-level .py files are copied into a fresh sandbox where the verifier's harness imports the
module and reports what its functions return on hidden inputs (other than the visible
test's); the expected values and the comparisons stay here (sandbox/verdict.py), so a
module that shadows or patches the harness's names, forges its report or exits early
passes nothing. Reward 1.0 when every hidden assert holds, else 0.0.
"""

from __future__ import annotations

import os
import random
import stat
from dataclasses import dataclass
from typing import Any

from tsync_mcore.sandbox import jail as sb
from tsync_mcore.sandbox import verdict
from tsync_mcore.rollout.envs import observation_ids, prompt_ids
from tsync_mcore.sandbox.tools import ToolBox, parse_tool_calls

_MODULES = ("calc", "mathutil", "numbers_lib", "helpers", "ops")


@dataclass(frozen=True)
class Task:
    module: str
    files: dict[str, str]  # the repo: name -> text
    hidden_test: str  # test code run after `from <module> import *`
    fixed: str  # the module with the bug fixed (scripted agents, tests)


def _task(seed: int) -> Task:
    rng = random.Random(seed)
    mod = rng.choice(_MODULES)
    kind = rng.randrange(4)
    a, b = rng.randint(2, 9), rng.randint(1, 20)
    if kind == 0:
        name = rng.choice(("affine", "scale_shift", "transform"))
        doc = f"Return x * {a} + {b}."
        bug, fix = f"x * {a} - {b}", f"x * {a} + {b}"
        sig, visible = f"{name}(x)", [(3, 3 * a + b), (0, b)]
        hidden = [(v, v * a + b) for v in (5, -2, 11)]
    elif kind == 1:
        name = rng.choice(("total_upto", "sum_to", "triangle"))
        doc = "Return 1 + 2 + ... + n."
        bug, fix = "sum(range(n))", "sum(range(n + 1))"
        sig, visible = f"{name}(n)", [(a, a * (a + 1) // 2)]
        hidden = [(v, v * (v + 1) // 2) for v in (1, b, 50)]
    elif kind == 2:
        name = rng.choice(("largest", "biggest", "top"))
        doc = "Return the largest element of xs."
        bug, fix = "min(xs)", "max(xs)"
        sig, visible = f"{name}(xs)", [([a, b, 1], max(a, b, 1))]
        hidden = [([v, v + a, v - b], v + a) for v in (0, 7, -3)]
    else:
        name = rng.choice(("shout_reversed", "mirror_upper", "flip_loud"))
        doc = "Return s reversed, in upper case."
        bug, fix = "s.upper()", "s[::-1].upper()"
        word = rng.choice(("abc", "tool", "sandbox", "agent"))
        sig, visible = f"{name}(s)", [(word, word[::-1].upper())]
        hidden = [(w, w[::-1].upper()) for w in ("xyz", "Hello", "q" + word)]
    arg = sig[sig.index("(") + 1:-1]
    helpers = ('def double(x):\n    """Return 2 * x."""\n    return 2 * x\n\n\n'
               'def is_even(n):\n    """Whether n is even."""\n    return n % 2 == 0\n')

    def module(body: str) -> str:
        return (f'"""Small utilities."""\n\n\n{helpers}\n\n'
                f'def {name}({arg}):\n    """{doc}"""\n    return {body}\n')

    checks = "".join(f"assert {name}({x!r}) == {y!r}, {name}({x!r})\n" for x, y in visible)
    test = (f"import os\nimport sys\n\nsys.path.insert(0, os.path.dirname("
            f"os.path.abspath(__file__)))\n\nfrom {mod} import *  # noqa\n\n"
            f"assert double(4) == 8\n{checks}print('all tests passed')\n")
    hidden_checks = "".join(f"assert {name}({x!r}) == {y!r}\n" for x, y in visible + hidden)
    readme = (f"# {mod}\n\nRun the tests with `python test_{mod}.py`. "
              f"They fail: fix `{mod}.py` (the function `{name}`).\n")
    return Task(mod, {f"{mod}.py": module(bug), f"test_{mod}.py": test, "README.md": readme},
                f"assert double(4) == 8\nassert is_even(6)\n{hidden_checks}", module(fix))


SYSTEM_PROMPT = """\
You work in a terminal on a small Python repository. Call a tool by writing
<tool_call>{{"name": "bash", "arguments": {{"command": "..."}}}}</tool_call>
or
<tool_call>{{"name": "python", "arguments": {{"code": "..."}}}}</tool_call>
in your reply; each call's output comes back as a tool message. Commands run in the \
repository (no network, {timeout:g} s per call). Reply without a tool call when you are done."""


@dataclass(frozen=True)
class TerminalConfig:
    max_turns: int = 4
    max_calls_per_turn: int = 4
    verify_timeout_s: float = 20.0


class TerminalTaskEnv:
    """An `AgentEnv`: fix the failing test of a generated repo (module docstring)."""

    def __init__(self, tokenizer: Any, config: TerminalConfig | None = None,
                 limits: sb.Limits | None = None) -> None:
        self.tok = tokenizer
        self.cfg = config or TerminalConfig()
        self.limits = limits or sb.Limits()
        self.box = ToolBox(self.limits)
        self.task: Task | None = None
        self.workdir: str | None = None
        self.turn = 0
        self.n_calls = 0
        self._reward: float | None = None
        self.verify_result: sb.Result | None = None

    # --- episode ---------------------------------------------------------------------------

    def reset(self, seed: int) -> list[int]:
        return prompt_ids(self.tok, self.start(seed))

    def start(self, seed: int) -> list[dict[str, str]]:
        """A fresh episode: write its repo, return its first messages (system, user). The
        OpenAI endpoint's agents get these; `reset` is their ids for the built-in loop."""
        self.close()
        self.task = _task(seed)
        # a tmpfs of its own under the namespaces: the episode's bytes and files are bounded
        self.workdir = sb.episode_dir(self.limits, prefix="tsync-terminal-")
        for name, text in self.task.files.items():
            with open(os.path.join(self.workdir, name), "w", encoding="utf-8") as f:
                f.write(text)
        self.box = ToolBox(self.limits, workdir=self.workdir)
        self.turn = self.n_calls = 0
        self._reward = None
        self.verify_result = None
        mod = self.task.module
        return [
            {"role": "system", "content": SYSTEM_PROMPT.format(timeout=self.limits.timeout_s)},
            {"role": "user", "content": f"The test `python test_{mod}.py` fails. Fix "
                                        f"`{mod}.py` so that it passes. Files: "
                                        f"{', '.join(sorted(self.task.files))}."}]

    async def step(self, action_ids: list[int]) -> tuple[list[int], bool]:
        if self.task is None:
            raise RuntimeError("TerminalTaskEnv.step before reset")
        self.turn += 1
        text = self.tok.decode(action_ids, skip_special_tokens=True)
        calls = parse_tool_calls(text)
        messages = []
        for i, c in enumerate(calls):
            if i >= self.cfg.max_calls_per_turn:
                out = (f"error: at most {self.cfg.max_calls_per_turn} tool calls per turn; "
                       f"this one did not run")
            else:
                out = c.error or await self.box.call(c.name, c.arguments)
                self.n_calls += not c.error
            messages.append({"role": "tool", "content": out})
        if not calls or self.turn >= self.cfg.max_turns:
            await sb.in_thread(self._verify)
            return [], True
        return observation_ids(self.tok, messages, action_ids), False

    def timeout_observation(self, action_ids: list[int]) -> tuple[list[int], bool]:
        # A tool call past the agent's limit: the episode ends (reward() verifies).
        return [], True

    async def verify(self) -> float:
        """The verifier's reward, off the event loop (the hidden tests take seconds)."""
        return await sb.in_thread(self._verify)

    def reward(self) -> float:
        if self._reward is None:
            self._verify()  # the agent stopped early (token budget, timeout): verify now
        return float(self._reward or 0.0)

    def close(self) -> None:
        if self.workdir is not None:
            sb.remove_episode_dir(self.workdir)
            self.workdir = None

    # --- verifier --------------------------------------------------------------------------

    def _sources(self) -> dict[str, str]:
        """The repo's regular top-level .py files (no links, FIFOs, or huge files; test
        files are the hidden tests' business)."""
        out = {}
        assert self.workdir is not None
        try:  # the repo belongs to the sandbox user: a symlink in its place is not followed
            top = os.open(self.workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            return out  # replaced or gone: nothing to verify, the episode scores 0
        try:
            for name in sorted(os.listdir(top)):
                if not name.endswith(".py") or name.startswith("test_"):
                    continue
                try:
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=top)
                except OSError:
                    continue
                with os.fdopen(fd, "rb") as f:
                    st = os.fstat(fd)
                    if stat.S_ISREG(st.st_mode) and st.st_size <= 1 << 20:
                        out[name] = f.read(1 << 20).decode("utf-8", errors="replace")
        finally:
            os.close(top)
        return out

    def _verify(self) -> float:
        if self._reward is not None:
            return self._reward
        if self.task is None or self.workdir is None:
            self._reward = 0.0
            return 0.0
        # The hidden tests' expected values and comparisons never enter the sandbox that
        # imports the repo's module: it reports what the module's functions return, and
        # the verdict is decided here (sandbox/verdict.py, sandbox/harness.py).
        plan = verdict.plan(self.task.hidden_test)
        lim = sb.Limits(**{**self.limits.__dict__, "timeout_s": self.cfg.verify_timeout_s,
                           "max_output": max(self.limits.max_output, 1 << 20)})
        sources = self._sources()

        def run(spec: dict) -> str:
            files = {**(sources if spec["mode"] == "solution" else {}),
                     **verdict.harness_files(spec)}
            # (a SandboxError propagates: a broken sandbox is not the agent's failure)
            self.verify_result = sb.run_python(verdict.HARNESS, limits=lim, files=files)
            return self.verify_result.stdout

        self._reward = float(all(verdict.check([plan], run, module=self.task.module)))
        self.close()
        return self._reward

    def __del__(self) -> None:  # an abandoned episode's repo
        try:
            self.close()
        except Exception:
            pass


def terminal_envs(tokenizer: Any, n: int, *, max_turns: int, tools_cfg: Any) -> list:
    """`n` TerminalTaskEnv of the config's `tools` section (the driver's registry hook)."""
    from tsync_mcore.sandbox.tools import limits_from_config

    conf = TerminalConfig(max_turns=max_turns, max_calls_per_turn=tools_cfg.max_calls_per_turn,
                          verify_timeout_s=tools_cfg.verify_timeout_s)
    lim = limits_from_config(tools_cfg)
    return [TerminalTaskEnv(tokenizer, conf, lim) for _ in range(n)]
