"""Knowledge bases and documents as MCP resources, driven by the official MCP client over
streamable HTTP against the real stack, on both protocol revisions kbmesh serves (the SDK's
newest and the one before it): resources listed in pages, the two templates, a KB and a
document read as text (a large document in pages), search and answer results that link the
documents they cite, and API keys held to what their tools may see."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS, ResourceLink, TextResourceContents
from mcp_types.version import KNOWN_PROTOCOL_VERSIONS, LATEST_PROTOCOL_VERSION

from services.cli.runtime import api_keys
from services.gateway.app import create_app
from services.gateway.mcp import create_mcp
from tests.conftest import running_stack
from tests.support.asgi import serve_app
from tests.support.bus import OperatorKeys
from tests.support.corpus import DOCS, PARAPHRASES
from tests.support.domain import create_kb
from tests.support.mcp_client import ok, sdk_client
from tests.support.openai_chat import (
    Reply,
    ScriptedChat,
    Text,
    message_text,
    search,
    tool_ids,
    tool_results,
)

# The revision a default client negotiates (the SDK's newest) and the one before it, which a
# client that only knows the initialize handshake asks for.
LATEST, PREVIOUS = LATEST_PROTOCOL_VERSION, KNOWN_PROTOCOL_VERSIONS[-2]
REVISIONS = {LATEST: "auto", PREVIOUS: "legacy"}
# Resources per resources/list page on this test's server: fewer than it has KBs.
LIST_PAGE = 3
PAGE_FOOTER = "\n\n[page "


def uid() -> str:
    return uuid.uuid4().hex[:8]


def large_text() -> str:
    """About 120,000 characters of numbered paragraphs: several pages."""
    return "\n\n".join(
        f"Paragraph {i:04d}. The archive keeps minutes of every meeting held since the "
        f"founding; this one records decision {i} and who voted for it."
        for i in range(1, 1100)
    )


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders):
    """Five KBs besides the default one (`mine` and `theirs` with a document each), a large
    document in no KB, and three keys: org-wide, limited to `mine`, and another org's; the
    MCP server lists LIST_PAGE resources a page."""
    async with running_stack(
        tmp_path_factory.mktemp("mcp-resources"), embedders=embedders, mcp_toolsets="core,compat"
    ) as (rt, client):
        mine = await create_kb(client, name=f"mine-{uid()}", description="The team's plans.")
        theirs = await create_kb(client, name=f"theirs-{uid()}")
        others = [await create_kb(client) for _ in range(3)]
        docs = {}
        for kb, name in ((mine, "tcp.md"), (theirs, "volcanoes.md")):
            r = await client.post(
                f"/v1/kbs/{kb['kb_id']}/documents?wait=true",
                json={"name": name, "content": DOCS[name], "mime_type": "text/markdown"},
            )
            assert r.json()["status"] == "complete", r.text
            docs[name] = r.json()["document_id"]
        big = large_text()
        r = await client.post("/v1/documents?wait=true", json={"name": "big.txt", "content": big})
        assert r.json()["status"] == "stored", r.text
        docs["big.txt"] = r.json()["document_id"]

        org = rt.settings.default_org
        keys = OperatorKeys(rt)
        admin = await keys.create(org, "admin")
        scoped = await keys.create(org, "scoped", kb_ids=[mine["kb_id"]])
        stranger = await keys.create(f"other-{uid()}", "stranger")
        client.headers["Authorization"] = f"Bearer {admin}"
        resolver = api_keys(rt)
        mcp = create_mcp(rt.gateway, keys=resolver, resource_page_size=LIST_PAGE)
        app = create_app(rt.gateway, resolver, mcp=mcp, ready=rt.ready)
        async with serve_app(app, limits=rt.settings.http) as base:
            yield SimpleNamespace(
                rt=rt,
                client=client,
                base=base,
                mine=mine,
                theirs=theirs,
                kbs=[mine, theirs, *others],
                docs=docs,
                big=big,
                admin=admin,
                scoped=scoped,
                stranger=stranger,
            )


@contextlib.asynccontextmanager
async def connected(stack: Any, revision: str, key: str | None = None) -> Any:
    async with sdk_client(stack.base, key or stack.admin, mode=REVISIONS[revision]) as client:
        assert client.protocol_version == revision
        yield client


def kb_uri(kb_id: str) -> str:
    return f"kbmesh://kbs/{kb_id}"


def document_uri(document_id: str) -> str:
    return f"kbmesh://documents/{document_id}"


async def every_resource(client: Client) -> list[list[Any]]:
    """Every page of resources/list, following the cursors."""
    pages, cursor = [], None
    while True:
        page = await client.list_resources(cursor=cursor)
        pages.append(page.resources)
        if page.next_cursor is None:
            return pages
        assert len(pages) < 50, "the cursors do not end"
        cursor = page.next_cursor


def text_of(result: Any) -> TextResourceContents:
    (content,) = result.contents
    assert isinstance(content, TextResourceContents), content
    return content


async def refused(client: Client, uri: str) -> str:
    """The message of a resources/read that the server refuses as invalid params."""
    with pytest.raises(MCPError) as caught:
        await client.read_resource(uri)
    assert caught.value.error.code == INVALID_PARAMS, caught.value.error
    assert "Traceback" not in caught.value.error.message
    return caught.value.error.message


# ---- protocol revisions ---------------------------------------------------------------------


@pytest.mark.parametrize("revision", REVISIONS)
async def test_each_protocol_revision_is_negotiated_and_served(stack, revision):
    """The official client negotiates the SDK's newest revision by default (server/discover)
    and the previous one when it asks for it (the initialize handshake); on each, the server
    offers tools and resources, and tools are listed and called."""
    async with connected(stack, revision) as client:
        capabilities = client.server_capabilities
        assert capabilities.tools is not None and capabilities.resources is not None
        assert "kb_search" in {t.name for t in (await client.list_tools()).tools}
        listed = ok(await client.call_tool("kb_list", {}))
        assert {kb["kb_id"] for kb in stack.kbs} <= {kb["kb_id"] for kb in listed["items"]}


# ---- listing --------------------------------------------------------------------------------


@pytest.mark.parametrize("revision", REVISIONS)
async def test_resources_are_listed_in_pages_each_once(stack, revision):
    """resources/list pages through every KB (first) and every document with text, LIST_PAGE
    at a time, each exactly once, following the server's cursors; a KB is listed by id with
    its name and description as markdown, a document by id with its name."""
    async with connected(stack, revision) as client:
        pages = await every_resource(client)
    assert len(pages) >= 3 and all(len(page) <= LIST_PAGE for page in pages), pages
    listed = [r for page in pages for r in page]
    uris = [str(r.uri) for r in listed]
    assert len(uris) == len(set(uris)), uris
    kbs = [r for r in listed if str(r.uri).startswith("kbmesh://kbs/")]
    assert listed[: len(kbs)] == kbs, "KBs come first"
    assert {kb_uri(kb["kb_id"]) for kb in stack.kbs} <= {str(r.uri) for r in kbs}
    assert {document_uri(d) for d in stack.docs.values()} <= set(uris)
    by_uri = {str(r.uri): r for r in listed}
    mine = by_uri[kb_uri(stack.mine["kb_id"])]
    assert (mine.name, mine.description, mine.mime_type) == (
        stack.mine["name"],
        "The team's plans.",
        "text/markdown",
    )
    tcp = by_uri[document_uri(stack.docs["tcp.md"])]
    assert (tcp.name, tcp.mime_type) == ("tcp.md", "text/markdown")
    assert by_uri[document_uri(stack.docs["big.txt"])].mime_type == "text/plain"


@pytest.mark.parametrize("revision", REVISIONS)
async def test_templates_name_the_kb_and_the_document_addresses(stack, revision):
    """resources/templates/list offers the two address forms a client can fill in: a KB by
    name or id, and a document by id with an optional page."""
    async with connected(stack, revision) as client:
        templates = {
            t.uri_template: t for t in (await client.list_resource_templates()).resource_templates
        }
    assert set(templates) == {"kbmesh://kbs/{kb}", "kbmesh://documents/{document_id}{?page}"}
    assert templates["kbmesh://kbs/{kb}"].mime_type == "text/markdown"
    for template in templates.values():
        assert template.name and len(template.description or "") > 40, template


# ---- reading --------------------------------------------------------------------------------


@pytest.mark.parametrize("revision", REVISIONS)
async def test_a_kb_reads_as_markdown_with_its_settings_counts_and_documents(stack, revision):
    """A KB read by id (or by name) is a markdown page: its name, description, id, settings,
    indexed document and chunk counts, and its documents as resource links."""
    kb = stack.mine
    async with connected(stack, revision) as client:
        page = text_of(await client.read_resource(kb_uri(kb["kb_id"])))
        by_name = text_of(await client.read_resource(kb_uri(kb["name"])))
    assert page.mime_type == "text/markdown" and str(page.uri) == kb_uri(kb["kb_id"])
    text = page.text
    assert text.startswith(f"# {kb['name']}\n") and "The team's plans." in text, text
    assert kb["kb_id"] in text and kb["embedding_model"] in text
    assert f"| chunk_size | {kb['chunk_size']} |" in text, text
    assert "documents indexed: 1" in text, text
    assert f"[tcp.md]({document_uri(stack.docs['tcp.md'])})" in text, text
    assert by_name.text == text


@pytest.mark.parametrize("revision", REVISIONS)
async def test_a_document_reads_as_its_text_and_a_large_one_in_pages(stack, revision):
    """A document reads as its extracted text. A large one reads in pages: each page ends by
    naming the next page's address (and says so in `_meta`), the last says it is the end, and
    the pages in order are the whole text."""
    async with connected(stack, revision) as client:
        small = text_of(await client.read_resource(document_uri(stack.docs["tcp.md"])))
        assert small.mime_type == "text/markdown"
        assert small.text.strip() == DOCS["tcp.md"].strip()
        assert small.meta is None or "kbmesh/page" not in small.meta

        uri, parts, pages = document_uri(stack.docs["big.txt"]), [], None
        while uri is not None:
            page = text_of(await client.read_resource(uri))
            assert page.mime_type == "text/plain"
            info = (page.meta or {})["kbmesh/page"]
            pages = pages or info["pages"]
            assert info["page"] == len(parts) + 1 and info["pages"] == pages, info
            body, footer = page.text.rsplit(PAGE_FOOTER, 1)
            parts.append(body)
            uri = info.get("next")
            if uri is not None:
                assert uri == f"{document_uri(stack.docs['big.txt'])}?page={info['page'] + 1}"
                assert uri in footer, footer
            else:
                assert "end" in footer, footer
    assert pages is not None and pages >= 3 and len(parts) == pages
    assert "".join(parts) == stack.big


async def test_bad_reads_are_refused_with_a_clear_error(stack):
    """A page that is not a whole number, zero or past the end, an address of no template and
    a cursor the server never gave are refused as invalid params, with a message that says
    what is wrong; nothing is read."""
    big = document_uri(stack.docs["big.txt"])
    async with connected(stack, LATEST) as client:
        assert "page" in await refused(client, f"{big}?page=two")
        assert "page" in await refused(client, f"{big}?page=0")
        past = await refused(client, f"{big}?page=9999")
        assert "9999" in past and "pages" in past, past
        assert "not found" in await refused(client, "kbmesh://elsewhere/x")
        with pytest.raises(MCPError) as caught:
            await client.list_resources(cursor="not-a-cursor")
        assert caught.value.error.code == INVALID_PARAMS
        assert "cursor" in caught.value.error.message


# ---- links from tool results ----------------------------------------------------------------


def links(result: Any) -> list[ResourceLink]:
    return [c for c in result.content if isinstance(c, ResourceLink)]


@pytest.mark.parametrize("revision", REVISIONS)
async def test_search_results_link_the_documents_they_cite(stack, revision):
    """kb_search, search_docs and search_knowledge_base answer with their structured results
    (valid against their output schemas, which the client checks) and a resource link per
    cited document, once each; reading the link gives that document's text."""
    tcp = stack.docs["tcp.md"]
    async with connected(stack, revision) as client:
        await client.list_tools()  # the client holds results to the output schemas it lists
        result = await client.call_tool(
            "kb_search",
            {"kb": stack.mine["name"], "query": PARAPHRASES["tcp.md"], "coalesce_neighbors": 1},
        )
        body = ok(result)
        assert body["hits"] and {h["document_id"] for h in body["hits"]} == {tcp}
        (link,) = links(result)
        assert (str(link.uri), link.name) == (document_uri(tcp), "tcp.md")
        read = text_of(await client.read_resource(str(link.uri)))
        assert read.text.strip() == DOCS["tcp.md"].strip()

        result = await client.call_tool(
            "search_docs",
            {"query": PARAPHRASES["tcp.md"], "projectId": stack.mine["kb_id"], "minScore": 0.1},
        )
        assert ok(result)["results"]
        assert [str(x.uri) for x in links(result)] == [document_uri(tcp)]

        result = await client.call_tool(
            "search_knowledge_base", {"query": PARAPHRASES["volcanoes.md"], "top_k": 2}
        )
        cited = [str(x.uri) for x in links(result)]
        assert ok(result)["results"] and len(cited) == len(set(cited))
        assert cited[0] == document_uri(stack.docs["volcanoes.md"]), cited


