"""`kbmesh status`, `kbmesh search` and `kbmesh kb list|create|delete`: clients of a running
kbmesh's REST API, for people at a terminal and for scripts (`--json`).

The API is `--api`, else KBMESH_API_URL, else http://127.0.0.1:$KBMESH_PORT (8080); the key
is KBMESH_API_KEY, else the token `kbmesh login` stored for that API. Errors name the URL and
the server's reason; the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import httpx

from services.cli.ingest import default_api
from services.cli.login import credential

EXIT_ERROR = 1
MODES = ("hybrid", "dense", "keyword")


class ApiFailure(Exception):
    """The API could not be reached, or refused the call; the message says which and why."""


class Api:
    def __init__(self, url: str, key: str | None) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=60.0)

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            r = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as err:
            raise ApiFailure(
                f"cannot reach kbmesh at {self.url} ({err.__class__.__name__}: {err}); is "
                "`kbmesh up` running there? (--api, KBMESH_API_URL)"
            ) from err
        if r.status_code >= 400:
            try:
                body = r.json()
                reason = body.get("detail") or body.get("title") or r.text
            except ValueError:
                reason = r.text
            raise ApiFailure(f"{method} {self.url}{path}: HTTP {r.status_code}: {reason}")
        return r.json() if r.content else None


def add_parsers(sub: Any) -> None:
    """Register the commands on the CLI's subparsers."""
    status = sub.add_parser(
        "status",
        help="a running stack's health, its knowledge bases with document and chunk counts, "
        "and its dead letters",
    )
    api_command(status, _status)

    search = sub.add_parser("search", help="search knowledge bases of a running stack")
    search.add_argument("query", help="what to look for, in plain words")
    search.add_argument(
        "--kb",
        action="append",
        dest="kbs",
        metavar="KB",
        help="a knowledge base name or id to search (repeat; default: every KB you may read)",
    )
    search.add_argument("--mode", choices=MODES, default="hybrid", help="default hybrid")
    search.add_argument("--top-k", type=int, default=5, help="how many hits (default 5)")
    api_command(search, _search)

    kb = sub.add_parser("kb", help="knowledge bases of a running stack: list, create, delete")
    kb_sub = kb.add_subparsers(dest="kb_command", required=True)
    api_command(kb_sub.add_parser("list", help="every knowledge base with its counts"), _kb_list)
    create = kb_sub.add_parser(
        "create", help="a new knowledge base; unnamed settings take the server's defaults"
    )
    create.add_argument("name", help="unique in your org")
    create.add_argument("--description", help="what it holds (agents read it)")
    create.add_argument(
        "--tags", help="comma-separated: documents with any of these tags belong to it"
    )
    create.add_argument("--chunk-size", type=int, help="tokens per chunk (server default)")
    create.add_argument("--embedding-model", help="a LiteLLM model id (server default: local)")
    api_command(create, _kb_create)
    delete = kb_sub.add_parser("delete", help="delete a knowledge base and its index")
    delete.add_argument("kb", help="name or id")
    api_command(delete, _kb_delete)


def api_command(p: argparse.ArgumentParser, run: Callable[[Api, argparse.Namespace], Any]) -> None:
    """Make `p` a command over the REST API: `--api`, `--json`, and `run` as what it does."""
    p.add_argument(
        "--api",
        default=default_api(),
        help="the kbmesh REST API (KBMESH_API_URL; default http://127.0.0.1:$KBMESH_PORT); "
        "the key comes from KBMESH_API_KEY, else `kbmesh login`",
    )
    p.add_argument("--json", action="store_true", help="print the API's JSON answer")
    p.set_defaults(api_run=run)


def run(args: argparse.Namespace) -> int:
    """Entry point from the CLI: returns the exit status."""
    api = Api(args.api, credential(args.api))
    try:
        result = args.api_run(api, args)
    except ApiFailure as err:
        print(f"kbmesh {args.command}: {err}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


def _kbs(api: Api) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    while True:
        page = api.call("GET", "/v1/kbs", params={"skip": len(items), "limit": 200})
        items += page["items"]
        if len(items) >= page["total"] or not page["items"]:
            return items


def print_table(rows: list[list[str]], header: list[str]) -> None:
    """`rows` under `header`, in columns as wide as their widest cell."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def _status(api: Api, args: argparse.Namespace) -> dict[str, Any]:
    try:
        ready = api.call("GET", "/readyz")
    except ApiFailure as err:
        if "HTTP 503" not in str(err):
            raise
        ready = {"status": "starting"}
    kbs = _kbs(api)
    dead = api.call("GET", "/v1/dead-letters", params={"limit": 1})["total"]
    result = {"api": api.url, "health": ready, "knowledge_bases": kbs, "dead_letters": dead}
    if not args.json:
        print(f"kbmesh at {api.url}: {ready.get('status')}")
        rows = [
            [k["name"], k["status"], str(k["document_count"]), str(k["chunk_count"]), k["kb_id"]]
            for k in kbs
        ]
        print_table(rows, ["KNOWLEDGE BASE", "STATUS", "DOCUMENTS", "CHUNKS", "ID"])
        print(f"dead letters: {dead}" + (" (`kbmesh dlq list` shows them)" if dead else ""))
    return result


def _search(api: Api, args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"query": args.query, "mode": args.mode, "top_k": args.top_k}
    if args.kbs:
        body["kb_ids"] = args.kbs
    result: dict[str, Any] = api.call("POST", "/v1/search", json=body)
    if not args.json:
        if not result["hits"]:
            print("no hits")
        for n, hit in enumerate(result["hits"], 1):
            text = " ".join(hit["content"].split())
            print(f"{n}. {hit['document_name']}  (score {hit['score']:.3f}, {hit['kb_id']})")
            print(f"   {text[:300]}{'…' if len(text) > 300 else ''}")
    return result


def _kb_list(api: Api, args: argparse.Namespace) -> list[dict[str, Any]]:
    kbs = _kbs(api)
    if not args.json:
        rows = [
            [k["name"], str(k["document_count"]), str(k["chunk_count"]), k["embedding_model"]]
            for k in kbs
        ]
        print_table(rows, ["NAME", "DOCUMENTS", "CHUNKS", "EMBEDDING MODEL"])
    return kbs


def _kb_create(api: Api, args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"name": args.name}
    if args.description:
        body["description"] = args.description
    if args.tags:
        body["tag_ids"] = [t.strip() for t in args.tags.split(",") if t.strip()]
    if args.chunk_size is not None:
        body["chunk_size"] = args.chunk_size
    if args.embedding_model:
        body["embedding_model"] = args.embedding_model
    kb: dict[str, Any] = api.call("POST", "/v1/kbs", json=body)
    if not args.json:
        print(
            f"created {kb['name']} ({kb['kb_id']}): chunk size {kb['chunk_size']}, "
            f"{kb['embedding_model']}"
        )
    return kb


def _kb_delete(api: Api, args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = api.call("DELETE", f"/v1/kbs/{args.kb}")
    if not args.json:
        print(f"deleted {args.kb}")
    return result
