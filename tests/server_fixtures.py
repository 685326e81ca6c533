"""Fixtures that run one real server (`python -m server serve`) per test module.

A pytest plugin: tests/conftest.py lists it in `pytest_plugins`, so a test asks for `server`,
`server_url`, `client` or `http` by naming it as an argument; nothing imports these. A module
that needs other flags defines its own fixture of the same name, which takes precedence (e.g.
tests/test_api_reliability.py's `server`). The helpers they use are tests/server_helpers.py's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import pytest

if TYPE_CHECKING:
    import httpx
    import openai

    from tests.server_helpers import ServerProcess

# NOTE: tests.server_helpers (httpx, and the openai client: ~1 s to import) is imported inside
# the fixtures, so that sessions which start no server do not pay for it


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """A `strata serve` with the default flags (and $STRATA_TEST_SERVER_ARGS), ready."""
    from tests.server_helpers import running_server
    with running_server() as proc:
        yield proc


@pytest.fixture(scope="module")
def server_url(server: ServerProcess) -> str:
    """`server`'s base URL, http://127.0.0.1:<port>."""
    return server.url


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    """An `openai` client of `server` (no retries)."""
    from tests.server_helpers import openai_client
    return openai_client(server_url)


@pytest.fixture(scope="module")
def http(server_url: str) -> Iterator[httpx.Client]:
    """An httpx client with `server`'s base URL."""
    import httpx

    from tests.server_helpers import REQUEST_TIMEOUT_S
    with httpx.Client(base_url=server_url, timeout=REQUEST_TIMEOUT_S) as c:
        yield c
