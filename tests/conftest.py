from __future__ import annotations

from typing import Iterator

import pytest

from tests.harness import Server


@pytest.fixture
def server_factory() -> Iterator[type[Server]]:
    """``server_factory(*args, app=..., env=...)`` starts a server; every one is killed and
    checked for orphans at teardown."""
    started: list[Server] = []

    def start(*args: str, **kwargs: object) -> Server:
        server = Server(*args, **kwargs)  # type: ignore[arg-type]
        started.append(server)
        return server

    yield start  # type: ignore[misc]
    for server in started:
        server.close()


@pytest.fixture
def server(server_factory: type[Server]) -> Server:
    """A ready two-worker server running tests.apps:app."""
    return server_factory().wait_ready()  # type: ignore[call-arg]
