"""The web console driven through headless Chromium, as a person would: every action below
goes through the page (clicks, typing, file picker); the REST API is only read to check
that the page told the truth."""

from __future__ import annotations

import base64
import re
import uuid

import pytest
from playwright.async_api import expect

from services.common.messages.events import DocUploaded, OcrDone
from tests.browser.conftest import shoot

XSS = "<img src=x onerror=alert(1)>"
# The smallest valid PNG (1x1): an image, so its upload waits for OCR.
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)
ETNA = (
    "Mount Etna is an active stratovolcano on the east coast of Sicily. It erupts often: "
    "lava flows down its slopes and ash closes the airport of Catania.\n\n"
    "The volcano is one of the most active in the world and is in an almost constant state "
    "of activity. Its fertile volcanic soils support extensive agriculture, with vineyards "
    "and orchards spread across the lower slopes.\n\n"
    "Etna was added to the list of UNESCO World Heritage Sites in 2013."
)
GLACIER = "Glaciers are slow rivers of ice that carve valleys as they move downhill."
LEDGER = "Quarterly ledger: invoices are paid within thirty days of receipt by the accounts team."


async def test_console_serves_a_strict_page(page, stack):
    """`/` is the console: its title names kbmesh and its Content-Security-Policy allows
    scripts from this origin only (no inline code)."""
    response = await page.goto("/")
    assert response is not None and response.status == 200
    csp = response.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    await expect(page).to_have_title(re.compile("kbmesh"))
    await expect(page.get_by_role("heading", name="Knowledge bases")).to_be_visible()
    assert "<script>" not in (await response.text()).replace(" ", "")


