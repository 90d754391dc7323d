"""The integration lane: every test here is `live` (it starts launchers, torchrun ranks,
vLLM engines, agents or network namespaces); `-m "not live"` leaves them out."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.live)


@pytest.fixture(scope="module")
def et():
    """A module's event-loop thread for in-process vLLM engines (closed with the module)."""
    from tsync_mcore.rollout.engine import EngineThread
    loop = EngineThread()
    yield loop
    loop.close()
