"""The gateway's live view keeps its running counts right: after any sequence of document
and index-entry changes (arriving in any order, late deliveries of older values included),
a KB's figures equal those counted from the records themselves, for every tag set the KB
may have and every settings version; the uri index, the shared tag sets and the per-KB
groups shrink back to nothing when everything is deleted."""

from __future__ import annotations

import itertools
import random
from dataclasses import asdict

import pytest

from services.common.domain.models import (
    DocStatus,
    DocumentRecord,
    IndexEntry,
    KBStatus,
    KnowledgeBase,
    RevisionWriter,
    Writer,
    kb_tag,
    utcnow,
)
from services.gateway.catalog import Catalog, KbFigures

ORG = "org1"
KBS = ["kbone", "kbtwo"]
LABELS = ["red", "blue", "green", "collection:papers"]


def reference(
    kb: KnowledgeBase, docs: dict[str, DocumentRecord], entries: dict[str, IndexEntry]
) -> KbFigures:
    """The figures counted the slow way, as the gateway did before it kept a view."""
    mine = {e.document_id: e for e in entries.values() if e.kb_id == kb.kb_id}
    members = [d for d in docs.values() if kb.matches(d.tags)]

    def failed(d: DocumentRecord) -> bool:
        return d.status == DocStatus.failed or kb.kb_id in d.kb_errors

    ready = [d for d in members if d.status == DocStatus.ready]
    current = {i for i, e in mine.items() if e.built_for(kb)}
    return KbFigures(
        entries=len(mine),
        chunks=sum(e.chunk_count for e in mine.values()),
        current=len(current),
        members=len(members),
        ready=len(ready),
        failed=sum(1 for d in members if failed(d)),
        indexed=sum(
            1
            for d in members
            if not failed(d)
            and (e := mine.get(d.document_id)) is not None
            and e.revision >= d.revision
        ),
        rebuild_total=sum(1 for d in ready if not failed(d)),
        rebuild_done=sum(1 for d in ready if not failed(d) and d.document_id in current),
        pending=sum(
            1 for d in ready if d.document_id not in current and kb.kb_id not in d.kb_errors
        ),
    )


def random_document(rng: random.Random, doc_id: str, revision: int) -> DocumentRecord:
    tags = sorted(set(rng.sample([*LABELS, *(kb_tag(k) for k in KBS)], rng.randint(0, 3))))
    return DocumentRecord(
        org_id=ORG,
        document_id=doc_id,
        name=f"name-{doc_id}",
        uri=rng.choice([None, "https://a.test/x", f"https://a.test/{doc_id}"]),
        tags=tags,
        revision=revision,
        status=rng.choice(list(DocStatus)),
        kb_ids=[k for k in KBS if kb_tag(k) in tags],
        kb_errors={k: "broken" for k in KBS if rng.random() < 0.2},
        writers=[
            RevisionWriter(
                revision=revision,
                writer=Writer(kind="key", key_id=rng.choice(["k1", "k2"]), name="ci"),
                at=utcnow(),
            )
        ],
    )


@pytest.mark.parametrize("seed", range(20))
def test_figures_equal_a_count_of_the_records_after_any_changes(seed: int) -> None:
    """Random uploads, changes (tags, status, errors, revision), deletes and index entries
    (other revisions and settings versions), some delivered late (older than what is held,
    which must be ignored): for every KB tag set and settings version, `figures` equals the
    count from the records."""
    rng = random.Random(seed)
    catalog = Catalog()
    docs: dict[str, DocumentRecord] = {}
    entries: dict[str, IndexEntry] = {}
    held: dict[str, int] = {}  # key → the sequence of what the view holds
    for sequence in range(1, 401):
        doc_id = f"d{rng.randint(0, 25)}"
        roll = rng.random()
        if roll < 0.35:
            record = random_document(rng, doc_id, rng.randint(1, 4))
            docs[doc_id] = record
            catalog.put_document(record, sequence)
            held[f"{ORG}.{doc_id}"] = sequence
        elif roll < 0.45:
            docs.pop(doc_id, None)
            catalog.drop_document(f"{ORG}.{doc_id}", sequence)
        elif roll < 0.8:
            kb_id = rng.choice(KBS)
            entry = IndexEntry(
                org_id=ORG,
                kb_id=kb_id,
                document_id=doc_id,
                revision=rng.randint(1, 4),
                checksum="c",
                settings_version=rng.randint(1, 3),
                generation=rng.choice([None, 1, 2]),
                chunk_count=rng.randint(1, 9),
            )
            entries[entry.key] = entry
            catalog.put_entry(entry, sequence)
            held[entry.key] = sequence
        elif roll < 0.9:
            key = f"{rng.choice(KBS)}.{doc_id}"
            entries.pop(key, None)
            catalog.drop_entry(key, sequence)
        else:
            # A late delivery: an older value of a key the view already holds newer.
            key = f"{ORG}.{doc_id}"
            if doc_id in docs and held[key] > 1:
                catalog.put_document(random_document(rng, doc_id, 9), held[key] - 1)
                catalog.drop_document(key, held[key] - 1)
        for kb_id in KBS:
            for tag_ids in ([], ["red"], ["blue", "green"], [kb_tag(KBS[0])]):
                for version, generation in itertools.product((1, 2, 3), (1, 2)):
                    kb = KnowledgeBase(
                        org_id=ORG,
                        kb_id=kb_id,
                        name=kb_id,
                        tag_ids=tag_ids,
                        settings_version=version,
                        index_generation=generation,
                        generations=2,
                        status=KBStatus.pending_reindex,
                    )
                    assert asdict(catalog.figures(kb)) == asdict(reference(kb, docs, entries))
    for doc_id in list(docs):
        catalog.drop_document(f"{ORG}.{doc_id}", None)
    for key in list(entries):
        catalog.drop_entry(key, None)
    assert catalog.footprint() == {"documents": 0, "entries": 0, "tag_sets": 0}
    assert not catalog._pairs and not catalog._classes and not catalog._uris
    assert not catalog._org_kbs and not catalog._kb_orgs and not catalog._writers


def test_the_uri_index_names_every_document_with_the_uri() -> None:
    """Two documents with one uri are both found (the caller must then say which); a
    changed uri moves the document; a delete forgets it."""
    catalog = Catalog()
    rng = random.Random(1)
    a, b = random_document(rng, "a", 1), random_document(rng, "b", 1)
    a.uri = b.uri = "https://a.test/same"
    catalog.put_document(a, 1)
    catalog.put_document(b, 2)
    assert {d.document_id for d in catalog.with_uri(ORG, "https://a.test/same")} == {"a", "b"}
    moved = a.model_copy(update={"uri": "https://a.test/other"})
    catalog.put_document(moved, 3)
    assert [d.document_id for d in catalog.with_uri(ORG, "https://a.test/same")] == ["b"]
    assert [d.document_id for d in catalog.with_uri(ORG, "https://a.test/other")] == ["a"]
    catalog.drop_document(f"{ORG}.b", 4)
    assert catalog.with_uri(ORG, "https://a.test/same") == []
