"""The gateway's logic, shared by REST and MCP and free of both: knowledge bases, documents,
search, answers and stored prompts, sources (definitions, secrets, sync requests), KBs and
documents as resources to list and read, the access rules of API-key scopes, and
read-your-writes waiting.

It never writes vectors: documents change through events to ingest; KB definitions are
written here (the gateway owns the KB API) and announced with `kb.changed`."""

from __future__ import annotations

from services.common.bus.client import Bus
from services.common.bus.registry import Registries
from services.common.settings import Settings
from services.gateway.catalog import Catalog
from services.gateway.progress import ProgressFeed
from services.gateway.service.answers import Answers
from services.gateway.service.audit import AuditLog
from services.gateway.service.deadletters import DeadLetters
from services.gateway.service.documents import Documents
from services.gateway.service.kbs import KnowledgeBases, checked_kb
from services.gateway.service.resources import Resources
from services.gateway.service.search import Search
from services.gateway.service.sources import Sources
from services.gateway.service.waiting import Waiting

__all__ = [
    "Answers",
    "AuditLog",
    "DeadLetters",
    "Documents",
    "GatewayService",
    "KnowledgeBases",
    "Resources",
    "Search",
    "Sources",
    "checked_kb",
]


class GatewayService:
    """The gateway's parts on one bus and one set of registries."""

    def __init__(self, bus: Bus, registries: Registries, settings: Settings) -> None:
        self.bus = bus
        self.reg = registries
        self.settings = settings
        self.waiting = Waiting(registries, settings.wait_timeout_seconds)
        self.catalog = Catalog()
        self.kbs = KnowledgeBases(bus, registries, settings, self.catalog)
        self.documents = Documents(bus, registries, settings, self.kbs, self.waiting)
        self.resources = Resources(registries, self.kbs, self.documents)
        self.search = Search(bus, self.kbs, timeout_seconds=settings.search.timeout_seconds)
        self.progress = ProgressFeed()
        self.answers = Answers(bus, registries, settings, self.kbs)
        self.dead_letters = DeadLetters(bus)
        self.audit = AuditLog(bus)
        self.sources = Sources(bus, registries, self.kbs, settings)

    async def start(self) -> None:
        """Read the documents and index entries into the live view and follow them, and make
        sure the default org has its KB (the notifications the gateway follows come from its
        bus subscribers, handlers.py). Steps of the process's start: each waits out a bus
        that is failing over."""
        await self.bus.starting("document and index view", lambda: self.catalog.start(self.reg))
        await self.bus.starting(
            "default knowledge base", lambda: self.kbs.ensure_default(self.settings.default_org)
        )