async def test_knowledge_base_lifecycle(page, stack, screenshots):
    """Create (an over-long chunk size refused with the server's message next to the field,
    nothing created), upload in Documents until Indexed, find it in Search, Active badge,
    change the chunk size in Settings and watch the reindex reach the end, delete a
    document, delete the knowledge base. A document named like markup shows as text."""
    name = f"volcanoes-{uuid.uuid4().hex[:6]}"
    await page.goto("/")
    await expect(page.get_by_role("heading", name="Knowledge bases")).to_be_visible()
    await shoot(page, screenshots, "01-kb-list")

    # ---- create, first refused ---------------------------------------------------------
    await page.get_by_role("link", name="New knowledge base").first.click()
    # The form replaces the list after a route change; until it is drawn, the list's own
    # name search and "Sort by name" button would be what "Name" finds.
    await expect(page.get_by_role("heading", name="New knowledge base")).to_be_visible()
    await page.get_by_label("Name").fill(name)
    await page.get_by_label("Description").fill("Volcano facts for the geology agents.")
    await page.get_by_label("Tags").fill("geology, volcanoes")
    await page.get_by_label("Chunk size").fill("300")
    page.watch.expect("POST", "/v1/kbs", 422)
    await page.get_by_role("button", name="Create").click()
    error = page.locator("#kb-chunk_size-error")
    await expect(error).to_contain_text("exceeds the input limit")
    await expect(page.get_by_label("Chunk size")).to_have_attribute("aria-invalid", "true")
    await shoot(page, screenshots, "02-kb-create-refused")
    listed = (await stack.client.get("/v1/kbs", params={"name_search": name})).json()
    assert listed["total"] == 0, "a refused create must create nothing"

    await page.get_by_label("Chunk size").fill("120")
    await page.get_by_label("Chunk overlap").fill("10")
    await page.get_by_role("button", name="Create").click()
    await expect(page.get_by_role("heading", name=name)).to_be_visible()
    await expect(page.get_by_role("tab", name="Overview")).to_have_attribute(
        "aria-selected", "true"
    )

    # ---- upload ------------------------------------------------------------------------
    await page.get_by_role("tab", name="Documents").click()
    await expect(page.get_by_text("No documents yet")).to_be_visible()
    await page.get_by_label("Upload files").set_input_files(
        [
            {"name": "etna.md", "mimeType": "text/markdown", "buffer": ETNA.encode()},
            {"name": XSS, "mimeType": "text/plain", "buffer": LEDGER.encode()},
        ]
    )
    # And one dragged in: a drop of a file onto the drop zone.
    dropped = await page.evaluate_handle(
        """(text) => {
            const data = new DataTransfer();
            data.items.add(new File([text], "dropped.txt", {type: "text/plain"}));
            return data;
        }""",
        GLACIER,
    )
    await page.locator(".dropzone").dispatch_event("drop", {"dataTransfer": dropped})
    uploads = page.get_by_role("list", name="Uploads")
    await expect(uploads.get_by_text(re.compile(r"^Indexed · \d+ chunks?$"))).to_have_count(
        3, timeout=60_000
    )
    rows = page.locator("table.data tbody tr")
    await expect(rows).to_have_count(3)
    await expect(rows.filter(has_text="etna.md").get_by_text("Indexed")).to_be_visible()
    # Markup in a name is text: the characters show, no <img> element exists, no alert ran.
    await expect(rows.filter(has_text=XSS)).to_have_count(1)
    assert await page.locator("img[src='x']").count() == 0
    # Tags and collection, edited in place.
    await page.get_by_role("button", name="Edit etna.md").click()
    dialog = page.get_by_role("dialog")
    await dialog.get_by_label("Tags").fill("sicily, eruptions")
    await dialog.get_by_label("Collection").fill("europe")
    await dialog.get_by_role("button", name="Save").click()
    etna_row = rows.filter(has_text="etna.md")
    await expect(etna_row).to_contain_text("eruptions")
    await expect(etna_row).to_contain_text("europe")
    await shoot(page, screenshots, "03-kb-documents")

    # ---- search ------------------------------------------------------------------------
    await page.get_by_role("tab", name="Search").click()
    await page.get_by_label("Query").fill("volcano lava eruptions in Sicily")
    await page.get_by_label("Neighbours").fill("1")
    await page.get_by_role("button", name="Search", exact=True).click()
    first = page.locator("li.hit").first
    await expect(first.locator(".hit-doc")).to_have_text("etna.md")
    await expect(first.locator(".chunk.matched mark").first).to_be_visible()
    await expect(first.locator(".score").first).to_contain_text("score")
    await shoot(page, screenshots, "04-kb-search")
    # A tag filter leaves only the tagged document.
    search = page.get_by_role("tabpanel", name="Search")
    await search.get_by_text("Filters").click()
    await search.get_by_label("Tags").fill("eruptions")
    await page.get_by_label("Query").fill("ice and ledgers and volcanoes")
    await page.get_by_role("button", name="Search", exact=True).click()
    await expect(page.locator("li.hit .hit-doc")).to_have_text(["etna.md"])

    # ---- Active ------------------------------------------------------------------------
    await page.get_by_role("tab", name="Overview").click()
    await expect(page.locator(".title-badge")).to_have_text("Active")
    await expect(page.locator(".stat").first).to_contain_text("3")
    await shoot(page, screenshots, "05-kb-overview")

    # ---- settings → reindex --------------------------------------------------------------
    await page.get_by_role("tab", name="Settings").click()
    settings = page.get_by_role("tabpanel", name="Settings")
    await expect(settings.get_by_label("Name")).to_have_value(name)
    warning = settings.locator(".alert-warning")
    await expect(warning).to_be_hidden()
    await settings.get_by_label("Chunk size").fill("60")
    await settings.get_by_label("Chunk overlap").fill("5")
    await expect(warning).to_contain_text("reindexes all 3 documents")
    await shoot(page, screenshots, "06-kb-settings")
    await page.get_by_role("button", name="Save").click()
    progress = page.locator(".progress-box")
    await expect(progress).to_be_visible()
    await expect(progress).to_contain_text("Reindex complete", timeout=60_000)
    await expect(progress).to_contain_text("3 of 3 documents")
    await expect(page.locator(".title-badge")).to_have_text("Active")
    await shoot(page, screenshots, "07-kb-reindexed")

    # Smaller chunks now: a match comes with its neighbour, set apart from it.
    await page.get_by_role("tab", name="Search").click()
    await search.get_by_label("Tags").fill("")
    await page.get_by_label("Query").fill("UNESCO World Heritage list")
    await page.get_by_label("Top k").fill("1")
    await page.get_by_role("button", name="Search", exact=True).click()
    etna = page.locator("li.hit", has_text="etna.md")
    await expect(etna.locator(".chunk.matched mark").first).to_be_visible()
    await expect(etna.locator(".chunk.neighbour").first).to_contain_text("neighbour")
    await shoot(page, screenshots, "07b-kb-search-neighbours")
    kb = (await stack.client.get(f"/v1/kbs/{name}")).json()
    assert kb["chunk_size"] == 60 and kb["status"] == "active"

    # ---- delete a document -------------------------------------------------------------
    await page.get_by_role("tab", name="Documents").click()
    await page.get_by_role("button", name=f"Delete {XSS}").click()
    await expect(page.get_by_role("dialog")).to_contain_text("deleted everywhere")
    await page.get_by_role("dialog").get_by_role("button", name="Delete").click()
    await expect(page.locator("table.data tbody tr")).to_have_count(2)
    await expect(page.locator("table.data")).not_to_contain_text(XSS)

    # ---- delete the knowledge base -------------------------------------------------------
    await page.get_by_role("tab", name="Overview").click()
    await page.locator(".overview-actions").get_by_role("button", name="Delete").click()
    await shoot(page, screenshots, "08-kb-delete-confirm")
    await page.get_by_role("dialog").get_by_role("button", name="Delete").click()
    await expect(page.get_by_role("heading", name="Knowledge bases")).to_be_visible()
    await expect(page.get_by_role("link", name=name)).to_have_count(0)
    assert (await stack.client.get(f"/v1/kbs/{name}")).status_code == 404


