"""The answer loop (`search.ask`): a chat model searches the request's KBs through one tool,
`search_knowledge_base`, until it can answer; an answer that must follow a JSON Schema is
checked, repaired once, or refused; retrieved chunks whose ids the answer quotes are its
citations.

Every search the model makes goes through `SearchService.search` with the request's KBs, org
and key scope, so the model can never see more than its caller could. The model sits behind
`ChatModel` (services/search/llm.py), the one place outbound model calls are made.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jsonschema.protocols import Validator
from pydantic import ValidationError

from services.common.bus.registry import Registries
from services.common.domain.errors import (
    BadModelOutput,
    Conflict,
    InvalidInput,
    NotFound,
    Transient,
)
from services.common.domain.models import DocStatus, DocumentRecord, KnowledgeBase
from services.common.messages.answers import (
    TOOL_DESCRIPTION,
    TOOL_NAME,
    AskRequest,
    AskResponse,
    Citation,
    SearchMade,
    ToolResult,
    ToolSearchArgs,
    ToolSearchOutput,
    Usage,
    schema_validator,
)
from services.common.messages.queries import (
    MetadataCondition,
    SearchFilters,
    SearchHit,
    SearchRequest,
)
from services.common.ops.telemetry import tracer
from services.common.settings import AskSettings
from services.search.llm import ChatModel, ChatReply, LiteLLMChat, PolicySource, ToolCall
from services.search.service import SearchService

log = logging.getLogger("kbmesh.ask")
_tracer = tracer("kbmesh.search")

ChatFactory = Callable[[str, str | None], ChatModel]

_GUIDE = (
    "You answer from the knowledge bases listed below, which you search with the "
    f"{TOOL_NAME} tool. Search before answering, and search again with other words when the "
    "results do not hold the answer. Base your answer on what the searches (and the document, "
    "if one is given) show; when they do not contain the answer, say so instead of guessing. "
    "When you use a passage, cite it by writing its id (the `id` of the search result) in "
    "your answer."
)
_SCHEMA_RULE = (
    "Your final answer must be one JSON value that validates against the JSON Schema below, "
    "and nothing else: no prose, no code fences. Where the schema has room for sources, put "
    "the ids of the passages you used there.\n\nJSON Schema:\n"
)
_FINAL_TURN = (
    "You have used all your searches. Give your final answer now from what you have found, "
    "without calling any tool."
)
_REPAIR = (
    "Your answer does not follow the required JSON Schema: {problem}. Reply with the "
    "corrected answer only: one JSON value that validates against the schema, no other text."
)
_OUTPUT_SHOWN = 2000  # characters of a rejected answer quoted back to the caller
# A `document_id`'s text given to the model is cut here (and the model told): about 25k
# tokens, within every current chat model's context with room for the searches that follow.
DOCUMENT_MAX_CHARS = 100_000


@dataclass
class _Run:
    """What one answer has accumulated so far."""

    iterations: int = 0
    usage: Usage = field(default_factory=Usage)
    searches: list[SearchMade] = field(default_factory=list)
    retrieved: dict[tuple[str, str], SearchHit] = field(default_factory=dict)


class AskService:
    def __init__(
        self,
        registries: Registries,
        search: SearchService,
        settings: AskSettings,
        chat: ChatFactory | None = None,
        egress: PolicySource | None = None,
    ) -> None:
        self.reg = registries
        self.search = search
        self.settings = settings
        self._chat = chat or self._litellm_chat
        # The egress policy: every model request is vetted before it is sent.
        self._egress = egress

    def _litellm_chat(self, model: str, api_base: str | None) -> ChatModel:
        return LiteLLMChat(model, api_base, egress=self._egress)

    async def ask(self, req: AskRequest) -> AskResponse:
        try:
            async with asyncio.timeout(self.settings.timeout_seconds):
                return await self._ask(req)
        except TimeoutError as err:
            raise Transient(
                f"the answer took longer than {self.settings.timeout_seconds:g} s "
                "(KBMESH_ASK__TIMEOUT_SECONDS)"
            ) from err

    async def _ask(self, req: AskRequest) -> AskResponse:
        model = req.model or self.settings.model
        if not model:
            raise InvalidInput(
                "no model given and no default configured: pass `model` (a LiteLLM chat "
                "model id such as openai/gpt-4o-mini) or set KBMESH_ASK__MODEL",
                field="model",
            )
        api_base = req.api_base if req.model or req.api_base else self.settings.api_base
        chat = self._chat(model, api_base)
        with _tracer.start_as_current_span("kbmesh.ask") as span:
            span.set_attribute("gen_ai.request.model", model)
            await chat.check()
            kbs = await self.search.resolve_kbs(req.org_id, req.kb_ids, req.scope_kb_ids)
            span.set_attribute("kbmesh.kb_count", len(kbs))
            document = await self._document(req, req.document_id) if req.document_id else None
            schema = req.response_schema
            validator = schema_validator(schema) if schema is not None else None
            messages = _opening(req, kbs, document, DOCUMENT_MAX_CHARS)
            tools = [_TOOL]
            response_format = _response_format(req.response_schema)
            format_with_tools = response_format if chat.json_mode_with_tools() else None
            run = _Run()

            while True:
                if run.iterations >= req.max_iterations:
                    messages.append({"role": "user", "content": _FINAL_TURN})
                    reply = await self._call(chat, run, messages, tools, "none", response_format)
                    stopped = "iteration_limit"
                    break
                reply = await self._call(chat, run, messages, tools, "auto", format_with_tools)
                if not reply.tool_calls:
                    stopped = "answered"
                    break
                messages.append(reply.as_message())
                for call in reply.tool_calls:
                    result = await self._tool(call, req, kbs, run)
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})

            text = (reply.content or "").strip()
            if validator is None:
                if not text:
                    raise BadModelOutput(f"{model} returned no answer text")
                answer: Any = text
            else:
                answer, problem = _parse(text, validator)
                if problem is not None:
                    messages.append({"role": "assistant", "content": reply.content or ""})
                    messages.append({"role": "user", "content": _REPAIR.format(problem=problem)})
                    reply = await self._call(chat, run, messages, tools, "none", response_format)
                    text = (reply.content or "").strip()
                    answer, problem = _parse(text, validator)
                    if problem is not None:
                        raise BadModelOutput(
                            f"the answer of {model} does not follow response_schema, also "
                            f"after one repair round: {problem}. Its last output: "
                            f"{_clip(text)!r}",
                            field="response_schema",
                        )
            span.set_attribute("kbmesh.iterations", run.iterations)
            span.set_attribute("kbmesh.stopped", stopped)
            retrieved = list(run.retrieved.values())
            return AskResponse(
                answer=answer,
                citations=_citations(text, retrieved),
                retrieved=retrieved,
                iterations=run.iterations,
                searches=run.searches,
                stopped=stopped,  # type: ignore[arg-type]
                model=model,
                usage=run.usage,
            )

    async def _call(
        self,
        chat: ChatModel,
        run: _Run,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        tool_choice: str,
        response_format: dict[str, Any] | None,
    ) -> ChatReply:
        run.iterations += 1
        with _tracer.start_as_current_span("kbmesh.ask.model_call") as span:
            span.set_attribute("gen_ai.request.model", chat.model)
            span.set_attribute("kbmesh.iteration", run.iterations)
            span.set_attribute("kbmesh.tool_choice", tool_choice)
            reply = await chat.complete(
                messages, tools=tools, tool_choice=tool_choice, response_format=response_format
            )
            span.set_attribute("gen_ai.usage.input_tokens", reply.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", reply.completion_tokens)
            span.set_attribute("kbmesh.tool_calls", len(reply.tool_calls))
        run.usage.prompt_tokens += reply.prompt_tokens
        run.usage.completion_tokens += reply.completion_tokens
        return reply

    async def _tool(
        self, call: ToolCall, req: AskRequest, kbs: list[KnowledgeBase], run: _Run
    ) -> str:
        """Run one tool call; whatever the model got wrong goes back to it as a tool error."""
        with _tracer.start_as_current_span("kbmesh.ask.search") as span:
            if call.name != TOOL_NAME:
                return _tool_error(f"unknown tool {call.name!r}; the only tool is {TOOL_NAME}")
            try:
                args = ToolSearchArgs.model_validate_json(call.arguments or "{}")
                search = SearchRequest(
                    query=args.query,
                    kb_ids=[kb.kb_id for kb in kbs],
                    top_k=args.top_k or req.top_k,
                    coalesce_neighbors=args.coalesce_neighbors,
                    filters=_filters(req.filters, args),
                    org_id=req.org_id,
                    scope_kb_ids=req.scope_kb_ids,
                )
            except ValueError as err:  # pydantic's ValidationError included
                return _tool_error(f"invalid arguments: {_reason(err)}")
            span.set_attribute("kbmesh.query_length", len(args.query))
            if not kbs:
                hits: list[SearchHit] = []
                coalesced = 0
            else:
                try:
                    resp = await self.search.search(search)
                except InvalidInput as err:
                    return _tool_error(err.message)
                hits, coalesced = resp.hits, resp.coalesced
            span.set_attribute("kbmesh.hits", len(hits))
        run.searches.append(SearchMade(query=args.query, hit_count=len(hits)))
        for hit in hits:
            run.retrieved.setdefault((hit.kb_id, hit.chunk_id), hit)
        return ToolSearchOutput(
            results=[
                ToolResult(
                    id=h.chunk_id,
                    content=h.content,
                    source=h.document_name,
                    relevance=h.score,
                    is_matched=h.is_matched,
                    chunk_index=h.chunk_index,
                    place=h.place() or None,
                )
                for h in hits
            ],
            query=args.query,
            sources_searched=len(kbs),
            coalesced=coalesced,
        ).model_dump_json()

    async def _document(self, req: AskRequest, document_id: str) -> tuple[DocumentRecord, str]:
        """The document to work on, if the caller may see it (the documents API's rule: one
        of its KBs is in the key's scope)."""
        record = await self.reg.documents.get(f"{req.org_id}.{document_id}")
        if record is None or not record.in_scope(req.scope_kb_ids):
            raise NotFound(f"document {document_id!r} not found", field="document_id")
        if record.status != DocStatus.ready:
            raise Conflict(
                f"document {document_id!r} has no text yet (status {record.status.value})",
                field="document_id",
            )
        text = await self.reg.texts.get_text(record.text_object)
        if text is None:
            raise Conflict(f"document {document_id!r} has no stored text", field="document_id")
        return record, text


# ---- conversation -----------------------------------------------------------------------------


def _opening(
    req: AskRequest,
    kbs: list[KnowledgeBase],
    document: tuple[DocumentRecord, str] | None,
    max_chars: int,
) -> list[dict[str, Any]]:
    listed = "\n".join(
        f"- {kb.name}" + (f": {kb.description}" if kb.description else "") for kb in kbs
    )
    system = [_GUIDE, "Knowledge bases:\n" + (listed or "(none)")]
    if req.instructions:
        system.append("Instructions:\n" + req.instructions)
    if req.response_schema is not None:
        system.append(_SCHEMA_RULE + json.dumps(req.response_schema, indent=1))
    user: list[str] = []
    if document is not None:
        record, text = document
        cut = len(text) > max_chars
        user.append(
            f'The document to work on, "{record.name}" (id {record.document_id})'
            + (f", cut at {max_chars} of its {len(text)} characters" if cut else "")
            + f":\n<document>\n{text[:max_chars]}\n</document>"
        )
    user.append(req.question or "Carry out the instructions on this document.")
    return [
        {"role": "system", "content": "\n\n".join(system)},
        {"role": "user", "content": "\n\n".join(user)},
    ]


def _response_format(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    # Providers' structured output takes an object at the root; other schemas are asked for in
    # the prompt alone (and checked all the same).
    if schema is None or schema.get("type") != "object":
        return None
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def _tool_error(message: str) -> str:
    return json.dumps({"error": message})


def _reason(err: Exception) -> str:
    if isinstance(err, ValidationError):
        return "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(arguments)'}: {e['msg']}"
            for e in err.errors()[:5]
        )
    return str(err)


def _filters(base: SearchFilters | None, args: ToolSearchArgs) -> SearchFilters | None:
    """The request's filters narrowed by the model's: the model can restrict its searches,
    never widen them."""
    mf = args.metadata_filter
    if base is None and mf is None and not args.upload_date_from and not args.upload_date_to:
        return None
    data: dict[str, Any] = base.model_dump(exclude_none=True) if base else {}
    if mf is not None:
        if mf.document_name and "document_name" not in data:
            data["document_name"] = mf.document_name
        if mf.tag_ids:
            allowed = data.get("tags")
            tags = [t for t in mf.tag_ids if allowed is None or t in allowed]
            if not tags:
                raise ValueError(f"tag_ids must be among this request's tags {allowed}")
            data["tags"] = tags
        conditions = [
            MetadataCondition(key=key, any_of=value)
            if isinstance(value, list)
            else MetadataCondition(key=key, eq=value)
            for key, value in mf.custom.items()
        ]
        data["metadata"] = [*data.get("metadata", []), *conditions]
    if args.upload_date_from:
        current = data.get("upload_date_from")
        data["upload_date_from"] = max(filter(None, (current, args.upload_date_from)))
    if args.upload_date_to:
        current = data.get("upload_date_to")
        data["upload_date_to"] = min(filter(None, (current, args.upload_date_to)))
    return SearchFilters.model_validate(data)


# ---- answers ------------------------------------------------------------------------------------


def _parse(text: str, validator: Validator) -> tuple[Any, str | None]:
    """(the JSON answer, None) or (None, why it is not acceptable)."""
    if not text:
        return None, "the answer is empty"
    try:
        value = json.loads(_unfenced(text))
    except ValueError as err:
        return None, f"the answer is not JSON ({err})"
    errors = sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path))
    if errors:
        return None, "; ".join(
            f"at {'/'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}"
            for e in errors[:5]
        )
    return value, None


