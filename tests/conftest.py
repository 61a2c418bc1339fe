"""Shared pytest configuration for the dmuon tests."""

from __future__ import annotations

import pytest

from tests.harness import shutdown_pools


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the distributed worker pools once, after the last test of the session.

    The pools outlive single tests on purpose (spawning workers costs seconds); each
    is stopped with a barrier before ``destroy_process_group``, since destroying while
    a peer still talks to the rank races.
    """
    shutdown_pools()