async def test_new_knowledge_base_form_accepts_its_own_defaults(page, stack):
    """The form is pre-filled from the server's published defaults, and creating a knowledge
    base with nothing but a name (every other field as pre-filled) succeeds."""
    defaults = (await stack.client.get("/v1/defaults")).json()
    name = f"first-{uuid.uuid4().hex[:6]}"
    await page.goto("/#/kbs/new")
    await expect(page.get_by_role("heading", name="New knowledge base")).to_be_visible()
    chunk_size = page.get_by_label("Chunk size")
    await expect(chunk_size).to_have_value(str(defaults["kb"]["chunk_size"]))
    await expect(page.get_by_label("Chunk overlap")).to_have_value(
        str(defaults["kb"]["chunk_overlap"])
    )
    model = defaults["models"][0]
    await expect(chunk_size).to_have_attribute("max", str(model["max_chunk_size"]))
    await page.get_by_label("Name").fill(name)
    await page.get_by_role("button", name="Create").click()
    await expect(page.get_by_role("heading", name=name)).to_be_visible()


@pytest.mark.parametrize("path", ["/docs", "/redoc"])
async def test_api_docs_render_offline_under_the_policy(page, stack, path):
    """Swagger UI and ReDoc draw the API from assets kbmesh serves itself: every request
    stays on the server's origin (no CDN), and the page's policy refuses no script of theirs
    (a refusal is a console error, which fails the test)."""
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    await page.goto(path)
    await expect(page.get_by_role("heading", name=re.compile(r"^kbmesh"))).to_be_visible()
    await expect(page.get_by_text("knowledge bases").first).to_be_visible()
    # ReDoc's footer always asks for its vendor's logo from a CDN: the policy refuses it
    # before it leaves the browser (Chromium says so), and the image hides itself.
    refused = [e for e in page.watch.errors if "Content Security Policy" in e and "blocked" in e]
    foreign = [u for u in requested if not u.startswith((stack.base, "data:", "blob:"))]
    assert [u for u in foreign if not any(u in e for e in refused)] == []
    assert all("cdn.redoc.ly" in e for e in refused), refused
    page.watch.errors[:] = [e for e in page.watch.errors if e not in refused]
    policy = (await stack.client.get(path)).headers["content-security-policy"]
    assert "script-src 'self'" in policy and "unsafe-eval" not in policy


async def test_destructive_dialogs_open_on_cancel_and_skip_link_stays(page, stack):
    """ "Skip to content" moves the focus into the page without leaving it; a delete dialog
    opens with the focus on Cancel, so Enter keeps the knowledge base."""
    name = f"keep-{uuid.uuid4().hex[:6]}"
    kb = (await stack.client.post("/v1/kbs", json={"name": name})).json()
    await page.goto(f"/#/kbs/{kb['kb_id']}/overview")
    await expect(page.get_by_role("heading", name=name)).to_be_visible()
    url = page.url
    await page.keyboard.press("Tab")
    await expect(page.get_by_role("link", name="Skip to content")).to_be_focused()
    await page.keyboard.press("Enter")
    await expect(page.locator("#main")).to_be_focused()
    assert page.url == url
    await expect(page.get_by_role("heading", name=name)).to_be_visible()

    await page.get_by_role("button", name="Delete", exact=True).click()
    dialog = page.get_by_role("dialog")
    await expect(dialog.get_by_role("button", name="Cancel")).to_be_focused()
    await page.keyboard.press("Enter")
    await expect(dialog).to_have_count(0)
    assert (await stack.client.get(f"/v1/kbs/{kb['kb_id']}")).status_code == 200


