"""Checking a KB's embedding model before the KB is saved: a local model must be bundled, a
remote one must answer. A misspelt model id or a dead `api_base` is then a 4xx naming the
field on the request that set it, not a failure of every later search and upload."""

from __future__ import annotations

from services.common.domain.errors import Forbidden, InvalidInput, Transient
from services.common.embedders import LiteLLMEmbedder, is_local, model_limits
from services.common.outbound.egress import EgressPolicy
from services.common.outbound.modelcalls import check_destination

PROBE_TIMEOUT_SECONDS = 15.0


async def check_model(model: str, api_base: str | None, egress: EgressPolicy) -> None:
    """InvalidInput (field `embedding_model` or `api_base`) unless `model` can embed; Forbidden
    when `api_base` points where the egress policy does not allow."""
    if is_local(model):
        model_limits(model)  # raises for a model that is not bundled
        return
    # The address LiteLLM would call — the api_base, or the provider's own default such as
    # Ollama's localhost:11434 — is vetted before the probe sends anything.
    await check_destination(
        egress,
        model,
        api_base,
        model_field="embedding_model",
        what="call the embedding model at",
    )
    # One real request, no retries: the caller is waiting, and a provider that cannot answer
    # one embedding now is not one to index with.
    embedder = LiteLLMEmbedder(
        model, api_base=api_base, tries=1, timeout_seconds=PROBE_TIMEOUT_SECONDS, egress=egress
    )
    try:
        await embedder.probe()
    except Forbidden:
        raise
    except InvalidInput as err:
        raise InvalidInput(
            f"embedding_model {model!r} cannot embed: {err.message}", field="embedding_model"
        ) from err
    except Transient as err:
        where = f"at {api_base}" if api_base else "at its provider"
        raise InvalidInput(
            f"embedding_model {model!r} did not answer {where}: {err.message}",
            field="api_base" if api_base else "embedding_model",
        ) from err
    except Exception as err:
        # LiteLLM's own refusals (unknown provider prefix, missing key) come as other types.
        raise InvalidInput(
            f"embedding_model {model!r} is not usable ({type(err).__name__})",
            field="embedding_model",
        ) from err
