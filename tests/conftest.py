"""Shared fixtures: a real nats-server per session, and a whole in-process stack per test
module on its own data directory (uuid-named, so tests never share state)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The ONNX export of the bundled model is content-addressed (weights, recipe, onnxruntime
# version) and never changes once written, so every test and every `kbmesh up` subprocess
# may share one build instead of exporting it again per data directory.
os.environ.setdefault(
    "KBMESH_MODEL_CACHE_DIR",
    str(Path(tempfile.gettempdir()) / f"kbmesh-test-models-{os.getuid()}"),
)

from services.common.bus.nats_server import NatsServer

MODEL_CACHE_DIR = Path(os.environ["KBMESH_MODEL_CACHE_DIR"])


@pytest.fixture(scope="session", autouse=True)
def model_cache() -> Path:
    """Build the ONNX exports once before any test needs them (fp32, and the precision
    `auto` uses on this machine), so that no `kbmesh up` under test spends its readiness
    timeout exporting (a no-op once the cache holds them)."""
    from services.common.domain.models import DEFAULT_MODEL
    from services.common.embedders import LocalEmbedder
    from services.common.embedders.onnx_export import ensure_onnx
    from services.common.embedders.selection import select

    model = LocalEmbedder(DEFAULT_MODEL, backend="onnx", cache_dir=MODEL_CACHE_DIR)
    auto = select("auto", "cpu").precision
    ensure_onnx(model.model_dir, MODEL_CACHE_DIR, name=model.name, variant=auto)
    return ensure_onnx(model.model_dir, MODEL_CACHE_DIR, name=model.name, variant="fp32")


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path_factory.mktemp("nats")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def embedders():
    """One model load for the whole session (the pool is stateless apart from caches)."""
    from services.common.embedders import EmbedderPool

    return EmbedderPool(cache_dir=MODEL_CACHE_DIR, local_backend="onnx")


@contextlib.asynccontextmanager
async def running_stack(
    data_dir: Path,
    nats_url: str | None = None,
    embedders=None,
    span_processors=None,
    store=None,
    **overrides,
) -> AsyncIterator[tuple]:
    """All five services in this process plus an HTTP client on the gateway app.
    Without `nats_url`, the stack runs its own private nats-server under `data_dir`; without
    `store`, it uses the vector store the settings name."""
    import httpx

    from services.cli.runtime import build_runtime, gateway_app, start_consuming
    from services.common.settings import Settings

    settings = Settings(data_dir=data_dir, nats_url=nats_url, **overrides)
    rt = await build_runtime(
        settings, embedders=embedders, span_processors=span_processors, store=store
    )
    app = gateway_app(rt)
    started, stop = asyncio.Event(), asyncio.Event()

    async def lifespan() -> None:
        # One task enters and exits the lifespan: anyio cancel scopes (the MCP session
        # manager) must not cross tasks, and fixtures set up and tear down in different ones.
        async with app.router.lifespan_context(app):
            started.set()
            await stop.wait()

    task = asyncio.create_task(lifespan())
    try:
        await asyncio.wait(
            [task, asyncio.create_task(started.wait())], return_when=asyncio.FIRST_COMPLETED
        )
        if task.done():
            task.result()
        await start_consuming(rt)
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 50000))
        async with httpx.AsyncClient(
            transport=transport, base_url="http://127.0.0.1", timeout=120
        ) as client:
            yield rt, client
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await task
        await rt.close()
