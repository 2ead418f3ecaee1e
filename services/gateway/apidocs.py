"""The API docs (`/docs`: Swagger UI, `/redoc`: ReDoc) served from the assets of the pinned
`fastapi-offline` package, so they work without a CDN, under a Content-Security-Policy as
strict as the console's for scripts.

Only the styles are relaxed ('unsafe-inline'): both UIs set style attributes and ReDoc
injects <style> elements at run time. Scripts come from this origin only, no inline code:
Swagger UI is started by a script of ours served as a file, ReDoc by its `<redoc>` element.
"""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI
from starlette.responses import HTMLResponse, Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

from services.gateway.console import HEADERS

ASSETS = Path(fastapi_offline.__file__).parent / "static"
ASSETS_URL = "/docs/assets"
CSP = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self' 'unsafe-inline'",
        "img-src 'self' data:",
        "font-src 'self' data:",
        "connect-src 'self'",
        # ReDoc's search runs in a worker it builds from a blob.
        "worker-src 'self' blob:",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)
DOCS_HEADERS = {**HEADERS, "Content-Security-Policy": CSP}

SWAGGER_PAGE = f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>kbmesh API — Swagger UI</title>
<link rel="icon" href="{ASSETS_URL}/favicon.png">
<link rel="stylesheet" href="{ASSETS_URL}/swagger-ui.css">
</head>
<body>
<div id="swagger-ui"></div>
<script src="{ASSETS_URL}/swagger-ui-bundle.js"></script>
<script src="/docs/start.js"></script>
</body>
</html>
"""
SWAGGER_START = """SwaggerUIBundle({
  url: "/openapi.json",
  dom_id: "#swagger-ui",
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
  layout: "BaseLayout",
  deepLinking: true,
});
"""
REDOC_PAGE = f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>kbmesh API — ReDoc</title>
<link rel="icon" href="{ASSETS_URL}/favicon.png">
</head>
<body>
<redoc spec-url="/openapi.json"></redoc>
<script src="{ASSETS_URL}/redoc.standalone.js"></script>
</body>
</html>
"""


class _Assets(StaticFiles):
    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(DOCS_HEADERS)
        return response


def mount_api_docs(app: FastAPI) -> None:
    """`/docs` and `/redoc`, for an app made with `docs_url=None, redoc_url=None`."""

    @app.get("/docs", include_in_schema=False)
    async def swagger() -> HTMLResponse:
        return HTMLResponse(SWAGGER_PAGE, headers=DOCS_HEADERS)

    @app.get("/docs/start.js", include_in_schema=False)
    async def swagger_start() -> Response:
        return Response(SWAGGER_START, media_type="text/javascript", headers=DOCS_HEADERS)

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return HTMLResponse(REDOC_PAGE, headers=DOCS_HEADERS)

    app.mount(ASSETS_URL, _Assets(directory=ASSETS), name="api-docs")
