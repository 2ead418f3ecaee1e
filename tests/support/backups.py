"""Backups as someone holding the file reads and rewrites them (the members of the gzip'd
tar, the manifest resealed to match), `kbmesh` run as an operator runs it, and a KB whose
searches a restored stack must answer as the backed-up one did."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import random
import sys
import tarfile
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY

from tests.support.procs import KBMESH, ROOT, kbmesh_env

Members = list[tuple[str, bytes]]


def members_of(archive: Path) -> Members:
    with tarfile.open(archive, "r:gz") as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar if m.isfile()]  # type: ignore[union-attr]


def write_archive(
    path: Path,
    members: Members,
    *,
    sparse: dict[str, int] | None = None,
    links: tuple[str, ...] = (),
    pax: dict[str, dict[str, str]] | None = None,
) -> Path:
    """A gzip'd tar of `members` in order; those named in `sparse` become sparse members of
    that size (one hole: nothing stored), `links` symlinks, `pax` adds extended headers."""
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.mode = 0o600
            if sparse and name in sparse:
                info.pax_headers = {
                    "GNU.sparse.map": f"{sparse[name]},0",
                    "GNU.sparse.realsize": str(sparse[name]),
                    "GNU.sparse.name": name,
                }
                tar.addfile(info, io.BytesIO(b""))
                continue
            if name in links:
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
                tar.addfile(info)
                continue
            info.pax_headers = (pax or {}).get(name, {})
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def manifest(members: Members) -> dict:
    assert members[0][0] == "manifest.json"
    found: dict = json.loads(members[0][1])
    return found


def with_manifest(members: Members, found: object) -> Members:
    return [("manifest.json", json.dumps(found).encode()), *members[1:]]


def reseal(members: Members) -> Members:
    """The manifest rewritten to match the members as they now are (sizes and checksums):
    what someone who edits an archive with care does."""
    found = manifest(members)
    if "members" in found:
        found["members"] = [
            {"name": n, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()}
            for n, d in members[1:]
        ]
    return with_manifest(members, found)


def first(members: Members, prefix: str) -> int:
    return next(i for i, (name, _) in enumerate(members) if name.startswith(prefix))


def edited(members: Members, prefix: str, data: bytes) -> Members:
    i = first(members, prefix)
    return [*members[:i], (members[i][0], data), *members[i + 1 :]]


def appended_line(members: Members, prefix: str, line: str) -> Members:
    i = first(members, prefix)
    return edited(members, prefix, members[i][1].rstrip(b"\n") + b"\n" + line.encode())


def the_original(members: Members) -> str:
    return next(n for n, _ in members if n.startswith("objects/") and n.endswith("/original"))


# Runs `kbmesh ...` under an address-space limit and reports its peak memory (VmHWM: the
# process's own high-water mark since exec; getrusage's would count the forking parent's).
BOUNDED = """
import atexit, re, resource, runpy, sys
limit = int(sys.argv.pop(1))
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
def peak():
    status = open("/proc/self/status").read()
    print("peak_kib=" + re.search(r"VmHWM:\\s*(\\d+)", status).group(1), file=sys.stderr)
atexit.register(peak)
sys.argv[0] = "kbmesh"
runpy.run_module("services.cli", run_name="__main__", alter_sys=True)
"""


async def kbmesh(
    *args: str, address_space: int | None = None, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    command = [*KBMESH, *args]
    if address_space is not None:
        command = [sys.executable, "-c", BOUNDED, str(address_space), *args]
    proc = await asyncio.create_subprocess_exec(
        *command,
        cwd=ROOT,
        env=kbmesh_env(**(env or {})),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=600)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


# --- a KB to back up, and its answers ---------------------------------------------------

TAG = "vectors"
PARAGRAPHS = {
    "glaciers.md": "A glacier carves a U-shaped valley as it creeps downhill over centuries. "
    "Meltwater streams leave gravel ridges called eskers, and boulders dropped far from "
    "their source are known as erratics.",
    "beekeeping.md": "Beekeepers smoke the hive gently before lifting the honey frames. The "
    "smoke masks the alarm pheromone, so the workers gorge on honey instead of stinging.",
    "lighthouse.md": "The lighthouse keeper logs every passing ship in a leather ledger and "
    "trims the lamp's wick at dusk, winding the clockwork that turns the lens.",
    "croissants.md": "The baker folds butter into the dough six times for flaky croissants, "
    "chilling it between folds so the layers of butter stay separate in the oven.",
    "tidepools.md": "Tidal pools hold anemones, crabs and starfish between the rocks at low "
    "tide; the animals there survive heat, waves and changing salinity twice a day.",
    "cartography.md": "The cartographer drew the coastline from soundings taken by the survey "
    "boat, marking shoals and reefs with the depths measured by a weighted line.",
}


def _long(seed: str, words: str, sentences: int = 40) -> str:
    """A document of several chunks whose sentences all differ in words and length, so that
    no two chunks score alike (tied hits may come back in either order)."""
    rng = random.Random(seed)
    return " ".join(
        " ".join(rng.choices(words.split(), k=rng.randint(6, 16))).capitalize() + f" ({i})."
        for i in range(sentences)
    )


# Long documents: several chunks each, so points of one document are spread over pages.
LONG = {
    "volcanoes.md": _long(
        "volcanoes",
        "lava ash eruption crater basalt magma fumarole sulphur caldera tephra pumice vent "
        "obsidian plume dome fissure scoria cinder lahar pyroclastic",
    ),
    "rivers.md": _long(
        "rivers",
        "river meander oxbow floodplain levee silt delta estuary bank channel current bend "
        "sediment tributary gravel rapids valley flood erosion confluence",
    ),
}
QUERIES = (
    "who records ships in a ledger",
    "how glaciers shape valleys",
    "creatures living in rock pools at low tide",
    "lava ash eruption crater",
    "oxbow lake floodplain meanders",
)
MODES = ("hybrid", "dense", "keyword")


def embedded() -> float:
    """Chunks embedded in this process so far (`kbmesh_chunks_embedded_total`)."""
    return REGISTRY.get_sample_value("kbmesh_chunks_embedded_total") or 0.0


async def answers(client: Any, kb_id: str) -> dict[tuple[str, str], list[tuple[str, int]]]:
    """(document id, chunk index) of every hit, in order, per query and mode."""
    found = {}
    for mode in MODES:
        for query in QUERIES:
            r = await client.post(
                "/v1/search", json={"query": query, "kb_ids": [kb_id], "mode": mode, "top_k": 8}
            )
            assert r.status_code == 200, r.text
            found[(mode, query)] = [(h["document_id"], h["chunk_index"]) for h in r.json()["hits"]]
    return found
