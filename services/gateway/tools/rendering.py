"""Tool results as clients read them: the numbered, source-attributed listings an LLM reads
(the same results travel as structured content too), and links to the documents they cite."""

from __future__ import annotations

import json

from services.common.messages.answers import AskResponse
from services.common.messages.queries import ChunkResponse, SearchHit, SearchResponse, place_text
from services.gateway.service.resources import ResourceInfo, document_links


def search_links(resp: SearchResponse) -> list[ResourceInfo]:
    return hit_links(resp.hits)


def hit_links(hits: list[SearchHit]) -> list[ResourceInfo]:
    """The documents of the matched hits, best first."""
    return document_links((h.document_id, h.document_name) for h in hits if h.is_matched)


def answer_links(resp: AskResponse) -> list[ResourceInfo]:
    return document_links((c.document_id, c.document_name) for c in resp.citations)


def _hit_header(hit: SearchHit) -> str:
    where = hit.uri or hit.source_id or ""
    score = f", score {hit.score:.3f}" if hit.score is not None else ""
    place = hit.place()
    return (
        f"{hit.document_name} — chunk {hit.chunk_index + 1} of {hit.total_chunks}{score}"
        + (f"\n    in: {place}" if place else "")
        + (f"\n    source: {where}" if where else "")
        + f"\n    kb: {hit.kb_id} · document_id: {hit.document_id} · chunk_id: {hit.chunk_id}"
    )


def render_search(resp: SearchResponse) -> str:
    matched = [h for h in resp.hits if h.is_matched]
    notes = [f"warning: {w}" for w in resp.warnings]
    if resp.budget is not None:
        b = resp.budget
        notes.append(
            f"{b.used_tokens} of {b.max_tokens} tokens used"
            + (
                "; left out: "
                + ", ".join(f"#{o.rank} {o.document_name} ({o.tokens} tokens)" for o in b.omitted)
                if b.omitted
                else ""
            )
            + (f"; {b.omitted_neighbors} context chunk(s) dropped" if b.omitted_neighbors else "")
        )
    if not matched:
        return "\n".join([f'No results for "{resp.query}".', *notes])
    lines = [
        f'{len(matched)} result(s) for "{resp.query}" ({resp.mode.value} search; '
        f"score = {resp.score_kind}):",
        *notes,
    ]
    for hit in resp.hits:
        if hit.is_matched:
            lines.append(f"\n[{hit.rank}] {_hit_header(hit)}\n{hit.content}")
        else:
            lines.append(
                f"\n    (context: chunk {hit.chunk_index + 1} of {hit.document_name})"
                f"\n{hit.content}"
            )
    return "\n".join(lines)


def render_chunk(resp: ChunkResponse) -> str:
    chunks = sorted([resp.chunk, *resp.neighbors], key=lambda h: h.chunk_index)
    lines = [_hit_header(resp.chunk)]
    for h in chunks:
        marker = ">>" if h.chunk_id == resp.chunk.chunk_id else "  "
        lines.append(f"\n{marker} chunk {h.chunk_index + 1}:\n{h.content}")
    return "\n".join(lines)


def render_answer(resp: AskResponse) -> str:
    answer = (
        resp.answer
        if isinstance(resp.answer, str)
        else json.dumps(resp.answer, indent=2, ensure_ascii=False)
    )
    lines = [answer]
    if resp.citations:
        lines.append("\nSources:")
        lines.extend(
            f"- {c.document_name}, {_cited_place(c.heading_path, c.pages, c.slides)}"
            f"chunk {c.chunk_index + 1} (kb: {c.kb_id} · document_id: "
            f"{c.document_id} · chunk_id: {c.chunk_id})"
            for c in resp.citations
        )
    searched = "; ".join(f'"{s.query}" ({s.hit_count})' for s in resp.searches) or "none"
    stop = "answered" if resp.stopped == "answered" else "stopped at the iteration limit"
    lines.append(f"\n({resp.model}, {resp.iterations} model call(s), {stop}; searches: {searched})")
    return "\n".join(lines)


def _cited_place(heading_path: list[str], pages: list[int], slides: list[int]) -> str:
    place = place_text(heading_path, pages, slides)
    return f"{place}, " if place else ""
