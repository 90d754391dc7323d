"""From YAML and `--set` overrides to a validated, resolved `Config`: the file read safely,
each value checked against its field's annotation, and the renamed keys (`RENAMED`) moved
to their new places."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import stat
import sys
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from tsync_mcore.config.checks import ConfigError, check
from tsync_mcore.config.rules import Config, resolve


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotated type `tp`; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        check(value in allowed, key, f"must be one of {list(allowed)}, got {value!r}")
        return value
    if tp is bool:
        check(isinstance(value, bool), key, f"must be true/false, got {value!r}")
        return value
    if tp is int:
        check(isinstance(value, int) and not isinstance(value, bool), key,
              f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        check(ok, key, f"must be a number, got {value!r}")
        # inf/nan would pass every range check below and then poison the update
        check(math.isfinite(float(value)), key, f"must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if key.endswith(("_gpus", "_cpus")) and type(value) is int:
            value = str(value)  # one device: YAML reads `launch.rollout_cpus=0` as the int 0
        check(isinstance(value, str), key, f"must be a string, got {value!r}")
        return value
    if origin is dict:  # free-form parameters handed on as they are (reasoning_gym.params)
        check(isinstance(value, dict) and all(isinstance(k, str) for k in value), key,
              f"must be a mapping of names to values, e.g. {{a: 1}}, got {value!r}")
        return dict(value)
    if origin is list:
        (item,) = typing.get_args(tp)
        check(isinstance(value, list), key, f"must be a list, e.g. [a, b], got {value!r}")
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    raise ConfigError(f"config key '{key}': unsupported type {tp}")


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass `cls` from a mapping, naming the dotted key of any error."""
    if not isinstance(data, dict):
        where = prefix.rstrip(".") or "<root>"
        raise ConfigError(f"config key '{where}': must be a mapping of its keys, got "
                          f"{type(data).__name__} {str(data)[:80]!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            if not (isinstance(key, str) and _NAME.fullmatch(key)):
                # not quoted: a config pointed at some other file (a secret) must not print it
                n = len(key) if isinstance(key, str) else len(repr(key))
                raise ConfigError(f"config key under '{prefix.rstrip('.') or '<root>'}': a "
                                  f"{n}-character key that is no config name (is this a "
                                  f"config file?); allowed: {sorted(names)}")
            where = f"{prefix}{key}"
            raise ConfigError(f"config key '{where}': unknown key (allowed: {sorted(names)})")
    kwargs = {}
    for name, value in data.items():
        tp, key = hints[name], f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            kwargs[name] = from_dict(tp, value, prefix=f"{key}.")
        else:
            kwargs[name] = _coerce(value, tp, key)
    return cls(**kwargs)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` command-line overrides; each VALUE is read as YAML (`4`, `true`, `1e-6`)."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r}: must be KEY=VALUE with a dotted key, e.g. "
                              f"learner.k_open=2")
        try:
            out[key] = yaml.safe_load(value)
        except RecursionError:
            raise ConfigError(f"override {key}: value nested too deeply") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not YAML "
                              f"({str(e).splitlines()[0]})") from None
    return out


MAX_CONFIG_BYTES = 1 << 20  # a config is a page of YAML; more is not one


def _read_yaml(path: str | Path) -> dict[str, Any]:
    """A config file's mapping. Only a regular file is read (a FIFO or device would block
    or never end), at most MAX_CONFIG_BYTES, and no error quotes its content (a config
    pointed at a secret must not print it)."""
    try:
        # O_NONBLOCK: a FIFO does not wait for a writer before fstat refuses it
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise ConfigError(f"config file {path}: cannot read ({e.strerror or e})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # checked before fdopen, which refuses a directory itself
        os.close(fd)
        kind = "a directory, not a YAML file" if stat.S_ISDIR(mode) else "not a regular file"
        raise ConfigError(f"config file {path}: {kind}")
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path}: not UTF-8 text") from None
    except RecursionError:
        raise ConfigError(f"config file {path}: nested too deeply to be a config") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}" if mark is not None else ""
        why = getattr(e, "problem", None) or type(e).__name__
        raise ConfigError(f"config file {path}{at}: not valid YAML ({why})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: must be a mapping of sections (model:, "
                          f"learner:, ...), got a YAML {type(data).__name__}")
    return data


# Keys that moved, old dotted name → new. The old names still load, in a YAML file and in
# --set overrides, each with one line on stderr naming old → new (as learner.token_norm's
# deprecated values are resolved and said).
RENAMED = {
    "run.publish": "publish.method",
    "run.publish_dir": "publish.dir",
    "run.publish_bucket_mb": "publish.bucket_mb",
    "run.publish_delta": "publish.delta",
    "run.publish_delta_dense": "publish.delta_dense",
    "run.publish_port": "publish.port",
    "run.publish_ifname": "publish.ifname",
    "run.publish_lora": "publish.lora",
}


def _deprecated(old: str, new: str, where: str) -> None:
    print(f"config: '{old}' is deprecated, renamed '{new}' ({where}); the old name still "
          f"works", file=sys.stderr, flush=True)


def _rename_keys(data: dict[str, Any], where: str) -> None:
    """Move every RENAMED key found in the mapping `data` (a YAML file's) to its new place."""
    for old, new in RENAMED.items():
        (old_sec, old_key), (new_sec, new_key) = old.split("."), new.split(".")
        section = data.get(old_sec)
        if not isinstance(section, dict) or old_key not in section:
            continue
        target = data.setdefault(new_sec, {})
        if not isinstance(target, dict):
            raise ConfigError(f"config key '{new_sec}': must be a mapping of its keys, got "
                              f"{type(target).__name__} {str(target)[:80]!r}")
        if new_key in target:
            raise ConfigError(f"config key '{new}': set twice in {where}, also by its old "
                              f"name '{old}'; keep '{new}' only")
        target[new_key] = section.pop(old_key)
        _deprecated(old, new, where)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None,
                replay: bool = False) -> Config:
    """Load a YAML file (or defaults) and apply dotted overrides like {"learner.k_open": 2}.
    `replay`: validate for the replay harness (Config.validate). Old key names (RENAMED)
    are moved to their new ones, with one line each."""
    data: dict[str, Any] = _read_yaml(path) if path is not None else {}
    _rename_keys(data, str(path))
    for dotted, value in (overrides or {}).items():
        if dotted in RENAMED:
            _deprecated(dotted, RENAMED[dotted], "--set")
            dotted = RENAMED[dotted]
        node = data
        *parents, leaf = dotted.split(".")
        for i, p in enumerate(parents):
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                where = ".".join(parents[:i + 1])
                raise ConfigError(f"config key '{where}': a section, cannot hold "
                                  f"'{dotted}' (it was set to {node!r})")
        node[leaf] = value
    cfg = from_dict(Config, data)
    cfg.validate(replay=replay)
    cfg.choices = resolve(cfg)  # type: ignore[attr-defined]  # not a key: the launchers log it
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
