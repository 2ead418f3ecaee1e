"""REST: answers (`/v1/ask`) and stored prompts (`/v1/prompts`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from services.common.messages.answers import AskQuery, AskResponse, AskTask
from services.gateway.api.deps import Answerer, Caller
from services.gateway.api.routing import StrictBodyRoute
from services.gateway.schemas import (
    PromptCreate,
    PromptDeleted,
    PromptList,
    PromptUpdate,
    PromptView,
)

router = APIRouter(prefix="/v1", tags=["answers"], route_class=StrictBodyRoute)

# A model that answered, but not in the requested schema even after a repair round.
BAD_MODEL_OUTPUT: dict[int | str, dict[str, Any]] = {
    502: {
        "description": "the model's answer does not follow response_schema after one repair "
        "round (BadModelOutput: the problem's detail gives the reason and the last output)"
    }
}


@router.post("/ask", responses=BAD_MODEL_OUTPUT)
async def ask(body: AskQuery, answers: Answerer, caller: Caller) -> AskResponse:
    """An LLM answers from the knowledge bases: it searches them (search_knowledge_base, as
    often as it needs, up to max_iterations), then answers — as JSON following
    response_schema when given — with the chunks it cites."""
    return await answers.ask(caller, body)


@router.post("/prompts", status_code=201)
async def create_prompt(body: PromptCreate, answers: Answerer, caller: Caller) -> PromptView:
    """Store a prompt (instructions, KBs, model, response schema) to run again and again."""
    return await answers.create_prompt(caller, body)


@router.get("/prompts")
async def list_prompts(answers: Answerer, caller: Caller) -> PromptList:
    return await answers.list_prompts(caller)


@router.get("/prompts/{prompt}")
async def get_prompt(prompt: str, answers: Answerer, caller: Caller) -> PromptView:
    return await answers.get_prompt(caller, prompt)


@router.patch("/prompts/{prompt}")
async def update_prompt(
    prompt: str, body: PromptUpdate, answers: Answerer, caller: Caller
) -> PromptView:
    return await answers.update_prompt(caller, prompt, body)


@router.delete("/prompts/{prompt}")
async def delete_prompt(prompt: str, answers: Answerer, caller: Caller) -> PromptDeleted:
    return await answers.delete_prompt(caller, prompt)


@router.post("/prompts/{prompt}/run", responses=BAD_MODEL_OUTPUT)
async def run_prompt(prompt: str, body: AskTask, answers: Answerer, caller: Caller) -> AskResponse:
    """Run a stored prompt on a question and/or a document (`{prompt}`: its id or name)."""
    return await answers.run_prompt(caller, prompt, body)
