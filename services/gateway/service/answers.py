"""Answers and stored prompts: names, scope and documents checked here, the loop itself asked
of the search service (`search.ask`); prompts kept in the `prompts` registry.

Prompts belong to the org. A KB-scoped key sees and changes only prompts whose KBs all lie in
its scope (a prompt over every KB is visible to all), and runs them within its scope."""

from __future__ import annotations

from services.common.bus.client import Bus
from services.common.bus.registry import Registries
from services.common.domain.errors import Conflict, InvalidInput, NotFound
from services.common.domain.ids import is_id, new_id
from services.common.domain.models import utcnow
from services.common.messages.answers import AskQuery, AskRequest, AskResponse, AskTask, Prompt
from services.common.messages.names import Subject
from services.common.outbound.egress import egress_policy
from services.common.outbound.modelcalls import check_destination
from services.common.settings import Settings
from services.gateway.auth import Principal
from services.gateway.schemas import (
    PromptCreate,
    PromptDeleted,
    PromptList,
    PromptUpdate,
    PromptView,
)
from services.gateway.service.access import visible
from services.gateway.service.kbs import KnowledgeBases
from services.gateway.service.search import request_reply

# The search service bounds an answer by KBMESH_ASK__TIMEOUT_SECONDS and replies with an error
# when it runs out; the gateway waits a little longer, so that reply (not a bare timeout) is
# what the client sees.
REPLY_MARGIN_SECONDS = 10.0
PROMPT_LIMIT = 1000


class Answers:
    def __init__(
        self, bus: Bus, registries: Registries, settings: Settings, kbs: KnowledgeBases
    ) -> None:
        self.bus = bus
        self.reg = registries
        self.settings = settings
        self.kbs = kbs

    async def ask(self, p: Principal, query: AskQuery) -> AskResponse:
        kb_ids = await self._kb_ids(p, query.kb_ids)
        if query.document_id is not None:
            record = await self.reg.documents.get(f"{p.org_id}.{query.document_id}")
            if record is None or not visible(p, record):
                raise NotFound(f"document {query.document_id!r} not found", field="document_id")
        request = AskRequest(
            **query.model_dump(exclude={"kb_ids"}),
            kb_ids=kb_ids,
            org_id=p.org_id,
            scope_kb_ids=p.scope,
        )
        body = await request_reply(
            self.bus,
            Subject.SEARCH_ASK,
            request,
            self.settings.ask.timeout_seconds + REPLY_MARGIN_SECONDS,
        )
        return AskResponse.model_validate(body)

    # ---- stored prompts ---------------------------------------------------------------------

    async def create_prompt(self, p: Principal, body: PromptCreate) -> PromptView:
        p.check_write()
        existing = await self.reg.prompts.list(f"{p.org_id}.")
        if len(existing) >= PROMPT_LIMIT:
            raise Conflict(f"this org already has {PROMPT_LIMIT} prompts")
        if any(x.name == body.name for x in existing):
            raise Conflict(f"a prompt named {body.name!r} exists", field="name")
        fields = body.model_dump(exclude={"kb_ids"})
        kb_ids = await self._kb_ids(p, body.kb_ids)
        prompt = Prompt(org_id=p.org_id, prompt_id=new_id(), kb_ids=kb_ids, **fields)
        await self._check_model(prompt)
        await self.reg.prompts.create(prompt.key, prompt)
        return view(prompt)

    async def list_prompts(self, p: Principal) -> PromptList:
        prompts = [x for x in await self.reg.prompts.list(f"{p.org_id}.") if _visible(p, x)]
        prompts.sort(key=lambda x: x.created_at)
        return PromptList(items=[view(x) for x in prompts], total=len(prompts))

    async def get_prompt(self, p: Principal, ref: str) -> PromptView:
        return view((await self._prompt(p, ref))[0])

    async def update_prompt(self, p: Principal, ref: str, body: PromptUpdate) -> PromptView:
        p.check_write()
        prompt, revision = await self._prompt(p, ref)
        changes = body.model_dump(exclude_unset=True)
        if "name" in changes and changes["name"] is None:
            raise InvalidInput("name cannot be null", field="name")
        if changes.get("name") not in (None, prompt.name):
            others = await self.reg.prompts.list(f"{p.org_id}.")
            if any(x.name == changes["name"] for x in others):
                raise Conflict(f"a prompt named {changes['name']!r} exists", field="name")
        if "kb_ids" in changes:
            changes["kb_ids"] = await self._kb_ids(p, body.kb_ids)
        updated = Prompt.model_validate({**prompt.model_dump(), **changes, "updated_at": utcnow()})
        if (updated.model, updated.api_base) != (prompt.model, prompt.api_base):
            await self._check_model(updated)
        # Compare-and-set: two concurrent edits cannot silently overwrite each other.
        await self.reg.prompts.update(prompt.key, updated, revision)
        return view(updated)

    async def delete_prompt(self, p: Principal, ref: str) -> PromptDeleted:
        p.check_write()
        prompt, _ = await self._prompt(p, ref)
        await self.reg.prompts.delete(prompt.key)
        return PromptDeleted(prompt_id=prompt.prompt_id)

    async def run_prompt(
        self, p: Principal, ref: str, task: AskTask, overrides: dict[str, object] | None = None
    ) -> AskResponse:
        """The prompt's options with `task` (question and/or document); `overrides` replace
        options for this run only."""
        prompt, _ = await self._prompt(p, ref)
        query = AskQuery.model_validate(
            {**prompt.options(), **(overrides or {}), **task.model_dump(exclude_unset=True)}
        )
        return await self.ask(p, query)

    async def _check_model(self, prompt: Prompt) -> None:
        """A stored prompt's model address is vetted at save, as a KB's is: its api_base, or
        the provider's default (a model without api_base runs where LiteLLM routes it)."""
        model = prompt.model or self.settings.ask.model
        if model is None and prompt.api_base is None:
            return
        policy = egress_policy(self.settings)
        if model is None:
            await policy.check_url(
                prompt.api_base or "", field="api_base", what="call the chat model at"
            )
            return
        await check_destination(
            policy, model, prompt.api_base, model_field="model", what="call the chat model at"
        )

    async def _prompt(self, p: Principal, ref: str) -> tuple[Prompt, int]:
        """A prompt id or name, within the caller's org and scope (else 404)."""
        found = await self.reg.prompts.get_versioned(f"{p.org_id}.{ref}") if is_id(ref) else None
        if found is None:
            named = next(
                (x for x in await self.reg.prompts.list(f"{p.org_id}.") if x.name == ref), None
            )
            found = await self.reg.prompts.get_versioned(named.key) if named else None
        if found is None or not _visible(p, found[0]):
            raise NotFound(f"prompt {ref!r} not found", field="prompt")
        return found

    async def _kb_ids(self, p: Principal, refs: list[str] | None) -> list[str] | None:
        """KB names or ids → ids, each within the caller's scope (names are checked here so
        that errors name what was asked for)."""
        if not refs:
            return None
        return list(dict.fromkeys([(await self.kbs.resolve(p, ref)).kb_id for ref in refs]))


def _visible(p: Principal, prompt: Prompt) -> bool:
    return prompt.kb_ids is None or all(p.can_see(k) for k in prompt.kb_ids)


def view(prompt: Prompt) -> PromptView:
    return PromptView.model_validate(prompt.model_dump(exclude={"org_id"}))
