"""One trace per upload: the gateway request, the ingest handler and the embed handler
share a trace id, carried through NATS headers."""

from __future__ import annotations

from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from tests.conftest import running_stack


async def test_one_trace_spans_gateway_ingest_and_embed(tmp_path, embedders):
    """The upload's HTTP span, the doc.uploaded consume span (ingest), the kb.index
    consume span (embed) and the embed work spans all carry the request's trace id."""
    exporter = InMemorySpanExporter()
    async with running_stack(
        tmp_path, embedders=embedders, span_processors=[SimpleSpanProcessor(exporter)]
    ) as (_rt, client):
        exporter.clear()
        r = await client.post(
            "/v1/kbs/default/documents?wait=true",
            json={"name": "traced.txt", "content": "trace me end to end"},
        )
        assert r.json()["status"] == "complete"
    spans = exporter.get_finished_spans()
    servers = [s for s in spans if s.kind is SpanKind.SERVER]
    assert [s.name for s in servers] == ["POST /v1/kbs/{kb}/documents"], "one span per request"
    request = servers[0]
    trace_id = request.context.trace_id
    in_trace = [s for s in spans if s.context.trace_id == trace_id]
    names = {s.name for s in in_trace}
    assert any("doc.uploaded" in n and "process" in n for n in names), names
    assert any("kb.index" in n and "process" in n for n in names), names
    assert {"kbmesh.embed.chunk", "kbmesh.embed.embed", "kbmesh.embed.upsert"} <= names
