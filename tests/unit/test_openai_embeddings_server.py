"""The stand-in embeddings API answers as fast as a local process can: benchmarks use it in
place of a hosted model to measure kbmesh's own pipeline, so its latency must be negligible."""

from __future__ import annotations

import statistics
import time

import httpx

from tests.support.openai_embeddings import OpenAIEmbeddingsServer


def test_requests_on_a_kept_alive_connection_are_not_held_by_delayed_acks():
    """Each request on one kept-alive connection (as LiteLLM's client sends them) is answered
    in milliseconds. Without TCP_NODELAY on the server's connections a response written in two
    parts (headers, then body) waits for the client's delayed ACK: about 40 ms each on Linux."""
    with OpenAIEmbeddingsServer(dim=384) as server, httpx.Client(timeout=10) as client:
        times = []
        for i in range(20):
            started = time.perf_counter()
            r = client.post(
                f"{server.base_url}/embeddings", json={"model": "m", "input": [f"text {i}"]}
            )
            times.append(time.perf_counter() - started)
            assert r.status_code == 200
        assert statistics.median(times) < 0.02, f"median {statistics.median(times) * 1000:.1f} ms"
