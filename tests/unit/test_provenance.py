"""Who wrote what: the writer kept per revision, the bus default, and the audit filters."""

from __future__ import annotations

from datetime import timedelta

from services.common.bus.audit import AuditEntry, AuditQuery
from services.common.domain.models import WRITER_HISTORY, DocumentRecord, Writer, utcnow
from services.common.messages.events import DocUploaded, TagsChanged
from services.ingest.service import writer_for_bus_event

KEY = Writer(kind="key", key_id="3f9a1c0b7d2e", name="hr-sync")


def test_a_record_keeps_the_writer_of_each_revision_and_caps_the_history() -> None:
    record = DocumentRecord(org_id="acme", document_id="d1", name="a.txt")
    record.applied("e1", Writer(kind="local"))
    record.revision = 2
    record.applied("e2", KEY)
    assert record.writer == KEY
    assert [(w.revision, w.writer.kind) for w in record.writers] == [(1, "local"), (2, "key")]
    assert record.written_by("hr-sync") and record.written_by("3f9a1c0b7d2e")
    assert record.written_by("local") and not record.written_by("bus")
    for revision in range(3, 3 + WRITER_HISTORY + 5):
        record.revision = revision
        record.applied(f"e{revision}", Writer(kind="bus"))
    assert len(record.writers) == WRITER_HISTORY
    assert record.writers[-1].revision == record.revision
    # A change applied without a writer (an older producer) leaves no claim on the revision.
    record.revision += 1
    record.applied("late")
    assert record.writer is None


def test_events_without_a_writer_are_written_by_the_bus() -> None:
    upstream = DocUploaded(org_id="acme", name="x.txt", content="x")
    assert writer_for_bus_event(upstream) == Writer(kind="bus")
    stated = TagsChanged(org_id="acme", document_id="d1", tags=[], writer=KEY)
    assert writer_for_bus_event(stated) == KEY


def test_audit_filters_all_hold() -> None:
    now = utcnow()
    entry = AuditEntry(
        org_id="acme",
        occurred_at=now,
        kind="document",
        action="uploaded",
        writer=KEY,
        document_id="d1",
        kb_ids=["kb1"],
    )
    assert AuditQuery().accepts(entry)
    assert AuditQuery(writer="hr-sync", action="uploaded", kb_id="kb1").accepts(entry)
    assert AuditQuery(document_id="d1", since=now, until=now).accepts(entry)
    assert not AuditQuery(writer="local").accepts(entry)
    assert not AuditQuery(action="deleted").accepts(entry)
    assert not AuditQuery(kb_id="kb2").accepts(entry)
    assert not AuditQuery(since=now + timedelta(seconds=1)).accepts(entry)
    assert not AuditQuery(until=now - timedelta(seconds=1)).accepts(entry)
