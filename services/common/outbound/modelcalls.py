"""Outbound model calls through LiteLLM, for every model kbmesh calls (embedding, chat,
rerank): one egress path, one classification of provider errors and one retry policy.

Every request LiteLLM sends goes through the egress transport
(`services.common.outbound.egress`): the OpenAI SDK's client (`litellm.aclient_session`),
LiteLLM's module-level client, and a client handed to each call of LiteLLM's own HTTP handlers
(`http_client`). None of them follows redirects.

Provider errors become kbmesh errors (`call_model`): a request the provider rejects (unknown
model, bad parameters, missing credentials, context too long) is `InvalidInput` on the `model`
field; an unreachable, overloaded or timed-out provider is retried with exponential backoff
and then `Transient` (HTTP 503). Anything else is a bug and propagates. Clients learn the
status and kind of a provider error, not its body: with a client-chosen `api_base` the body
is whatever that server sent.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from services.common.domain.errors import InvalidInput, KbmeshError, Transient
from services.common.outbound.egress import (
    EgressPolicy,
    EgressTransport,
    Unreachable,
    refusal_in,
)

log = logging.getLogger("kbmesh.models")
T = TypeVar("T")
MODEL_FIELD = "model"
# One provider call (embedding, chat): its timeout, and its tries with exponential backoff on
# transient errors. A blip is ridden out here; a longer outage is the bus's to retry
# (redelivery with backoff), so a call never holds a worker for long.
MODEL_TIMEOUT_SECONDS = 60.0
MODEL_TRIES = 3
MODEL_BACKOFF_SECONDS = 0.5
# The egress policy as it stands now (read per call: an operator may change the allow-list).
PolicySource = Callable[[], EgressPolicy]
# Providers LiteLLM reaches through the OpenAI SDK, whose client is `litellm.aclient_session`;
# every other provider goes through LiteLLM's own handlers and takes the `client` of the call.
_OPENAI_SDK_PROVIDERS = {"openai", "azure", "azure_text", "text-completion-openai", "custom_openai"}
_TRANSPORT = EgressTransport()


def import_litellm() -> Any:
    # Without this, `import litellm` fetches its cost map from the internet at import time.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    # Otherwise every provider error also prints a "Give Feedback / Get Help" banner to stdout.
    litellm.suppress_debug_info = True
    if not isinstance(litellm.aclient_session, _GuardedClient):
        litellm.aclient_session = _GuardedClient(
            transport=_TRANSPORT, follow_redirects=False, trust_env=False
        )
        litellm.module_level_aclient = _guarded_handler()
    return litellm


class _GuardedClient(httpx.AsyncClient):
    """The OpenAI SDK's client inside LiteLLM, held to the egress policy."""


@functools.cache
def _guarded_handler() -> Any:
    """LiteLLM's own HTTP client class, on the egress transport (one for the process)."""
    from litellm.llms.custom_httpx.http_handler import AsyncHTTPHandler

    return AsyncHTTPHandler(transport=_TRANSPORT, follow_redirects=False)


def http_client(model: str, api_base: str | None = None) -> dict[str, Any]:
    """The `client` argument that routes one LiteLLM call through the egress transport: none
    for providers on the OpenAI SDK (their client is already the guarded one)."""
    litellm = import_litellm()
    try:
        _, provider, _, _ = litellm.get_llm_provider(model, api_base=api_base)
    except Exception:
        provider = None
    if provider in _OPENAI_SDK_PROVIDERS:
        return {}
    return {"client": _guarded_handler()}


def routed_api_base(model: str, api_base: str | None) -> str | None:
    """Where LiteLLM will send a call to `model`: `api_base`, else the provider's built-in
    address when LiteLLM names one (Ollama: http://localhost:11434); None where only the
    provider's SDK knows it. Either way every request is vetted again where it is sent."""
    if api_base:
        return api_base
    litellm = import_litellm()
    try:
        name, provider, _, routed = litellm.get_llm_provider(model)
    except Exception:
        return None  # not a model LiteLLM can route: its call fails before any request
    if isinstance(routed, str) and routed:
        return routed
    try:
        # Some providers fill in their default only when building the URL (ollama_chat).
        config = litellm.utils.ProviderConfigManager.get_provider_chat_config(
            model=name, provider=litellm.LlmProviders(provider)
        )
        url = config.get_complete_url(
            api_base=None, api_key=None, model=name, optional_params={}, litellm_params={}
        )
    except Exception:
        # "api_base is required" and the like: the provider's SDK has its own default.
        return None
    return url if isinstance(url, str) and url else None


async def check_destination(
    policy: EgressPolicy, model: str, api_base: str | None, *, model_field: str, what: str
) -> None:
    """Refuse, before any request, a model whose address (its `api_base`, or the provider's
    default) the egress policy does not allow. A refused default names the model's field and
    says to set an api_base; requests are vetted again where they are sent."""
    await import_litellm_off_loop()
    destination = routed_api_base(model, api_base)
    if destination is None:
        return
    try:
        await policy.check_url(
            destination, field=_base_field(model_field) if api_base else model_field, what=what
        )
    except Unreachable:
        if api_base:
            raise
        return  # a default that does not resolve here fails at the call, as a provider error
    except KbmeshError as err:
        if api_base:
            raise
        raise type(err)(
            f"{model}: {err.message} (the provider's default address; set an api_base "
            "the policy allows)",
            field=model_field,
        ) from err


