"""`kbmesh up` heals itself: work accepted before a crash resumes within seconds of the
restart, not after a long ack timeout."""

from __future__ import annotations

import time

import httpx

from tests.support.procs import Proc, free_port, kbmesh_env, wait_ready, wait_until

PARAGRAPH = (
    "Section {i}.{j}: the reactor coolant loop number {i} carries heat from the core to the "
    "steam generator, where feedwater boils and drives turbine stage {j}. "
)


def test_work_accepted_before_a_crash_resumes_within_seconds(tmp_path):
    """kill -9 of `kbmesh up` while it embeds: after a restart on the same data directory,
    every accepted document is indexed within 45 seconds — the messages in flight at the
    crash are redelivered after one short ack wait, not after two minutes."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = ["up", "--data-dir", str(tmp_path / "data"), "--port", str(port)]

    def indexed(client: httpx.Client) -> int:
        items = client.get("/v1/kbs/default/documents", params={"limit": 100}).json()["items"]
        return sum(1 for d in items if d["status"] == "complete")

    first = Proc(args, tmp_path / "first.log", kbmesh_env())
    with httpx.Client(base_url=base, timeout=60) as client:
        try:
            wait_ready(base, first)
            for i in range(6):
                text = "".join(PARAGRAPH.format(i=i, j=j) for j in range(40))
                r = client.post(
                    "/v1/kbs/default/documents", json={"name": f"doc-{i}.txt", "content": text}
                )
                assert r.status_code == 202, r.text
            wait_until(lambda: indexed(client) >= 1, 300, "the first document indexed")
            before = indexed(client)
        finally:
            first.kill9()
        assert before < 6, "everything was indexed before the crash; nothing was tested"

        second = Proc(args, tmp_path / "second.log", kbmesh_env())
        try:
            wait_ready(base, second)
            restarted = time.monotonic()
            wait_until(lambda: indexed(client) == 6, 45, "every accepted document indexed")
            elapsed = time.monotonic() - restarted
        finally:
            second.stop()
    print(f"indexed {6 - before} remaining documents {elapsed:.1f}s after the restart")
