"""Sandboxed tools for agents: `python` (run code) and `bash` (run a shell command).

`ToolBox.schemas()` describes them in the OpenAI function-calling format
({"type": "function", "function": {"name", "description", "parameters"}}), for a chat
template's `tools=` or an endpoint's function calling. `await ToolBox.call(name,
arguments)` validates the arguments (a JSON object string, or a dict) and runs the tool in
the sandbox (tsync_mcore.sandbox.jail) in a worker thread (`sandbox.in_thread`: 64 of them), so
the event loop goes on; it never
raises on bad model output: an unknown tool, arguments that are not a JSON object, missing
or mistyped fields, all give an "error: ..." string the model sees. A box made with a
`workdir` runs every call there (files persist between calls: a terminal episode's repo);
without one, each call gets a fresh throwaway directory.

In-text tool calls (`parse_tool_calls`) follow the Qwen/Hermes convention:
`<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>`. docs/guide/tools.md.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from tsync_mcore.sandbox import jail as sb

_SCHEMAS: dict[str, dict[str, Any]] = {
    "python": {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run a Python 3 program in a sandbox (no network, limited time "
                           "and memory) in the working directory; returns its exit code, "
                           "stdout and stderr.",
            "parameters": {
                "type": "object",
                "properties": {
                    "code": {"type": "string", "description": "The program's source."},
                    "stdin": {"type": "string", "description": "Its standard input."},
                },
                "required": ["code"],
                "additionalProperties": False,
            },
        },
    },
    "bash": {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a bash command in a sandbox (no network, limited time and "
                           "memory) in the working directory; returns its exit code, "
                           "stdout and stderr.",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string", "description": "The command line."},
                },
                "required": ["command"],
                "additionalProperties": False,
            },
        },
    },
}

TOOL_NAMES = tuple(_SCHEMAS)


def tool_schemas(names: tuple[str, ...] = TOOL_NAMES) -> list[dict[str, Any]]:
    return [json.loads(json.dumps(_SCHEMAS[n])) for n in names]  # copies


def limits_from_config(tc: Any) -> sb.Limits:
    """sandbox.Limits from a ToolsConfig (config key section `tools`)."""
    return sb.Limits(timeout_s=tc.timeout_s, memory_mb=tc.memory_mb, nproc=tc.nproc,
                     fsize_mb=tc.fsize_mb, user=tc.user, python=tc.python,
                     network=tc.network, max_output=tc.max_output_chars,
                     isolation=tc.isolation, disk_mb=tc.disk_mb, disk_inodes=tc.disk_inodes,
                     uid_base=tc.uid_base)


def format_result(r: sb.Result) -> str:
    """What the model sees of a run: exit code (or the limit that stopped it), output."""
    if r.timed_out:
        head = "killed: wall time limit"
    elif r.limit == "cpu":
        head = "killed: CPU time limit"
    elif r.limit == "fsize":
        head = "killed: file size limit"
    elif r.limit == "memory":
        head = "killed: memory limit"
    elif r.returncode is not None and r.returncode < 0:
        head = f"killed by signal {-r.returncode}"
    else:
        head = f"exit code: {r.returncode}"
    parts = [head]
    if r.stdout:
        parts.append("stdout:\n" + r.stdout.rstrip("\n"))
    if r.stderr:
        parts.append("stderr:\n" + r.stderr.rstrip("\n"))
    return "\n".join(parts)


def _check_args(name: str, arguments: Any) -> dict[str, str] | str:
    """The validated arguments, or an error string."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return f"error: {name}: arguments are not valid JSON ({e.msg} at position {e.pos})"
        except RecursionError:
            return f"error: {name}: arguments are nested too deeply"
    if not isinstance(arguments, dict):
        return (f"error: {name}: arguments must be a JSON object, got "
                f"{type(arguments).__name__}")
    params = _SCHEMAS[name]["function"]["parameters"]
    missing = [k for k in params["required"] if k not in arguments]
    if missing:
        return f"error: {name}: missing argument(s) {', '.join(missing)}"
    unknown = sorted(set(arguments) - set(params["properties"]))
    if unknown:
        return (f"error: {name}: unknown argument(s) {', '.join(unknown)} (takes "
                f"{', '.join(params['properties'])})")
    for k, v in arguments.items():
        if not isinstance(v, str):
            return f"error: {name}: argument {k!r} must be a string, got {type(v).__name__}"
    return arguments


@dataclass
class ToolBox:
    """The python and bash tools under `limits`, in `workdir` (None: a fresh directory per
    call)."""

    limits: sb.Limits = sb.Limits()
    workdir: str | None = None
    names: tuple[str, ...] = TOOL_NAMES

    def __post_init__(self) -> None:
        sb.check_unprivileged(self.limits.user, "tools")

    def schemas(self) -> list[dict[str, Any]]:
        return tool_schemas(self.names)

    def with_workdir(self, workdir: str | None) -> "ToolBox":
        return replace(self, workdir=workdir)

    async def call(self, name: Any, arguments: Any = "{}") -> str:
        """Run tool `name` with `arguments` (a JSON object string or a dict); the result as
        text, or "error: ..." for a call the model got wrong. Never raises for the model's
        mistakes; a broken sandbox (SandboxError) is reported as an error string too."""
        res = self._prepare(name, arguments)
        if isinstance(res, str):
            return res
        fn, kw = res
        try:
            return format_result(await sb.in_thread(fn, **kw))
        except sb.SandboxError as e:
            return f"error: {name}: the sandbox cannot run: {e}"

    def call_sync(self, name: Any, arguments: Any = "{}") -> str:
        res = self._prepare(name, arguments)
        if isinstance(res, str):
            return res
        fn, kw = res
        try:
            return format_result(fn(**kw))
        except sb.SandboxError as e:
            return f"error: {name}: the sandbox cannot run: {e}"

    def _prepare(self, name: Any, arguments: Any):
        if not isinstance(name, str) or name not in self.names:
            return f"error: unknown tool {name!r}; available: {', '.join(self.names)}"
        args = _check_args(name, arguments)
        if isinstance(args, str):
            return args
        common = dict(limits=self.limits, workdir=self.workdir)
        if name == "python":
            return (lambda **kw: sb.run_python(args["code"], stdin=args.get("stdin", ""),
                                               **kw)), common
        return (lambda **kw: sb.run_shell(args["command"], **kw)), common


# --- tool calls in text -------------------------------------------------------------------

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Any  # dict, or the raw value when malformed
    error: str = ""  # non-empty: the call could not be parsed (shown to the model)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks of `text`, in
    order; a block that is not such an object comes back with `error` set."""
    calls = []
    for body in _CALL.findall(text):
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", body, f"error: tool call is not valid JSON ({e.msg})"))
            continue
        except RecursionError:
            calls.append(ToolCall("", body, "error: tool call is nested too deeply"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall("", obj, 'error: a tool call must be {"name": ..., '
                                           '"arguments": {...}}'))
            continue
        calls.append(ToolCall(obj["name"], obj.get("arguments", {})))
    return calls


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"
