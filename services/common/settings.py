"""Every `KBMESH_*` environment variable is read here: `Settings` for the services and
`ClientSettings` for kbmesh's own REST clients (`kbmesh ingest|search|status|kb`). Each
setting has one default, defined here (docs/operations.md lists them all, and a test holds
the two together); components take the group they use. Values that no operator needs to
turn are constants next to the code they shape; `RETIRED` names the variables earlier
versions read, so that a start can say which ones are set for nothing."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.common.domain.ids import check_id
from services.common.domain.limits import LimitSettings
from services.common.domain.models import DEFAULT_MODEL

# Defaults that library callers of the embedders share with the services.
LocalBackend = Literal["auto", "onnx", "torch"]
LocalDevice = Literal["auto", "cpu", "cuda"]
LocalPrecision = Literal["auto", "fp32", "int8"]
LOCAL_BACKEND: LocalBackend = "auto"
PORT = 8080


class BusSettings(BaseModel):
    max_deliver: int = Field(5, ge=1, description="deliveries before a message is dead-lettered")
    stream_max_age_days: float = Field(7.0, gt=0)
    stream_max_mb: int = Field(
        1024,
        ge=1,
        description="disk each stream of events may fill (MiB): kbmesh's events, upstream "
        "publishers' events and dead letters, each (docs/operations.md, Limits)",
    )
    replicas: int = Field(
        1, ge=1, le=5, description="JetStream replicas of streams, buckets and the object store"
    )


class SearchSettings(BaseModel):
    timeout_seconds: float = Field(
        10.0, gt=0, description="how long the gateway waits for a search reply"
    )
    concurrency: int = Field(32, ge=1, description="search requests answered at once per replica")

    @property
    def rerank_timeout_seconds(self) -> float:
        """Half the gateway's wait: a slow rerank model still leaves time to answer in
        fused order."""
        return self.timeout_seconds / 2


class EgressSettings(BaseModel):
    """Where outbound calls a client can steer (upload by URL, a KB's `api_base`) may go
    besides public addresses."""

    allowlist: list[str] = Field(
        default_factory=list,
        description="hosts (`*.example.com` for subdomains), addresses or CIDRs allowed even "
        "though they are loopback, link-local or private",
    )
    allow_private: bool = Field(
        False, description="allow every non-public address (self-hosted models nearby)"
    )


class AuditSettings(BaseModel):
    """The audit trail's stream (`KBMESH_AUDIT`): how long and how much of it is kept."""

    max_age_days: float = Field(365.0, gt=0, description="how long audit entries are kept")
    max_bytes: int = Field(
        1024 * 1024 * 1024,
        ge=1024 * 1024,
        description="the audit stream's size at most; the oldest entries go first",
    )


class AskSettings(BaseModel):
    """The answer loop (`search.ask`): which chat model answers when a request names none,
    and how long a loop may take."""

    model: str | None = Field(
        None,
        description="LiteLLM chat model used when a request names none (e.g. "
        "openai/gpt-4o-mini; the provider's key comes from its usual variable, such as "
        "OPENAI_API_KEY)",
    )
    api_base: str | None = Field(None, description="base URL for the default model")
    timeout_seconds: float = Field(
        180.0,
        gt=0,
        description="budget of one whole answer (every model call and search); the gateway "
        "waits this long plus a margin for the reply",
    )
    concurrency: int = Field(8, ge=1, description="answers worked at once per search replica")


class HttpSettings(BaseModel):
    """How many connections one client address may hold (the deadlines on what a client
    sends are fixed: services/gateway/server.py)."""

    connections_per_client: int = Field(
        256,
        ge=0,
        description="open connections one client address may hold; more are answered 503 "
        "and closed (0: no limit; behind a proxy every client has the proxy's address)",
    )


class NatsAuthSettings(BaseModel):
    """How a process proves itself to NATS (`kbmesh serve`; `kbmesh up` and the CLI use the
    credentials in the data directory), and TLS to NATS."""

    user: str | None = Field(None, description="NATS user (one per service: docs/operations.md)")
    password: str | None = Field(None, description="that user's password")
    tls_ca_file: Path | None = Field(None, description="CA that signed the NATS server's cert")
    tls_cert_file: Path | None = Field(None, description="client certificate (mutual TLS)")
    tls_key_file: Path | None = Field(None, description="client certificate's key")


class OAuthSettings(BaseModel):
    """kbmesh as an OAuth 2.1 resource server: JWT access tokens of one identity provider are
    accepted beside API keys (docs/operations.md, "Sign-in with your identity provider")."""

    issuer: str | None = Field(
        None,
        description="the identity provider's issuer URL (the `iss` of its tokens); unset: "
        "API keys only",
    )
    resource: str | None = Field(
        None,
        description="kbmesh's resource URL, the audience its tokens must name, e.g. "
        "https://kb.example.com/mcp (required with an issuer)",
    )
    org_claim: str | None = Field(
        None,
        description="token claim naming the caller's org; unset: every user is in "
        "KBMESH_DEFAULT_ORG",
    )
    kb_claim: str | None = Field(
        None,
        description="token claim listing the KBs the user may reach (a list, or ids "
        "separated by spaces); 'scope': scopes of the form kb:<kb id>; unset or absent: every "
        "KB of the org",
    )
    jwks_url: str | None = Field(
        None, description="the provider's signing keys; unset: its discovery document's jwks_uri"
    )
    client_id: str | None = Field(
        None,
        description="a public client (no secret) registered with the provider, with kbmesh's "
        "own URL (`/`) as redirect URI and the device grant, that the console and `kbmesh "
        "login` sign people in with; unset: the console asks for an API key",
    )

    @model_validator(mode="after")
    def _resource_with_issuer(self) -> OAuthSettings:
        if self.issuer and not self.resource:
            raise ValueError(
                "KBMESH_OAUTH__RESOURCE (kbmesh's URL, the tokens' audience) is required "
                "with KBMESH_OAUTH__ISSUER"
            )
        return self


class Settings(BaseSettings):
    # Unknown environment variables are left alone (a start names them: `unread_variables`);
    # an unknown keyword is a mistake in the code that builds the settings, so it is refused.
    model_config = SettingsConfigDict(
        env_prefix="KBMESH_", env_nested_delimiter="__", extra="forbid"
    )

    data_dir: Path = Field(Path(".kbmesh"), description="NATS store and Edge shards (embedded)")
    nats_url: str | None = Field(None, description="external NATS; unset runs a private one")
    qdrant_url: str | None = Field(None, description="Qdrant server; unset uses embedded Edge")
    qdrant_api_key: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(PORT, ge=0, le=65535)
    metrics_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="serve this process's Prometheus metrics on their own port "
        "(services without the gateway, whose /metrics serves them)",
    )

    default_org: str = Field("local", description="org served when no API keys exist")
    default_model: str = DEFAULT_MODEL
    kb_limit: int = Field(20, ge=1, description="knowledge bases per org")
    max_content_bytes: int = Field(
        10 * 1024 * 1024, ge=1, description="a document's content, and its text once read"
    )
    wait_timeout_seconds: float = Field(120.0, gt=0)
    embed_concurrency: int = Field(
        16,
        ge=1,
        description="kb.index messages worked at once; their chunks share embedding batches",
    )
    local_backend: LocalBackend = Field(
        LOCAL_BACKEND,
        description="engine for local/... models: auto (services/common/embedders/selection.py: "
        "onnxruntime on CPU with document batches in child processes, torch on a CUDA GPU), "
        "onnx (onnxruntime, one process) or torch (fp32, the reference)",
    )
    local_device: LocalDevice = Field(
        "auto", description="where local models run: auto (a CUDA GPU if torch sees one), cpu, cuda"
    )
    local_precision: LocalPrecision = Field(
        "auto",
        description="local models' precision: auto (per CPU kind; fp16 documents on a CUDA GPU, "
        "queries on the faster engine), fp32 (everywhere), int8 (CPU only)",
    )
    model_cache_dir: Path | None = Field(
        None, description="ONNX exports of the local models; default <data_dir>/models"
    )

    mcp_toolsets: str = Field("core", description="comma list of core, compat")
    upload_root: Path | None = Field(None, description="root for kb_upload by path")
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Host headers the gateway answers besides loopback names (DNS-rebinding "
        "protection for REST, tools, MCP and the console); 'name' or 'name:*' for any port, "
        "'*' turns the check off (behind a proxy that checks Host itself)",
    )
    cors_origins: list[str] = Field(
        default_factory=list,
        description="browser origins (scheme://host[:port]) allowed to call the API from "
        "their pages (CORS); empty: only the gateway's own console",
    )

    http: HttpSettings = Field(default_factory=HttpSettings)
    bus: BusSettings = Field(default_factory=BusSettings)
    search: SearchSettings = Field(default_factory=SearchSettings)
    egress: EgressSettings = Field(default_factory=EgressSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    ask: AskSettings = Field(default_factory=AskSettings)
    audit: AuditSettings = Field(default_factory=AuditSettings)
    nats: NatsAuthSettings = Field(default_factory=NatsAuthSettings)
    oauth: OAuthSettings = Field(default_factory=OAuthSettings)

    @field_validator("default_org")
    @classmethod
    def _org_is_key_safe(cls, value: str) -> str:
        return check_id(value, "KBMESH_DEFAULT_ORG")

    @property
    def models_dir(self) -> Path:
        return self.model_cache_dir or self.data_dir / "models"

    @property
    def store_kind(self) -> Literal["edge", "server"]:
        return "server" if self.qdrant_url else "edge"

    @property
    def toolsets(self) -> list[str]:
        return [t.strip() for t in self.mcp_toolsets.split(",") if t.strip()]


class ClientSettings(BaseSettings):
    """What kbmesh's own clients read: the REST API they talk to and its key (`kbmesh ingest`,
    `search`, `status`, `kb`; the key also confines `kbmesh mcp`), and every command's log
    level."""

    model_config = SettingsConfigDict(env_prefix="KBMESH_", extra="forbid")

    api_url: str | None = Field(
        None, description="kbmesh REST API; unset: the local stack on `port`"
    )
    api_key: str | None = Field(None, description="API key sent as `Authorization: Bearer`")
    port: int = Field(PORT, ge=0, le=65535)
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING, ERROR")

    @property
    def api(self) -> str:
        """`api_url`, else the local stack on `port`, as `kbmesh up` serves it."""
        return self.api_url or f"http://127.0.0.1:{self.port}"


# Read by earlier versions, now fixed values or derived (docs/operations.md, "Upgrades").
RETIRED = frozenset(
    {
        "KBMESH_ASK__BACKOFF_SECONDS",
        "KBMESH_ASK__DOCUMENT_MAX_CHARS",
        "KBMESH_ASK__MODEL_TIMEOUT_SECONDS",
        "KBMESH_ASK__TRIES",
        "KBMESH_BUS__ACK_WAIT_SECONDS",
        "KBMESH_BUS__BACKOFF_SECONDS",
        "KBMESH_DEFAULT_KB",
        "KBMESH_EDGE_INDEX_THRESHOLD",
        "KBMESH_EMBED_BATCH_SIZE",
        "KBMESH_EMBED_MAX_BATCH",
        "KBMESH_HTTP__BODY_MIN_BYTES_PER_SECOND",
        "KBMESH_HTTP__BODY_TIMEOUT_SECONDS",
        "KBMESH_HTTP__HEADER_TIMEOUT_SECONDS",
        "KBMESH_INLINE_CONTENT_BYTES",
        "KBMESH_LIMITS__METADATA_DEPTH",
        "KBMESH_LIMITS__TAGS_PER_DOCUMENT",
        "KBMESH_LIMITS__TAG_LENGTH",
        "KBMESH_LIMITS__TEXT_BYTES",
        "KBMESH_LIMITS__URI_LENGTH",
        "KBMESH_LOCAL_DOCUMENT_PROCESSES",
        "KBMESH_SEARCH__DOCUMENT_CACHE_POINTS",
        "KBMESH_SEARCH__HNSW_EF",
        "KBMESH_SEARCH__LEAD_FLOOR",
        "KBMESH_SEARCH__LEAD_WEIGHT",
        "KBMESH_SEARCH__PREFETCH_LIMIT",
        "KBMESH_SEARCH__QUERY_CACHE_SIZE",
        "KBMESH_SEARCH__RERANK_DEPTH",
        "KBMESH_SEARCH__RERANK_TIMEOUT_SECONDS",
        "KBMESH_SEARCH__RRF_K",
        "KBMESH_SEARCH__TERM_STATS_TTL_SECONDS",
    }
)


def _fields(model: type[BaseModel], prefix: str) -> dict[str, type[BaseModel] | None]:
    """Each variable of `model`, with the group it takes as JSON (None for a value)."""
    found: dict[str, type[BaseModel] | None] = {}
    for name, info in model.model_fields.items():
        kind = info.annotation
        group = kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None
        found[f"{prefix}{name}".upper()] = group
        if group is not None:
            found |= _fields(group, f"{prefix}{name}__")
    return found


def unread_variables(environ: Mapping[str, str]) -> list[str]:
    """The `KBMESH_*` variables in `environ` that no setting reads, as `KBMESH_GROUP__KEY`
    for a key of a group given as JSON: retired ones (`RETIRED`) and misspelt ones.
    pydantic-settings ignores them; a start names them instead."""
    known = _fields(Settings, "KBMESH_") | _fields(ClientSettings, "KBMESH_")
    unread = []
    for variable, value in environ.items():
        name = variable.upper()
        if not name.startswith("KBMESH_"):
            continue
        if name not in known:
            unread.append(name)
            continue
        group = known[name]
        if group is not None:  # a whole group as JSON: its keys
            try:
                keys = json.loads(value)
            except ValueError:
                continue  # not JSON: the settings' own validation says so
            if isinstance(keys, dict):
                unread += [f"{name}__{k}".upper() for k in keys if k not in group.model_fields]
    return sorted(unread)
