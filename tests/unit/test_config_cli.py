"""Config reference, resolve step, launcher command lines, channel port errors, launch/run.py."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import socket
import sys
import threading

import pytest
import yaml

from tests.helpers.paths import ROOT
from tsync_mcore import config as config_mod
from tsync_mcore.channel import ChannelError, ChannelTimeout, open_rollout_side
from tsync_mcore.channel.link import connect_learner
from tsync_mcore.cli import launch
from tsync_mcore.config import ConfigError, load_config, parse_overrides, resolve
from tsync_mcore.config import reference as config_doc
from tsync_mcore.config import rules
from tsync_mcore.util.net import free_port  # noqa: E402

LAUNCHERS = ["learner", "rollout", "demo", "run"]
SECRET = b"s" * 32


def test_reference_is_up_to_date_and_every_key_documented():
    missing = [k.dotted for k in config_doc.keys() if not k.doc]
    assert not missing, f"config keys without a comment in tsync_mcore/config/: {missing}"
    with open(config_doc.REFERENCE, encoding="utf-8") as f:
        assert f.read() == config_doc.reference(), \
            "docs/guide/config.md is stale: run python -m tsync_mcore.config --reference"
    # every key of every section is in it, with its default
    text = config_doc.reference()
    for k in config_doc.keys():
        assert f"| `{k.dotted}` |" in text
    assert "| `channel.port` | int | `29610` |" in text


def test_field_comments_same_line_wins_else_the_block_above():
    src = (
        "class A:\n"
        "    # not this one\n"
        "\n"
        "    # first line\n"
        "    # second line\n"
        "    x: int = 1\n"
        "    y: str = 'a'  # inline\n"
        "    # above, ignored\n"
        "    z: float = 2.0  # inline wins\n"
        "    w: bool = True\n"
    )
    docs = config_doc.field_docs(src)
    assert docs[("A", "x")] == "first line second line"
    assert docs[("A", "y")] == "inline"
    assert docs[("A", "z")] == "inline wins"
    assert docs[("A", "w")] == ""


def test_check_command_fails_on_a_stale_reference(tmp_path, capsys):
    stale = tmp_path / "config.md"
    stale.write_text("old\n")
    assert config_doc.main(["--check", "--out", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert config_doc.main(["--reference", "--out", str(stale)]) == 0
    assert config_doc.main(["--check", "--out", str(stale)]) == 0


def test_resolve_makes_every_auto_concrete_and_says_why(monkeypatch):
    monkeypatch.setattr(rules, "on_gpu", lambda: False)
    cfg = load_config(None, {"model.dtype": "bf16"})
    assert (cfg.learner.token_norm, cfg.rollout.routing, cfg.rollout.dtype, cfg.model.spec,
            cfg.model.attention) == ("trajectory", "balanced", "bf16", "local", "megatron")
    assert len(cfg.choices) == 5 and all(" auto -> " in c and "(" in c for c in cfg.choices)
    assert "model.spec: auto -> local (no CUDA)" in cfg.choices
    # nothing auto is left anywhere, and resolving again chooses nothing
    flat = json.dumps(config_mod.to_dict(cfg))
    assert '"auto"' not in flat
    assert resolve(cfg) == []
    opd = load_config(None, {"learner.objective": "opd"})
    assert (opd.learner.token_norm, opd.rollout.routing, opd.rollout.dtype) == \
        ("token_mean", "static", "fp32")
    explicit = load_config(None, {"learner.token_norm": "token_mean", "rollout.routing": "static",
                                  "rollout.dtype": "fp32", "model.spec": "local",
                                  "model.attention": "sdpa"})
    assert explicit.choices == []


def test_resolve_on_gpu_picks_te_with_or_without_span_forwards(monkeypatch):
    """Span forwards (OPD turns, shared prompts) run on TE layers: `auto` never falls back."""
    monkeypatch.setattr(rules, "on_gpu", lambda: True)
    monkeypatch.setattr(rules, "te_available", lambda: True)
    plain = load_config(None, {"learner.shared_prefix": False})
    assert (plain.model.spec, plain.model.attention) == ("te", "sdpa")
    shared = load_config(None, {})  # shared_prefix defaults to true
    assert shared.model.spec == "te"
    assert "model.spec: auto -> te (CUDA and transformer_engine present)" in shared.choices
    opd = load_config(None, {"learner.objective": "opd"})
    assert opd.model.spec == "te"
    for over in ({}, {"learner.objective": "opd"}):  # an explicit te is accepted with spans
        assert load_config(None, {"model.spec": "te", **over}).model.spec == "te"
    monkeypatch.setattr(rules, "te_available", lambda: False)
    no_te = load_config(None, {"learner.objective": "opd"})
    assert no_te.model.spec == "local"
    assert "model.spec: auto -> local (transformer_engine not importable)" in no_te.choices


def test_resolve_refuses_impossible_combinations(monkeypatch):
    monkeypatch.setattr(rules, "on_gpu", lambda: True)
    monkeypatch.setattr(rules, "te_available", lambda: False)
    with pytest.raises(ConfigError, match=r"'model.spec'.*needs CUDA.*transformer_engine"):
        load_config(None, {"model.spec": "te"})
    monkeypatch.setattr(rules, "on_gpu", lambda: False)
    with pytest.raises(ConfigError, match=r"'model.spec'.*needs CUDA"):
        load_config(None, {"model.spec": "te", "learner.shared_prefix": False})


def test_launch_and_rollout_engine_keys_are_checked():
    ok = load_config(None, {"launch.learner_gpus": "0,1", "launch.rollout_gpus": "2,3",
                            "rollout.tp": 2, "rollout.gpu_memory_utilization": 0.8})
    assert (ok.launch.learner_gpus, ok.rollout.tp) == ("0,1", 2)
    for overrides, key in [({"launch.learner_gpus": "0,1,2"}, "launch.learner_gpus"),
                           ({"launch.learner_gpus": "0,a"}, "launch.learner_gpus"),
                           ({"launch.rollout_gpus": "1,1"}, "launch.rollout_gpus"),
                           ({"launch.rollout_gpus": "0", "rollout.tp": 2}, "launch.rollout_gpus"),
                           ({"rollout.tp": 0}, "rollout.tp"),
                           ({"rollout.gpu_memory_utilization": 1.5},
                            "rollout.gpu_memory_utilization"),
                           ({"rollout.dtype": "fp16"}, "rollout.dtype"),
                           ({"model.dtype": "bf16", "model.autocast": "bf16"},
                            "model.autocast")]:
        with pytest.raises(ConfigError, match=f"'{key}'"):
            load_config(None, overrides)


def test_cpu_placement_lists_overlap_and_environment(capsys, monkeypatch):
    """launch.rollout_cpus / learner_cpus: CPU lists, disjoint when both sides share a host,
    and each side's environment carries its cores and thread counts."""
    from tsync_mcore.cli.launch import check_cpu_placement, learner_env, rollout_env
    from tsync_mcore.util import cpus
    assert cpus.parse("0-3,8") == [0, 1, 2, 3, 8] and cpus.parse("") == []
    for bad in ("a", "3-1", "0,,1", "-1", "1-"):
        assert cpus.parse(bad) is None, bad
        with pytest.raises(ConfigError, match="'launch.rollout_cpus'"):
            load_config(None, {"launch.rollout_cpus": bad})
    cfg = load_config(None, {"launch.rollout_cpus": "0", "launch.learner_cpus": "1-4",
                             "rollout.n_learners": 2})
    env = learner_env(cfg, {})
    assert (env[cpus.ENV], env["OMP_NUM_THREADS"]) == ("1-4", "2")  # 4 cores, 2 ranks
    env = rollout_env(cfg, {})
    assert (env[cpus.ENV], env["OMP_NUM_THREADS"], env["VLLM_CPU_OMP_THREADS_BIND"]) == \
        ("0", "1", "0")
    assert cpus.ENV not in learner_env(load_config(None, {}), {})  # unset: inherit
    assert load_config(None, {"launch.rollout_cpus": 0}).launch.rollout_cpus == "0"  # --set …=0
    check_cpu_placement(cfg, "run")
    overlap = load_config(None, {"launch.rollout_cpus": "0-1", "launch.learner_cpus": "1"})
    with pytest.raises(SystemExit) as e:
        check_cpu_placement(overlap, "run")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "share cores [1]" in err, err
    # a process told to use cores it may not: one line, exit 2
    monkeypatch.setenv(cpus.ENV, "4095")
    with pytest.raises(SystemExit) as e:
        cpus.pin_from_env("rollout")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "cores [4095] are not available" in err and \
        err.count("\n") == 1, err


