"""Main content of web pages: how each way of reading an HTML page keeps its content and leaves
out the chrome a docs site repeats on every page. On a sample of Debian's python3.11-doc pages
(`make pydoc`), whose content Sphinx marks with role="main":

- recall: share of the distinct words of the marked content that the output keeps;
- precision: share of the output's words that belong to that content;
- repeated: share of the output's lines found in at least 30% of the pages (chrome);
- ms/page: extraction time.

    python -m benchmarks.main_content [--pages 60]
"""

from __future__ import annotations

import argparse
import collections
import random
import re
import time
from collections.abc import Callable
from pathlib import Path

import kreuzberg
import lxml.html
import trafilatura

from services.ingest.extract import Bounds, extract
from tests.support.website import PYTHON_DOCS, PYTHON_DOCS_MISSING

WORD = re.compile(r"\w+")
BOUNDS = Bounds(expanded_bytes=50 * 1024 * 1024, expansion_ratio=200)


def _content_words(page: bytes) -> set[str]:
    root = lxml.html.document_fromstring(page)
    main = root.xpath("//div[@role='main']")
    return set(WORD.findall(main[0].text_content().lower())) if main else set()


def _kreuzberg_plain(page: bytes) -> str:
    config = kreuzberg.ExtractionConfig(output_format="markdown", use_cache=False)
    return str(kreuzberg.extract_bytes_sync(page, "text/html", config).content)


def _trafilatura(page: bytes) -> str:
    return (
        trafilatura.extract(
            page.decode("utf-8", "replace"),
            output_format="markdown",
            include_formatting=True,
            include_tables=True,
            include_links=False,
            favor_recall=True,
        )
        or ""
    )


def _kbmesh(page: bytes) -> str:
    return extract(page, "text/html", "page.html", BOUNDS).text


WAYS: dict[str, Callable[[bytes], str]] = {
    "kreuzberg, whole page (before)": _kreuzberg_plain,
    "trafilatura (markdown, favor_recall)": _trafilatura,
    "kbmesh: main landmark + kreuzberg": _kbmesh,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pages", type=int, default=60)
    args = parser.parse_args()
    if not PYTHON_DOCS.is_dir():
        raise SystemExit(PYTHON_DOCS_MISSING)
    files = sorted(p for p in Path(PYTHON_DOCS).rglob("*.html") if "_" not in p.parts[-2][:1])
    pages = [p.read_bytes() for p in random.Random(1).sample(files, args.pages)]
    truth = [_content_words(p) for p in pages]
    print(f"{len(pages)} pages of {PYTHON_DOCS}")
    print(f"{'way':38s} {'ms/page':>8s} {'recall':>7s} {'precision':>9s} {'repeated':>8s}")
    for name, way in WAYS.items():
        started = time.perf_counter()
        outputs = [way(p) for p in pages]
        per_page = (time.perf_counter() - started) / len(pages) * 1000
        lines = collections.Counter(
            line.strip() for out in outputs for line in set(out.splitlines()) if line.strip()
        )
        recall, precision, repeated = [], [], []
        for words, out in zip(truth, outputs, strict=True):
            found = WORD.findall(out.lower())
            recall.append(len(words & set(found)) / max(1, len(words)))
            precision.append(sum(w in words for w in found) / max(1, len(found)))
            kept = [line.strip() for line in out.splitlines() if line.strip()]
            repeated.append(
                sum(lines[line] >= 0.3 * len(pages) for line in kept) / max(1, len(kept))
            )
        n = len(pages)
        print(
            f"{name:38s} {per_page:8.1f} {sum(recall) / n:7.3f} "
            f"{sum(precision) / n:9.3f} {sum(repeated) / n:8.3f}"
        )


if __name__ == "__main__":
    main()
