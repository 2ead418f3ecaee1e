"""`kbmesh keys create|list|revoke` against a running stack: a revoked key is refused at once,
and a listing never shows a key or its hash."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import running_stack
from tests.support.bus import bus_env
from tests.support.domain import uid, wait_until
from tests.support.procs import ROOT, kbmesh_env


def keys(rt, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "keys", *args],
        cwd=ROOT,
        env=kbmesh_env(**bus_env(rt, "operator")),
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_keys_are_listed_without_secrets_and_revoked_at_once(tmp_path, embedders):
    async with running_stack(tmp_path, embedders=embedders) as (rt, client):
        name = f"bot-{uid()}"
        made = keys(rt, "create", "--org", "local", "--name", name, "--read-only")
        assert made.returncode == 0, made.stderr[-2000:]
        token = made.stdout.strip()
        auth = {"Authorization": f"Bearer {token}"}
        assert (await client.get("/v1/kbs", headers=auth)).status_code == 200

        listed = keys(rt, "list", "--org", "local")
        assert listed.returncode == 0, listed.stderr[-2000:]
        (entry,) = [json.loads(line) for line in listed.stdout.splitlines()]
        assert entry["name"] == name and entry["org_id"] == "local" and entry["read_only"]
        assert len(entry["key_id"]) == 12
        assert token not in listed.stdout and "key_hash" not in entry

        revoked = keys(rt, "revoke", name)
        assert revoked.returncode == 0, revoked.stderr[-2000:]
        assert json.loads(revoked.stdout) == {"revoked": entry["key_id"], "name": name}

        async def refused() -> bool:
            return (await client.get("/v1/kbs", headers=auth)).status_code == 401

        # The gateway follows the key bucket by a watch: the revocation lands in milliseconds.
        await wait_until(refused, timeout=10, what="the revoked key refused")

        again = keys(rt, "revoke", entry["key_id"])
        assert again.returncode == 1 and "no API key" in again.stderr
