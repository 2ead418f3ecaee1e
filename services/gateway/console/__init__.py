"""The web console: static pages served at `/` that talk to the public REST API only.

Everything is in this package (no build step, no CDN). The pages run under a strict
Content-Security-Policy: scripts and styles from this origin only, no inline code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"


def headers(connect: list[str]) -> dict[str, str]:
    """The console's response headers; `connect`: origins beside its own that its scripts
    may fetch from (the identity provider's, for signing in)."""
    csp = "; ".join(
        [
            "default-src 'none'",
            "script-src 'self'",
            "style-src 'self'",
            "img-src 'self' data:",
            " ".join(["connect-src 'self'", *connect]),
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )
    return {
        "Content-Security-Policy": csp,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "X-Frame-Options": "DENY",
        # Revalidate (ETag) on every load: a new release's modules are never mixed with old
        # ones.
        "Cache-Control": "no-cache",
    }


# Without a provider to sign in with: this origin only (the API docs' pages build on these).
HEADERS = headers([])
CSP = HEADERS["Content-Security-Policy"]


class _ConsoleFiles(StaticFiles):
    def __init__(self, *, directory: Path, headers: dict[str, str]) -> None:
        super().__init__(directory=directory)
        self.headers = headers

    async def get_response(self, path: str, scope: Any) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(self.headers)
        return response


def mount_console(app: FastAPI, connect: list[str]) -> None:
    """`/` answers the console's page (also where the identity provider sends a person back
    after signing in); its scripts, styles and icon live under `/console/`."""
    page_headers = headers(connect)

    @app.get("/", include_in_schema=False)
    async def console() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers=page_headers)

    app.mount("/console", _ConsoleFiles(directory=STATIC, headers=page_headers), name="console")
