"""Moving off one machine: a backup of a data dir restored onto a JetStream cluster and a
Qdrant server (`kbmesh restore ARCHIVE --nats-url URL --qdrant-url URL`) brings every KB
over, its registries, texts and vectors; a stack there answers every search as the one
machine did, and nothing is embedded on the way.

The cluster is three real nats-server processes (tests/support/cluster.py); qdrant-client's
local mode, kept in a folder, stands in for the Qdrant server behind the same adapter
(services/common/store/server.py). Each process opens its own client on that folder, as
each of a deployment's processes connects to the server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import nats
import pytest
from qdrant_client import AsyncQdrantClient

from services.cli.backup import BackupError, restore
from services.common.messages.names import KV_BUCKETS, STREAM
from services.common.settings import BusSettings, Settings
from services.common.store.server import ServerStore
from tests.conftest import running_stack
from tests.support.backups import LONG, PARAGRAPHS, TAG, answers, embedded, kbmesh
from tests.support.cluster import NatsCluster, jetstream_ready
from tests.support.domain import create_kb, settled, upload, wait_until


def qdrant(folder: Path) -> ServerStore:
    return ServerStore(client=AsyncQdrantClient(path=str(folder)))


async def test_a_data_dirs_kbs_move_onto_a_cluster_and_a_qdrant_server_without_embedding(
    tmp_path: Path, embedders: Any
) -> None:
    """A KB on the embedded default (private NATS, Edge), backed up from its stopped data dir
    and restored onto a three-node cluster (three replicas of every stream) and a Qdrant
    server: the restore embeds no chunk, and a stack on the cluster and the server answers
    every hybrid, dense and keyword search with the same chunks in the same order."""
    data_dir = tmp_path / "one-machine"
    async with running_stack(data_dir, embedders=embedders) as (rt, client):
        kb = await create_kb(client, tag_ids=[TAG])
        for name, text in {**PARAGRAPHS, **LONG}.items():
            await upload(client, name, text, tags=[TAG])
        await settled(rt)
        before = await answers(client, kb["kb_id"])
        chunks = sum(e.chunk_count for e in await rt.registries.index.list(f"{kb['kb_id']}."))
    archive = tmp_path / "one-machine.tar.gz"
    rc, out, err = await kbmesh("backup", str(archive), "--data-dir", str(data_dir))
    assert rc == 0, (out, err)

    with NatsCluster(tmp_path / "cluster") as cluster:
        await wait_until(
            lambda: jetstream_ready(cluster.url), timeout=60, interval=0.2, what="JetStream"
        )
        servers = Settings(
            data_dir=tmp_path / "restorer", nats_url=cluster.url, bus=BusSettings(replicas=3)
        )
        start = embedded()
        report = await restore(
            archive, onto=servers, store=qdrant(tmp_path / "qdrant"), embedders=embedders
        )
        assert embedded() == start, "the restore embedded chunks"
        assert report.counts["vectors"] == chunks and report.reembedded == {}, report

        nc = await nats.connect(cluster.url.split(","))
        try:
            js = nc.jetstream()
            for name in (STREAM, *(f"KV_{b}" for b in KV_BUCKETS)):
                assert (await js.stream_info(name)).config.num_replicas == 3, name
        finally:
            await nc.close()

        async with running_stack(
            tmp_path / "node",
            nats_url=cluster.url,
            embedders=embedders,
            store=qdrant(tmp_path / "qdrant"),
        ) as (rt, client):
            await settled(rt)
            assert await answers(client, kb["kb_id"]) == before
        assert embedded() == start, "the stack on the servers embedded chunks"

        # Only onto a new deployment: the servers now hold KBs, and a second copy is refused
        # before anything is written.
        with pytest.raises(BackupError, match="already holds"):
            await restore(
                archive, onto=servers, store=qdrant(tmp_path / "qdrant"), embedders=embedders
            )


async def test_restore_names_what_it_needs_to_reach_the_servers(tmp_path: Path) -> None:
    """`kbmesh restore` onto servers takes both addresses, or a data dir, never a mix: an
    incomplete command is refused with the reason, and nothing is written."""
    archive = tmp_path / "a.tar.gz"
    archive.write_bytes(b"")
    for args in (
        ["--nats-url", "nats://127.0.0.1:1"],
        ["--qdrant-url", "http://127.0.0.1:1"],
        ["--data-dir", str(tmp_path / "d"), "--nats-url", "nats://127.0.0.1:1"],
        [],
    ):
        rc, out, err = await kbmesh("restore", str(archive), *args)
        assert rc == 2, (args, out, err)
        assert "--data-dir" in err and "--nats-url" in err and "--qdrant-url" in err, err
    assert not (tmp_path / "d").exists()
