"""Extraction libraries side by side on the format fixtures: which formats each reads (the
fixture's distinctive word present in its output), time per file, peak memory, and whether
headings, tables and lists survive as markdown.

    python -m benchmarks.extraction_libraries [DIR] [--library kreuzberg|markitdown]

Each library runs in its own child process, so its peak RSS (ru_maxrss) is its own.
markitdown is not a kbmesh dependency: install it beside kreuzberg to compare
(`pip install 'markitdown[all]'`).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "formats"
# Fixtures whose markdown should show structure: file -> markers expected in the output.
STRUCTURE = {
    "table.docx": ("# Inventory", "| crate |"),
    "budget.xlsx": ("| hardware |",),
    "budget.ods": ("| hardware |",),
    "page.html": ("# Field guide", "- oak"),
    "guide.rst": ("# User guide", "## Install"),
    "letter.odt": ("# Letter",),
    "book.epub": ("# Chapter 1",),
    "table.csv": ("| ada |",),
}


def _run(library: str, directory: Path) -> list[dict[str, object]]:
    sys.path.insert(0, str(directory))
    from make_fixtures import FIXTURES  # type: ignore[import-not-found]

    if library == "kreuzberg":
        import kreuzberg

        config = kreuzberg.ExtractionConfig(output_format="markdown", use_cache=False)

        def extract(path: Path) -> str:
            return str(kreuzberg.extract_file_sync(str(path), config=config).content)
    else:
        from markitdown import MarkItDown

        converter = MarkItDown(enable_plugins=False)

        def extract(path: Path) -> str:
            return str(converter.convert(str(path)).text_content)

    rows: list[dict[str, object]] = []
    for name, word in FIXTURES.items():
        started = time.perf_counter()
        try:
            text, error = extract(directory / name), ""
        except Exception as err:
            text, error = "", f"{type(err).__name__}: {str(err)[:80]}"
        rows.append(
            {
                "file": name,
                "ms": round((time.perf_counter() - started) * 1000, 1),
                "found": word in text,
                "structure": all(m in text for m in STRUCTURE.get(name, ())),
                "error": error,
            }
        )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    return [*rows, {"peak_rss_mb": peak}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", nargs="?", type=Path, default=HERE)
    parser.add_argument("--library", choices=("kreuzberg", "markitdown"))
    args = parser.parse_args()
    if args.library:
        print(json.dumps(_run(args.library, args.directory)))
        return
    results = {}
    for library in ("kreuzberg", "markitdown"):
        started = time.perf_counter()
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.extraction_libraries",
                str(args.directory),
                "--library",
                library,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode:
            print(f"{library}: failed: {out.stderr.strip()[-300:]}")
            continue
        rows = json.loads(out.stdout.strip().splitlines()[-1])
        results[library] = (rows, time.perf_counter() - started)
    print("| file | " + " | ".join(f"{lib} ms / word / structure" for lib in results) + " |")
    print("| --- |" + " --- |" * len(results))
    files = [r["file"] for r in next(iter(results.values()))[0] if "file" in r]
    for i, name in enumerate(files):
        cells = []
        for rows, _ in results.values():
            r = rows[i]
            mark = "yes" if r["found"] else ("error" if r["error"] else "no")
            cells.append(f"{r['ms']} / {mark} / {'yes' if r['structure'] else 'no'}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    for library, (rows, seconds) in results.items():
        found = sum(1 for r in rows if r.get("found"))
        print(
            f"{library}: {found}/{len(files)} words found, peak RSS {rows[-1]['peak_rss_mb']} MB, "
            f"{seconds:.1f} s with start-up"
        )


if __name__ == "__main__":
    main()
