"""Collection generations of a KB: a rebuild starts a new one while the current one serves;
cancelling returns to the serving one and its settings; numbers are never reused."""

from __future__ import annotations

from services.common.domain.models import KBStatus, KnowledgeBase


def kb(**fields: object) -> KnowledgeBase:
    return KnowledgeBase(org_id="o", kb_id="k", name="k", **fields)  # type: ignore[arg-type]


def test_rebuild_serves_the_current_generation_and_cancel_returns_to_it() -> None:
    current = kb(chunk_size=120, settings_version=3)
    updated = current.model_copy(update={"chunk_size": 50, "settings_version": 4})
    updated.status = KBStatus.pending_reindex
    updated.rebuild_from(current)
    assert (updated.collection_name, updated.serving_collection) == ("kb_k_g2", "kb_k")
    # A second change before the first is built: the same collection keeps serving, and
    # the replaced generation is left for embed to drop.
    again = updated.model_copy(update={"chunk_size": 80, "settings_version": 5})
    again.rebuild_from(updated)
    assert (again.collection_name, again.serving_collection) == ("kb_k_g3", "kb_k")
    assert again.abandoned_collections == ["kb_k_g2"]

    assert again.cancel_rebuild() == "kb_k_g3"
    assert again.serving is None and again.collection_name == again.serving_collection == "kb_k"
    assert (again.chunk_size, again.settings_version, again.status) == (120, 3, KBStatus.active)
    assert again.cancel_rebuild() is None

    later = again.model_copy(update={"settings_version": 4})
    later.rebuild_from(again)
    assert later.collection_name == "kb_k_g4", "a cancelled generation's number is not reused"


def test_cancel_restores_the_serving_model() -> None:
    current = kb(embedding_model="local/all-MiniLM-L6-v2")
    updated = current.model_copy(update={"embedding_model": "openai/x", "api_base": "http://e"})
    updated.rebuild_from(current)
    assert updated.serving_model == ("local/all-MiniLM-L6-v2", None)
    updated.cancel_rebuild()
    assert (updated.embedding_model, updated.api_base) == ("local/all-MiniLM-L6-v2", None)
