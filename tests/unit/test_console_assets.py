"""The console's files keep the rules its Content-Security-Policy and its escaping rely on:
no inline script or handler in the page, no HTML parsing of strings in the scripts, and
nothing loaded from another origin."""

from __future__ import annotations

import re

from services.gateway.console import CSP, STATIC

SCRIPTS = sorted((STATIC / "js").glob("*.js"))


def test_page_has_no_inline_script_or_handler():
    page = (STATIC / "index.html").read_text()
    for tag in re.findall(r"<script\b[^>]*>", page):
        assert "src=" in tag, f"inline script: {tag}"
    assert not re.search(r"\son[a-z]+\s*=", page), "inline event handler in index.html"
    assert "unsafe-inline" not in CSP and "script-src 'self'" in CSP


def test_scripts_never_parse_strings_as_html():
    assert SCRIPTS, "no console scripts found"
    forbidden = re.compile(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\(")
    for script in SCRIPTS:
        found = forbidden.findall(script.read_text())
        assert not found, f"{script.name}: {found}"


def test_everything_comes_from_this_origin():
    for path in [STATIC / "index.html", STATIC / "console.css", *SCRIPTS]:
        text = path.read_text()
        assert not re.search(r"(src|href)=\"https?://", text), path.name
        assert "@import url(http" not in text, path.name
