"""A folder of text that answers no man-page query, for multi-KB runs: Debian copyright files.

Distinct `/usr/share/doc/*/copyright` texts over 2 kB, shuffled with a fixed seed, the first
`--count` written as `<package>.txt`. Legal text that names programs and files but describes
what none of them does; load it with `kbmesh ingest DIR --kb licenses`.

    .venv/bin/python -m benchmarks.licenses_dir benchmarks/data/licenses [--count 60]
"""

from __future__ import annotations

import argparse
import hashlib
import random
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("--count", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    seen: set[str] = set()
    texts: list[tuple[str, str]] = []
    for path in sorted(Path("/usr/share/doc").glob("*/copyright")):
        text = path.read_text(errors="replace")
        digest = hashlib.sha1(text.encode()).hexdigest()
        if digest not in seen and len(text) >= 2000:
            seen.add(digest)
            texts.append((path.parent.name, text))
    random.Random(a.seed).shuffle(texts)
    a.out.mkdir(parents=True, exist_ok=True)
    for name, text in texts[: a.count]:
        (a.out / f"{name}.txt").write_text(text)
    print(f"{min(a.count, len(texts))} of {len(texts)} distinct copyright files -> {a.out}")


if __name__ == "__main__":
    main()