async def test_search_tester_errors_at_the_field_filters_by_collection_and_source(page, stack):
    """A Top k of 0 is refused at the field (no banner); the score is labelled as what the
    API says it is; collection and source filters narrow the hits."""
    name = f"tester-{uuid.uuid4().hex[:6]}"
    kb = (await stack.client.post("/v1/kbs", json={"name": name})).json()
    for doc, collection, source in (
        ("etna.md", "europe", "volcano-wiki"),
        ("fuji.md", "asia", "travel-notes"),
    ):
        r = await stack.client.post(
            f"/v1/kbs/{kb['kb_id']}/documents?wait=true",
            json={
                "name": doc,
                "content": f"{doc[:-3].title()} is a volcano that erupts lava and ash.",
                "collection": collection,
                "source_id": source,
            },
        )
        assert r.status_code in (200, 202), r.text
    await page.goto(f"/#/kbs/{kb['kb_id']}/search")
    await page.get_by_label("Query").fill("volcano lava")
    await page.get_by_label("Top k").fill("0")
    page.watch.expect("POST", "/v1/search", 422)
    await page.get_by_role("button", name="Search", exact=True).click()
    await expect(page.locator("#sf-topk-error")).to_be_visible()
    await expect(page.get_by_label("Top k")).to_have_attribute("aria-invalid", "true")
    await expect(page.locator(".results .alert")).to_have_count(0)

    await page.get_by_label("Top k").fill("5")
    await page.get_by_role("button", name="Search", exact=True).click()
    await expect(page.locator(".result-summary")).to_contain_text("rank fusion")
    await expect(page.locator(".hit-doc")).to_have_count(2)
    await expect(page.get_by_label("Top k")).not_to_have_attribute("aria-invalid", "true")

    await page.get_by_text("Filters").click()
    await page.get_by_label("Collection").fill("asia")
    await page.get_by_role("button", name="Search", exact=True).click()
    await expect(page.locator(".hit-doc")).to_have_text(["fuji.md"])
    await page.get_by_label("Collection").fill("")
    await page.get_by_role("textbox", name="Sources").fill("volcano-wiki")
    await page.get_by_role("button", name="Search", exact=True).click()
    await expect(page.locator(".hit-doc")).to_have_text(["etna.md"])


async def test_documents_show_their_path_and_filter_by_status(page, stack):
    """Two files of one name from different folders are told apart by their path; the
    status filter lists only the documents in that state, with the reason for a failure."""
    name = f"paths-{uuid.uuid4().hex[:6]}"
    kb = (await stack.client.post("/v1/kbs", json={"name": name})).json()
    for folder in ("git", "pip"):
        r = await stack.client.post(
            f"/v1/kbs/{kb['kb_id']}/documents?wait=true",
            json={
                "name": "README.Debian",
                "uri": f"/usr/share/doc/{folder}/README.Debian",
                "content": f"Notes on the Debian packaging of {folder}.",
            },
        )
        assert r.status_code in (200, 202), r.text
    # A scan whose OCR fails: the document fails, and says why.
    r = await stack.client.post(
        f"/v1/kbs/{kb['kb_id']}/documents?wait=true",
        json={
            "name": "scan.png",
            "mime_type": "image/png",
            "content": base64.b64encode(PNG).decode(),
            "content_encoding": "base64",
        },
    )
    assert r.json()["status"] == "awaiting_ocr", r.text
    await stack.rt.bus.publish(
        "ocr.done",
        OcrDone(org_id="local", document_id=r.json()["document_id"], ok=False, error="blurred"),
    )
    await page.goto(f"/#/kbs/{kb['kb_id']}/documents")
    rows = page.locator("table.data tbody tr")
    await expect(rows.filter(has_text="README.Debian")).to_have_count(2)
    await expect(page.get_by_text("/usr/share/doc/git/README.Debian")).to_be_visible()
    await expect(page.get_by_text("/usr/share/doc/pip/README.Debian")).to_be_visible()

    await page.get_by_label("Status").select_option("failed")
    for _ in range(60):  # until ingest has failed it
        if await rows.filter(has_text="scan.png").count():
            break
        await page.get_by_label("Status").select_option("complete")
        await page.get_by_label("Status").select_option("failed")
        await page.wait_for_timeout(500)
    await expect(rows).to_have_count(1)
    await expect(rows.first).to_contain_text("scan.png")
    await expect(rows.first.locator(".reason")).to_contain_text("blurred")
    await page.get_by_label("Status").select_option("complete")
    await expect(rows).to_have_count(2)
    await expect(rows.filter(has_text="scan.png")).to_have_count(0)


