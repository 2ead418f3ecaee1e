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
CSP = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # Revalidate (ETag) on every load: a new release's modules are never mixed with old ones.
    "Cache-Control": "no-cache",
}


class _ConsoleFiles(StaticFiles):
    async def get_response(self, path: str, scope: Any) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(HEADERS)
        return response


def mount_console(app: FastAPI) -> None:
    """`/` answers the console's page; its scripts, styles and icon live under `/console/`."""

    @app.get("/", include_in_schema=False)
    async def console() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers=HEADERS)

    app.mount("/console", _ConsoleFiles(directory=STATIC), name="console")
