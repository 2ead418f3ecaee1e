"""Fixtures of the contract tests: the contracts as the code exports them, and the mock."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from services.contracts.export import Contracts, build


@pytest.fixture(scope="session")
def contracts() -> Contracts:
    return build()


@pytest.fixture(scope="module")
async def mock(contracts: Contracts) -> AsyncIterator[httpx.AsyncClient]:
    """The mock app in-process (REST and /api/v1/tools need no lifespan)."""
    from services.contracts.mock import create_mock_app

    transport = httpx.ASGITransport(app=create_mock_app(contracts=contracts))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        yield client
