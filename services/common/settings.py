"""Every `KBMESH_*` environment variable is read here: `Settings` for the services and
`ClientSettings` for kbmesh's own REST clients (`kbmesh ingest|search|status|kb`). Each
setting has one default, defined here (docs/operations.md lists them all, and a test holds
the two together); components take the group they use."""

from __future__ import annotations

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
EMBED_BATCH_SIZE = 32
EMBED_MAX_BATCH = 64
PORT = 8080
QUERY_CACHE_SIZE = 1024
# One provider call (embedding, chat): its timeout, and tries with backoff on transient errors.
MODEL_TIMEOUT_SECONDS = 60.0
MODEL_TRIES = 3
MODEL_BACKOFF_SECONDS = 0.5


class BusSettings(BaseModel):
    max_deliver: int = Field(5, ge=1, description="deliveries before a message is dead-lettered")
    backoff_seconds: list[float] = Field(
        default_factory=lambda: [0.5, 2.0, 5.0, 15.0],
        description="redelivery delays for transient errors, one per retry",
    )
    ack_wait_seconds: float = Field(
        10.0,
        ge=3,
        description="redelivery when a worker dies; a working handler reports progress "
        "every third of it, so long work is never redelivered while it runs",
    )
    stream_max_age_days: float = Field(7.0, gt=0)
    replicas: int = Field(
        1, ge=1, le=5, description="JetStream replicas of streams, buckets and the object store"
    )


class SearchSettings(BaseModel):
    # Defaults measured on three sets (man pages by what they are for, man pages by a sentence
    # from their middle, stdlib pages by one function's summary): docs/benchmarks/log.
    rrf_k: int = Field(10, ge=1, description="reciprocal rank fusion constant")
    lead_weight: float = Field(
        1.0,
        ge=0,
        description="how much a document whose opening matches the query lifts its chunks "
        "(their score times up to 1 + this); 0 turns the document-position signal off",
    )
    lead_floor: float = Field(
        0.7,
        ge=0,
        lt=1,
        description="the lift fades to nothing when the best document opening scores this "
        "fraction of the best chunk or less (the answer is inside a document)",
    )
    # 50, not 100: the same quality on every set measured (MRR@10 within 0.003), and a
    # search turns half as many candidates into hits (docs/benchmarks/log, "Candidates per
    # list"). A larger `top_k` still gets lists of `top_k`.
    prefetch_limit: int = Field(
        50, ge=1, le=1000, description="candidates per list (signal, lead or not, KB)"
    )
    rerank_depth: int = Field(
        30, ge=1, le=200, description="best fused candidates handed to a rerank model"
    )
    # Below the gateway's wait for a search reply (timeout_seconds), so that a slow reranker
    # still leaves time to answer in fused order.
    rerank_timeout_seconds: float = Field(5.0, gt=0)
    hnsw_ef: int = Field(128, ge=8, description="HNSW search breadth (recall vs latency)")
    query_cache_size: int = Field(
        QUERY_CACHE_SIZE, ge=0, description="LRU size for query embeddings"
    )
    document_cache_points: int = Field(
        200_000,
        ge=0,
        description="chunks whose document id a search replica remembers for ranking "
        "(~200 bytes each; a chunk id always names the same document)",
    )
    term_stats_ttl_seconds: float = Field(
        10.0,
        ge=0,
        description="how long a collection's BM25 term statistics, read to weigh terms alike "
        "in every KB of a search over several, are reused; 0: read on every search",
    )
    timeout_seconds: float = Field(10.0, gt=0)
    concurrency: int = Field(32, ge=1, description="search requests answered at once per replica")


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
    model_timeout_seconds: float = Field(MODEL_TIMEOUT_SECONDS, gt=0, description="one model call")
    tries: int = Field(
        MODEL_TRIES, ge=1, le=10, description="tries per model call on transient errors"
    )
    backoff_seconds: float = Field(
        MODEL_BACKOFF_SECONDS, ge=0, description="first retry delay, doubled per try"
    )
    document_max_chars: int = Field(
        100_000, ge=1000, description="a document given to the model is cut at this length"
    )
    concurrency: int = Field(8, ge=1, description="answers worked at once per search replica")


class HttpSettings(BaseModel):
    """How long the gateway waits for a client, and how many connections one client may hold
    (a client that never finishes sending must not hold the server's sockets or memory)."""

    header_timeout_seconds: float = Field(
        10.0, gt=0, description="a request's line and headers must arrive within this"
    )
    body_timeout_seconds: float = Field(
        20.0,
        gt=0,
        description="a request's body must arrive within this once its headers have, plus "
        "the time its declared length (at most the largest body the gateway takes) needs at "
        "body_min_bytes_per_second",
    )
    body_min_bytes_per_second: int = Field(
        100_000,
        ge=1,
        description="the slowest upload rate a body's deadline allows for (the largest body, "
        "a 10 MiB document in JSON, ~32 MB, gets 20 s + 319 s at the defaults)",
    )
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

    @model_validator(mode="after")
    def _resource_with_issuer(self) -> OAuthSettings:
        if self.issuer and not self.resource:
            raise ValueError(
                "KBMESH_OAUTH__RESOURCE (kbmesh's URL, the tokens' audience) is required "
                "with KBMESH_OAUTH__ISSUER"
            )
        return self


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KBMESH_", env_nested_delimiter="__", extra="ignore"
    )

    data_dir: Path = Field(Path(".kbmesh"), description="NATS store and Edge shards (embedded)")
    nats_url: str | None = Field(None, description="external NATS; unset runs a private one")
    qdrant_url: str | None = Field(None, description="Qdrant server; unset uses embedded Edge")
    qdrant_api_key: str | None = None
    edge_index_threshold: int = Field(
        10_000,
        ge=0,
        description="embedded engine: a KB's vectors outside its HNSW index that start an "
        "index build (the process pauses ~1-2.5 s per 1,000 of them); 0: never",
    )
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
    default_kb: str = "default"
    default_model: str = DEFAULT_MODEL
    kb_limit: int = Field(20, ge=1, description="knowledge bases per org")
    max_content_bytes: int = Field(10 * 1024 * 1024, ge=1)
    inline_content_bytes: int = Field(
        256 * 1024, ge=1, description="larger uploads travel via the object store"
    )
    wait_timeout_seconds: float = Field(120.0, gt=0)
    embed_batch_size: int = Field(EMBED_BATCH_SIZE, ge=1, description="texts per local model run")
    embed_max_batch: int = Field(
        EMBED_MAX_BATCH,
        ge=1,
        description="chunks of concurrent documents embedded together, at most",
    )
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
        "auto", description="local models' precision on CPU: auto (chosen per CPU kind), fp32, int8"
    )
    local_document_processes: int = Field(
        0,
        ge=0,
        description="child processes that embed document batches with the auto backend on CPU; "
        "0: one per core, up to 4 (each ~0.17 GB)",
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

    model_config = SettingsConfigDict(env_prefix="KBMESH_", extra="ignore")

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
