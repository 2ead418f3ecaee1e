"""The data dir's format version: a data dir the previous format wrote opens, is migrated
and serves what it held; a newer one is refused and left as it was."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.cli.runtime import build_runtime
from services.common.ops.datadir import (
    CURRENT_FORMAT,
    FORMAT_FILE,
    DataDirError,
    open_data_dir,
    read_format,
)
from services.common.settings import Settings
from tests.conftest import running_stack
from tests.support.domain import create_kb, uid, upload
from tests.support.procs import ROOT

TEXT = "The lighthouse keeper logs every passing ship in a leather ledger kept by the lamp."


def snapshot(path: Path) -> dict[str, tuple[int, int]]:
    """Every file under `path` with its size and modification time."""
    return {
        str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


async def test_a_data_dir_of_the_previous_format_opens_and_serves_what_it_held(
    tmp_path: Path, embedders
) -> None:
    """Format 0 is the layout written before the version was recorded: the same directories,
    no FORMAT file. A stack writes one (its documents indexed), the marker is taken away, and
    the next start migrates it and finds the document by search."""
    data = tmp_path / "data"
    async with running_stack(data, embedders=embedders) as (_rt, client):
        kb = await create_kb(client, name=f"ships-{uid()}")
        r = await client.post(
            f"/v1/kbs/{kb['kb_id']}/documents?wait=true",
            json={"name": "ledger.md", "content": TEXT},
        )
        assert r.status_code in (200, 202), r.text
    assert read_format(data) == CURRENT_FORMAT
    (data / FORMAT_FILE).unlink()
    assert read_format(data) == 0

    async with running_stack(data, embedders=embedders) as (_rt, client):
        assert json.loads((data / FORMAT_FILE).read_text()) == {"format": CURRENT_FORMAT}
        r = await client.post(
            "/v1/search", json={"query": "lighthouse ledger of ships", "kb_ids": [kb["kb_id"]]}
        )
        assert r.status_code == 200, r.text
        assert [h["document_name"] for h in r.json()["hits"]][:1] == ["ledger.md"]
        # And it keeps working: a new document lands beside the old one.
        await upload(client, "second.md", "A second note.", kb_id=kb["kb_id"])


async def test_a_newer_format_is_refused_and_left_untouched(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / FORMAT_FILE).write_text(json.dumps({"format": CURRENT_FORMAT + 1}))
    (data / "nats").mkdir()
    (data / "nats" / "something").write_text("written by a newer kbmesh")
    before = snapshot(data)
    with pytest.raises(SystemExit, match="newer kbmesh"):
        await build_runtime(Settings(data_dir=data))
    assert snapshot(data) == before


def test_a_new_data_dir_gets_the_current_format_private(tmp_path: Path) -> None:
    data = tmp_path / "fresh"
    assert open_data_dir(data) == CURRENT_FORMAT
    assert read_format(data) == CURRENT_FORMAT
    assert (data / FORMAT_FILE).stat().st_mode & 0o777 == 0o600
    assert open_data_dir(data) == CURRENT_FORMAT  # idempotent


def test_an_unreadable_marker_is_refused_not_overwritten(tmp_path: Path) -> None:
    (tmp_path / FORMAT_FILE).write_text("{not json")
    with pytest.raises(DataDirError, match="unreadable"):
        open_data_dir(tmp_path)
    assert (tmp_path / FORMAT_FILE).read_text() == "{not json"


# Each process waits for the same moment, then opens the data dir.
OPEN_AT = """
import sys, time
from pathlib import Path
from services.common.ops.datadir import open_data_dir
time.sleep(max(float(sys.argv[1]) - time.time(), 0))
print(open_data_dir(Path(sys.argv[2])))
"""


@pytest.mark.parametrize("state", ["new", "format 0"])
def test_processes_opening_one_data_dir_at_once_all_start(tmp_path: Path, state: str) -> None:
    """`kbmesh serve ingest`, `serve embed search` and `serve gateway` started together open
    the same data dir: each one opens it (one of them creating or migrating it), none fails
    on another's half-written marker, and the one marker left is the current format."""
    for round_ in range(3):
        data = tmp_path / f"data-{round_}"
        if state == "format 0":
            (data / "nats").mkdir(parents=True)
        at = str(time.time() + 1.0)
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", OPEN_AT, at, str(data)],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(6)
        ]
        results = [p.communicate(timeout=60) for p in procs]
        assert [p.returncode for p in procs] == [0] * 6, [err for _, err in results]
        assert {int(out) for out, _ in results} <= {0, CURRENT_FORMAT}
        assert read_format(data) == CURRENT_FORMAT
        assert not [p.name for p in data.iterdir() if p.name.endswith(".tmp")]
