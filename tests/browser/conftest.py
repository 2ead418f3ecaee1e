"""Headless Chromium (Debian's `chromium`, driven by Playwright) against a real stack served
over HTTP. Pages are checked for JavaScript errors, and screenshots land in a folder that
the run prints (KBMESH_SCREENSHOTS names another)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.conftest import running_stack
from tests.support.mcp_client import serve_http

# As the machine notes say: no background traffic (the network is closed), no sandbox as root.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


def _missing(what: str) -> None:
    message = f"browser tests need {what}"
    if os.environ.get("CI"):
        pytest.fail(message + " (CI must run them; `make test` installs it as root)")
    pytest.skip(message)


def chromium_binary() -> str:
    found = shutil.which("chromium") or (
        "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None
    )
    if found is None:
        _missing(
            "Debian's chromium (/usr/bin/chromium): `apt-get install -y chromium` as root, "
            "or `make test` as root, which does it"
        )
    return str(found)


@pytest.fixture(scope="session")
async def browser() -> AsyncIterator[Any]:
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        _missing("the playwright package: `pip install -e '.[dev]'`")
    binary = chromium_binary()
    async with async_playwright() as pw:
        launched = await pw.chromium.launch(executable_path=binary, args=CHROMIUM_ARGS)
        yield launched
        await launched.close()


@pytest.fixture(scope="session")
def screenshots() -> Path:
    folder = os.environ.get("KBMESH_SCREENSHOTS")
    path = Path(folder) if folder else Path(tempfile.mkdtemp(prefix="kbmesh-console-"))
    path.mkdir(parents=True, exist_ok=True)
    print(f"console screenshots: {path}")
    return path


@pytest.fixture(scope="module")
async def stack(tmp_path_factory, embedders) -> AsyncIterator[SimpleNamespace]:
    """One stack for the module: every test makes its own knowledge bases."""
    async with (
        running_stack(tmp_path_factory.mktemp("console"), embedders=embedders) as (rt, client),
        serve_http(rt) as (base, app),
    ):
        yield SimpleNamespace(rt=rt, client=client, base=base, app=app)


@dataclass
class Watch:
    """What went wrong in a page: uncaught errors, console errors, unexpected HTTP errors."""

    expected: set[tuple[str, str, int]] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)

    def expect(self, method: str, path: str, status: int) -> None:
        self.expected.add((method, path, status))

    def attach(self, page: Any) -> None:
        page.on("pageerror", lambda err: self.errors.append(f"page error: {err}"))
        page.on("console", self._console)
        page.on("response", self._response)
        page.on("dialog", self._dialog)

    def _console(self, msg: Any) -> None:
        # Chromium logs every HTTP error status as a console error; those are judged by
        # _response against what the test expected instead.
        if msg.type == "error" and "the server responded with a status of" not in msg.text:
            self.errors.append(f"console error: {msg.text}")

    def _response(self, response: Any) -> None:
        if response.status < 400:
            return
        from urllib.parse import urlsplit

        key = (response.request.method, urlsplit(response.url).path, response.status)
        if key not in self.expected:
            self.errors.append(f"unexpected HTTP {key}")

    def _dialog(self, dialog: Any) -> None:
        # No page of the console opens alert()/confirm(): one means injected script ran.
        self.dialogs.append(dialog.message)
        self.errors.append(f"unexpected dialog: {dialog.message!r}")


@pytest.fixture
async def page(browser, stack) -> AsyncIterator[Any]:
    context = await browser.new_context(viewport=DESKTOP, base_url=stack.base)
    context.set_default_timeout(30_000)
    tab = await context.new_page()
    watch = Watch()
    watch.attach(tab)
    tab.watch = watch
    yield tab
    await context.close()
    assert watch.errors == [], "\n".join(watch.errors)


async def shoot(page: Any, folder: Path, name: str) -> None:
    """The page as it is, at 1280×800 and at 390×844 (full height)."""
    await page.screenshot(path=folder / f"{name}-1280x800.png")
    await page.set_viewport_size(PHONE)
    await page.screenshot(path=folder / f"{name}-390x844.png", full_page=True)
    await page.set_viewport_size(DESKTOP)
