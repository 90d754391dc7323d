"""The integration lane: every test here is `live` (it starts launchers, torchrun ranks,
vLLM engines, agents or network namespaces); `-m "not live"` leaves them out."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.live)
