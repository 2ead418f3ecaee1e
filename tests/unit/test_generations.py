"""Collection generations of a KB: a rebuild starts a new one while the current one serves;
cancelling returns to the serving one and its settings; numbers are never reused."""

from __future__ import annotations

from services.common.domain.models import IndexEntry, KBStatus, KnowledgeBase


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


def entry(
    kb_: KnowledgeBase, *, checksum: str = "c", revision: int = 1, chunks: int = 3
) -> IndexEntry:
    return IndexEntry(
        org_id="o",
        kb_id="k",
        document_id="d",
        revision=revision,
        checksum=checksum,
        settings_version=kb_.settings_version,
        chunk_count=chunks,
        generation=kb_.index_generation,
    )


def test_a_rebuilt_entry_keeps_the_served_one_and_a_cancel_returns_to_it() -> None:
    """An entry written by a rebuild keeps the served build's (also through a second build
    of the same document); after a cancel that one counts, with the newer revision its
    labels were kept at, unless the text changed meanwhile."""
    current = kb(settings_version=3)
    served = entry(current, chunks=3)
    rebuilding = current.model_copy(update={"chunk_size": 50, "settings_version": 4})
    rebuilding.rebuild_from(current)
    rebuilt = entry(rebuilding, chunks=7).replacing(served, rebuilding)
    assert rebuilt.serving == served and not rebuilt.built_for(current)
    relabelled = entry(rebuilding, revision=2, chunks=7).replacing(rebuilt, rebuilding)
    assert relabelled.serving == served

    cancelled = rebuilding.model_copy(deep=True)
    cancelled.cancel_rebuild()
    restored = relabelled.for_build(cancelled)
    assert (restored.chunk_count, restored.revision, restored.generation) == (3, 2, 1)
    assert restored.built_for(cancelled)
    new_text = entry(rebuilding, checksum="other", chunks=7).replacing(served, rebuilding)
    assert new_text.for_build(cancelled) is new_text  # only the abandoned build has it


def test_an_entry_counts_as_built_only_for_its_own_generation() -> None:
    """A cancel brings the settings version back, so the same change made again reaches the
    cancelled build's version: its entries are not built for the new generation."""
    current = kb(settings_version=3)
    first = current.model_copy(update={"chunk_size": 50, "settings_version": 4})
    first.rebuild_from(current)
    abandoned = entry(first)
    again = first.model_copy(deep=True)
    again.cancel_rebuild()
    retry = again.model_copy(update={"chunk_size": 50, "settings_version": 4})
    retry.rebuild_from(again)
    assert retry.settings_version == abandoned.settings_version
    assert not abandoned.built_for(retry) and entry(retry).built_for(retry)
