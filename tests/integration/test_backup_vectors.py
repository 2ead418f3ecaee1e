"""Backups carry the vectors: a restore loads each KB's points and index entries from the
archive instead of embedding every chunk again, and answers every search as the backed-up
stack did. `--reembed` (and an archive whose vectors cannot be used) embeds them again.

Embedding is counted by `kbmesh_chunks_embedded_total`, the metric an operator reads: the
restore runs in this process, so the counter it would move is the one read here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from services.cli.backup import BackupError, restore
from services.cli.vectors import NO_VECTORS, OTHER_SETTINGS
from services.common.domain.models import DocumentRecord
from tests.conftest import running_stack
from tests.support.backups import (
    LONG,
    PARAGRAPHS,
    TAG,
    Members,
    answers,
    edited,
    embedded,
    first,
    kbmesh,
    manifest,
    members_of,
    reseal,
    with_manifest,
    write_archive,
)
from tests.support.bus import bus_env
from tests.support.domain import create_kb, settled, upload, wait_until


@dataclass
class Source:
    hot: Path  # written while the stack ran, its vectors asked of the running embed service
    cold: Path  # written from the stopped stack's data dir, its vectors read from the shards
    kb_id: str
    answers: dict[tuple[str, str], list[tuple[str, int]]]
    chunks: int  # points of the KB
    long_chunks: int  # points of volcanoes.md


@pytest.fixture(scope="module")
async def source(tmp_path_factory: pytest.TempPathFactory, embedders: Any) -> Source:
    root = tmp_path_factory.mktemp("backup-vectors")
    data_dir = root / "a"
    async with running_stack(data_dir, embedders=embedders) as (rt, client):
        kb = await create_kb(client, tag_ids=[TAG])
        for name, text in {**PARAGRAPHS, **LONG}.items():
            await upload(client, name, text, tags=[TAG])
        await settled(rt)
        before = await answers(client, kb["kb_id"])
        entries = await rt.registries.index.list(f"{kb['kb_id']}.")
        chunks = sum(e.chunk_count for e in entries)
        records = {d.document_id: d.name for d in await rt.registries.documents.list()}
        long_chunks = next(
            e.chunk_count for e in entries if records[e.document_id] == "volcanoes.md"
        )
        assert long_chunks > 1 and chunks > len(entries), entries
        # `kbmesh backup` as an operator runs it against a running stack.
        rc, out, err = await kbmesh("backup", str(root / "hot.tar.gz"), env=bus_env(rt, "operator"))
        assert rc == 0, (out, err)
    # ... and against a stopped one: its data dir.
    rc, out, err = await kbmesh("backup", str(root / "cold.tar.gz"), "--data-dir", str(data_dir))
    assert rc == 0, (out, err)
    return Source(
        root / "hot.tar.gz", root / "cold.tar.gz", kb["kb_id"], before, chunks, long_chunks
    )


async def restored_answers(data_dir: Path, kb_id: str, embedders: Any) -> Any:
    async with running_stack(data_dir, embedders=embedders) as (rt, client):
        await settled(rt)
        return await answers(client, kb_id)


# --- restore without embedding -----------------------------------------------------------


@pytest.mark.parametrize("taken", ["hot", "cold"])
async def test_a_restore_loads_the_vectors_embeds_nothing_and_answers_the_same(
    source: Source, tmp_path: Path, embedders: Any, taken: str
) -> None:
    """Restoring a backup (taken from a running stack, or from a stopped one's data dir)
    embeds no chunk, and the restored stack answers every hybrid, dense and keyword search
    with the same chunks of the same documents in the same order as the stack backed up."""
    archive = source.hot if taken == "hot" else source.cold
    data_dir = tmp_path / "b"
    start = embedded()
    report = await restore(archive, data_dir)
    assert embedded() == start, "the restore embedded chunks"
    assert report.counts["vectors"] == source.chunks, report
    assert report.reembedded == {}, report

    assert await restored_answers(data_dir, source.kb_id, embedders) == source.answers
    assert embedded() == start, "the restored stack embedded chunks"


async def test_reembed_embeds_every_chunk_again_and_answers_the_same(
    source: Source, tmp_path: Path, embedders: Any
) -> None:
    """`--reembed`: the archive's vectors are not used; every chunk of the KB is embedded
    again, and the answers are the same."""
    data_dir = tmp_path / "b"
    start = embedded()
    # The source's models: vectors embedded again are the very same numbers.
    report = await restore(source.hot, data_dir, reembed=True, embedders=embedders)
    assert embedded() - start == source.chunks
    assert report.counts["vectors"] == 0, report

    assert await restored_answers(data_dir, source.kb_id, embedders) == source.answers


async def test_the_command_prints_what_it_loaded_and_what_it_embeds_again(
    source: Source, tmp_path: Path
) -> None:
    """`kbmesh backup` and `kbmesh restore` say how many chunk vectors they wrote; `restore
    --reembed` names each KB it embeds again and why."""
    rc, out, err = await kbmesh("restore", str(source.hot), "--data-dir", str(tmp_path / "b"))
    assert rc == 0, (out, err)
    assert f", {source.chunks} chunk vectors," in out.splitlines()[0], out
    assert "embedded again" not in out, out
    rc, out, err = await kbmesh(
        "restore", str(source.hot), "--data-dir", str(tmp_path / "c"), "--reembed"
    )
    assert rc == 0, (out, err)
    assert ", 0 chunk vectors," in out.splitlines()[0], out
    assert f"embedded again: KB {source.kb_id} (--reembed)" in out, out


# --- archives whose vectors cannot all be used --------------------------------------------


def _rows(members: Members, prefix: str) -> list[tuple[int, list[dict[str, Any]]]]:
    return [
        (i, [json.loads(line) for line in data.split(b"\n") if line])
        for i, (name, data) in enumerate(members)
        if name.startswith(prefix)
    ]


def _document_newer(members: Members) -> tuple[Members, str]:
    """volcanoes.md's record one revision newer than its index entry and points: an upload
    that landed between the backup's read of the records and of the vectors."""
    for i, rows in _rows(members, "kv/documents"):
        for row in rows:
            record = DocumentRecord.model_validate_json(row["value"])
            if record.name == "volcanoes.md":
                record.revision += 1
                row["value"] = record.model_dump_json()
                data = b"\n".join(json.dumps(r).encode() for r in rows)
                return [*members[:i], (members[i][0], data), *members[i + 1 :]], record.document_id
    raise AssertionError("volcanoes.md is not in the archive")


async def test_a_document_newer_than_its_vectors_is_embedded_again_alone(
    source: Source, tmp_path: Path, embedders: Any
) -> None:
    """A document whose record is newer than its index entry (the vectors are of a revision
    the archive does not hold) has its points dropped and is embedded again; every other
    document's vectors are loaded as they are."""
    members, document_id = _document_newer(members_of(source.hot))
    archive = write_archive(tmp_path / "newer.tar.gz", reseal(members))
    data_dir = tmp_path / "b"
    start = embedded()
    report = await restore(archive, data_dir, embedders=embedders)
    assert embedded() - start == source.long_chunks
    assert report.counts["vectors"] == source.chunks - source.long_chunks, report
    async with running_stack(data_dir, embedders=embedders) as (rt, client):
        await settled(rt)
        entry = await wait_until(
            lambda: rt.registries.index.get(f"{source.kb_id}.{document_id}"), what="its entry"
        )
        assert entry.revision == 2 and entry.chunk_count == source.long_chunks
        assert await answers(client, source.kb_id) == source.answers


def _vectors_built_with(**settings: Any) -> Any:
    """The archive's vectors said to be built with other KB settings than the KB's own."""

    def change(members: Members) -> Members:
        found = manifest(members)
        for vector_set in found["vectors"]:
            vector_set.update(settings)
        return with_manifest(members, found)

    return change


def _version_2(members: Members) -> Members:
    """As kbmesh wrote archives before they carried vectors."""
    kept = [(n, d) for n, d in members if not n.startswith(("vectors/", "kv/index/"))]
    found = manifest(kept)
    found["archive_version"] = 2
    del found["vectors"]
    return reseal(with_manifest(kept, found))


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (_vectors_built_with(chunk_size=150), OTHER_SETTINGS),
        (
            _vectors_built_with(embedding_model="local/all-MiniLM-L6-v2-int8"),
            OTHER_SETTINGS,
        ),
        (_version_2, NO_VECTORS),
    ],
    ids=["other-chunking", "other-model", "version-2"],
)
async def test_vectors_that_do_not_fit_the_kb_are_not_loaded_and_the_kb_is_embedded_again(
    source: Source, tmp_path: Path, change: Any, reason: str
) -> None:
    """Vectors built with other chunking or another model than the KB's settings, and an
    archive written before backups carried vectors (version 2): the KB is embedded again
    (every chunk counted), and the restore says which KB and why."""
    archive = write_archive(tmp_path / "changed.tar.gz", reseal(change(members_of(source.hot))))
    start = embedded()
    report = await restore(archive, tmp_path / "b")
    assert report.reembedded.get(source.kb_id) == reason, report
    assert report.counts["vectors"] == 0, report
    assert embedded() - start >= source.chunks


# --- a vector part altered -----------------------------------------------------------------


async def test_a_tampered_vector_part_is_refused_by_its_checksum(
    source: Source, tmp_path: Path
) -> None:
    """One number of one chunk's dense vector changed, the part's size kept: the restore
    refuses the archive, naming the part, and leaves no data dir."""
    members = members_of(source.hot)
    data = bytearray(members[first(members, "vectors/")][1])
    at = data.index(b'"dense":') + len(b'"dense":')
    at = data.index(b'"', at) + 1  # the first character of the base64 of the vector
    data[at] = ord("B") if data[at] != ord("B") else ord("C")
    path = write_archive(tmp_path / "tampered.tar.gz", edited(members, "vectors/", bytes(data)))
    with pytest.raises(BackupError, match=r"vectors/\d{6}\.jsonl does not match its checksum"):
        await restore(path, tmp_path / "d")
    assert not (tmp_path / "d").exists()
