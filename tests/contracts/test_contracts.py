"""contracts/ is the code's contracts: the committed files equal a fresh export, every example
validates against its schema, and every tool, event and REST operation has a contract."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.common.messages.events import EVENT_MODELS
from services.contracts.export import CALL_TOOL, Contracts, build, drift, schema_errors
from services.gateway.tools import TOOLS
from tests.support.contracts import errors

CONTRACTS_DIR = Path(__file__).resolve().parents[2] / "contracts"
FILES = build().files()


def test_committed_contracts_equal_the_code():
    """A change to an event, tool or REST model (or an example) without re-exporting fails
    here, naming the files that differ."""
    differences = drift(CONTRACTS_DIR)
    assert not differences, (
        "contracts/ differs from the code; run `make contracts` (kbmesh contracts export) and "
        "commit the result:\n  " + "\n  ".join(differences)
    )


def test_every_tool_event_and_operation_has_a_contract_with_examples(contracts: Contracts):
    assert not contracts.missing, "add examples to services/contracts/examples.py:\n  " + (
        "\n  ".join(contracts.missing)
    )
    for name in TOOLS:
        for part in ("input.schema", "output.schema", "examples"):
            assert f"tools/{name}.{part}.json" in FILES
    for subject in EVENT_MODELS:
        assert f"events/{subject}.schema.json" in FILES
        assert f"events/{subject}.example.json" in FILES
    for op in contracts.operations.values():
        assert f"rest/examples/{op.operation_id}.json" in FILES


@pytest.mark.parametrize("subject", sorted(EVENT_MODELS))
def test_event_example_validates_and_is_accepted(subject: str):
    """What an upstream publisher copies from contracts/ is valid JSON Schema-wise and is what
    the consumers' model accepts."""
    example = FILES[f"events/{subject}.example.json"]
    assert not errors(FILES[f"events/{subject}.schema.json"], example)
    EVENT_MODELS[subject].model_validate(example)


@pytest.mark.parametrize("name", sorted(TOOLS))
def test_tool_examples_validate(name: str):
    for example in FILES[f"tools/{name}.examples.json"]:
        assert not errors(FILES[f"tools/{name}.input.schema.json"], example["input"])
        assert not errors(FILES[f"tools/{name}.output.schema.json"], example["output"])


@pytest.mark.parametrize("path", sorted(p for p in FILES if p.startswith("rest/examples/")))
def test_rest_example_validates(contracts: Contracts, path: str):
    """Parameters, body and answer of each REST fixture validate against the OpenAPI document,
    and the answer's status is one the operation declares."""
    example: dict[str, Any] = FILES[path]
    key = (example["method"], example["path"])
    op = contracts.operations[key]
    assert op.operation_id == Path(path).stem
    params = {(p["in"], p["name"]): p for p in op.spec.get("parameters", [])}
    for where, values in (
        ("path", example["request"]["path"]),
        ("query", example["request"]["query"]),
    ):
        for name, value in values.items():
            param = params[(where, name)]
            assert not errors({**param["schema"], **contracts.components}, value), (where, name)
    response = example["response"]
    assert str(response["status"]) in op.spec["responses"]
    if key == CALL_TOOL:
        # The route reads its body raw: the tool's own schemas describe it.
        name = example["request"]["path"]["name"]
        assert not errors(FILES[f"tools/{name}.input.schema.json"], example["request"]["body"])
        assert not errors(FILES[f"tools/{name}.output.schema.json"], response["body"])
        return
    body_schema = contracts.request_body_schema(key)
    assert ("body" in example["request"]) == (body_schema is not None)
    if body_schema is not None:
        assert not schema_errors(contracts.validator(body_schema), example["request"]["body"])
    schema = contracts.response_schema(key, response["status"])
    assert not schema_errors(contracts.validator(schema), response["body"])
