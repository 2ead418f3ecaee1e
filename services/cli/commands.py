"""The `kbmesh` command: up, serve, keys, mcp, ingest, mock, contracts, dlq, audit."""

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
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from services.common.settings import RETIRED, ClientSettings, unread_variables

if TYPE_CHECKING:
    from services.common.bus.client import Bus
    from services.common.settings import Settings

# Nothing downloads at run time: the model ships in a package, litellm's cost map too.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class _Parser(argparse.ArgumentParser):
    """No abbreviated options: `--api` must never be taken for `--api-key`. Subcommands'
    parsers are of this class too (argparse makes them of the parent's class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


# What `add_subparsers` returns; each `_add_<command>` adds its command (and subcommands) to it.
_Subparsers: TypeAlias = "argparse._SubParsersAction[_Parser]"


def build_parser() -> argparse.ArgumentParser:
    """Every command and option of `kbmesh` (the docs' client configurations are checked
    against it), in the order `kbmesh --help` lists them."""
    from services.cli.api import add_parsers as add_api_parsers
    from services.cli.ingest import add_parser as add_ingest_parser
    from services.cli.sources import add_parsers as add_sources_parsers

    parser = _Parser(prog="kbmesh", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (
        _add_up,
        _add_serve,
        _add_keys,
        _add_mcp,
        add_ingest_parser,
        add_api_parsers,
        add_sources_parsers,
        _add_login,
        _add_mock,
        _add_contracts,
        _add_dlq,
        _add_backup,
        _add_restore,
        _add_audit,
        _add_publishers,
        _add_bus,
    ):
        add(sub)
    return parser


def _add_up(sub: _Subparsers) -> None:
    """`kbmesh up`: the whole stack in one process."""
    up = sub.add_parser("up", help="everything in one process: private NATS, embedded Qdrant")
    _server_args(up)


def _add_serve(sub: _Subparsers) -> None:
    """`kbmesh serve`: chosen services against a shared NATS."""
    serve = sub.add_parser("serve", help="the named services, against KBMESH_NATS_URL")
    serve.add_argument(
        "services", nargs="+", metavar="SERVICE", help="ingest, embed, search, gateway"
    )
    _server_args(serve)


def _add_keys(sub: _Subparsers) -> None:
    """`kbmesh keys`: create, list and revoke API keys."""
    keys = sub.add_parser("keys", help="API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="create a key and print it once")
    create.add_argument("--org", required=True, help="the org the key acts for")
    create.add_argument("--name", default="", help="who or what holds it (shown in the audit)")
    create.add_argument("--kb", action="append", dest="kbs", help="limit to this KB id (repeat)")
    create.add_argument("--read-only", action="store_true", help="search and read only")
    keys_list = keys_sub.add_parser(
        "list", help="one JSON line per key: id, org, name, scope (never the key itself)"
    )
    keys_list.add_argument("--org", help="only this org's keys")
    revoke = keys_sub.add_parser("revoke", help="delete a key: requests with it are refused")
    revoke.add_argument("key", help="the key's id (as `keys list` shows) or its unique name")
    for p in (create, keys_list, revoke):
        p.add_argument("--data-dir", type=Path, help="default ./.kbmesh (KBMESH_DATA_DIR)")


def _add_mcp(sub: _Subparsers) -> None:
    """`kbmesh mcp`: MCP over stdio, joined to a stack, embedded, or relayed over HTTP."""
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
        "--api",
        metavar="URL",
        help="relay to the kbmesh REST/MCP server at URL over HTTP (a stack on another "
        "machine; the key comes from --api-key / KBMESH_API_KEY) instead of joining its NATS",
    )
    mcp.add_argument(
        "--api-key",
        default=ClientSettings().api_key,
        help="run as this API key's org and scope (KBMESH_API_KEY); "
        "default: the default org, unscoped",
    )


def _add_login(sub: _Subparsers) -> None:
    """`kbmesh login` / `logout`: a token from the identity provider for the REST commands."""
    from services.cli.login import add_parsers

    add_parsers(sub, ClientSettings().api)


def _add_mock(sub: _Subparsers) -> None:
    """`kbmesh mock`: the contract examples served without NATS or a model."""
    mock = sub.add_parser(
        "mock", help="serve the contract examples (REST, /api/v1/tools, MCP); no NATS, no model"
    )
    mock.add_argument("--port", type=int, default=8080, help="default 8080")
    mock.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1")
    mock.add_argument("--toolsets", default="core,compat", help="core, compat or core,compat")


def _add_contracts(sub: _Subparsers) -> None:
    """`kbmesh contracts`: export or check the JSON Schemas and examples."""
    contracts = sub.add_parser("contracts", help="the JSON Schemas and examples in contracts/")
    contracts_sub = contracts.add_subparsers(dest="contracts_command", required=True)
    for name, text in (
        ("export", "write contracts/ from the code"),
        ("check", "exit 1 when contracts/ differs from the code"),
    ):
        contracts_sub.add_parser(name, help=text).add_argument(
            "--dir", type=Path, default=Path("contracts"), help="default ./contracts"
        )


def _add_dlq(sub: _Subparsers) -> None:
    """`kbmesh dlq`: list, replay and discard dead letters."""
    dlq = sub.add_parser("dlq", help="dead letters: list them, replay them, discard them")
    dlq_sub = dlq.add_subparsers(dest="dlq_command", required=True)
    dlq_list = dlq_sub.add_parser("list", help="one JSON line per dead letter, oldest first")
    dlq_list.add_argument("--limit", type=int, default=100, help="at most this many (100)")
    dlq_list.add_argument(
        "--after", type=int, default=0, metavar="SEQUENCE", help="only those after this one"
    )
    dlq_replay = dlq_sub.add_parser(
        "replay", help="republish to the original subject and remove the dead letter"
    )
    dlq_discard = dlq_sub.add_parser(
        "discard", help="remove dead letters without replaying them (their cause is known)"
    )
    for p in (dlq_replay, dlq_discard):
        p.add_argument(
            "sequences", nargs="*", type=int, metavar="SEQUENCE", help="as `dlq list` shows"
        )
        p.add_argument("--all", action="store_true", help="every dead letter (of --subject)")
    for p in (dlq_list, dlq_replay, dlq_discard):
        p.add_argument("--subject", help="only dead letters of this original subject")
        p.add_argument("--org", help="only dead letters of this org")
        p.add_argument("--data-dir", type=Path, help="default ./.kbmesh (KBMESH_DATA_DIR)")


def _add_backup(sub: _Subparsers) -> None:
    """`kbmesh backup`: an archive of a running stack."""
    backup = sub.add_parser(
        "backup",
        help="write an archive of a running stack (KBs, keys, prompts, documents and their "
        "texts, the vectors, the audit trail) without stopping it; protect it like the key store",
    )
    backup.add_argument("file", type=Path, help="the archive to write (.tar.gz)")
    backup.add_argument(
        "--data-dir", type=Path, help="where `kbmesh up` runs (default ./.kbmesh, KBMESH_DATA_DIR)"
    )


def _add_restore(sub: _Subparsers) -> None:
    """`kbmesh restore`: a new data dir from an archive."""
    restore = sub.add_parser(
        "restore",
        help="make a new data dir from an archive, its vectors loaded, for `kbmesh up` to serve; "
        "or, with --nats-url and --qdrant-url, fill a new deployment's servers with it",
    )
    restore.add_argument("file", type=Path, help="an archive written by `kbmesh backup`")
    restore.add_argument(
        "--data-dir", type=Path, help="the new data dir (must not exist or be empty)"
    )
    restore.add_argument(
        "--nats-url",
        help="instead of a data dir: the NATS server or cluster (comma-separated URLs) of a new "
        "deployment, reached as its operator's user (KBMESH_NATS__USER, KBMESH_NATS__PASSWORD)",
    )
    restore.add_argument(
        "--qdrant-url",
        help="with --nats-url: the deployment's Qdrant server (KBMESH_QDRANT_API_KEY its key)",
    )
    restore.add_argument(
        "--with-keys",
        action="store_true",
        help="restore the archive's API keys too (without: the new stack has none, and serves "
        "loopback clients keyless until `kbmesh keys create`)",
    )
    restore.add_argument(
        "--with-prompts", action="store_true", help="restore the archive's stored prompts too"
    )
    restore.add_argument(
        "--reembed",
        action="store_true",
        help="leave the archive's vectors and embed every document again (KBs whose vectors "
        "were built with other settings, or archives without vectors, are embedded anyway)",
    )


def _add_audit(sub: _Subparsers) -> None:
    """`kbmesh audit`: an org's audit trail, filtered."""
    audit = sub.add_parser(
        "audit", help="the audit trail of an org: one JSON line per entry, oldest first"
    )
    audit.add_argument("--org", help="default: the default org (KBMESH_DEFAULT_ORG)")
    audit.add_argument("--writer", help="an API key's id or name, a publisher, local, bus")
    audit.add_argument("--kind", choices=["document", "kb", "key", "backup"], help="what changed")
    audit.add_argument(
        "--action",
        choices=["uploaded", "changed", "deleted", "created", "failed", "restored"],
        help="how it changed",
    )
    audit.add_argument("--document", dest="document_id", help="entries about this document")
    audit.add_argument("--kb", dest="kb_id", help="entries about this KB id")
    audit.add_argument("--since", type=_timestamp, help="ISO 8601, e.g. 2026-11-26T22:00Z")
    audit.add_argument("--until", type=_timestamp, help="ISO 8601")
    audit.add_argument("--limit", type=int, default=100, help="at most this many, 1-1000 (100)")
    audit.add_argument("--data-dir", type=Path, help="default ./.kbmesh (KBMESH_DATA_DIR)")


