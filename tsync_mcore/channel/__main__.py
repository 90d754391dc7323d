"""`python -m tsync_mcore.channel --table` prints the wire layout table (Markdown);
`--update-docs [PATH]` rewrites it in docs/design/wire.md (between the wire-table markers)."""

from __future__ import annotations

import argparse
import os

BEGIN, END = "<!-- wire-table: begin (python -m tsync_mcore.channel --update-docs) -->", \
    "<!-- wire-table: end -->"
DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "design", "wire.md")


def embedded_table(text: str) -> str:
    """The table between the markers of a docs/design/wire.md text."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip("\n") + "\n"


def update_docs(path: str = DOCS) -> bool:
    """Write the current table into `path`; whether it changed."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    from tsync_mcore.channel.wire import schema_table  # torch: after the path is read
    new = (text[:text.index(BEGIN) + len(BEGIN)] + "\n" + schema_table() + text[text.index(END):])
    if new != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return new != text


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m tsync_mcore.channel", description=__doc__)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--table", action="store_true", help="print the wire layout table")
    g.add_argument("--update-docs", nargs="?", const=DOCS, metavar="PATH",
                   help="rewrite the table in docs/design/wire.md (or PATH)")
    args = ap.parse_args()
    if args.table:
        from tsync_mcore.channel.wire import schema_table
        print(schema_table(), end="")
    else:
        try:
            changed = update_docs(args.update_docs)
        except (OSError, ValueError) as e:  # no such file, or no wire-table markers in it
            ap.exit(2, f"error: {args.update_docs}: cannot update the wire table: {e}\n")
        print(f"{os.path.normpath(args.update_docs)}: "
              f"{'updated' if changed else 'already current'}")


if __name__ == "__main__":
    from tsync_mcore.util import quiet
    quiet.install()
    main()