def _base_field(model_field: str) -> str:
    """The api_base field that goes with a model field (rerank_model → rerank_api_base)."""
    return "rerank_api_base" if model_field == "rerank_model" else "api_base"


def raise_refusal(err: Exception) -> None:
    """Re-raise the egress refusal hidden inside a provider library's error, if any."""
    refused = refusal_in(err)
    if refused is not None:
        raise refused from err


async def import_litellm_off_loop() -> Any:
    # The first `import litellm` takes seconds; it must not stall the event loop.
    module = sys.modules.get("litellm")
    if module is not None and getattr(module, "suppress_debug_info", False):
        return module
    return await asyncio.to_thread(import_litellm)


class _TruthyZero(int):
    """0 retries that survives `max_retries or DEFAULT_MAX_RETRIES`.

    litellm's OpenAI embedding path does exactly that (BerriAI/litellm#7003), so a plain 0
    becomes 2 hidden retries inside the OpenAI SDK, stacked under ours.
    """

    def __bool__(self) -> bool:
        return True


# What to pass as LiteLLM's `max_retries`: one retry policy, ours.
NO_SDK_RETRIES = _TruthyZero(0)


def is_retryable(err: Exception, litellm: Any) -> bool | None:
    """True: transient provider error. False: the request itself is wrong. None: not ours."""
    exceptions = litellm.exceptions
    if isinstance(err, exceptions.APIConnectionError | exceptions.Timeout):
        return True
    status = getattr(err, "status_code", None)
    if isinstance(status, int):
        if 300 <= status < 400:
            return False  # a redirect, which model calls never follow: the api_base is wrong
        if status in (408, 429) or status >= 500:
            return True
        if 400 <= status < 500:
            return False
    if isinstance(err, exceptions.APIError | exceptions.OpenAIError):
        return True
    return None


async def call_model(
    call: Callable[[], Awaitable[T]],
    *,
    model: str,
    tries: int,
    backoff_seconds: float,
    litellm: Any,
    kind: str,
    rejected: str,
    field: str = MODEL_FIELD,
) -> T:
    """`call()` under the one retry policy for provider calls: transient errors (connection,
    timeout, 408/429/5xx) are tried `tries` times with exponential backoff, then `Transient`;
    a request the provider refuses is `InvalidInput` at once ("{model} rejected {rejected}");
    an egress refusal is raised as it is, never retried. Errors name `field`; `kind` names
    the log lines (`embed_retry`, `chat_rejected`, ...); the provider's words stay in the log."""

    def transient(err: BaseException) -> bool:
        return (
            isinstance(err, Exception)
            and refusal_in(err) is None
            and is_retryable(err, litellm) is True
        )

    def before_sleep(state: RetryCallState) -> None:
        err = state.outcome.exception() if state.outcome else None
        delay = state.next_action.sleep if state.next_action else 0.0
        log.warning(
            "%s_retry model=%s attempt=%d delay=%.2f error=%r",
            kind,
            model,
            state.attempt_number,
            delay,
            _short(err, 200) if isinstance(err, Exception) else err,
        )

    retrying = AsyncRetrying(
        stop=stop_after_attempt(max(1, tries)),
        wait=wait_exponential(multiplier=backoff_seconds, max=60),
        retry=retry_if_exception(transient),
        before_sleep=before_sleep,
        reraise=True,
    )
    try:
        return await retrying(call)
    except Exception as err:
        raise_refusal(err)
        retryable = is_retryable(err, litellm)
        if retryable is None:
            raise
        if not retryable:
            log.warning("%s_rejected model=%s error=%r", kind, model, _short(err))
            raise InvalidInput(
                f"{model} rejected {rejected} ({summary(err)})", field=field
            ) from err
        log.warning("%s_unavailable model=%s error=%r", kind, model, _short(err))
        raise Transient(
            f"{model} unavailable after {max(1, tries)} tries ({summary(err)})", field=field
        ) from err


def summary(err: Exception) -> str:
    """What a provider error may tell a client: its HTTP status and kind, not its body."""
    status = getattr(err, "status_code", None)
    kind = type(err).__name__
    return f"HTTP {status}, {kind}" if isinstance(status, int) else kind


def _short(err: Exception, limit: int = 500) -> str:
    text = str(err)
    return text if len(text) <= limit else text[:limit] + "…"


__all__ = [
    "MODEL_BACKOFF_SECONDS",
    "MODEL_FIELD",
    "MODEL_TIMEOUT_SECONDS",
    "MODEL_TRIES",
    "NO_SDK_RETRIES",
    "PolicySource",
    "call_model",
    "check_destination",
    "http_client",
    "import_litellm",
    "import_litellm_off_loop",
    "is_retryable",
    "raise_refusal",
    "routed_api_base",
    "summary",
]