def _add_publishers(sub: _Subparsers) -> None:
    """`kbmesh publishers`: NATS credentials for upstream systems."""
    publishers = sub.add_parser(
        "publishers", help="NATS credentials for upstream systems, each bound to one org"
    )
    publishers_sub = publishers.add_subparsers(dest="publishers_command", required=True)
    pub_add = publishers_sub.add_parser(
        "add", help="create a publisher and print its connection settings once (JSON)"
    )
    pub_add.add_argument("name", metavar="NAME", help="the publisher's NATS user name")
    pub_add.add_argument("--org", required=True, help="the only org it may write")
    publishers_sub.add_parser("list", help="one JSON line per publisher (no passwords)")
    pub_revoke = publishers_sub.add_parser(
        "revoke", help="remove a publisher; its open connections are closed"
    )
    pub_revoke.add_argument("name", metavar="NAME", help="the publisher to remove")
    for p in publishers_sub.choices.values():
        p.add_argument("--data-dir", type=Path, help="default ./.kbmesh (KBMESH_DATA_DIR)")


def _add_bus(sub: _Subparsers) -> None:
    """`kbmesh bus`: NATS accounts for deployments."""
    bus = sub.add_parser("bus", help="NATS users and permissions for deployments")
    bus_sub = bus.add_subparsers(dest="bus_command", required=True)
    bus_config = bus_sub.add_parser(
        "config",
        help="print nats-server's accounts for deploy/ (deploy/nats/auth.conf), passwords "
        "read from the server's environment",
    )
    bus_config.add_argument(
        "--publisher",
        action="append",
        default=[],
        metavar="NAME:ORG",
        help="an upstream publisher bound to ORG (repeat); its password: NATS_PASSWORD_<NAME>",
    )
    bus_config.add_argument(
        "--helm",
        action="store_true",
        help="print the accounts as YAML for the NATS Helm chart's config.merge.accounts "
        "(deploy/kubernetes/helm/nats-values.yaml)",
    )
    bus_setup = bus_sub.add_parser(
        "setup",
        help="create or update kbmesh's streams, buckets, object store and durable consumers, "
        "as the operator's NATS user (services may not): before `kbmesh serve` starts, and "
        "after every upgrade or change of KBMESH_BUS__* settings",
    )
    bus_setup.add_argument("--data-dir", type=Path, help="default ./.kbmesh (KBMESH_DATA_DIR)")


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command not in ("contracts", "mock") and getattr(args, "bus_command", None) != "config":
        # Everything kbmesh writes in its data directory (NATS store, shards, credentials,
        # model exports) is its owner's only.
        os.umask(0o077)
    logging.basicConfig(
        level=ClientSettings().log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    for noisy in ("httpx", "LiteLLM", "litellm", "sentence_transformers", "kbmesh.faststream"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for name in unread_variables(os.environ):
        # Ignored by the settings: said once, so that no value seems to apply that does not
        # (retired ones are listed in docs/operations.md, "Upgrades"; unknown ones misspelt).
        reason = "retired" if name in RETIRED else "unknown"
        logging.getLogger("kbmesh").warning("setting_not_read variable=%s reason=%s", name, reason)
    if args.command in ("up", "serve"):
        from services.common.bus.auth import BusNotSetUp

        try:
            services = None if args.command == "up" else args.services
            _run_server(_serve(_settings(args), services, embedded=args.command == "up"))
        except BusNotSetUp as err:  # the operator's to fix, not a crash
            sys.exit(f"kbmesh {args.command}: {err}")
    elif args.command == "keys":
        sys.exit(asyncio.run(_keys(args)))
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
        if args.dlq_command != "list" and not (args.all or args.sequences):
            parser.error(f"dlq {args.dlq_command} needs sequence numbers or --all")
        sys.exit(asyncio.run(_dlq(args)))
    elif args.command == "contracts":
        sys.exit(_contracts(args.contracts_command, args.dir))
    elif args.command in ("status", "search", "kb"):
        from services.cli.api import run as run_api

        sys.exit(run_api(args))
    elif args.command == "sources":
        from services.cli.sources import run as run_sources

        sys.exit(run_sources(args))
    elif args.command in ("login", "logout"):
        from services.cli.login import run as run_login

        sys.exit(run_login(args))
    elif args.command in ("backup", "restore"):
        onto_servers = args.command == "restore" and (args.nats_url or args.qdrant_url)
        if args.command == "restore" and (
            bool(args.data_dir) == bool(onto_servers)
            or (onto_servers and not (args.nats_url and args.qdrant_url))
        ):
            parser.error(
                "restore needs --data-dir (a new data dir), or --nats-url and --qdrant-url "
                "(a new deployment's servers)"
            )
        sys.exit(asyncio.run(_backup_or_restore(args)))
    elif args.command == "audit":
        if not 1 <= args.limit <= 1000:
            parser.error("--limit must be 1-1000")
        asyncio.run(_audit(args))
    elif args.command == "publishers":
        sys.exit(_publishers(args))
    elif args.command == "bus" and args.bus_command == "setup":
        sys.exit(asyncio.run(_bus_setup(_settings(args))))
    elif args.command == "bus":
        sys.exit(_bus_config(args.publisher, helm=args.helm))
    elif args.command == "ingest":
        from services.cli.ingest import run as run_ingest

        sys.exit(run_ingest(args))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kbmesh")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


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

    from services.cli.runtime import (
        SERVICES,
        Runtime,
        build_runtime,
        check_services,
        gateway_app,
        start_consuming,
    )
    from services.common.bus.auth import BusNotSetUp

    if not embedded and not settings.nats_url:
        sys.exit("kbmesh serve needs KBMESH_NATS_URL (or use `kbmesh up`)")
    names = check_services(list(SERVICES) if services is None else services, settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    rt: Runtime | None = None
    front = None
    server = None
    tasks: list[asyncio.Task[None]] = []
    if "gateway" in names:
        from services.gateway.bodylimit import largest_body_bytes
        from services.gateway.server import server_config
        from services.gateway.starting import StartingGateway

        # HTTP from the first moment: the probes answer (liveness ok, readiness "starting")
        # while the start below waits out a NATS failover.
        front = StartingGateway(names)
        config = server_config(
            front,
            settings.host,
            settings.port,
            settings.http,
            max_body_bytes=largest_body_bytes(settings),
        )
        server = uvicorn.Server(config)
        tasks.append(asyncio.create_task(server.serve()))
        base = f"http://{settings.host}:{settings.port}"
        print(f"kbmesh {' '.join(names)}", flush=True)
        print(f"  console  {base}/", flush=True)
        print(f"  REST     {base}/v1", flush=True)
        print(f"  docs     {base}/docs", flush=True)
        print(f"  MCP      {base}/mcp", flush=True)
        print(f"  ready    {base}/readyz", flush=True)

    async def start() -> None:
        nonlocal rt
        try:
            rt = await build_runtime(settings, names, embedded_nats=embedded)
        except SystemExit as refused:
            # A setting or data dir refused before anything opened: end as a failed start,
            # so that the HTTP side stops in order (SystemExit would escape the loop).
            raise RuntimeError(str(refused.code).removeprefix("kbmesh: ")) from None
        print(f"kbmesh {' '.join(rt.services)} on {rt.bus.url}", flush=True)
        if front is not None:
            await front.open(gateway_app(rt))
        await start_consuming(rt)
        print(f"kbmesh {' '.join(rt.services)} ready", flush=True)

    failure: BaseException | None = None
    starting = asyncio.create_task(start())
    try:
        # A failed start (model load, NATS refusing us or away past the start deadline)
        # ends the process non-zero instead of idling.
        waiters = [asyncio.create_task(stop.wait()), starting, *tasks]
        while True:
            done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            if starting in done and starting.exception() is None and len(done) == 1:
                waiters.remove(starting)  # started: keep serving
                _freeze_heap()
                continue
            break
        if starting.done() and not starting.cancelled() and starting.exception() is not None:
            failure = starting.exception()
        starting.cancel()
        with contextlib.suppress(BaseException):
            await starting
        if server is not None:
            if rt is not None and rt.gateway is not None:
                rt.gateway.progress.close_streams()  # open event streams: the server waits
            server.should_exit = True
            with contextlib.suppress(Exception):
                await tasks[0]
    finally:
        if rt is not None:
            await rt.close()
        print("kbmesh stopped", flush=True)
    if isinstance(failure, BusNotSetUp):
        raise failure
    if failure is not None:
        sys.exit(f"kbmesh failed to start: {failure or repr(failure)}")


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

    if args.api:
        if args.embedded or args.toolsets:
            sys.exit(
                "kbmesh mcp --api: the remote stack runs the tools; drop --embedded/--toolsets"
            )
        from services.cli.mcp import relay

        await relay(args.api, args.api_key)
        return

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
    # A running `kbmesh up` records its URL (and its users) in its data directory.
    recorded = settings.data_dir / "nats.url"
    url = recorded.read_text().strip() if recorded.exists() else None
    if not args.embedded and not settings.nats.user:
        _use_recorded_user(settings, "gateway")
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
    from services.cli.runtime import SERVICES, api_keys, build_runtime, start_consuming, stdio_mcp
    from services.gateway.auth import Principal

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
async def _cli_bus(settings: Settings, *, administer: bool = False) -> AsyncIterator[Bus]:
    """A bus for one-off commands: KBMESH_NATS_URL, else the URL a running `kbmesh up`
    recorded in its data directory, else the data directory's store opened directly.

    The topology is set up (as the operator) with `administer`, on a store opened here, and
    on a NATS without authorization (no KBMESH_NATS__USER); else it is only checked."""
    from services.cli.runtime import start_private_nats
    from services.common.bus.client import Bus
    from services.common.ops.telemetry import configure_telemetry

    nats_server = None
    url = settings.nats_url
    recorded = settings.data_dir / "nats.url"
    if not url:
        url = recorded.read_text().strip() if recorded.exists() else None
        if url and not _reachable(url):
            url = None
        if not url:
            from services.cli.runtime import check_data_dir

            check_data_dir(settings.data_dir)
            nats_server = start_private_nats(settings.data_dir)
            url = nats_server.url
        if not settings.nats.user:
            _use_recorded_user(settings, "operator")
    administer = administer or nats_server is not None or not settings.nats.user
    bus = Bus(
        url,
        configure_telemetry("kbmesh-cli"),
        rules=settings.bus,
        auth=settings.nats,
        audit=settings.audit,
    )
    try:
        await bus.connect(administer=administer)
        yield bus
    finally:
        await bus.close()
        if nats_server:
            nats_server.stop()


# What `kbmesh backup` and `restore` count, as they print it.
_ARCHIVE_COUNTS = {
    "kbs": "KBs",
    "documents": "documents",
    "objects": "objects",
    "vectors": "chunk vectors",
    "keys": "API keys",
    "prompts": "prompts",
    "audit": "audit entries",
    "events": "pending uploads",
}


def _counted(counts: dict[str, int]) -> str:
    return ", ".join(f"{counts.get(k, 0)} {label}" for k, label in _ARCHIVE_COUNTS.items())


async def _backup_or_restore(args: argparse.Namespace) -> int:
    from services.cli.backup import BackupError, backup, member_limit, restore
    from services.common.settings import Settings
    from services.common.store import create_store

    try:
        if args.command == "backup":
            settings = _settings(args)
            async with _cli_bus(settings) as bus:
                manifest = await backup(
                    bus,
                    args.file,
                    limit=member_limit(settings),
                    # With the stack stopped, its store is read here.
                    open_store=lambda: create_store(settings),
                )
            print(f"wrote {args.file}: {_counted(manifest.counts)}")
            for kb_id, reason in manifest.vectors_left_out.items():
                print(f"  vectors of KB {kb_id} not in the archive ({reason}): a restore embeds it")
            skipped = manifest.skipped_documents
        else:
            # Onto servers: the rest of the settings (the operator's NATS user, the bus's
            # replicas, the models) as the deployment's own processes read them.
            onto = (
                Settings(nats_url=args.nats_url, qdrant_url=args.qdrant_url)
                if args.nats_url
                else None
            )
            restored = await restore(
                args.file,
                args.data_dir,
                onto=onto,
                with_keys=args.with_keys,
                with_prompts=args.with_prompts,
                reembed=args.reembed,
            )
            where = args.data_dir or f"NATS at {args.nats_url} and Qdrant at {args.qdrant_url}"
            # What was written, counted as it was written: not what the archive claims.
            print(f"restored {args.file} into {where}: {_counted(restored.counts)}")
            for kb_id, reason in restored.reembedded.items():
                print(f"  embedded again: KB {kb_id} ({reason})")
            if restored.stale_documents:
                print(
                    f"  embedded again: {restored.stale_documents} documents that changed while "
                    "the backup ran"
                )
            left = restored.left_out
            if left:
                flags = {"keys": "--with-keys", "prompts": "--with-prompts"}
                print(
                    "  not restored: "
                    + ", ".join(f"{n} {_ARCHIVE_COUNTS[k]} ({flags[k]})" for k, n in left.items())
                )
            if left.get("keys"):
                print(
                    "  the restored stack has no API key: it serves loopback clients without "
                    "one until `kbmesh keys create` makes one"
                )
            if onto is None:
                print(f"start it with `kbmesh up --data-dir {args.data_dir}`")
            else:
                print("start the deployment's services on these servers")
            skipped = restored.skipped_documents
    except BackupError as err:
        print(f"kbmesh {args.command}: {err}", file=sys.stderr)
        return 1
    for key in skipped:
        print(f"  not in the archive (still being extracted): {key}", file=sys.stderr)
    return 0


def _use_recorded_user(settings: Settings, role: str) -> None:
    """Connect as `role` with the credentials a `kbmesh up` on the data directory made."""
    from services.common.bus.auth import recorded_credentials

    found = recorded_credentials(settings.data_dir, role)
    if found is not None:
        settings.nats.user, settings.nats.password = found.user, found.password


async def _bus_setup(settings: Settings) -> int:
    from services.common.bus.auth import DURABLE_CONSUMERS, BusNotSetUp

    try:
        async with _cli_bus(settings, administer=True) as bus:
            print(
                f"kbmesh bus setup: streams, buckets, object store and "
                f"{len(DURABLE_CONSUMERS)} durable consumers ready on {bus.url}"
            )
    except PermissionError as err:
        print(
            f"kbmesh bus setup: this NATS user may not set up the bus (run it as the "
            f"operator's user): {err}",
            file=sys.stderr,
        )
        return 1
    except BusNotSetUp as err:
        print(f"kbmesh bus setup: {err}", file=sys.stderr)
        return 1
    return 0


def _bus_config(publishers: list[str], *, helm: bool = False) -> int:
    from services.common.bus.auth import (
        Publisher,
        check_publisher_name,
        deploy_conf,
        deploy_helm_accounts,
    )
    from services.common.domain.errors import InvalidInput
    from services.common.domain.ids import check_id

    chosen = []
    for spec in publishers:
        name, _, org = spec.partition(":")
        try:
            chosen.append(Publisher(check_publisher_name(name), check_id(org, "ORG")))
        except InvalidInput as err:
            print(f"kbmesh bus config: {err} (--publisher NAME:ORG)", file=sys.stderr)
            return 2
    print((deploy_helm_accounts if helm else deploy_conf)(chosen), end="")
    return 0


def _publishers(args: argparse.Namespace) -> int:
    import json

    from services.common.bus import auth as busauth
    from services.common.bus.nats_server import ReloadRefused, reload_running
    from services.common.domain.errors import InvalidInput

    command = f"kbmesh publishers {args.publishers_command}"
    data_dir = _settings(args).data_dir
    if args.publishers_command == "list":
        for record in busauth.load_publishers(data_dir):
            print(json.dumps(record.summary()))
        return 0
    from services.cli.runtime import prepare_data_dir

    prepare_data_dir(data_dir)
    adding = args.publishers_command == "add"
    if adding:
        try:
            record = busauth.add_publisher(data_dir, args.name, args.org)
        except InvalidInput as err:
            print(f"{command}: {err}", file=sys.stderr)
            return 2
        except ValueError as err:
            print(f"{command}: {err}", file=sys.stderr)
            return 1
    else:
        found = busauth.revoke_publisher(data_dir, args.name)
        if found is None:
            print(f"{command}: no publisher named {args.name!r}", file=sys.stderr)
            return 1
        record = found
    # A running `kbmesh up` takes the change at once, proven by connecting with the
    # credentials (admitted once added, refused once revoked); a stopped one at its start.
    recorded = data_dir / "nats.url"
    url = recorded.read_text().strip() if recorded.exists() else None
    try:
        applied = reload_running(data_dir / "nats", busauth.local_accounts(data_dir))
        if applied and url:
            admitted = asyncio.run(busauth.admits(url, record.name, record.password))
            if admitted != adding:
                raise ReloadRefused(
                    "its credentials are " + ("refused" if adding else "still admitted")
                )
    except ReloadRefused as err:
        if adding:
            busauth.revoke_publisher(data_dir, record.name)
            with contextlib.suppress(ReloadRefused):
                reload_running(data_dir / "nats", busauth.local_accounts(data_dir))
            print(
                f"{command}: the running kbmesh did not take it ({err}); nothing was added",
                file=sys.stderr,
            )
        else:
            print(
                f"{command}: removed from {data_dir}, but the running kbmesh did not take it "
                f"({err}): {record.name!r} can connect until kbmesh restarts",
                file=sys.stderr,
            )
        return 1
    if adding:
        print(
            json.dumps(
                {
                    **record.summary(),
                    "user": record.name,
                    "password": record.password,
                    "url": url,
                    "publish": list(busauth.UPSTREAM_PUBLISH),
                    "subscribe": list(busauth.UPSTREAM_STATUS),
                    "applied": applied,
                }
            )
        )
    else:
        print(json.dumps({"revoked": record.name, "applied": applied}))
    if not applied:
        print(f"no running kbmesh on {data_dir}: applies at its next start", file=sys.stderr)
    return 0


async def _keys(args: argparse.Namespace) -> int:
    import json

    from services.common.bus.audit import sink as audit_sink
    from services.common.bus.registry import Registries
    from services.common.domain.errors import KbmeshError
    from services.common.domain.ids import check_id
    from services.gateway.auth import KeyResolver, key_id

    settings = _settings(args)
    if args.keys_command == "create":
        check_id(args.org, "--org")
    async with _cli_bus(settings) as bus:
        registries = await Registries.open(bus.js)
        resolver = KeyResolver(
            registries.keys, settings.default_org, audit=audit_sink(lambda: bus.js)
        )
        try:
            if args.keys_command == "create":
                print(await resolver.create(args.org, args.name, args.kbs, args.read_only))
            elif args.keys_command == "list":
                for k in await resolver.list(args.org):
                    view = {"key_id": key_id(k.key_hash), **k.model_dump(exclude={"key_hash"})}
                    print(json.dumps(view))
            else:
                record = await resolver.revoke(args.key)
                print(json.dumps({"revoked": key_id(record.key_hash), "name": record.name}))
        except KbmeshError as err:
            print(f"kbmesh keys {args.keys_command}: {err}", file=sys.stderr)
            return 1
        finally:
            await registries.close()
    return 0


def _timestamp(raw: str) -> datetime:
    try:
        value = datetime.fromisoformat(raw)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {raw!r}") from err
    return value if value.tzinfo else value.replace(tzinfo=UTC)  # naive: UTC


async def _audit(args: argparse.Namespace) -> None:
    from services.common.bus.audit import AuditQuery, read_audit
    from services.common.domain.ids import check_id

    settings = _settings(args)
    org = args.org or settings.default_org
    check_id(org, "--org")
    query = AuditQuery(
        writer=args.writer,
        kind=args.kind,
        action=args.action,
        document_id=args.document_id,
        kb_id=args.kb_id,
        since=args.since,
        until=args.until,
        limit=args.limit,
    )
    async with _cli_bus(settings) as bus:
        read = await read_audit(bus.js, org, query)
    for entry in read.entries:
        print(entry.model_dump_json())
    if read.skipped:
        print(
            f"{read.skipped} entries skipped: not audit entries, or not of org {org!r}",
            file=sys.stderr,
        )


async def _dlq(args: argparse.Namespace) -> int:
    import json

    from services.common.bus.deadletters import (
        discard,
        get_dead_letter,
        list_dead_letters,
        replay,
    )

    async with _cli_bus(_settings(args)) as bus:
        if args.dlq_command == "list":
            page = await list_dead_letters(
                bus.js, args.org, args.subject, after=args.after, limit=args.limit
            )
            for letter in page.letters:
                print(json.dumps(letter.summary()))
            return 0
        if args.all:
            sequences, after = [], 0
            while True:  # a page at a time: only headers are read to choose
                page = await list_dead_letters(bus.js, args.org, args.subject, after=after)
                sequences += [letter.sequence for letter in page.letters]
                if page.next is None:
                    break
                after = page.next
        else:
            sequences = args.sequences
            missing = [seq for seq in sequences if await get_dead_letter(bus.js, seq) is None]
            if missing:
                print(f"no dead letter with sequence {missing}", file=sys.stderr)
                return 1
        for seq in sequences:  # one body in memory at a time
            stored = await get_dead_letter(bus.js, seq)
            if stored is None:
                continue  # replayed or discarded meanwhile
            if args.dlq_command == "replay":
                await replay(bus.js, stored)
            else:
                await discard(bus.js, stored)
            done = "replayed" if args.dlq_command == "replay" else "discarded"
            print(json.dumps({done: stored.sequence, "subject": stored.subject}))
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
