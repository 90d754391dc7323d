"""The general sandbox (tsync_mcore.sandbox.jail), the agents' tools (tsync_mcore.sandbox.tools) and the
terminal task env (rollout.env: terminal). Fast: no vLLM, no model; a tiny tokenizer.

What must hold: a tool call that loops forever, forks without end, allocates 10 GB, writes
a huge file or opens a socket is stopped or refused — each returns a result — and the next
sandbox call works."""

from __future__ import annotations

import json

import pytest

from tests.helpers.sandbox_tools_shared import tok  # noqa: F401  (fixtures)
from tsync_mcore.rollout.terminal_env import TerminalTaskEnv
from tsync_mcore.sandbox.tools import format_tool_call, parse_tool_calls, tool_schemas


def test_tool_schemas_are_openai_function_schemas():
    jsonschema = pytest.importorskip("jsonschema")
    schemas = tool_schemas()
    assert [s["function"]["name"] for s in schemas] == ["python", "bash"]
    for s in schemas:
        assert s["type"] == "function" and set(s["function"]) == {"name", "description",
                                                                   "parameters"}
        params = s["function"]["parameters"]
        jsonschema.Draft202012Validator.check_schema(params)
        assert params["type"] == "object" and set(params["required"]) <= set(params["properties"])
        json.dumps(s)
    jsonschema.validate({"command": "ls"}, schemas[1]["function"]["parameters"])


def test_parse_tool_calls():
    text = ("I will look. " + format_tool_call("bash", {"command": "ls"}) +
            "<tool_call>{oops}</tool_call><tool_call>[1]</tool_call>")
    calls = parse_tool_calls(text)
    assert calls[0].name == "bash" and calls[0].arguments == {"command": "ls"}
    assert calls[1].error.startswith("error:") and calls[2].error.startswith("error:")
    assert parse_tool_calls("no calls here") == []
    # 5,000-deep JSON (Python's recursion limit) is the model's error, not a RecursionError
    deep = "[" * 5000 + "]" * 5000
    call, = parse_tool_calls(f"<tool_call>{deep}</tool_call>")
    assert call.error == "error: tool call is nested too deeply"
    from tsync_mcore.sandbox.tools import _check_args
    assert _check_args("bash", '{"command": ' + deep + "}") == \
        "error: bash: arguments are nested too deeply"


def test_terminal_env_from_config_and_the_driver_hook(tok):

    from tsync_mcore.config import ConfigError, load_config
    from tsync_mcore.rollout.plan import Batch, batch_envs, step_timeout_s

    cfg = load_config(None, {"rollout": {"env": "terminal", "max_turns": 5},
                             "tools": {"timeout_s": 3.0, "network": "require"}})
    cfg.validate()  # no data.train needed
    envs = batch_envs(cfg, tok, None, Batch(0, {}, [], [], ["a", "b"], ["g", "g"]))
    assert len(envs) == 2 and all(isinstance(e, TerminalTaskEnv) for e in envs)
    assert envs[0].cfg.max_turns == 5 and envs[0].limits.timeout_s == 3.0
    assert envs[0].limits.network == "require"
    assert step_timeout_s(cfg) == 3.0 * 4 + 20.0 + 10.0
    for bad in ({"tools": {"network": "maybe"}}, {"tools": {"timeout_s": 0}},
                {"rollout": {"env": "terminal"}, "learner": {"objective": "opd"}}):
        with pytest.raises(ConfigError):
            c = load_config(None, {"rollout": {"env": "terminal"}, **bad})
            c.validate()

