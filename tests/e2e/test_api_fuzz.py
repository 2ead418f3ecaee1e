"""The REST API fuzzed from its own OpenAPI document against a running `kbmesh up`: for
requests schemathesis generates from the document (valid and invalid ones, a few per
operation), no answer is a server error, and every status code, media type, header and body
is one the document declares for that operation."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.support.procs import Proc, free_port, kbmesh_env, wait_ready

EXAMPLES = 6
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("fuzz")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # `?wait=true` requests give up after 5 s instead of 2 minutes: the answer is the same
    # kind (202 with the status so far), and the run stays short.
    env = kbmesh_env(KBMESH_WAIT_TIMEOUT_SECONDS="5")
    proc = Proc(["up", "--data-dir", str(tmp / "data"), "--port", str(port)], tmp / "up.log", env)
    try:
        wait_ready(base, proc)
        yield base
    finally:
        proc.stop()


def test_every_answer_is_documented_and_none_is_a_server_error(base_url: str) -> None:
    """Each operation on its own, so one failure does not hide another; all are reported."""
    api = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    failures: dict[str, str] = {}
    operations = 0
    for result in api.get_all_operations():
        operation = result.ok()
        operations += 1

        # Valid requests and invalid ones (wrong types, missing fields, bad parameters).
        cases = operation.as_strategy() | operation.as_strategy(GenerationMode.NEGATIVE)

        @given(case=cases)
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def fuzz(case) -> None:  # type: ignore[no-untyped-def]
            case.call_and_validate(base_url=base_url, checks=CHECKS, timeout=30)

        try:
            fuzz()
        except (Exception, BaseExceptionGroup) as err:  # schemathesis groups its findings
            failures[operation.label] = str(err)[:3000]
    assert operations > 10
    assert not failures, "\n\n".join(f"{label}: {text}" for label, text in failures.items())