def test_tensor_parallel_sizes_are_checked_against_the_checkpoint(tiny_qwen2):
    # tiny_qwen2: 4 attention heads, 2 KV heads, vocab 256
    assert load_config(None, {"model.hf_dir": tiny_qwen2, "model.tp": 2,
                              "rollout.n_learners": 2, "rollout.tp": 4}).model.tp == 2
    with pytest.raises(ConfigError, match=r"'model.tp': 4 does not divide the 2 KV heads"):
        load_config(None, {"model.hf_dir": tiny_qwen2, "model.tp": 4, "rollout.n_learners": 4})
    with pytest.raises(ConfigError, match=r"'rollout.tp': vLLM cannot split"):
        load_config(None, {"model.hf_dir": tiny_qwen2, "rollout.tp": 3})


def test_every_config_file_loads_and_resolves():
    paths = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ROOT, "configs"))
             for f in fs if f.endswith(".yaml")]
    assert any("recipes" in p for p in paths)
    for path in sorted(paths):
        cfg = load_config(path)
        assert '"auto"' not in json.dumps(config_mod.to_dict(cfg)), path


OLD_PUBLISH = {"run.publish": ("file", "method"), "run.publish_dir": ("/tmp/pub", "dir"),
               "run.publish_bucket_mb": (8, "bucket_mb"), "run.publish_delta": (False, "delta"),
               "run.publish_delta_dense": (0.5, "delta_dense"),
               "run.publish_port": (29611, "port"), "run.publish_ifname": ("lo", "ifname"),
               "run.publish_lora": ("merged", "lora")}


