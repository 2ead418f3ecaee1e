"""Chat models through LiteLLM: the one place kbmesh calls a chat model from, with one retry
policy and one classification of provider errors (shared with the LiteLLM embedders).

Every request LiteLLM sends goes through the egress transport (`services.common.egress`): the
OpenAI SDK's client (`litellm.aclient_session`), LiteLLM's module-level client, and a client
handed to each call of LiteLLM's own HTTP handlers (`http_client`). None of them follows
redirects.

Provider errors become kbmesh errors: a request the provider rejects (unknown model, bad
parameters, missing credentials, context too long) is `InvalidInput` on the `model` field; an
unreachable, overloaded or timed-out provider is retried with exponential backoff and then
`Transient` (HTTP 503). Anything else is a bug and propagates. Clients learn the status and
kind of a provider error, not its body: with a client-chosen `api_base` the body is whatever
that server sent.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from services.common.egress import (
    EgressPolicy,
    EgressTransport,
    Unreachable,
    egress_scope,
    refusal_in,
)
from services.common.errors import InvalidInput, KbmeshError, Transient

log = logging.getLogger("kbmesh.llm")
MODEL_FIELD = "model"
# Providers whose LiteLLM adapter emulates `response_format` with a forced tool call: sent
# together with our own tools it would stop the model from searching, so those providers get
# the schema in the prompt while tools are offered, and `response_format` only without tools.
_FORCED_TOOL_JSON = {"anthropic", "bedrock", "bedrock_converse", "vertex_ai", "databricks"}
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


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ChatReply:
    """One model turn: text and/or tool calls, and what it cost."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def as_message(self) -> dict[str, Any]:
        """The assistant message to send back in the conversation."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in self.tool_calls
            ]
        return message


class ChatModel(Protocol):
    """A chat model that can call tools (what the answer loop needs of a provider)."""

    @property
    def model(self) -> str: ...

    async def check(self) -> None:
        """Refuse, before any call, a model or api_base that can never work."""
        ...

    def json_mode_with_tools(self) -> bool:
        """Whether `response_format` may be sent in the same call as tools."""
        ...

    async def complete(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | None = None,
        response_format: dict[str, Any] | None = None,
    ) -> ChatReply: ...


class LiteLLMChat:
    """Any LiteLLM chat model (hosted providers, Ollama, vLLM and other OpenAI-compatible
    servers through `api_base`)."""

    def __init__(
        self,
        model: str,
        api_base: str | None = None,
        *,
        timeout_seconds: float = 60.0,
        tries: int = 3,
        backoff_seconds: float = 0.5,
        egress: PolicySource | None = None,
    ) -> None:
        self._model = model
        self.api_base = api_base
        # None: unrestricted, for tools and tests that run their own model servers; every
        # service builds its chat models with the operator's policy.
        self._egress = egress
        self._timeout = timeout_seconds
        self._tries = max(1, tries)
        self._backoff = backoff_seconds
        self._provider: str | None = None

    @property
    def model(self) -> str:
        return self._model

    async def check(self) -> None:
        """Fail early, as invalid input, for a model id LiteLLM cannot route or an address
        (api_base or the provider's default) the egress policy refuses."""
        litellm = await import_litellm_off_loop()
        await check_destination(
            self._policy(), self._model, self.api_base, model_field=MODEL_FIELD, what=_CHAT
        )
        try:
            _, self._provider, _, _ = litellm.get_llm_provider(self._model, api_base=self.api_base)
        except Exception as err:
            raise InvalidInput(
                f"model {self._model!r} is not a LiteLLM chat model id; prefix it with its "
                "provider, e.g. openai/gpt-4o-mini or ollama_chat/llama3.1",
                field=MODEL_FIELD,
            ) from err
        # A missing key fails inside the provider SDK before any request, and LiteLLM reports
        # it as a server error: it would be retried as if transient. Name it instead.
        try:
            env = litellm.validate_environment(model=self._model, api_base=self.api_base)
        except Exception:
            env = {}
        missing = [k for k in env.get("missing_keys", []) if k.endswith("_KEY")]
        if missing:
            raise InvalidInput(
                f"model {self._model!r} needs {' and '.join(missing)} set in the search "
                "service's environment",
                field=MODEL_FIELD,
            )

    def json_mode_with_tools(self) -> bool:
        return self._provider not in _FORCED_TOOL_JSON

    def _policy(self) -> EgressPolicy:
        return self._egress() if self._egress is not None else EgressPolicy(allow_private=True)

    async def complete(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | None = None,
        response_format: dict[str, Any] | None = None,
    ) -> ChatReply:
        litellm = await import_litellm_off_loop()
        optional: dict[str, Any] = {}
        if tools:
            optional["tools"] = tools
            if tool_choice:
                optional["tool_choice"] = tool_choice
        if response_format:
            optional["response_format"] = response_format
        optional |= http_client(self._model, self.api_base)
        for attempt in range(1, self._tries + 1):
            try:
                with egress_scope(self._policy(), field=self._field(), what=_CHAT):
                    response = await litellm.acompletion(
                        model=self._model,
                        messages=list(messages),
                        api_base=self.api_base,
                        timeout=self._timeout,
                        max_retries=NO_SDK_RETRIES,
                        # A parameter this provider lacks (response_format, tool_choice) is
                        # left out rather than failing: the prompt carries the same request.
                        drop_params=True,
                        **optional,
                    )
            except Exception as err:
                raise_refusal(err)
                retryable = is_retryable(err, litellm)
                if retryable is None:
                    raise
                if not retryable:
                    log.warning("chat_rejected model=%s error=%r", self._model, _short(err))
                    raise InvalidInput(
                        f"{self._model} rejected the request ({summary(err)})",
                        field=MODEL_FIELD,
                    ) from err
                if attempt == self._tries:
                    log.warning("chat_unavailable model=%s error=%r", self._model, _short(err))
                    raise Transient(
                        f"{self._model} unavailable after {attempt} tries ({summary(err)})",
                        field=MODEL_FIELD,
                    ) from err
                delay = self._backoff * 2 ** (attempt - 1)
                log.warning(
                    "chat_retry model=%s attempt=%d delay=%.2f error=%r",
                    self._model,
                    attempt,
                    delay,
                    _short(err),
                )
                await asyncio.sleep(delay)
            else:
                return _reply(response)
        raise AssertionError("unreachable")  # pragma: no cover

    def _field(self) -> str:
        return "api_base" if self.api_base else MODEL_FIELD


_CHAT = "call the chat model at"


def _reply(response: Any) -> ChatReply:
    choice = response.choices[0]
    message = choice.message
    calls = [
        ToolCall(
            id=call.id or f"call_{i}",
            name=call.function.name or "",
            arguments=call.function.arguments or "",
        )
        for i, call in enumerate(getattr(message, "tool_calls", None) or [])
    ]
    usage = getattr(response, "usage", None)
    return ChatReply(
        content=message.content,
        tool_calls=calls,
        prompt_tokens=int(getattr(usage, "prompt_tokens", 0) or 0),
        completion_tokens=int(getattr(usage, "completion_tokens", 0) or 0),
    )


def summary(err: Exception) -> str:
    """What a provider error may tell a client: its HTTP status and kind, not its body."""
    status = getattr(err, "status_code", None)
    kind = type(err).__name__
    return f"HTTP {status}, {kind}" if isinstance(status, int) else kind


def _short(err: Exception, limit: int = 500) -> str:
    text = str(err)
    return text if len(text) <= limit else text[:limit] + "…"


__all__ = [
    "NO_SDK_RETRIES",
    "ChatModel",
    "ChatReply",
    "LiteLLMChat",
    "ToolCall",
    "check_destination",
    "http_client",
    "import_litellm",
    "import_litellm_off_loop",
    "is_retryable",
    "raise_refusal",
    "routed_api_base",
    "summary",
]
