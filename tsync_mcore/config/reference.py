"""The config reference, docs/guide/config.md, generated from the section dataclasses.

Each key's meaning is the comment on its line or the comment lines right above it, read with
`tokenize` from the file that defines the field's class (config/model.py, learner.py, ...)
and matched to the dataclass fields with `ast`; defaults and allowed values come from the
dataclasses themselves. Regenerate after adding keys:

    python -m tsync_mcore.config --reference        # writes docs/guide/config.md
    python -m tsync_mcore.config --check            # exit 1 when docs/guide/config.md is stale
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import os
import sys
import tokenize
import typing
from dataclasses import dataclass
from typing import Any, Literal

from tsync_mcore.config.rules import Config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REFERENCE = os.path.join(ROOT, "docs", "guide", "config.md")


@dataclass
class Key:
    dotted: str
    type: str
    default: Any
    doc: str  # "" when the field has no comment


def _comments(source: str) -> dict[int, str]:
    """Line number → the text of the comment on that line."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def field_docs(source: str) -> dict[tuple[str, str], str]:
    """(class name, field name) → its comment: same line, else the comment block above."""
    comments = _comments(source)
    lines = source.splitlines()
    docs = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            doc = comments.get(stmt.end_lineno, "")
            if not doc:  # the contiguous block of whole-line comments right above
                block, n = [], stmt.lineno - 1
                while n >= 1 and n in comments and lines[n - 1].lstrip().startswith("#"):
                    block.insert(0, comments[n])
                    n -= 1
                doc = " ".join(block)
            docs[(node.name, stmt.target.id)] = doc
    return docs


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(str(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def keys(cls: type = Config, prefix: str = "") -> list[Key]:
    """Every leaf key under `cls`, in declaration order, with its type, default and doc."""
    return list(_walk(cls, prefix))


@functools.cache
def _file_docs(path: str) -> dict[tuple[str, str], str]:
    with open(path, encoding="utf-8") as f:
        return field_docs(f.read())


def _walk(cls: type, prefix: str):
    # each section's comments are read from its own module (the sections live in several)
    docs = _file_docs(inspect.getsourcefile(cls))
    hints = typing.get_type_hints(cls)
    default = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _walk(tp, f"{prefix}{f.name}.")
        else:
            yield Key(f"{prefix}{f.name}", _type_name(tp), getattr(default, f.name),
                      docs.get((cls.__name__, f.name), ""))


def sections(cls: type = Config) -> list[tuple[str, type]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls)
            if dataclasses.is_dataclass(hints[f.name])]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def _default(value: Any) -> str:
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def reference() -> str:
    """The text of docs/guide/config.md."""
    out = ["# Config reference", "",
           "Generated from the section dataclasses in `tsync_mcore/config/` by",
           "`python -m tsync_mcore.config --reference`;",
           "do not edit by hand. Every key can be set in the YAML file (`section: {key: value}`)",
           "or on any launcher's command line with `--set section.key=value` (repeatable).",
           "`auto` values are resolved at start (`config.resolve`): each choice is logged once",
           "and the run's `config.yaml` holds the concrete value. `launch/*.py --print-config`",
           "prints the resolved config.", ""]
    top = [k for k in keys() if "." not in k.dotted]
    for name, cls in sections():
        out += [f"## `{name}`", ""]
        if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):
            out += [cls.__doc__.strip(), ""]
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for k in keys(cls, f"{name}."):
            out.append(f"| `{k.dotted}` | {_cell(k.type)} | {_cell(_default(k.default))} | "
                       f"{_cell(k.doc)} |")
        out.append("")
    if top:
        out += ["## top level", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        out += [f"| `{k.dotted}` | {_cell(k.type)} | {_cell(_default(k.default))} | "
                f"{_cell(k.doc)} |" for k in top]
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tsync_mcore.config",
                                description="Write or check the generated config reference.")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--reference", action="store_true",
                   help="write the reference to --out")
    g.add_argument("--check", action="store_true",
                   help="exit 1 if --out differs from the generated reference or a key has "
                        "no comment")
    p.add_argument("--out", default=REFERENCE, help="reference file (default docs/guide/config.md)")
    args = p.parse_args(argv)
    missing = [k.dotted for k in keys() if not k.doc]
    if missing:
        print(f"error: config keys without a comment in tsync_mcore/config/: "
              f"{', '.join(missing)}",
              file=sys.stderr)
        return 1
    text = reference()
    if args.check:
        try:
            with open(args.out, encoding="utf-8") as f:
                current = f.read()
        except OSError:
            current = None
        if current != text:
            print(f"error: {args.out} is out of date: run python -m tsync_mcore.config "
                  f"--reference", file=sys.stderr)
            return 1
        return 0
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {args.out} ({len(keys())} keys)")
    return 0
