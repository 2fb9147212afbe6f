"""One `duet serve` (serve_process.py) for the whole e2e session: every e2e test talks
to it, so the session pays for one Ray start and one deploy (~35 s each on these 2
cores), not one per test module. A test marked `stops_server` ends it (Ctrl-C and the
checks that follow); the collection hook runs such tests last, and the fixture, when
such a test runs alone, still starts the server it needs.

Runs in its own pytest invocation (scripts/test.sh), after the integration suite's Ray
cluster is gone: the CLI starts a fresh one.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from serve_process import Served, running


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that stop the shared server run after every test that uses it."""
    items.sort(key=lambda item: item.get_closest_marker("stops_server") is not None)


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with running(tmp_path_factory.mktemp("serve")) as s:
        yield s
