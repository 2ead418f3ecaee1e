"""Container health check for the kbmesh image: GET a gateway path on the local port.

Usage: `python healthcheck.py [PATH]` (default `/healthz`); exit 0 when healthy, else 1.

One image runs every service, but only the gateway (`kbmesh serve ... gateway`, or
`kbmesh up`, which runs all four) serves HTTP. For any other command (the ingest, embed and
search workers) the check passes while the process runs, so the image's HEALTHCHECK never
marks a working worker unhealthy.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

ENTRY_POINTS = {"kbmesh", "services.cli"}


def gateway_port(argv: list[str], default: str) -> str | None:
    """The gateway port when this kbmesh command line serves HTTP, else None."""
    start = next((i for i, a in enumerate(argv) if Path(a).name in ENTRY_POINTS), None)
    if start is None or start + 1 >= len(argv):
        return None
    command, rest = argv[start + 1], argv[start + 2 :]
    if command == "up" or (command == "serve" and "gateway" in rest):
        for i, arg in enumerate(rest):
            if arg == "--port" and i + 1 < len(rest):
                return rest[i + 1]
            if arg.startswith("--port="):
                return arg.split("=", 1)[1]
        return default
    return None


def main_process_argv() -> list[str]:
    """The container's main command line (PID 1; under an init such as tini it holds the
    child's command after `--`)."""
    raw = Path("/proc/1/cmdline").read_bytes()
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def healthy(port: str, path: str, timeout: float = 4.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError):
        return False


def main(argv: list[str]) -> int:
    path = argv[1] if len(argv) > 1 else "/healthz"
    default = os.environ.get("KBMESH_PORT", "8080")
    try:
        port = gateway_port(main_process_argv(), default)
    except OSError:
        port = default  # cannot tell what runs: check as if it were the gateway
    if port is None:
        return 0
    return 0 if healthy(port, path) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
