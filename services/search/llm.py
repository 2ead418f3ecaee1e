"""Chat models through LiteLLM: what the answer loop (`services.search.ask`) calls. Egress,
provider errors and retries are those of every model call
(`services.common.outbound.modelcalls`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.common.domain.errors import InvalidInput
from services.common.outbound.egress import EgressPolicy, egress_scope
from services.common.outbound.modelcalls import (
    MODEL_BACKOFF_SECONDS,
    MODEL_FIELD,
    MODEL_TIMEOUT_SECONDS,
    MODEL_TRIES,
    NO_SDK_RETRIES,
    PolicySource,
    call_model,
    check_destination,
    http_client,
    import_litellm_off_loop,
)

# Providers whose LiteLLM adapter emulates `response_format` with a forced tool call: sent
# together with our own tools it would stop the model from searching, so those providers get
# the schema in the prompt while tools are offered, and `response_format` only without tools.
_FORCED_TOOL_JSON = {"anthropic", "bedrock", "bedrock_converse", "vertex_ai", "databricks"}


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
        timeout_seconds: float = MODEL_TIMEOUT_SECONDS,
        tries: int = MODEL_TRIES,
        backoff_seconds: float = MODEL_BACKOFF_SECONDS,
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
        policy, base_field = self._policy(), self._field()

        async def call() -> Any:
            with egress_scope(policy, field=base_field, what=_CHAT):
                return await litellm.acompletion(
                    model=self._model,
                    messages=list(messages),
                    api_base=self.api_base,
                    timeout=self._timeout,
                    max_retries=NO_SDK_RETRIES,
                    # A parameter this provider lacks (response_format, tool_choice) is left
                    # out rather than failing: the prompt carries the same request.
                    drop_params=True,
                    **optional,
                )

        response = await call_model(
            call,
            model=self._model,
            tries=self._tries,
            backoff_seconds=self._backoff,
            litellm=litellm,
            kind="chat",
            rejected="the request",
        )
        return _reply(response)

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


__all__ = ["ChatModel", "ChatReply", "LiteLLMChat", "PolicySource", "ToolCall"]
