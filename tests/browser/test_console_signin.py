"""The console signs a person in through a real OpenID provider (tests/oidc/) in headless
Chromium: authorization code + PKCE in the page, the provider's own login and consent pages,
back to the console signed in; what the person then does is theirs on the audit trail."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from playwright.async_api import expect

from services.common.bus.nats_server import free_port
from tests.browser.conftest import DESKTOP, Watch, shoot
from tests.conftest import running_stack
from tests.support.bus import OperatorKeys
from tests.support.mcp_client import serve_http
from tests.support.oidc import PEOPLE_CLIENT, oidc_provider, provider_missing

pytestmark = pytest.mark.skipif(provider_missing() is not None, reason=provider_missing() or "")
ETNA = "Mount Etna is an active stratovolcano on the east coast of Sicily; lava flows often."


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders) -> AsyncIterator[SimpleNamespace]:
    """kbmesh trusting a provider on loopback whose people's client returns to the console;
    alice is in org acme, where an API key made one KB."""
    tmp = tmp_path_factory.mktemp("console-signin")
    accounts = tmp / "accounts.json"
    accounts.write_text(
        json.dumps({"alice": {"org": "acme", "email": "alice@example.com", "name": "Alice"}})
    )
    port, kb_port = free_port(), free_port()
    issuer = f"http://127.0.0.1:{port}"
    oauth = {
        "issuer": issuer,
        "resource": f"http://127.0.0.1:{kb_port}/mcp",
        "org_claim": "org",
        "client_id": PEOPLE_CLIENT,
    }
    async with (
        oidc_provider(issuer, port, accounts, console_url=f"http://127.0.0.1:{kb_port}/"),
        running_stack(tmp / "data", embedders=embedders, oauth=oauth) as (rt, client),
        serve_http(rt, port=kb_port) as (base, app),
    ):
        admin = await OperatorKeys(rt).create("acme", "admin")
        async with httpx.AsyncClient(
            base_url=base, headers={"Authorization": f"Bearer {admin}"}, timeout=60
        ) as http:
            response = await http.post("/v1/kbs", json={"name": f"geo-{uuid.uuid4().hex[:6]}"})
            assert response.status_code == 201, response.text
        yield SimpleNamespace(
            rt=rt,
            client=client,
            base=base,
            app=app,
            issuer=issuer,
            admin=admin,
            kb=response.json(),
        )


class ConsoleWatch(Watch):
    """The console's errors only: the provider's pages (which ask a font CDN the closed
    network refuses) are not the console's to answer for."""

    base: str = ""

    def _console(self, msg: Any) -> None:
        if msg.location.get("url", "").startswith(self.base):
            super()._console(msg)


@pytest.fixture
async def page(browser, stack) -> AsyncIterator[Any]:
    context = await browser.new_context(viewport=DESKTOP, base_url=stack.base)
    context.set_default_timeout(30_000)
    tab = await context.new_page()
    watch = ConsoleWatch()
    watch.base = stack.base
    watch.attach(tab)
    tab.watch = watch
    yield tab
    await context.close()
    assert watch.errors == [], "\n".join(watch.errors)


async def test_console_signs_in_through_the_provider_and_acts_as_the_user(page, stack, screenshots):
    """Unsigned, the console offers to sign in with the provider; the click goes to the
    provider's login and consent pages and comes back signed in as Alice; she lists the KBs
    of her org, uploads and finds a document; the audit trail names her subject as its
    writer; after signing out the console asks again."""
    page.watch.expect("GET", "/v1/kbs", 401)
    await page.goto("/")
    sign_in = page.get_by_role("button", name=sign_in_name(stack))
    await expect(sign_in).to_be_visible()
    await shoot(page, screenshots, "signin-01-asked")
    await sign_in.click()

    # The provider's own pages (oidc-provider's development interactions).
    await page.wait_for_url(f"{stack.issuer}/**")
    await page.locator("input[name=login]").fill("alice")
    await page.locator("input[name=password]").fill("any")
    await page.locator("button[type=submit]").first.click()
    await expect(page.get_by_text("Authorize")).to_be_visible()
    await page.locator("button[type=submit]").first.click()

    await expect(page.locator("#keyslot")).to_contain_text("Signed in as Alice <alice@example.com>")
    assert page.url == f"{stack.base}/"  # the code left the address bar
    link = page.get_by_role("link", name=stack.kb["name"])
    await expect(link).to_be_visible()
    await shoot(page, screenshots, "signin-02-signed-in")

    await link.click()
    await page.get_by_role("tab", name="Documents").click()
    await page.get_by_label("Upload files").set_input_files(
        [{"name": "etna.md", "mimeType": "text/markdown", "buffer": ETNA.encode()}]
    )
    rows = page.locator("table.data tbody tr")
    await expect(rows.filter(has_text="etna.md").get_by_text("Indexed")).to_be_visible(
        timeout=60_000
    )
    await page.get_by_role("tab", name="Search").click()
    await page.get_by_label("Query").fill("volcano in Sicily")
    await page.get_by_role("button", name="Search", exact=True).click()
    await expect(page.locator("li.hit").first.locator(".hit-doc")).to_have_text("etna.md")

    async with httpx.AsyncClient(base_url=stack.base, timeout=60) as http:
        response = await http.get(
            "/v1/audit",
            params={"writer": "alice", "kind": "document", "kb_id": stack.kb["kb_id"]},
            headers={"Authorization": f"Bearer {stack.admin}"},
        )
    assert response.status_code == 200, response.text
    writers = [e["writer"] for e in response.json()["items"] if e.get("writer")]
    assert writers and writers[0]["subject"] == "alice", response.json()

    # Signed out, the page in view is refused and the console asks again.
    page.watch.expect("GET", f"/v1/kbs/{stack.kb['kb_id']}", 401)
    await page.get_by_role("button", name="Sign out").click()
    await expect(page.get_by_role("button", name=sign_in_name(stack))).to_be_visible()


def sign_in_name(stack: SimpleNamespace) -> str:
    return f"Sign in with {stack.issuer.split('//')[1]}"