def answer_from_first_hit(body: dict[str, Any]) -> Reply:
    """A scripted chat model: one search for the question, then an answer citing the top hit."""
    if not tool_results(body):
        return search(message_text(body, "user"))
    return Text(f"See {tool_ids(body)[0]}.")


@contextlib.contextmanager
def allowlist(settings: Any, entries: list[str]) -> Iterator[None]:
    """The gateway reads KBMESH_EGRESS__ALLOWLIST per call; restored so later tests see none."""
    before = settings.egress.allowlist
    settings.egress.allowlist = entries
    try:
        yield
    finally:
        settings.egress.allowlist = before


async def test_an_answer_links_the_documents_it_cites(stack):
    """kb_ask's answer carries a resource link to each document its citations come from,
    beside the structured answer; the link reads as that document's text."""
    chat = ScriptedChat(default=answer_from_first_hit)
    with allowlist(stack.rt.settings, ["127.0.0.1/32"]):
        async with (
            serve_app(chat.app, lifespan="off") as chat_url,
            connected(stack, LATEST) as client,
        ):
            await client.list_tools()
            result = await client.call_tool(
                "kb_ask",
                {
                    "question": PARAPHRASES["volcanoes.md"],
                    "kb_ids": [stack.theirs["kb_id"]],
                    "model": "hosted_vllm/scripted",
                    "api_base": chat_url + "/v1",
                },
            )
            body = ok(result)
            assert [c["document_id"] for c in body["citations"]] == [stack.docs["volcanoes.md"]]
            (link,) = links(result)
            assert str(link.uri) == document_uri(stack.docs["volcanoes.md"])
            read = text_of(await client.read_resource(str(link.uri)))
    assert read.text.strip() == DOCS["volcanoes.md"].strip()


