"""A known-item set from the Python standard library's documentation, in BEIR format.

Each document is the pydoc page of one stdlib module (plain text, first `--max-chars`). Its
query is the one-line summary of one function or class documented on that page, removed from
the page: "which module does X?", with the answer anywhere in the page (the entry is picked
at random, so the answers spread over the beginning, the middle and the end of pages).

    .venv/bin/python -m benchmarks.stdlib_set benchmarks/data/stdlib [--max-docs 150]

Deterministic for a given Python and seed. Nothing is downloaded: pydoc renders the
installed library.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import inspect
import io
import json
import pydoc
import re
import sys
import warnings
from pathlib import Path

# Packages that are not documentation a user looks up, or that open windows / print on import.
SKIP = re.compile(r"^(test|idlelib|tkinter|turtle|turtledemo|lib2to3|ensurepip|antigravity|this)")


def summaries(module: object) -> list[str]:
    """First lines of the docstrings of the functions and classes the module defines."""
    out = []
    for name, obj in inspect.getmembers(module):
        if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        if getattr(obj, "__module__", None) != getattr(module, "__name__", None):
            continue
        doc = inspect.getdoc(obj) or ""
        line = " ".join(doc.split("\n\n")[0].split())
        if 6 <= len(line.split()) <= 30 and "(" not in line[:20] and not line.startswith(">>>"):
            out.append(line)
    return out


def remove(text: str, sentence: str) -> str | None:
    pattern = r"\s+".join(re.escape(w) for w in sentence.split())
    new, n = re.subn(pattern, " ", text, count=1)
    return new if n == 1 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("--max-docs", type=int, default=150)
    ap.add_argument("--max-chars", type=int, default=12000)
    ap.add_argument("--seed", type=int, default=3)
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    names = sorted(
        m for m in sys.stdlib_module_names if not m.startswith("_") and not SKIP.match(m)
    )
    names.sort(key=lambda m: hashlib.sha1(f"{a.seed}:{m}".encode()).hexdigest())
    corpus, queries, seen = [], [], set()
    for name in names:
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                module = importlib.import_module(name)
            text = pydoc.render_doc(module, renderer=pydoc.plaintext)[: a.max_chars]
        except Exception:
            continue
        found = [s for s in summaries(module) if s.lower() not in seen and remove(text, s)]
        if not found:
            continue
        found.sort(key=lambda s: hashlib.sha1(f"{a.seed}:{s}".encode()).hexdigest())
        query = found[0]
        seen.add(query.lower())
        corpus.append({"_id": name, "title": name, "text": remove(text, query)})
        queries.append(query)
        if len(corpus) == a.max_docs:
            break
    (a.out / "qrels").mkdir(parents=True, exist_ok=True)
    with (
        open(a.out / "corpus.jsonl", "w") as c,
        open(a.out / "queries.jsonl", "w") as q,
        open(a.out / "qrels" / "test.tsv", "w") as r,
    ):
        r.write("query-id\tcorpus-id\tscore\n")
        for i, (doc, text) in enumerate(zip(corpus, queries, strict=True)):
            c.write(json.dumps(doc) + "\n")
            q.write(json.dumps({"_id": f"q{i}", "text": text}) + "\n")
            r.write(f"q{i}\t{doc['_id']}\t1\n")
    print(f"{len(corpus)} documents -> {a.out}")


if __name__ == "__main__":
    main()
