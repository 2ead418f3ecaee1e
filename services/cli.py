"""The `kbmesh` command: up, serve, keys, mcp, ingest, mock, contracts, dlq."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.common.bus import Bus
    from services.common.settings import Settings

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
    serve.add_argument(
        "services", nargs="+", metavar="SERVICE", help="ingest, embed, search, gateway"
    )
    _server_args(serve)

    keys = sub.add_parser("keys", help="API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="create a key and print it once")
    create.add_argument("--org", required=True)
    create.add_argument("--name", default="")
    create.add_argument("--kb", action="append", dest="kbs", help="limit to this KB id (repeat)")
    create.add_argument("--read-only", action="store_true")
    create.add_argument("--data-dir", type=Path)

    mcp = sub.add_parser(
        "mcp", help="MCP over stdio for desktop agents; logs go to stderr, stdout is the protocol"
    )
    mcp.add_argument(
        "--embedded",
        action="store_true",
        help="run the whole stack in this process (private NATS, embedded Qdrant, "
        "local model) instead of connecting to a running one",
    )
    mcp.add_argument(
        "--data-dir",
        type=Path,
        help="default ./.kbmesh (KBMESH_DATA_DIR); "
        "without --embedded, where `kbmesh up` recorded its NATS URL",
    )
    mcp.add_argument("--toolsets", help="core, compat or core,compat (KBMESH_MCP_TOOLSETS)")
    mcp.add_argument(
        "--api-key",
        default=os.environ.get("KBMESH_API_KEY"),
        help="run as this API key's org and scope (KBMESH_API_KEY); "
        "default: the default org, unscoped",
    )

    from services.cli_ingest import add_parser as add_ingest_parser

    add_ingest_parser(sub)

    mock = sub.add_parser(
        "mock", help="serve the contract examples (REST, /api/v1/tools, MCP); no NATS, no model"
    )
    mock.add_argument("--port", type=int, default=8080)
    mock.add_argument("--host", default="127.0.0.1")
    mock.add_argument("--toolsets", default="core,compat", help="core, compat or core,compat")

    contracts = sub.add_parser("contracts", help="the JSON Schemas and examples in contracts/")
    contracts_sub = contracts.add_subparsers(dest="contracts_command", required=True)
    for name, text in (
        ("export", "write contracts/ from the code"),
        ("check", "exit 1 when contracts/ differs from the code"),
    ):
        contracts_sub.add_parser(name, help=text).add_argument(
            "--dir", type=Path, default=Path("contracts"), help="default ./contracts"
        )

    dlq = sub.add_parser("dlq", help="dead letters: list them, replay them")
    dlq_sub = dlq.add_subparsers(dest="dlq_command", required=True)
    dlq_list = dlq_sub.add_parser("list", help="one JSON line per dead letter, oldest first")
    dlq_list.add_argument("--limit", type=int, default=100)
    dlq_replay = dlq_sub.add_parser(
        "replay", help="republish to the original subject and remove the dead letter"
    )
    dlq_replay.add_argument("sequences", nargs="*", type=int, metavar="SEQUENCE")
    dlq_replay.add_argument("--all", action="store_true", help="every dead letter (of --subject)")
    for p in (dlq_list, dlq_replay):
        p.add_argument("--subject", help="only dead letters of this original subject")
        p.add_argument("--data-dir", type=Path)

    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("KBMESH_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    for noisy in ("httpx", "LiteLLM", "litellm", "sentence_transformers", "kbmesh.faststream"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.command == "up":
        _run_server(_serve(_settings(args), None, embedded=True))
    elif args.command == "serve":
        _run_server(_serve(_settings(args), args.services, embedded=False))
    elif args.command == "keys":
        asyncio.run(_create_key(args))
    elif args.command == "mcp":
        asyncio.run(_mcp(args))
    elif args.command == "mock":
        from services.contracts.mock import serve_mock

        toolsets = [t.strip() for t in args.toolsets.split(",") if t.strip()]
        try:
            asyncio.run(serve_mock(args.host, args.port, toolsets))
        except ValueError as err:  # an unknown toolset
            sys.exit(f"kbmesh mock: {err}")
    elif args.command == "dlq":
        if args.dlq_command == "replay" and not (args.all or args.sequences):
            parser.error("dlq replay needs sequence numbers or --all")
        sys.exit(asyncio.run(_dlq(args)))
    elif args.command == "contracts":
        sys.exit(_contracts(args.contracts_command, args.dir))
    elif args.command == "ingest":
        from services.cli_ingest import run as run_ingest

        sys.exit(run_ingest(args))


def _server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", type=Path, help="default ./.kbmesh (KBMESH_DATA_DIR)")
    p.add_argument("--port", type=int, help="gateway port, default 8080 (KBMESH_PORT)")
    p.add_argument("--host", help="gateway bind address, default 127.0.0.1 (KBMESH_HOST)")


def _settings(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from services.common.settings import Settings

    overrides = {
        k: v for k in ("data_dir", "port", "host") if (v := getattr(args, k, None)) is not None
    }
    return Settings(**overrides)


def _run_server(main: Coroutine[Any, Any, None]) -> None:
    """Servers run on uvloop where it exists (not on Windows), as uvicorn would run them on
    its own: HTTP, NATS and the consumers all share this one loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


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
    failure: BaseException | None = None
    try:
        tasks = [asyncio.create_task(start_consuming(rt))]
        if "gateway" in rt.services:
            from services.runtime import gateway_app

            config = uvicorn.Config(
                gateway_app(rt),
                host=settings.host,
                port=settings.port,
                log_level="warning",
                lifespan="on",
            )
            server = uvicorn.Server(config)
            tasks.append(asyncio.create_task(server.serve()))
            base = f"http://{settings.host}:{settings.port}"
            print(f"kbmesh {' '.join(rt.services)} on {rt.bus.url}", flush=True)
            print(f"  console  {base}/", flush=True)
            print(f"  REST     {base}/v1", flush=True)
            print(f"  docs     {base}/docs", flush=True)
            print(f"  MCP      {base}/mcp", flush=True)
            print(f"  ready    {base}/readyz", flush=True)
        else:
            print(f"kbmesh {' '.join(rt.services)} on {rt.bus.url}", flush=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        # A failed start (model load, NATS) ends the process non-zero instead of idling.
        waiters = [asyncio.create_task(stop.wait()), *tasks]
        while True:
            done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            if tasks[0] in done and tasks[0].exception() is None and len(done) == 1:
                waiters.remove(tasks[0])  # started: keep serving
                _freeze_heap()
                continue
            break
        if tasks[0].done() and not tasks[0].cancelled() and tasks[0].exception() is not None:
            failure = tasks[0].exception()
        if server is not None:
            if rt.gateway is not None:  # open event streams: the server would wait for them
                rt.gateway.progress.close_streams()
            server.should_exit = True
            with contextlib.suppress(Exception):
                await tasks[1]
        tasks[0].cancel()
    finally:
        await rt.close()
        print("kbmesh stopped", flush=True)
    if failure is not None:
        sys.exit(f"kbmesh failed to start: {failure!r}")


def _freeze_heap() -> None:
    """What a started server holds (modules, models, schemas: over a million objects) lives
    as long as the process. Frozen, the collector's full passes skip it; unfrozen, they
    walked it all every few seconds under load, each pausing the process several times
    longer (docs/benchmarks/log)."""
    gc.collect()
    gc.freeze()


async def _mcp(args: argparse.Namespace) -> None:
    from services.common.settings import Settings
    from services.gateway.tools import tools_for

    overrides: dict[str, object] = {}
    if args.data_dir is not None:
        overrides["data_dir"] = args.data_dir
    if args.toolsets:
        overrides["mcp_toolsets"] = args.toolsets
    settings = Settings(**overrides)  # type: ignore[arg-type]
    try:
        tools_for(settings.toolsets)
    except ValueError as err:
        sys.exit(f"kbmesh mcp: {err}")
    # A running `kbmesh up` records its URL in its data directory.
    recorded = settings.data_dir / "nats.url"
    url = recorded.read_text().strip() if recorded.exists() else None
    if args.embedded and url and _reachable(url):
        # Its NATS store and Edge shards open in one process only.
        sys.exit(
            f"kbmesh mcp --embedded: a kbmesh is already running on {settings.data_dir}; "
            "use `kbmesh mcp` (without --embedded) to connect to it, or another "
            "KBMESH_DATA_DIR."
        )
    if not args.embedded and not settings.nats_url:
        if not url or not _reachable(url):
            sys.exit(
                "kbmesh mcp: no running kbmesh found. Set KBMESH_NATS_URL, start `kbmesh up` "
                f"(it records its NATS URL in {recorded}), or use `kbmesh mcp --embedded`."
            )
        settings.nats_url = url
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    if task is not None:
        # A client stops its server with SIGTERM: unwind, so the private NATS stops too.
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await _serve_stdio(settings, embedded=args.embedded, api_key=args.api_key)


async def _serve_stdio(settings: Settings, *, embedded: bool, api_key: str | None) -> None:
    """MCP over this process's stdin/stdout. Connects to a running stack
    (`settings.nats_url`), or with `embedded` runs the whole stack in this process."""
    from services.gateway.auth import Principal
    from services.runtime import SERVICES, api_keys, build_runtime, start_consuming, stdio_mcp

    with _stdout_to_stderr():
        rt = await build_runtime(
            settings, SERVICES if embedded else ("gateway",), embedded_nats=embedded
        )
    gateway = rt.gateway
    try:
        if gateway is None:  # pragma: no cover - both service sets include the gateway
            raise RuntimeError("the gateway is not wired")
        with _stdout_to_stderr():
            await start_consuming(rt)
            await gateway.start()
            principal = Principal(org_id=settings.default_org)
            if api_key:
                principal = await api_keys(rt).resolve(f"Bearer {api_key}", None)
            server = stdio_mcp(rt, principal)
            logging.getLogger("kbmesh.mcp").info(
                "mcp_stdio_ready nats=%s embedded=%s toolsets=%s org_id=%s",
                rt.bus.url,
                embedded,
                ",".join(settings.toolsets),
                principal.org_id,
            )
        await server.run_stdio_async()
    finally:
        if gateway is not None:
            await gateway.stop()
        await rt.close()


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """stdout is the protocol channel: while starting up, anything a library prints goes to
    stderr instead (the SDK diverts it the same way while serving)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


@contextlib.asynccontextmanager
async def _cli_bus(settings: Settings) -> AsyncIterator[Bus]:
    """A bus for one-off commands: KBMESH_NATS_URL, else the URL a running `kbmesh up`
    recorded in its data directory, else the data directory's store opened directly."""
    from services.common.bus import Bus
    from services.common.natsproc import NatsServer
    from services.common.telemetry import configure_telemetry

    nats_server = None
    url = settings.nats_url
    recorded = settings.data_dir / "nats.url"
    if not url:
        url = recorded.read_text().strip() if recorded.exists() else None
        if url and not _reachable(url):
            url = None
        if not url:
            nats_server = NatsServer(settings.data_dir / "nats").start()
            url = nats_server.url
    bus = Bus(settings, url, configure_telemetry("kbmesh-cli"))
    try:
        await bus.connect()
        yield bus
    finally:
        await bus.close()
        if nats_server:
            nats_server.stop()


async def _create_key(args: argparse.Namespace) -> None:
    from services.common.ids import check_id
    from services.common.registry import Registries
    from services.gateway.auth import KeyResolver

    settings = _settings(args)
    check_id(args.org, "--org")
    async with _cli_bus(settings) as bus:
        registries = await Registries.open(bus.js)
        token = await KeyResolver(registries.keys, settings.default_org).create(
            args.org, args.name, args.kbs, args.read_only
        )
        await registries.close()
        print(token)


async def _dlq(args: argparse.Namespace) -> int:
    import json

    from services.common.deadletters import get_dead_letter, list_dead_letters, replay

    async with _cli_bus(_settings(args)) as bus:
        if args.dlq_command == "list":
            for letter in await list_dead_letters(bus.js, args.subject, args.limit):
                print(json.dumps(letter.summary()))
            return 0
        if args.all:
            letters = await list_dead_letters(bus.js, args.subject, limit=1_000_000)
        else:
            found = [await get_dead_letter(bus.js, seq) for seq in args.sequences]
            missing = [seq for seq, letter in zip(args.sequences, found, strict=True) if not letter]
            if missing:
                print(f"no dead letter with sequence {missing}", file=sys.stderr)
                return 1
            letters = [letter for letter in found if letter is not None]
        for letter in letters:
            await replay(bus.js, letter)
            print(json.dumps({"replayed": letter.sequence, "subject": letter.subject}))
        return 0


def _contracts(command: str, root: Path) -> int:
    from services.contracts.export import build, drift, export

    contracts = build()
    if command == "export":
        changes = export(root, contracts)
        for line in changes:
            kind, path = line.split(" ", 1)
            print(f"  {'removed' if kind == 'stale' else 'wrote'} {root / path}")
        print(f"{root}: {len(changes)} file(s) changed" if changes else f"{root}: up to date")
    else:
        changes = drift(root, contracts)
        if changes:
            print(f"{root} differs from the code; run `make contracts`:", file=sys.stderr)
        for line in changes:
            print(f"  {line}", file=sys.stderr)
    for gap in contracts.missing:
        print(f"  no contract example: {gap} (services/contracts/examples.py)", file=sys.stderr)
    return 1 if command == "check" and (changes or contracts.missing) else 0


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
