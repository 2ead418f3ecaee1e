"""What one org's dead-letter list costs while another org holds many large dead letters:
`kbmesh up`, two upstream publishers of org `attacker` flood it with uploads of 512 KB that
fail (they name a KB that does not exist), then `GET /v1/dead-letters?limit=1` is asked for
org `local` (keyless loopback) one at a time and two at once. Prints one line per figure:
the time of each call and the gateway process's peak resident memory while they ran.

    python -m benchmarks.dead_letter_list [--letters 2000] [--kb 512]

Publishes that the server refuses (a publisher's backlog or the publishers' stream full)
are retried after a pause, as an upstream system should; the line `refused` says how many.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import nats
import nats.js.errors

from benchmarks.common import ROOT, bench_env
from services.common.bus.nats_server import free_port

KBMESH = [sys.executable, "-m", "services.cli"]
PUBLISHERS = ("flood-1", "flood-2")


def status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


def reset_peak(pid: int) -> None:
    """From now on VmHWM is the peak since this call (Linux: clear_refs 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def kbmesh(data: str, *args: str) -> str:
    out = subprocess.run(
        [*KBMESH, *args, "--data-dir", data],
        cwd=ROOT,
        env=bench_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


async def flood(creds: dict[str, str], letters: int, size: int, counts: dict[str, int]) -> None:
    nc = await nats.connect(creds["url"], user=creds["user"], password=creds["password"])
    js = nc.jetstream()
    content = "x" * size
    try:
        for i in range(letters):
            body = json.dumps(
                {
                    "org_id": creds["org_id"],
                    "name": f"{creds['user']}-{i}.txt",
                    "content": content,
                    "kb_id": "nowhere",
                }
            ).encode()
            while True:
                try:
                    await js.publish("doc.uploaded", body, timeout=30)
                    break
                except nats.js.errors.APIError:
                    counts["refused"] += 1
                    await asyncio.sleep(0.2)
    finally:
        await nc.close()


async def dead_letters(url: str, operator: dict[str, str]) -> int:
    nc = await nats.connect(
        url,
        user=operator["user"],
        password=operator["password"],
        inbox_prefix=f"_INBOX.{operator['user']}",
    )
    try:
        return int((await nc.jetstream().stream_info("KBMESH_DLQ")).state.messages)
    finally:
        await nc.close()


async def timed_list(client: httpx.AsyncClient) -> float:
    started = time.perf_counter()
    r = await client.get("/v1/dead-letters", params={"limit": 1})
    r.raise_for_status()
    return time.perf_counter() - started


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--letters", type=int, default=2000, help="dead letters in all")
    parser.add_argument("--kb", type=int, default=512, help="KB per dead letter")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        # Room for every letter in the dead-letter stream (ignored by versions without it).
        env = bench_env(KBMESH_BUS__STREAM_MAX_MB=str(2 * args.letters * args.kb // 1024 + 64))
        up = subprocess.Popen(
            [*KBMESH, "up", "--data-dir", data, "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            async with httpx.AsyncClient(base_url=base, timeout=600) as client:
                deadline = time.monotonic() + 180
                while time.monotonic() < deadline:
                    try:
                        if (await client.get("/readyz")).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    await asyncio.sleep(0.5)
                publishers = [
                    json.loads(kbmesh(data, "publishers", "add", name, "--org", "attacker"))
                    for name in PUBLISHERS
                ]
                operator = json.loads((Path(data) / "nats-credentials.json").read_text())
                counts = {"refused": 0}
                started = time.perf_counter()
                share = args.letters // len(publishers)
                await asyncio.gather(*(flood(p, share, args.kb * 1024, counts) for p in publishers))
                print(
                    f"published  {share * len(publishers)} x {args.kb} KB in "
                    f"{time.perf_counter() - started:.1f} s; refused {counts['refused']} times"
                )
                url = publishers[0]["url"]
                while (held := await dead_letters(url, operator["operator"])) < args.letters:
                    await asyncio.sleep(1)
                print(f"dead letters  {held} after {time.perf_counter() - started:.1f} s")
                du = subprocess.run(["du", "-sm", data], capture_output=True, text=True)
                print(f"data dir  {du.stdout.split()[0]} MB")

                rss = status_kb(up.pid, "VmRSS") / 1024
                reset_peak(up.pid)
                single = [await timed_list(client) for _ in range(5)]
                peak = status_kb(up.pid, "VmHWM") / 1024
                print(
                    f"one at a time  GET /v1/dead-letters?limit=1 (org local): "
                    f"{' '.join(f'{s:.3f}' for s in single)} s; RSS {rss:.0f} MB before, "
                    f"peak {peak:.0f} MB"
                )
                rss = status_kb(up.pid, "VmRSS") / 1024
                reset_peak(up.pid)
                both = await asyncio.gather(timed_list(client), timed_list(client))
                peak = status_kb(up.pid, "VmHWM") / 1024
                print(
                    f"two at once  {' '.join(f'{s:.3f}' for s in both)} s; RSS {rss:.0f} MB "
                    f"before, peak {peak:.0f} MB"
                )
        finally:
            up.terminate()
            up.wait(120)


if __name__ == "__main__":
    asyncio.run(main())
