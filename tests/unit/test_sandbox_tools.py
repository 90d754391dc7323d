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



@pytest.mark.parametrize("key", ["tools.user", "reward.sandbox_user"])
@pytest.mark.parametrize("user", ["", "  "])
def test_an_empty_sandbox_user_is_refused(key, user):
    """'' kept root for the model's code (the bash tool read /etc/shadow): refused in one
    line naming the key, and the tools and the code sandbox refuse it too."""
    from tsync_mcore.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=rf"^config key '{key}': is empty: it would keep root"):
        load_config(None, {"model.hf_dir": "/nonexistent", key: user})


def test_no_tool_or_code_sandbox_runs_as_root():
    from tsync_mcore.rewards.sandbox import SandboxLimits
    from tsync_mcore.sandbox import jail
    from tsync_mcore.sandbox.tools import ToolBox

    for user in ("", "root"):
        with pytest.raises(jail.SandboxError, match="root"):
            ToolBox(jail.Limits(user=user))
        with pytest.raises(jail.SandboxError, match="root"):
            SandboxLimits(user=user)


def test_the_seccomp_filter_is_well_formed_for_both_architectures(monkeypatch):
    import platform
    import struct

    from tsync_mcore.sandbox import seccomp

    for machine, arch in (("x86_64", 0xC000003E), ("aarch64", 0xC00000B7)):
        monkeypatch.setattr(platform, "machine", lambda m=machine: m)
        assert seccomp.supported() == ""
        prog = seccomp.program()
        ins = [struct.unpack("=HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
        assert ins[1][3] == arch and ins[-4:] == [(6, 0, 0, 0x7FFF0000), (6, 0, 0, 0x50001),
                                                  (6, 0, 0, 0x50026), (6, 0, 0, 0x80000000)]
        for i, (code, jt, jf, _) in enumerate(ins):  # every jump lands inside the program
            if code & 0x07 == 0x05:
                assert i + 1 + max(jt, jf) < len(ins)
    monkeypatch.setattr(platform, "machine", lambda: "riscv64")
    assert "riscv64" in seccomp.supported()