# ---- scope ----------------------------------------------------------------------------------


@pytest.mark.parametrize("revision", REVISIONS)
async def test_a_kb_scoped_key_lists_and_reads_only_its_kbs_and_their_documents(stack, revision):
    """A key limited to `mine` lists exactly `mine` and its document, reads them, and reads
    every other KB and document of its org exactly as it reads ones that do not exist; its
    search results link only documents it can read."""
    mine, tcp = stack.mine, stack.docs["tcp.md"]
    async with connected(stack, revision, stack.scoped) as client:
        listed = [str(r.uri) for page in await every_resource(client) for r in page]
        assert listed == [kb_uri(mine["kb_id"]), document_uri(tcp)]
        assert "tcp.md" in text_of(await client.read_resource(kb_uri(mine["kb_id"]))).text
        assert text_of(await client.read_resource(document_uri(tcp))).text.strip() == (
            DOCS["tcp.md"].strip()
        )

        missing = uuid.uuid4().hex
        for hidden in (stack.theirs["kb_id"], stack.theirs["name"], "default"):
            message = await refused(client, kb_uri(hidden))
            assert message == (await refused(client, kb_uri(missing))).replace(missing, hidden)
        for name in ("volcanoes.md", "big.txt"):
            hidden = stack.docs[name]
            message = await refused(client, document_uri(hidden))
            expected = await refused(client, document_uri(missing))
            assert message == expected.replace(missing, hidden)

        result = await client.call_tool("kb_search", {"query": PARAPHRASES["volcanoes.md"]})
        assert {str(x.uri) for x in links(result)} <= {document_uri(tcp)}


@pytest.mark.parametrize("revision", REVISIONS)
async def test_another_orgs_key_sees_nothing_of_this_org(stack, revision):
    """A key of another org lists none of this org's KBs or documents and reads them as not
    found."""
    async with connected(stack, revision, stack.stranger) as client:
        listed = {str(r.uri) for page in await every_resource(client) for r in page}
        ours = {kb_uri(kb["kb_id"]) for kb in stack.kbs} | {
            document_uri(d) for d in stack.docs.values()
        }
        assert not listed & ours
        for uri in (kb_uri(stack.mine["kb_id"]), document_uri(stack.docs["tcp.md"])):
            assert "not found" in await refused(client, uri)
