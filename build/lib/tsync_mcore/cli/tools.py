"""The tools' console scripts (`[project.scripts]` in pyproject.toml): each silences the
known-harmless library warnings first, then runs the module's own command line, exactly as
`python -m <module>` does."""

from __future__ import annotations

import sys

from tsync_mcore.util import quiet


def replay() -> None:
    quiet.install()
    from tsync_mcore.learner import replay
    replay.cli()


def export() -> None:
    quiet.install()
    from tsync_mcore.learner import export
    sys.exit(export.main())


def report() -> None:
    quiet.install()
    from tsync_mcore.observability import report
    report.main()


def predict() -> None:
    quiet.install()
    from tsync_mcore.observability import predict
    sys.exit(predict.main())


def ledger() -> None:
    quiet.install()
    from tsync_mcore.observability.ledger.__main__ import main
    sys.exit(main())

