"""`kbmesh sources add|list|show|sync|remove|apply`: the sources of a running kbmesh, over its
REST API like `kbmesh kb` (services/cli/api.py).

`apply FILE` makes a YAML file of sources true, so that sources live in git with the rest of
a platform's configuration:

    kbs: [handbook]          # the KBs this file manages (default: the KBs its sources feed)
    sources:
      - id: handbook-repo    # a stable id: how apply finds the source again
        kind: git
        kb: handbook
        url: https://github.com/acme/handbook.git
        branch: main
        include: ["docs/**"]
        token_env: HANDBOOK_TOKEN   # credentials are read from the environment, never the file

The file manages the KBs it names: a source of one of them that the file does not declare is
removed, with its documents, whoever created it (`--keep-undeclared` keeps such sources);
sources of other KBs are never touched. A declared source is created when missing, and
changed when a field differs from the file (a field left out means its default). Credentials
cannot be compared (the API never shows them): they are sent when a source is created, or
when it has none. Everything is checked before anything changes.

Exit status: 0 done (or, with `--dry-run`, planned); 1 the API refused or could not be
reached (changes printed before it stay made); 2 the file is invalid (nothing changed).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.cli.api import Api, ApiFailure, api_command, print_table
from services.common.domain.ids import ID_PATTERN
from services.common.domain.sources import SourceSpec

EXIT_INVALID = 2
# `sync --wait` reads the source's runs this often; a run takes seconds at least.
WAIT_POLL_SECONDS = 0.5
# The fields of a definition that `apply` compares (all of SourceSpec's).
SPEC_FIELDS = tuple(SourceSpec.model_fields)


class DeclaredSource(SourceSpec):
    """One entry of an apply file: a source's definition, its stable id, and where its
    credentials are in the environment."""

    id: str = Field(pattern=ID_PATTERN, description="a stable id: how apply finds it again")
    token_env: str | None = Field(None, description="git over https: the token's variable")
    ssh_key_env: str | None = Field(None, description="git over ssh: the key's variable")


class SourcesFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kbs: list[str] | None = Field(
        None, description="the KBs the file manages (default: the KBs its sources feed)"
    )
    sources: list[DeclaredSource] = Field(default_factory=list)


class InvalidFile(Exception):
    """The apply file cannot be read as sources; nothing was changed."""


def add_parsers(sub: Any) -> None:
    sources = sub.add_parser(
        "sources",
        help="git repositories and web sites kept in sync with knowledge bases: add, list, "
        "show, sync, remove, apply a YAML file",
    )
    sources_sub = sources.add_subparsers(dest="sources_command", required=True)

    add = sources_sub.add_parser("add", help="add a source; prints its webhook secret once")
    add.add_argument("kind", choices=("git", "web"), help="git: a repository; web: a site")
    add.add_argument("url", help="git: the remote (https, ssh, git://); web: the start URL")
    add.add_argument("--kb", required=True, help="the knowledge base it feeds (name or id)")
    add.add_argument("--id", dest="source_id", help="a stable id (default: generated)")
    add.add_argument("--name", help="a label (default: the url)")
    add.add_argument("--branch", help="git: branch or tag (default: the remote's HEAD)")
    add.add_argument("--sitemap", help="web: a sitemap.xml URL")
    add.add_argument("--max-pages", type=int, help="web: pages per run (default 2000)")
    add.add_argument("--include", action="append", default=[], metavar="GLOB", help="repeat")
    add.add_argument("--exclude", action="append", default=[], metavar="GLOB", help="repeat")
    add.add_argument("--tag", action="append", default=[], dest="tags", help="repeat")
    add.add_argument("--collection", help="the collection its documents are in")
    add.add_argument("--schedule", help="an interval (30m, 1h, 1d) or a cron expression")
    add.add_argument("--disabled", action="store_true", help="added with its schedule paused")
    add.add_argument(
        "--token-env", metavar="VAR", help="git over https: read the token from this variable"
    )
    add.add_argument(
        "--ssh-key-file", type=Path, help="git over ssh: read the private key from this file"
    )
    api_command(add, _add)

    listing = sources_sub.add_parser("list", help="every source with its last and next run")
    listing.add_argument("--kb", help="only the sources feeding this knowledge base")
    api_command(listing, _list)

    show = sources_sub.add_parser("show", help="one source with its run history")
    show.add_argument("source", help="id or name")
    api_command(show, _show)

    sync = sources_sub.add_parser("sync", help="run a source now")
    sync.add_argument("source", help="id or name")
    sync.add_argument(
        "--wait",
        action="store_true",
        help="return when the run ends: exit 0 if it succeeded, 1 (with its error) if not",
    )
    sync.add_argument(
        "--timeout", type=float, default=600.0, help="seconds --wait waits at most (600)"
    )
    api_command(sync, _sync)

    remove = sources_sub.add_parser("remove", help="remove a source and its documents")
    remove.add_argument("source", help="id or name")
    remove.add_argument(
        "--keep-documents", action="store_true", help="keep the documents it brought in"
    )
    api_command(remove, _remove)

    apply = sources_sub.add_parser(
        "apply",
        help="make a YAML file of sources true: create, change and remove sources of the "
        "KBs it names (exit 0 done, 1 API error, 2 invalid file)",
    )
    apply.add_argument("file", type=Path, help="the YAML file (`-`: standard input)")
    apply.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    apply.add_argument(
        "--keep-undeclared",
        action="store_true",
        help="keep sources of the managed KBs that the file does not declare",
    )
    api_command(apply, _apply)


def run(args: argparse.Namespace) -> int:
    """Entry point from the CLI: `apply` answers 2 for an invalid file, else like api.run."""
    from services.cli.api import run as run_api

    try:
        return run_api(args)
    except InvalidFile as err:
        print(f"kbmesh sources {args.sources_command}: {err}", file=sys.stderr)
        return EXIT_INVALID


# ---- add, list, show, sync, remove ----------------------------------------------------------


def _add(api: Api, args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"kind": args.kind, "url": args.url, "kb": args.kb}
    for name in ("source_id", "name", "branch", "sitemap", "max_pages", "collection", "schedule"):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    for name in ("include", "exclude", "tags"):
        if getattr(args, name):
            body[name] = getattr(args, name)
    if args.disabled:
        body["enabled"] = False
    if args.token_env:
        body["token"] = _environ(args.token_env)
    if args.ssh_key_file:
        body["ssh_key"] = args.ssh_key_file.read_text()
    made: dict[str, Any] = api.call("POST", "/v1/sources", json=body)
    if not args.json:
        print(f"added {made['name'] or made['url']} ({made['source_id']}) feeding {args.kb}")
        print(f"webhook: POST {api.url}{made['hook_path']}")
        print(f"webhook secret (shown once): {made['webhook_secret']}")
    return made


def _sources(api: Api, kb: str | None) -> list[dict[str, Any]]:
    params = {"kb": kb} if kb else {}
    items: list[dict[str, Any]] = api.call("GET", "/v1/sources", params=params)["items"]
    return items


def _list(api: Api, args: argparse.Namespace) -> list[dict[str, Any]]:
    found = _sources(api, args.kb)
    if not args.json:
        rows = [_row(s) for s in found]
        print_table(rows, ["ID", "KIND", "NAME", "LAST RUN", "COUNTS", "NEXT RUN", "ERROR"])
    return found


def _row(source: dict[str, Any]) -> list[str]:
    status = source["status"]
    last = status["last_run"]
    ran = f"{last['status']} {_when(last['finished_at'] or last['started_at'])}" if last else "-"
    counts = _counts(last) if last else "-"
    nxt = _when(status["next_run_at"]) if source["enabled"] else "paused"
    error = (last or {}).get("error") or ""
    name = source["name"] or source["url"]
    return [source["source_id"], source["kind"], name, ran, counts, nxt, error[:60]]


def _when(stamp: str | None) -> str:
    return stamp[:19].replace("T", " ") if stamp else "-"


def _counts(run: dict[str, Any]) -> str:
    keys = ("added", "changed", "unchanged", "deleted", "failed")
    return " ".join(f"{k[0]}{run[k]}" for k in keys)


def _show(api: Api, args: argparse.Namespace) -> dict[str, Any]:
    source: dict[str, Any] = api.call("GET", f"/v1/sources/{args.source}")
    if not args.json:
        for key in ("source_id", "kind", "name", "kb", "kb_id", "url", "branch", "schedule"):
            if source.get(key) is not None:
                print(f"{key}: {source[key]}")
        print(f"enabled: {source['enabled']}  credentials: {source['has_credentials']}")
        print(f"webhook: POST {api.url}{source['hook_path']}")
        status = source["status"]
        print(f"next run: {_when(status['next_run_at'])}")
        rows = [
            [
                r["run_id"][:12],
                r["trigger"],
                r["status"],
                _when(r["started_at"]),
                _counts(r),
                r.get("revision") or "",
                (r.get("error") or "")[:60],
            ]
            for r in reversed(status["runs"])
        ]
        print_table(rows, ["RUN", "TRIGGER", "STATUS", "STARTED", "COUNTS", "REVISION", "ERROR"])
    return source


def _sync(api: Api, args: argparse.Namespace) -> dict[str, Any]:
    # The runs already recorded: the one this sync asks for is none of them.
    before = {r["run_id"] for r in _runs(api, args.source)[1]} if args.wait else set()
    ack: dict[str, Any] = api.call("POST", f"/v1/sources/{args.source}/sync")
    if not args.wait:
        if not args.json:
            print(f"sync of {ack['source_id']} requested (`kbmesh sources show` follows it)")
        return ack
    run = _ended_run(api, ack["source_id"], before, args.timeout)
    if run["status"] != "succeeded":
        raise ApiFailure(f"the run of {ack['source_id']} failed: {run.get('error')}")
    if not args.json:
        print(f"run of {ack['source_id']} succeeded: {_counts(run)}")
    return run


def _runs(api: Api, source: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    status: dict[str, Any] = api.call("GET", f"/v1/sources/{source}")["status"]
    return status, status["runs"]


def _ended_run(api: Api, source_id: str, before: set[str], timeout: float) -> dict[str, Any]:
    """The run that answered a sync asked for after `before` were recorded, once it ended
    and no sync is asked for any more (a run under way at the request is followed by
    another, which is the one that answers it)."""
    deadline = time.monotonic() + timeout
    while True:
        status, runs = _runs(api, source_id)
        ended = [r for r in runs if r["run_id"] not in before and r["status"] != "running"]
        if ended and status["requested"] is None:
            return ended[-1]
        if time.monotonic() >= deadline:
            raise ApiFailure(f"no run of {source_id} ended within {timeout:.0f} s")
        time.sleep(WAIT_POLL_SECONDS)


def _remove(api: Api, args: argparse.Namespace) -> dict[str, Any]:
    params = {"keep_documents": "true"} if args.keep_documents else {}
    ack: dict[str, Any] = api.call("DELETE", f"/v1/sources/{args.source}", params=params)
    if not args.json:
        kept = "kept" if args.keep_documents else "being deleted"
        print(f"removed {ack['source_id']} (its documents are {kept})")
    return ack


# ---- apply ----------------------------------------------------------------------------------


@dataclass
class Plan:
    create: list[DeclaredSource] = field(default_factory=list)
    # (declared, the fields that differ, the stored source)
    update: list[tuple[DeclaredSource, dict[str, Any], dict[str, Any]]] = field(
        default_factory=list
    )
    remove: list[dict[str, Any]] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, list[str]]:
        return {
            "created": [d.id for d in self.create],
            "updated": [d.id for d, _, _ in self.update],
            "removed": [s["source_id"] for s in self.remove],
            "unchanged": self.unchanged,
        }


def read_file(path: Path) -> SourcesFile:
    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text()
        raw = yaml.safe_load(text)
    except (OSError, yaml.YAMLError) as err:
        raise InvalidFile(f"cannot read {path}: {err}") from err
    if isinstance(raw, list):
        raw = {"sources": raw}
    if raw is None:
        raw = {}
    try:
        declared = SourcesFile.model_validate(raw)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        message = str(first["msg"]).removeprefix("Value error, ")
        raise InvalidFile(f"{path}: {where}: {message}") from err
    ids = [d.id for d in declared.sources]
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise InvalidFile(f"{path}: ids declared more than once: {', '.join(twice)}")
    return declared


def plan(api: Api, declared: SourcesFile, *, keep_undeclared: bool) -> Plan:
    """What applying `declared` changes, read from the API (nothing changes here)."""
    kbs: dict[str, str] = {}  # name or id as written → kb_id
    for ref in [*(declared.kbs or []), *(d.kb for d in declared.sources)]:
        if ref not in kbs:
            kbs[ref] = api.call("GET", f"/v1/kbs/{ref}")["kb_id"]
    managed = {kbs[ref] for ref in declared.kbs} if declared.kbs is not None else set(kbs.values())
    existing = {s["source_id"]: s for s in _sources(api, None)}
    result = Plan()
    for source in declared.sources:
        stored = existing.get(source.id)
        if stored is None:
            result.create.append(source)
            continue
        if stored["kind"] != source.kind:
            raise InvalidFile(
                f"{source.id}: a {stored['kind']} source cannot become a {source.kind} one; "
                "give it another id (the old one is then removed)"
            )
        differs = _differences(source, stored, kbs[source.kb])
        if differs:
            result.update.append((source, differs, stored))
        else:
            result.unchanged.append(source.id)
    if not keep_undeclared:
        ids = {d.id for d in declared.sources}
        result.remove = [
            s for s in existing.values() if s["kb_id"] in managed and s["source_id"] not in ids
        ]
    return result


def _differences(source: DeclaredSource, stored: dict[str, Any], kb_id: str) -> dict[str, Any]:
    wanted = source.model_dump(include=set(SPEC_FIELDS) - {"kind"})
    changed = {k: v for k, v in wanted.items() if k != "kb" and stored.get(k) != v}
    if stored["kb_id"] != kb_id:
        changed["kb"] = source.kb
    credentials = _credentials(source)
    if credentials and not stored["has_credentials"]:
        changed.update(credentials)
    return changed


def _credentials(source: DeclaredSource) -> dict[str, str]:
    found = {}
    if source.token_env:
        found["token"] = _environ(source.token_env)
    if source.ssh_key_env:
        found["ssh_key"] = _environ(source.ssh_key_env)
    return found


def _environ(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise InvalidFile(f"the environment variable {name} (a source's credential) is not set")
    return value


def _apply(api: Api, args: argparse.Namespace) -> dict[str, Any]:
    declared = read_file(args.file)
    todo = plan(api, declared, keep_undeclared=args.keep_undeclared)
    would = "would " if args.dry_run else ""
    quiet = args.json
    for source in todo.create:
        if not args.dry_run:
            body = source.model_dump(include=set(SPEC_FIELDS), exclude_none=True)
            api.call(
                "POST", "/v1/sources", json={**body, "source_id": source.id, **_credentials(source)}
            )
        _say(quiet, f"{would}create {source.id} ({source.kind} {source.url})")
    for source, differs, _stored in todo.update:
        if not args.dry_run:
            api.call("PATCH", f"/v1/sources/{source.id}", json=differs)
        names = ", ".join(
            sorted(k if k not in ("token", "ssh_key") else "credentials" for k in differs)
        )
        _say(quiet, f"{would}update {source.id}: {names}")
    for stored in todo.remove:
        if not args.dry_run:
            api.call("DELETE", f"/v1/sources/{stored['source_id']}")
        _say(quiet, f"{would}remove {stored['source_id']} ({stored['url']}) and its documents")
    summary = todo.summary()
    _say(
        quiet,
        f"{would}create {len(todo.create)}, {would}update {len(todo.update)}, "
        f"{would}remove {len(todo.remove)}; {len(todo.unchanged)} unchanged",
    )
    return {"dry_run": args.dry_run, **summary}


def _say(quiet: bool, line: str) -> None:
    if not quiet:
        print(line)