async def test_list_filters_sorts_and_shows_names_as_text(page, stack, screenshots):
    """The list searches by name, filters by status, sorts by documents; a knowledge base
    named like markup shows as those characters in the list and on its page."""
    prefix = f"list-{uuid.uuid4().hex[:6]}"
    for suffix, docs in (("alpha", 0), ("beta", 2)):
        r = await stack.client.post("/v1/kbs", json={"name": f"{prefix}-{suffix}"})
        for i in range(docs):
            await stack.client.post(
                f"/v1/kbs/{r.json()['kb_id']}/documents",
                params={"wait": "true"},
                json={"name": f"note-{i}.txt", "content": f"note number {i} about {suffix}"},
            )
    r = await stack.client.post("/v1/kbs", json={"name": XSS, "description": XSS})
    xss_id = r.json()["kb_id"]

    await page.goto("/")
    await page.get_by_role("searchbox", name="Name").fill(prefix)
    rows = page.locator("table.data tbody tr")
    await expect(rows).to_have_count(2)
    await page.get_by_role("button", name="Sort by documents").click()
    await expect(rows.first).to_contain_text(f"{prefix}-beta")
    await page.get_by_role("button", name="Sort by documents").click()
    await expect(rows.first).to_contain_text(f"{prefix}-alpha")
    await page.get_by_label("Status").select_option("error")
    await expect(page.get_by_text("No matching knowledge bases")).to_be_visible()
    await page.get_by_label("Status").select_option("active")
    await expect(rows).to_have_count(2)

    await page.get_by_role("searchbox", name="Name").fill("<img")
    await expect(rows).to_have_count(1)
    await expect(rows.first.get_by_role("link", name=XSS)).to_be_visible()
    await shoot(page, screenshots, "09-kb-list-filtered")
    await rows.first.get_by_role("link", name=XSS).click()
    await expect(page.get_by_role("heading", name=XSS)).to_be_visible()
    assert await page.locator("img[src='x']").count() == 0
    await page.get_by_role("link", name="Knowledge bases").first.click()
    await expect(page.get_by_role("heading", name="Knowledge bases")).to_be_visible()
    await stack.client.delete(f"/v1/kbs/{xss_id}")


async def test_dead_letters_listed_and_replayed(page, stack, screenshots):
    """An upload naming a knowledge base that does not exist yet is listed with its reason;
    once the knowledge base exists, Replay indexes it and the row goes away."""
    kb_name = f"late-{uuid.uuid4().hex[:6]}"
    event = DocUploaded(
        org_id="local", name="late-notes.txt", content="written too early", kb_id=kb_name
    )
    await stack.rt.bus.publish("doc.uploaded", event)

    await page.goto("/#/dead-letters")
    row = page.locator("tr", has_text="late-notes.txt")
    for _ in range(60):
        if await row.count():
            break
        await page.get_by_role("button", name="Refresh").click()
        await page.wait_for_timeout(500)
    await expect(row).to_contain_text(kb_name)
    await shoot(page, screenshots, "10-dead-letters")

    kb_id = (await stack.client.post("/v1/kbs", json={"name": kb_name})).json()["kb_id"]
    await row.get_by_role("button", name=re.compile("^Replay")).click()
    await expect(row).to_have_count(0)
    await page.goto(f"/#/kbs/{kb_id}/documents")
    await expect(page.get_by_role("cell", name="late-notes.txt", exact=True)).to_be_visible()
    await expect(page.locator("tr", has_text="late-notes.txt")).to_contain_text(
        "Indexed", timeout=60_000
    )


