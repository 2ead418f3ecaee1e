"""The egress policy shared by upload-by-URL and a KB's api_base."""

from __future__ import annotations

import pytest

from services.common.domain.errors import Forbidden, InvalidInput
from services.common.outbound.egress import EgressPolicy

REFUSED = [
    "http://127.0.0.1:8000/v1",
    "http://localhost:11434",
    "http://[::1]:8080",
    "http://[::ffff:127.0.0.1]/v1",
    "http://169.254.169.254/latest/meta-data",  # cloud metadata: link-local
    "http://10.1.2.3/v1",
    "http://192.168.0.10",
    "http://100.64.0.1",  # shared address space
    "http://0.0.0.0:9000",
]


@pytest.mark.parametrize("url", REFUSED)
async def test_non_public_destinations_are_refused_by_default(url: str) -> None:
    with pytest.raises(Forbidden) as err:
        await EgressPolicy().check_url(url, field="api_base", what="call")
    assert err.value.field == "api_base"
    assert "KBMESH_EGRESS__ALLOWLIST" in err.value.message


async def test_public_addresses_pass_and_the_allowlist_opens_only_what_it_names() -> None:
    await EgressPolicy().check_url("https://8.8.8.8/v1", field="api_base", what="call")
    policy = EgressPolicy.parse(["10.0.0.0/8", "localhost", "*.corp.example"])
    await policy.check_url("http://10.9.9.9/v1", field="api_base", what="call")
    await policy.check_url("http://localhost:1/v1", field="api_base", what="call")
    assert policy.host_allowed("models.corp.example")
    assert not policy.host_allowed("corp.example.evil.com")
    with pytest.raises(Forbidden):
        await policy.check_url("http://192.168.1.1/v1", field="api_base", what="call")
    await EgressPolicy(allow_private=True).check_url(
        "http://192.168.1.1/v1", field="api_base", what="call"
    )


@pytest.mark.parametrize("url", ["ftp://example.com", "file:///etc/passwd", "not a url", "/v1"])
async def test_non_http_urls_are_invalid(url: str) -> None:
    with pytest.raises(InvalidInput) as err:
        await EgressPolicy(allow_private=True).check_url(url, field="api_base", what="call")
    assert not isinstance(err.value, Forbidden)
    assert err.value.field == "api_base"


@pytest.mark.parametrize(
    "url", ["https://" + "a" * 70 + ".example.com/v1", "https://a..example.com/", "https://.x/"]
)
async def test_a_host_that_is_no_dns_name_is_invalid_input(url: str) -> None:
    """A label over 63 characters or an empty one cannot be looked up (the IDNA codec
    refuses it before DNS is asked): invalid input naming the field, never a server error."""
    with pytest.raises(InvalidInput) as found:
        await EgressPolicy().check_url(url, field="api_base", what="call the model at")
    assert found.value.field == "api_base"
