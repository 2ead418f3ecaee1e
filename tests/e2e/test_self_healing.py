"""`kbmesh up` heals itself: work accepted before a crash resumes within seconds of the
restart, not after a long ack timeout; a dead nats-server is reported, answered with 503s,
and restarted."""

from __future__ import annotations

import os
import signal
import socket
import time
from urllib.parse import urlparse

import httpx

from tests.support.procs import Proc, free_port, kbmesh_env, wait_ready, wait_until

PARAGRAPH = (
    "Section {i}.{j}: the reactor coolant loop number {i} carries heat from the core to the "
    "steam generator, where feedwater boils and drives turbine stage {j}. "
)
DOCUMENTS = 8


def test_work_accepted_before_a_crash_resumes_within_seconds(tmp_path):
    """kill -9 of `kbmesh up` while it embeds: after a restart on the same data directory,
    every accepted document is indexed within 60 seconds — the messages in flight at the
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
            # Enough work that the crash lands mid-way even on a fast, quiet machine.
            for i in range(DOCUMENTS):
                text = "".join(PARAGRAPH.format(i=i, j=j) for j in range(80))
                r = client.post(
                    "/v1/kbs/default/documents", json={"name": f"doc-{i}.txt", "content": text}
                )
                assert r.status_code == 202, r.text
            wait_until(
                lambda: indexed(client) >= 1, 300, "the first document indexed", interval=0.05
            )
            before = indexed(client)
        finally:
            first.kill9()
        assert before < DOCUMENTS, "everything was indexed before the crash; nothing was tested"

        second = Proc(args, tmp_path / "second.log", kbmesh_env())
        try:
            wait_ready(base, second)
            restarted = time.monotonic()
            wait_until(lambda: indexed(client) == DOCUMENTS, 60, "every accepted document indexed")
            elapsed = time.monotonic() - restarted
        finally:
            second.stop()
    print(f"indexed {DOCUMENTS - before} remaining documents {elapsed:.1f}s after the restart")


def test_a_dead_nats_server_is_reported_answered_with_503_and_restarted(tmp_path):
    """kill -9 of `kbmesh up`'s nats-server while something else holds its port, so it
    cannot come back at once: /healthz says 503 with the child's state, API calls answer
    503 problem bodies with Retry-After (never a 500); once the port is free the server is
    restarted on it and uploads and searches work again."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = ["up", "--data-dir", str(tmp_path / "data"), "--port", str(port)]
    up = Proc(args, tmp_path / "up.log", kbmesh_env())
    squatter = socket.socket()
    try:
        wait_ready(base, up)
        with httpx.Client(base_url=base, timeout=60) as client:
            health = client.get("/healthz").json()
            assert health["nats_server"]["running"] and health["nats_server"]["restarts"] == 0
            nats_port = int(urlparse((tmp_path / "data" / "nats.url").read_text()).port or 0)

            os.kill(health["nats_server"]["pid"], signal.SIGKILL)
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            wait_until(lambda: _bind(squatter, nats_port), 5, "the freed NATS port", 0.001)
            squatter.listen()

            # (Each restart attempt runs a server for the few milliseconds it needs to find
            # the port taken, so poll rather than look once.)
            down = wait_until(
                lambda: (r := client.get("/healthz")).status_code == 503 and r.json(),
                10,
                "/healthz to report the dead server",
                0.05,
            )
            assert not down["nats_server"]["running"] and down["status"] == "nats-server down"
            for method, path, body in (
                ("POST", "/v1/kbs/default/documents", {"name": "a.txt", "content": "hello"}),
                ("GET", "/v1/kbs", None),
                ("POST", "/v1/search", {"query": "hello"}),
            ):
                r = client.request(method, path, json=body)
                assert r.status_code == 503, (path, r.status_code, r.text)
                assert r.headers["content-type"] == "application/problem+json"
                assert r.headers["retry-after"] == "2"
                assert r.json()["error_type"] == "Unavailable"
            squatter.close()

            def healthy() -> dict:
                r = client.get("/healthz")
                return r.json()["nats_server"] if r.status_code == 200 else {}

            status = wait_until(healthy, 60, "the restarted nats-server")
            assert status["restarts"] >= 1 and status["last_exit_code"] is not None
            wait_ready(base, up)
            r = client.post(
                "/v1/kbs/default/documents",
                params={"wait": "true"},
                json={"name": "after.txt", "content": "written after NATS came back"},
            )
            assert r.status_code == 200 and r.json()["status"] == "complete", r.text
            hits = client.post("/v1/search", json={"query": "after NATS came back"}).json()
            assert hits["hits"][0]["document_id"] == r.json()["document_id"]
    finally:
        squatter.close()
        up.stop()
    assert "nats-server exited" in up.output()


def _bind(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True