async def test_dead_letters_failing_again_viewed_discarded_and_orgless_counted(page, stack):
    """A replay whose cause is not fixed is reported as failing again, not as done; a dead
    letter's body can be read and the letter discarded; messages that name no org are
    counted on the page instead of the page saying all was processed."""
    await stack.rt.bus.js.publish("doc.uploaded", b'["not", "an", "event"]')
    kb_name = f"never-{uuid.uuid4().hex[:6]}"
    event = DocUploaded(org_id="local", name="orphan.txt", content="no home yet", kb_id=kb_name)
    await stack.rt.bus.publish("doc.uploaded", event)

    await page.goto("/#/dead-letters")
    row = page.locator("tr", has_text="orphan.txt")
    for _ in range(60):
        if await row.count() and await page.get_by_text("name no organisation").count():
            break
        await page.get_by_role("button", name="Refresh").click()
        await page.wait_for_timeout(500)
    await expect(page.get_by_text("name no organisation")).to_be_visible()

    await row.get_by_role("button", name=re.compile("^Replay")).click()
    await expect(page.get_by_text(re.compile("but it failed again"))).to_be_visible(timeout=15_000)
    row = page.locator("tr", has_text="orphan.txt")
    await expect(row).to_have_count(1)

    await row.get_by_role("button", name=re.compile("^View")).click()
    dialog = page.get_by_role("dialog")
    await expect(dialog.locator("pre")).to_contain_text("no home yet")
    await dialog.get_by_role("button", name="Close").click()

    await row.get_by_role("button", name=re.compile("^Discard")).click()
    await page.get_by_role("dialog").get_by_role("button", name="Discard").click()
    await expect(page.locator("tr", has_text="orphan.txt")).to_have_count(0)


async def test_api_key_asked_for_and_kept_for_the_tab(browser, tmp_path, embedders, screenshots):
    """With API keys configured, the console asks for one (the API answered 401), keeps it
    in the tab's session storage, and shows only what the REST API shows that key: its own
    org's knowledge bases. Forgetting the key asks again."""
    from tests.browser.conftest import DESKTOP, Watch
    from tests.conftest import running_stack
    from tests.support.bus import OperatorKeys
    from tests.support.mcp_client import serve_http

    async with (
        running_stack(tmp_path, embedders=embedders) as (rt, client),
        serve_http(rt) as (base, _),
    ):
        resolver = OperatorKeys(rt)
        key = await resolver.create("acme", name="console")
        own = f"acme-kb-{uuid.uuid4().hex[:6]}"
        r = await client.post(
            "/v1/kbs", json={"name": own}, headers={"Authorization": f"Bearer {key}"}
        )
        assert r.status_code == 201, r.text

        context = await browser.new_context(viewport=DESKTOP, base_url=base)
        page = await context.new_page()
        watch = Watch()
        watch.attach(page)
        watch.expect("GET", "/v1/kbs", 401)
        try:
            await page.goto("/")
            await expect(page.get_by_text("This server needs an API key.")).to_be_visible()
            await shoot(page, screenshots, "11-api-key")
            # A wrong key is said to be refused, at the field, and not kept.
            await page.get_by_label("API key").fill("kbm_not-a-key")
            await page.get_by_role("button", name="Use key").click()
            await expect(page.locator("#api-key-error")).to_contain_text("This key was refused")
            await expect(page.get_by_label("API key")).to_have_attribute("aria-invalid", "true")
            assert await page.evaluate("sessionStorage.getItem('kbmesh.apiKey')") is None
            await page.get_by_label("API key").fill(key)
            await page.get_by_role("button", name="Use key").click()
            await expect(page.get_by_role("link", name=own)).to_be_visible()
            # Only the key's org: the keyless default org's `default` KB is not listed.
            await expect(page.get_by_role("link", name="default", exact=True)).to_have_count(0)
            assert await page.evaluate("sessionStorage.getItem('kbmesh.apiKey')") == key
            await page.reload()
            await expect(page.get_by_role("link", name=own)).to_be_visible()
            await expect(page.get_by_text("This server needs an API key.")).to_be_hidden()
            await page.get_by_role("button", name="Forget key").click()
            await expect(page.get_by_text("This server needs an API key.")).to_be_visible()
            assert await page.evaluate("sessionStorage.getItem('kbmesh.apiKey')") is None
        finally:
            await context.close()
        assert watch.errors == [], "\n".join(watch.errors)
