"""Helpers shared by the contract tests: sending a REST example, checking a body's schema."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import httpx

from services.contracts.export import Contracts, OpKey, schema_errors, validator


async def send_example(client: httpx.AsyncClient, example: dict[str, Any]) -> httpx.Response:
    """The request of a `contracts/rest/examples/*.json` fixture, as a client would send it."""
    request = example["request"]
    path = example["path"].format(**{k: quote(str(v), safe="") for k, v in request["path"].items()})
    kwargs: dict[str, Any] = {"params": request["query"]}
    if "body" in request:
        kwargs["json"] = request["body"]
    return await client.request(example["method"], path, **kwargs)


def rest_errors(contracts: Contracts, key: OpKey, response: httpx.Response) -> list[str]:
    """Why `response` does not match what the OpenAPI document says `key` answers."""
    schema = contracts.response_schema(key, response.status_code)
    return [
        f"{e.field}: {e.message}"
        for e in schema_errors(contracts.validator(schema), response.json())
    ]


def errors(schema: dict[str, Any], instance: Any) -> list[str]:
    return [f"{e.field}: {e.message}" for e in schema_errors(validator(schema), instance)]
