"""Which points a backup keeps and a restore loads (services/cli/vectors.py, `KbPoints`): a
document's points count only when its index entry describes the archive's record of it and
every chunk is there, labelled with that entry's revision, text and settings."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from services.cli.vectors import Current, KbPoints, VectorSet, as_restored
from services.common.domain.ids import point_id
from services.common.domain.models import IndexEntry, KnowledgeBase, ServingIndex
from services.common.store.export import PointRow

KB = KnowledgeBase(org_id="acme", kb_id="kb1", name="kb", settings_version=3)
HOSTED = "openai/text-embedding-3-small"
RECORD = Current(revision=7, checksum="c7", kb_ids=frozenset({"kb1"}))


def entry(**changes: Any) -> IndexEntry:
    fields: dict[str, Any] = dict(
        org_id="acme",
        kb_id="kb1",
        document_id="d1",
        revision=7,
        checksum="c7",
        settings_version=3,
        chunk_count=3,
        indexed_at=datetime(2026, 1, 1, tzinfo=UTC),
    )
    return IndexEntry(**(fields | changes))


def point(index: int, **labels: Any) -> PointRow:
    payload = dict(
        org_id="acme",
        kb_id="kb1",
        document_id="d1",
        chunk_index=index,
        total_chunks=3,
        revision=7,
        text_checksum="c7",
        settings_version=3,
        content=f"chunk {index}",
    )
    payload |= labels
    return PointRow(
        id=point_id("kb1", "d1", index),
        dense="AACAPw==",
        sparse={"indices": [1], "values": [1.0]},
        payload=payload,
    )


def test_a_document_whose_entry_and_points_are_of_its_record_is_whole() -> None:
    rule = KbPoints(KB)
    assert rule.expect(entry(), RECORD)
    assert all(rule.take(point(i)) for i in range(3))
    assert rule.whole() == [entry()] and rule.broken() == []


def test_an_entry_not_of_the_archived_record_is_not_expected() -> None:
    """The record is newer (an upload landed after it was read), the text differs, the KB's
    settings changed, the document left the KB, or is not in the archive: its points are
    not taken, and the restore embeds it."""
    for stale in (
        entry(revision=6),
        entry(checksum="c6"),
        entry(settings_version=2),
        entry(org_id="other"),
    ):
        rule = KbPoints(KB)
        assert not rule.expect(stale, RECORD)
        assert not rule.take(point(0)) and rule.whole() == []
    assert not KbPoints(KB).expect(entry(), None)
    assert not KbPoints(KB).expect(entry(), Current(7, "c7", frozenset({"kb2"})))


def test_points_of_two_revisions_or_missing_chunks_leave_the_document_out() -> None:
    """A document re-indexed while its points were read (one chunk relabelled to the next
    revision), or one whose last chunk was not read: not whole, so neither its entry nor its
    points are used."""
    mixed = KbPoints(KB)
    mixed.expect(entry(), RECORD)
    assert mixed.take(point(0)) and mixed.take(point(1))
    assert not mixed.take(point(2, revision=8))
    assert mixed.whole() == [] and [d.entry for d in mixed.broken()] == [entry()]

    short = KbPoints(KB)
    short.expect(entry(), RECORD)
    assert short.take(point(0)) and short.take(point(1))
    assert short.whole() == [] and len(short.broken()) == 1


def test_a_point_that_is_not_the_chunk_it_claims_spoils_its_document() -> None:
    """Its id is not the one kbmesh derives from KB, document and chunk; it names another
    org or KB; its chunk index is outside the entry's count or seen twice."""
    for bad in (
        point(1).model_copy(update={"id": point_id("kb2", "d1", 1)}),
        point(1, org_id="other"),
        point(1, kb_id="kb2"),
        point(1, total_chunks=4),
        point(0),
    ):
        rule = KbPoints(KB)
        rule.expect(entry(), RECORD)
        assert rule.take(point(0))
        assert not rule.take(bad)
        assert rule.whole() == []


def test_vectors_fit_a_kb_built_as_they_were_and_a_rebuild_is_restored_on_its_old_settings() -> (
    None
):
    vector_set = VectorSet.of(KB)
    assert vector_set.fits(KB)
    assert not vector_set.fits(KB.model_copy(update={"chunk_size": 300}))
    assert not vector_set.fits(
        KB.model_copy(update={"embedding_model": "openai/text-embedding-3-small"})
    )
    rebuilding = KB.model_copy(
        update={
            "embedding_model": HOSTED,
            "settings_version": 4,
            "index_generation": 2,
            "generations": 2,
            "serving": ServingIndex(
                generation=1, embedding_model=KB.embedding_model, settings_version=3
            ),
        }
    )
    restored = as_restored(rebuilding)
    assert vector_set.fits(restored) and restored.collection_name == KB.collection_name
    assert rebuilding.serving is not None  # the backed-up record is left as it was