def test_old_publish_keys_still_load_as_the_publish_section(tmp_path, capsys):
    """run.publish and run.publish_* (a YAML file's or --set's) land in publish.*, each
    with one line naming old → new; the old and the new name at once is one line too."""
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"run": {k.split(".")[1]: v for k, (v, _) in
                                            OLD_PUBLISH.items()}}))
    from_file = load_config(str(path))
    from_set = load_config(None, {k: v for k, (v, _) in OLD_PUBLISH.items()})
    for cfg in (from_file, from_set):
        for value, new in OLD_PUBLISH.values():
            assert getattr(cfg.publish, new) == value, new
    err = capsys.readouterr().err.splitlines()
    for old, (_, new) in OLD_PUBLISH.items():
        said = [line for line in err if f"'{old}'" in line]
        assert len(said) == 2 and all(f"'publish.{new}'" in line and "deprecated" in line
                                      for line in said), (old, err)
    # --set wins over a file's old name; a file with both names is refused
    assert load_config(str(path), {"publish.method": "dist"}).publish.method == "dist"
    path.write_text("run: {publish: file}\npublish: {method: dist}\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert "'publish.method'" in str(e.value) and "run.publish" in str(e.value)
    assert "\n" not in str(e.value)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    launch.add_config_args(p)
    return p


def test_set_repeats_in_both_forms():
    args = _parser().parse_args(["--config", "c.yaml", "--set", "a.b=1", "c.d=2",
                                 "--set", "e=3"])
    assert launch.set_items(args) == ["a.b=1", "c.d=2", "e=3"]
    args.config = None
    args.set = [["run.updates=3", "learner.k_open=2"], ["seed=7"]]
    cfg = launch.config_from_args("t", args, log=False)
    assert (cfg.run.updates, cfg.learner.k_open, cfg.seed) == (3, 2, 7)


@pytest.mark.parametrize("item,why", [("learner.k_open", "must be KEY=VALUE"),
                                      ("=3", "must be KEY=VALUE"),
                                      ("learner..k_open=2", "must be KEY=VALUE"),
                                      ("learner.k_open=[", "not YAML"),
                                      ("learner.nope=1", "unknown key")])
def test_bad_set_items_are_one_line_errors(item, why, capsys):
    args = _parser().parse_args(["--config", "x", "--set", "run.updates=2", "--set", item])
    args.config = None
    with pytest.raises(SystemExit) as e:
        launch.config_from_args("t", args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and why in err and err.count("\n") == 1 and err.startswith("error:")


def launcher(name: str, *argv: str, monkeypatch) -> int:
    """Run launch/<name>.py in this process (as `python launch/<name>.py ARGV`); its exit code."""
    monkeypatch.setattr(sys, "argv", [f"launch/{name}.py", *argv])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(os.path.join(ROOT, "launch", f"{name}.py"), run_name="__main__")
    return e.value.code


@pytest.mark.parametrize("name", LAUNCHERS)
def test_every_launcher_prints_the_resolved_config(name, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    rc = launcher(name, "--config", os.path.join(ROOT, "tsync_mcore/cli/demo.yaml"),
                  "--set", "run.updates=3", "learner.k_open=2", "--set", "seed=7",
                  f"run.dir={run_dir}", "--print-config", monkeypatch=monkeypatch)
    out = capsys.readouterr().out
    assert rc == 0
    printed = yaml.safe_load(out)
    assert (printed["run"]["updates"], printed["learner"]["k_open"], printed["seed"]) == (3, 2, 7)
    assert printed["learner"]["token_norm"] == "trajectory"
    assert '"auto"' not in json.dumps(printed)
    assert out.startswith("# learner.token_norm: auto -> trajectory")  # the choices, as comments
    assert not run_dir.exists()  # printing starts nothing and writes nothing


@pytest.mark.parametrize("name", LAUNCHERS)
def test_every_launcher_documents_every_option(name, monkeypatch, capsys):
    assert launcher(name, "--help", monkeypatch=monkeypatch) == 0
    out = capsys.readouterr().out
    assert "--print-config" in out and "may repeat" in out
    lines = out.split("options:")[1].splitlines()
    flags = [i for i, line in enumerate(lines) if line.startswith("  -")]
    assert len(flags) >= 4
    for i in flags:  # help on the flag's line (after a column gap) or indented below it
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        assert "  " in lines[i].strip() or nxt.startswith(" " * 20), lines[i]


def test_a_taken_port_is_one_line_naming_addr_port_and_the_key():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        with pytest.raises(ChannelError) as e:
            open_rollout_side("127.0.0.1", port, 1, timeout_s=1, secret=SECRET)
    msg = str(e.value)
    assert f"127.0.0.1:{port}" in msg and "channel.port" in msg and "\n" not in msg


def test_learner_says_once_where_it_waits_then_stops_with_one_line(capfd):
    port = free_port()
    with pytest.raises(ChannelTimeout) as e:
        connect_learner("127.0.0.1", port, 0, 1, 1.0, SECRET)
    err = capfd.readouterr().err
    assert err.count("waiting for the rollout's channel at") == 1
    assert f"127.0.0.1:{port}" in err and "channel.timeout_s" in err
    assert f"127.0.0.1:{port}" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("reply", [b"HTTP/1.1 400 Bad Request\r\n\r\n" * 4, b""])
def test_a_foreign_listener_is_named_as_such(reply):
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def answer():
        conn, _ = srv.accept()
        conn.sendall(reply)
        conn.close()

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        with pytest.raises(ChannelError) as e:
            connect_learner("127.0.0.1", port, 0, 1, 5.0, SECRET)
    finally:
        t.join(5)
        srv.close()
    msg = str(e.value)
    assert "not this run's rollout" in msg and f"channel.port {port}" in msg


def test_another_runs_rollout_is_named_as_such():
    port = free_port()
    other = threading.Thread(
        target=lambda: pytest.raises(ChannelError, open_rollout_side, "127.0.0.1", port, 1,
                                     timeout_s=3, secret=b"o" * 32), daemon=True)
    other.start()
    try:
        with pytest.raises(ChannelError) as e:
            connect_learner("127.0.0.1", port, 0, 1, 5.0, SECRET)
    finally:
        other.join(10)
    assert "authentication failed" in str(e.value) and "not this run's rollout" in str(e.value)


def test_resume_without_a_checkpoint_is_one_line(tmp_path, monkeypatch, capsys):
    for name in ("run", "demo"):
        rc = launcher(name, "--config", os.path.join(ROOT, "tsync_mcore/cli/demo.yaml"), "--resume",
                      "--set", f"run.dir={tmp_path}/{name}", monkeypatch=monkeypatch)
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and err[-1].startswith(f"error: {name}: --resume: run directory "
                                              f"{tmp_path}/{name} does not exist"), err
        assert not any(line.startswith("error:") for line in err[:-1])
    os.makedirs(tmp_path / "empty")  # a run directory without a checkpoint
    rc = launcher("run", "--config", os.path.join(ROOT, "tsync_mcore/cli/demo.yaml"), "--resume",
                  "--set", f"run.dir={tmp_path}/empty", monkeypatch=monkeypatch)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: run: --resume: no checkpoint under"), err
    assert not any(line.startswith("error:") for line in err[:-1])


def test_resume_keeps_the_metrics_rows_up_to_the_checkpoint(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_2\n")
    rows = [dict(step=s, policy_version=s - 1) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows)
                                            + '{"step": 4, "cut')
    v = launch.resume_version(str(tmp_path))
    assert v == 2
    assert launch._metrics_before(str(tmp_path / "metrics.jsonl"), v) == rows[:2]


def test_config_and_data_files_that_are_not_plain_files_are_one_line(tmp_path):
    """A FIFO is refused without waiting for a writer, a huge or deeply nested file without a
    traceback, and no refusal quotes the file (a config pointed at a secret)."""
    from tsync_mcore.data.load import DataError, load_prompts

    fifo = tmp_path / "cfg.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"cfg.yaml: not a regular file$"):
        load_config(str(fifo))
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$SECRETHASH:19000:0:99999:7:::\nbin:*:19000::::::\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(secret))
    assert "SECRETHASH" not in str(e.value) and "\n" not in str(e.value)
    colon = tmp_path / "colon.yaml"
    colon.write_text("model: {hf_dir: x}\n  bad: [SECRETHASH\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(colon))
    assert "SECRETHASH" not in str(e.value) and "colon.yaml:" in str(e.value)
    deep = tmp_path / "deep.yaml"
    deep.write_text("model: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match="deep.yaml: nested too deeply"):
        load_config(str(deep))
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (2 << 20) + "\n")
    with pytest.raises(ConfigError, match="big.yaml: larger than"):
        load_config(str(big))
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config(None, parse_overrides([f"model.hf_dir={'[' * 100_000}"]))
    data = tmp_path / "train.jsonl"
    os.mkfifo(data)
    cfg = load_config(None, {"model.hf_dir": str(tmp_path)})
    with pytest.raises(DataError, match=r"train.jsonl: not a regular file$"):
        load_prompts(str(data), cfg.data)


@pytest.mark.parametrize("key", ["tools.user", "reward.sandbox_user"])
def test_a_sandbox_user_may_not_be_root(key):
    with pytest.raises(ConfigError, match=rf"'{key}'.*root \(uid 0\)"):
        load_config(None, {"model.hf_dir": "/nonexistent", key: "root"})


def test_a_config_that_is_a_directory_is_one_line(tmp_path, monkeypatch, capsys):
    """`--config DIRECTORY` (and a FIFO) is named in one line, not a traceback."""
    os.mkfifo(tmp_path / "fifo")
    for path, why in [(tmp_path, "a directory, not a YAML file"),
                      (tmp_path / "fifo", "not a regular file")]:
        assert launcher("run", "--config", str(path), monkeypatch=monkeypatch) == 2
        assert capsys.readouterr().err == f"error: run: config file {path}: {why}\n"
