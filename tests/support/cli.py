"""`kbmesh` run as a person runs it: its own process, this checkout's code, no network."""

from __future__ import annotations

import asyncio
import os

from tests.support.mcp_client import OFFLINE_ENV, REPO, kbmesh_command


async def kbmesh(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run `kbmesh ARGS...`; (exit status, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        *kbmesh_command(),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO,
        env={**os.environ, **OFFLINE_ENV, "PYTHONPATH": str(REPO), **(env or {})},
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()
