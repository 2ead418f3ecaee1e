"""The `kb_ask` tool: a server-side LLM answers from the knowledge bases, searching them as
often as it needs, optionally in a JSON Schema and optionally as a stored prompt."""

from __future__ import annotations

from pydantic import Field

from services.common.messages.answers import AskOptions, AskQuery, AskResponse, AskTask
from services.gateway.auth import Principal
from services.gateway.service import GatewayService
from services.gateway.tools.registry import tool
from services.gateway.tools.rendering import answer_links, render_answer


class KbAskInput(AskQuery):
    prompt: str | None = Field(
        None,
        min_length=1,
        max_length=100,
        description="a stored prompt's name or id (see /v1/prompts): its instructions, "
        "knowledge bases, model and response_schema are used; fields given here override them",
    )


@tool(
    "core",
    title="Answer from the knowledge bases",
    render=render_answer,
    cites=answer_links,
    read_only=True,
    open_world=True,
)
async def kb_ask(service: GatewayService, p: Principal, inp: KbAskInput) -> AskResponse:
    """Have a server-side LLM answer a question from the knowledge bases: it searches them
    (several times, with its own queries, up to max_iterations) and answers with citations —
    the chunks whose ids it quotes. Give response_schema to get JSON that follows it (e.g. to
    extract fields), document_id to have it work on one document with the knowledge bases as
    context, or prompt to run a stored prompt. Use kb_search instead when you want the
    passages themselves to read."""
    if inp.prompt is None:
        return await service.answers.ask(
            p, AskQuery.model_validate(inp.model_dump(exclude={"prompt"}))
        )
    given = inp.model_fields_set
    overrides = {k: getattr(inp, k) for k in AskOptions.model_fields if k in given}
    task = AskTask.model_validate(inp.model_dump(include=set(AskTask.model_fields) & given))
    return await service.answers.run_prompt(p, inp.prompt, task, overrides)
