"""Fixtures of the OpenSandbox SDK suite: one `fastbox up` per test module."""

from __future__ import annotations

from collections.abc import Iterator

import fastbox_server as fb
import httpx
import pytest
from opensandbox.sync.manager import SandboxManagerSync


@pytest.fixture(scope="session", autouse=True)
def _no_leftovers_at_session_end() -> Iterator[None]:
    """Last line of defence: after every module's own cleanup, nothing of the suite's prefix
    may be left on the host. Raising here fails the run."""
    yield
    problems = [
        leak
        for prefix, binary in fb.STARTED.items()
        if prefix not in fb.REPORTED and (leak := fb.check_leftovers(binary, prefix))
    ]
    if problems:
        pytest.fail(
            "host resources left at the end of the session:\n" + "\n".join(problems),
            pytrace=False,
        )


@pytest.fixture(scope="module")
def fastbox(request: pytest.FixtureRequest) -> fb.FastboxServer:
    """A running `fastbox up` for this module. Skips the module when not root or when the
    binary is missing; fails it when the server does not come up. Its finalizer deletes every
    sandbox, stops the server, purges the prefix and fails on leftovers."""
    return fb.module_server(request, request.module.__name__.rsplit(".", 1)[-1])


@pytest.fixture(scope="module")
def api(fastbox: fb.FastboxServer) -> Iterator[httpx.Client]:
    """Raw lifecycle-API client that sends the server's API key."""
    with fastbox.http() as client:
        yield client


@pytest.fixture(scope="module")
def manager(fastbox: fb.FastboxServer) -> Iterator[SandboxManagerSync]:
    mgr = SandboxManagerSync.create(fastbox.connection_config())
    yield mgr
    mgr.close()
