"""The `kbmesh` command: up, serve, keys, mcp, mock, contracts."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

# Nothing downloads at run time: the model ships in a package, litellm's cost map too.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kbmesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="everything in one process: private NATS, embedded Qdrant")
    _server_args(up)

    serve = sub.add_parser("serve", help="the named services, against KBMESH_NATS_URL")
    serve.add_argument("services", nargs="+", metavar="SERVICE",
                       help="ingest, embed, search, gateway")
    _server_args(serve)

    keys = sub.add_parser("keys", help="API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="create a key and print it once")
    create.add_argument("--org", required=True)
    create.add_argument("--name", default="")
    create.add_argument("--kb", action="append", dest="kbs", help="limit to this KB id (repeat)")
    create.add_argument("--read-only", action="store_true")
    create.add_argument("--data-dir", type=Path)

    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("KBMESH_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    for noisy in ("httpx", "LiteLLM", "litellm", "sentence_transformers", "kbmesh.faststream"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.command == "up":
        asyncio.run(_serve(_settings(args), None, embedded=True))
    elif args.command == "serve":
        asyncio.run(_serve(_settings(args), args.services, embedded=False))
    elif args.command == "keys":
        asyncio.run(_create_key(args))


def _server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", type=Path, help="default ./.kbmesh (KBMESH_DATA_DIR)")
    p.add_argument("--port", type=int, help="gateway port, default 8080 (KBMESH_PORT)")
    p.add_argument("--host", help="gateway bind address, default 127.0.0.1 (KBMESH_HOST)")


def _settings(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from services.common.settings import Settings

    overrides = {k: v for k in ("data_dir", "port", "host")
                 if (v := getattr(args, k, None)) is not None}
    return Settings(**overrides)


async def _serve(settings, services: list[str] | None, *, embedded: bool) -> None:  # type: ignore[no-untyped-def]
    import uvicorn

    from services.runtime import SERVICES, build_runtime, start_consuming

    if not embedded and not settings.nats_url:
        sys.exit("kbmesh serve needs KBMESH_NATS_URL (or use `kbmesh up`)")
    names = list(SERVICES) if services is None else services
    rt = await build_runtime(settings, names, embedded_nats=embedded)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    server = None
    try:
        tasks = [asyncio.create_task(start_consuming(rt))]
        if "gateway" in rt.services:
            from services.gateway.app import create_app

            config = uvicorn.Config(create_app(rt), host=settings.host, port=settings.port,
                                    log_level="warning", lifespan="on")
            server = uvicorn.Server(config)
            tasks.append(asyncio.create_task(server.serve()))
            base = f"http://{settings.host}:{settings.port}"
            print(f"kbmesh {' '.join(rt.services)} on {rt.bus.url}", flush=True)
            print(f"  REST     {base}/v1", flush=True)
            print(f"  docs     {base}/docs", flush=True)
            print(f"  MCP      {base}/mcp", flush=True)
            print(f"  ready    {base}/readyz", flush=True)
        else:
            print(f"kbmesh {' '.join(rt.services)} on {rt.bus.url}", flush=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if server is not None:
            # uvicorn installs its own handlers while serving; it exits on the signal too.
            done, _ = await asyncio.wait(
                [tasks[1], asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED
            )
            server.should_exit = True
            with contextlib.suppress(Exception):
                await tasks[1]
        else:
            await stop.wait()
        tasks[0].cancel()
    finally:
        await rt.close()
        print("kbmesh stopped", flush=True)


async def _create_key(args: argparse.Namespace) -> None:
    from services.common.bus import Bus
    from services.common.models import check_id
    from services.common.natsproc import NatsServer
    from services.common.registry import Registries
    from services.common.telemetry import configure_telemetry
    from services.gateway.auth import KeyResolver

    settings = _settings(args)
    check_id(args.org, "--org")
    nats_server = None
    url = settings.nats_url
    recorded = settings.data_dir / "nats.url"
    if not url:
        # A running `kbmesh up` records its URL; otherwise open its store directly.
        url = recorded.read_text().strip() if recorded.exists() else None
        if url and not _reachable(url):
            url = None
        if not url:
            nats_server = NatsServer(settings.data_dir / "nats").start()
            url = nats_server.url
    bus = Bus(settings, url, configure_telemetry("kbmesh-cli"))
    try:
        await bus.connect()
        registries = await Registries.open(bus.js)
        token = await KeyResolver(registries.keys, settings.default_org).create(
            args.org, args.name, args.kbs, args.read_only
        )
        print(token)
    finally:
        await bus.close()
        if nats_server:
            nats_server.stop()


def _reachable(url: str) -> bool:
    import socket
    from urllib.parse import urlparse

    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 4222), 0.5):
            return True
    except OSError:
        return False


if __name__ == "__main__":
    main()
