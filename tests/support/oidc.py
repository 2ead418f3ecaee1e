"""A real OpenID provider for sign-in tests (panva/oidc-provider, tests/oidc/provider.mjs) on
loopback, and what a person does on its pages."""

from __future__ import annotations

import asyncio
import contextlib
import html
import os
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urljoin

import httpx

OIDC_DIR = Path(__file__).resolve().parents[1] / "oidc"
# The provider's client that people sign in as (the console, `kbmesh login`).
PEOPLE_CLIENT = "kbmesh-people"


def provider_missing() -> str | None:
    if shutil.which("node") is None:
        return "node is not installed (the OpenID provider of these tests runs on node 20+)"
    if not (OIDC_DIR / "node_modules" / "oidc-provider").is_dir():
        return (
            "oidc-provider is not installed in tests/oidc (`make test` runs `npm ci` there; "
            "it needs node 20+ and npm)"
        )
    return None


@contextlib.asynccontextmanager
async def oidc_provider(
    issuer: str, port: int, accounts: Path, console_url: str | None = None
) -> AsyncIterator[None]:
    """tests/oidc/provider.mjs listening on `port`, naming itself `issuer`; with
    `console_url`, its people's client sends them back there."""
    env = {"PATH": os.environ["PATH"], "ACCOUNTS_FILE": str(accounts)}
    if console_url:
        env["CONSOLE_URL"] = console_url
    proc = await asyncio.create_subprocess_exec(
        "node",
        str(OIDC_DIR / "provider.mjs"),
        str(port),
        issuer,
        cwd=str(OIDC_DIR),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=30)
        assert line.strip() == b"ready", line
        yield
    finally:
        proc.terminate()
        await proc.wait()


def form_fields(page: str) -> tuple[str, dict[str, str]]:
    """The first form of a page: its action and its hidden fields."""
    form = re.search(r"<form[^>]*action=\"([^\"]+)\"[^>]*>(.*?)</form>", page, re.S)
    assert form is not None, page[:500]
    fields = {
        html.unescape(name): html.unescape(value)
        for name, value in re.findall(
            r'<input[^>]*type="hidden"[^>]*name="([^"]+)"[^>]*value="([^"]*)"', form.group(2)
        )
    }
    return html.unescape(form.group(1)), fields


async def enter_device_code(verification_uri: str, user_code: str, user: str) -> None:
    """What a person does with the code a device shows (RFC 8628): open the provider's page,
    enter the code, sign in, consent, confirm."""
    async with httpx.AsyncClient(timeout=30, follow_redirects=True) as browser:
        response = await browser.get(verification_uri)
        for _ in range(10):
            if "Sign-in Success" in response.text:
                return
            action, fields = form_fields(response.text)
            if 'name="user_code"' in response.text and "user_code" not in fields:
                fields["user_code"] = user_code
            elif 'name="login"' in response.text:
                fields |= {"prompt": "login", "login": user, "password": "any"}
            elif "/interaction/" in action:
                fields |= {"prompt": "consent"}
            response = await browser.post(urljoin(str(response.url), action), data=fields)
            assert response.status_code == 200, response.text[:500]
    raise AssertionError(f"the device sign-in never succeeded: {response.text[:500]}")
