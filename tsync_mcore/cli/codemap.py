"""`python -m tsync_mcore.cli.codemap [--check]`: writes docs/design/code-map.md, the map of the
packages bottom to top with what each owns (its __init__ docstring) and one line per module
(the first line of its docstring). --check exits 1 when the file is stale."""

from __future__ import annotations

import argparse
import ast
import os
import sys

import tsync_mcore

PKG = os.path.dirname(os.path.abspath(tsync_mcore.__file__))
OUT = os.path.join(os.path.dirname(PKG), "docs", "design", "code-map.md")


def _doc(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return ast.get_docstring(ast.parse(f.read())) or ""


def _first_line(doc: str) -> str:
    para = doc.split("\n\n")[0]
    return " ".join(para.split())


def render() -> str:
    out = ["# Code map", "",
           "Generated from the packages' docstrings by `python -m tsync_mcore.cli.codemap`; "
           "`tests/unit/test_layout.py` fails when it is stale. Packages bottom to top: each "
           "may import those above it in this list, never those below.", ""]
    for name in tsync_mcore.LAYERS:
        root = os.path.join(PKG, name)
        out += [f"## `{name}/`", "", _doc(os.path.join(root, "__init__.py")), ""]
        rows = []
        for dp, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for f in sorted(files):
                if not f.endswith(".py") or f == "__init__.py" and dp == root:
                    continue
                rel = os.path.relpath(os.path.join(dp, f), root)
                first = _first_line(_doc(os.path.join(dp, f))).replace("|", "\\|")
                rows.append(f"| `{rel}` | {first} |")
        if rows:
            out += ["| module | what it holds |", "|---|---|", *rows, ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tsync_mcore.cli.codemap", description=__doc__)
    p.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    text = render()
    if args.check:
        current = open(args.out, encoding="utf-8").read() if os.path.exists(args.out) else ""
        if current != text:
            print(f"error: {args.out} is out of date: run python -m tsync_mcore.cli.codemap",
                  file=sys.stderr)
            return 1
        return 0
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