def _unfenced(text: str) -> str:
    # Models asked for bare JSON still often wrap it in a Markdown code fence.
    if text.startswith("```"):
        body = text.split("\n", 1)[1] if "\n" in text else ""
        return body.rsplit("```", 1)[0]
    return text


def _citations(text: str, retrieved: list[SearchHit]) -> list[Citation]:
    return [
        Citation(
            chunk_id=h.chunk_id,
            document_id=h.document_id,
            document_name=h.document_name,
            kb_id=h.kb_id,
            chunk_index=h.chunk_index,
            heading_path=h.heading_path,
            pages=h.pages,
            slides=h.slides,
        )
        for h in retrieved
        if h.chunk_id in text
    ]


def _clip(text: str) -> str:
    return text if len(text) <= _OUTPUT_SHOWN else text[:_OUTPUT_SHOWN] + "…"


def _plain_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic model's JSON Schema as tool parameters every provider reads: references
    inlined, optional fields as their type (not `anyOf` with null), no titles or null
    defaults."""
    defs = schema.get("$defs", {})

    def walk(node: dict[str, Any]) -> dict[str, Any]:
        if "$ref" in node:
            node = {**copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[1]]), **node}
            node.pop("$ref")
        options = [o for o in node.get("anyOf", []) if o != {"type": "null"}]
        if "anyOf" in node and len(options) == 1:
            node = {**{k: v for k, v in node.items() if k != "anyOf"}, **walk(options[0])}
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in ("title", "$defs") or (key == "default" and value is None):
                continue
            if key == "properties":
                out[key] = {name: walk(sub) for name, sub in value.items()}
            elif key in ("items", "additionalProperties") and isinstance(value, dict):
                out[key] = walk(value)
            elif key == "anyOf":
                out[key] = [walk(o) for o in value]
            else:
                out[key] = value
        return out

    return walk(schema)


_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": TOOL_DESCRIPTION,
        "parameters": _plain_schema(ToolSearchArgs.model_json_schema()),
    },
}

__all__ = ["AskService", "ChatFactory"]
