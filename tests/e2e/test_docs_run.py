"""The docs run as written: every code block in README.md and docs/*.md that talks to kbmesh
is taken from the markdown and run against a real stack (`kbmesh up` as a subprocess), so the
docs cannot drift from the product.

A block is run unless an HTML comment right above it says why not:
`<!-- docs-test: skip REASON -->` (it needs something kbmesh does not have here: Docker, a
hosted LLM, another program). `<!-- docs-test: stream -->` marks a block that never ends by
itself (server-sent events): it runs for a few seconds and must have printed an event.

The shell blocks of one file run in order in one bash session, as a reader pastes them, so a
variable set in one block is there in the next. `curl` fails on an HTTP error status (as if
`--fail-with-body` were written), the address `127.0.0.1:8080` (or `localhost:8080`) is the
test stack's, and `kbmesh` is this checkout's. JSON blocks (MCP client configurations) must
parse, and every kbmesh command line in them must parse with kbmesh's own argument parser.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.procs import ROOT, Proc, free_port, kbmesh_env, wait_ready

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"sh", "bash", "python"}
MARK = re.compile(r"<!--\s*docs-test:\s*(skip|stream)\b\s*(.*?)\s*-->")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
ADDRESS = re.compile(r"(127\.0\.0\.1|localhost):8080")

needs_tools = pytest.mark.skipif(
    not (shutil.which("curl") and shutil.which("jq") and shutil.which("bash")),
    reason="the docs' shell blocks use curl, jq and bash; one of them is not installed",
)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    text: str
    mark: str | None  # "skip" or "stream"
    reason: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    source = path.read_text()
    found = []
    for m in FENCE.finditer(source):
        before = source[: m.start()].rstrip().rsplit("\n", 1)[-1]
        mark = MARK.fullmatch(before.strip())
        found.append(
            Block(
                path=path,
                line=source.count("\n", 0, m.start()) + 1,
                lang=m.group(1),
                text=m.group(2),
                mark=mark.group(1) if mark else None,
                reason=mark.group(2) if mark else "",
            )
        )
    return found


def all_blocks() -> Iterator[Block]:
    for path in DOCS:
        yield from blocks(path)


def test_every_block_not_run_says_why():
    """A skipped block names its reason; a mark stands right above a block (a mark anywhere
    else is a typo that would silently run nothing)."""
    for block in all_blocks():
        if block.mark == "skip":
            assert len(block.reason) > 10, f"{block.where}: say why the block is not run"
    for path in DOCS:
        marks = len(MARK.findall(path.read_text()))
        assert marks == sum(1 for b in blocks(path) if b.mark), f"{path}: a stray docs-test mark"


def test_client_configurations_parse_and_name_real_commands():
    """Each JSON block parses; each kbmesh command line in an MCP client configuration is
    one kbmesh's parser accepts, and each URL is the MCP endpoint."""
    from services.cli.commands import build_parser

    checked = 0
    for block in all_blocks():
        if block.lang != "json":
            continue
        config = json.loads(block.text)
        servers = config.get("mcpServers") or config.get("servers") or {}
        for name, server in servers.items():
            if str(server.get("command", "")).endswith("kbmesh"):
                args = build_parser().parse_args(server["args"])
                assert args.command == "mcp", (block.where, name)
                checked += 1
            urls = [server.get("url", "")] + [a for a in server.get("args", []) if "://" in a]
            for url in filter(None, urls):
                assert url.endswith("/mcp"), (block.where, name, url)
                checked += 1
    assert checked >= 7  # four kbmesh command lines and three URLs today


def script_for(path: Path, port: int) -> str:
    """One bash script: the file's runnable blocks in order, each announced, so a failure
    names its block."""
    lines = [
        "set -euo pipefail",
        "curl() { command curl --fail-with-body --silent --show-error "
        '--max-time "${CURL_MAX_TIME:-120}" "$@"; }',
    ]
    for block in blocks(path):
        if block.lang not in RUN or block.mark == "skip":
            continue
        text = ADDRESS.sub(f"127.0.0.1:{port}", block.text)
        lines.append(f"echo '>>> {block.where}' >&2")
        if block.lang == "python":
            lines += [f"\"{sys.executable}\" - <<'PYTHON_BLOCK'", text + "PYTHON_BLOCK"]
        elif block.mark == "stream":
            # The stream runs until curl's time limit (exit 28) and must have sent an event.
            lines += [
                "stream=$(CURL_MAX_TIME=5; { " + text.strip() + "\n} || [ $? -eq 28 ])",
                'grep -q "^event: " <<<"$stream"',
            ]
        else:
            lines.append(text)
    return "\n".join(lines) + "\n"


@pytest.fixture
def reader(tmp_path: Path) -> Path:
    """The reader's working directory: the folder the README loads with `kbmesh ingest`."""
    home = tmp_path / "reader"
    handbook = home / "handbook"
    (handbook / "people").mkdir(parents=True)
    (handbook / "vacation.md").write_text(
        "# Vacation\n\nNew employees get 25 vacation days a year, 30 after five years.\n"
    )
    (handbook / "people" / "onboarding.md").write_text(
        "# Onboarding\n\nEvery new employee gets a laptop and a buddy in the first week.\n"
    )
    return home


@needs_tools
@pytest.mark.parametrize(
    "doc",
    [p for p in DOCS if any(b.lang in RUN and b.mark != "skip" for b in blocks(p))],
    ids=lambda p: p.name,
)
async def test_the_docs_shell_and_python_blocks_run(doc: Path, tmp_path: Path, reader: Path):
    """The file's blocks, run in order against a fresh `kbmesh up`, all succeed."""
    port = free_port()
    data = tmp_path / "data"
    up = Proc(
        ["up", "--data-dir", str(data), "--port", str(port)], tmp_path / "up.log", kbmesh_env()
    )
    try:
        await asyncio.to_thread(wait_ready, f"http://127.0.0.1:{port}", up)
        script = reader / "docs.sh"
        script.write_text(script_for(doc, port))
        env = kbmesh_env(KBMESH_DATA_DIR=str(data), KBMESH_PORT=str(port))
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
        run = await asyncio.to_thread(
            subprocess.run,
            ["bash", str(script)],
            cwd=reader,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, (
            f"{doc.name}: a block failed (the last '>>>' names it)\n"
            f"--- stderr\n{run.stderr[-4000:]}\n--- stdout\n{run.stdout[-3000:]}"
        )
    finally:
        assert up.stop() == 0, up.output()[-3000:]
