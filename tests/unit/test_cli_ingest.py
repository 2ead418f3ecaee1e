"""`kbmesh ingest`'s walk: what it picks from a folder, how it names it, what it skips."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import pytest

from services.cli.ingest import Options, Progress, Readable, Tally, UsageError, walk


def options(*paths: Path, **overrides: object) -> Options:
    args = argparse.Namespace(
        paths=[str(p) for p in paths],
        kb="default",
        tags="",
        collection=None,
        source_id=None,
        include=[],
        exclude=[],
        sync=False,
        concurrency=4,
        api="http://127.0.0.1:8080",
    )
    for key, value in overrides.items():
        setattr(args, key, value)
    return Options.from_args(args)


def tree(root: Path, files: dict[str, bytes | str]) -> None:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


def test_walk_honours_gitignore_hidden_folders_and_globs(tmp_path: Path) -> None:
    """Nested .gitignore files (with negation), hidden files and folders, --include and
    --exclude all narrow the walk; uris are relative to the folder given, in order."""
    root = tmp_path / "repo"
    tree(
        root,
        {
            ".gitignore": "*.log\nbuild/\n",
            "a.md": "a",
            "keep.log": "x",
            "build/out.md": "x",
            ".git/HEAD.md": "x",
            ".env": "x",
            "docs/.gitignore": "draft-*.md\n!draft-final.md\n",
            "docs/b.md": "b",
            "docs/draft-1.md": "x",
            "docs/draft-final.md": "x",
            "docs/deep/c.txt": "c",
            "docs/deep/page.html": "<p>x</p>",
        },
    )
    files, skipped = walk(options(root))
    assert [f.uri for f in files] == [
        "a.md",
        "docs/b.md",
        "docs/deep/c.txt",
        "docs/deep/page.html",
        "docs/draft-final.md",
    ]
    assert not skipped
    files, _ = walk(options(root, include=["*.md"], exclude=["docs/deep/*", "a.md"]))
    assert [f.uri for f in files] == ["docs/b.md", "docs/draft-final.md"]


def test_binaries_and_unextractable_types_are_skipped(tmp_path: Path) -> None:
    """A .bin, an image and a NUL-holding file without a telling extension are skipped with
    their type; a single file given directly is named by its file name."""
    tree(
        tmp_path,
        {
            "blob.bin": bytes(range(256)),
            "photo.png": b"\x89PNG\r\n",
            "LICENSE": b"MIT\0\0binary",
            "README": "plain text without an extension",
        },
    )
    files, skipped = walk(options(tmp_path))
    assert [f.uri for f in files] == ["README"]
    assert {s.uri for s in skipped} == {"blob.bin", "photo.png", "LICENSE"}
    assert all(s.reason.startswith("unsupported type") for s in skipped)
    single, _ = walk(options(tmp_path / "README"))
    assert [(f.uri, f.mime_type) for f in single] == [("README", "text/plain")]


def test_usage_errors(tmp_path: Path) -> None:
    """A missing path, or --sync with nothing local to compare, is bad usage."""
    with pytest.raises(UsageError):
        options(tmp_path / "missing")
    with pytest.raises(UsageError):
        options(sync=True, paths=["https://example.com/a.html"])
    assert options(tmp_path).source_id == tmp_path.name


def test_progress_line_counts_files_bytes_chunks() -> None:
    """The plain line carries the bar's figures: files, bytes done of all, chunks indexed,
    the transfer rate and the time left."""
    progress = Progress(files_total=4, bytes_total=4096)
    progress.add(1024, chunks=3)
    assert progress.line().startswith("1/4 files, 1.0/4.1 kB, 3 chunks indexed, ")
    progress.add(2048, chunks=5)
    line = progress.line()
    assert line.startswith("2/4 files, 3.1/4.1 kB, 8 chunks indexed, ")
    assert "/s, ETA " in line


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


async def test_progress_redraws_one_line_on_a_terminal_and_prints_lines_elsewhere() -> None:
    """On a terminal the bar is redrawn in place and left on its own line; elsewhere a
    plain `progress:` line is printed (at least once, at the end)."""
    tty, plain = Terminal(), io.StringIO()
    for out in (tty, plain):
        progress = Progress(files_total=2, bytes_total=10, out=out)
        async with progress.shown():
            progress.add(10, chunks=4)
    drawn = tty.getvalue()
    assert "\r\x1b[2K1/2 files" in drawn and "100%" in drawn and "4 chunks indexed" in drawn
    assert drawn.removesuffix("\x1b[?25h").endswith("\n") and "progress:" not in drawn
    assert plain.getvalue().startswith("progress: 1/2 files, 10/10 bytes, 4 chunks indexed")
    assert "\x1b" not in plain.getvalue()


def test_every_type_the_server_reads_is_picked_with_its_media_type(tmp_path: Path) -> None:
    """reStructuredText, gzipped markdown, code, office files and extensionless scripts are
    uploaded (with the server's media type for their extension); a gzip holding binary
    bytes and an image are skipped with the reason."""
    import gzip

    tree(
        tmp_path,
        {
            "guide.rst": "Guide\n=====\n",
            "readme.md.gz": gzip.compress(b"# Readme\n"),
            "changelog.Debian.gz": gzip.compress(b"pkg (1.0) unstable\n"),
            "blob.gz": gzip.compress(bytes(range(256))),
            "tool.py": "def f():\n    pass\n",
            "report.pdf": b"%PDF-1.4 \x00\x01",
            "configure": "#!/bin/sh\necho hi\n",
            "scan.jpg": b"\xff\xd8\xff",
        },
    )
    files, skipped = walk(options(tmp_path))
    assert {f.uri: f.mime_type for f in files} == {
        "guide.rst": "text/x-rst",
        "readme.md.gz": "application/gzip",
        "changelog.Debian.gz": "application/gzip",
        "tool.py": "text/x-python",
        "report.pdf": "application/pdf",
        "configure": "text/plain",
    }
    reasons = {s.uri: s.reason for s in skipped}
    assert reasons == {
        "blob.gz": "unsupported type (binary content)",
        "scan.jpg": "unsupported type (an image: it needs OCR first)",
    }


def test_the_servers_list_of_types_decides(tmp_path: Path) -> None:
    """What the server lists (GET /v1/types) is what is uploaded: a server that reads no
    PDFs gets none, as binary content of an unknown type."""
    tree(tmp_path, {"a.pdf": b"%PDF-1.4 \x00", "b.md": "# B"})
    server = {
        "formats": [
            {
                "name": "Markdown",
                "kind": "markdown",
                "mime_types": ["text/markdown"],
                "extensions": [".md"],
                "binary": False,
            },
        ]
    }
    files, skipped = walk(options(tmp_path), Readable.from_types(server))
    assert [(f.uri, f.mime_type) for f in files] == [("b.md", "text/markdown")]
    assert [(s.uri, s.reason) for s in skipped] == [("a.pdf", "unsupported type (binary content)")]


def test_summary_counts_skipped_files() -> None:
    tally = Tally(uploaded=3, unchanged=1, deleted=0, skipped=2)
    tally.failures.append(("x.md", "HTTP 422"))
    assert tally.summary() == "3 uploaded, 1 unchanged, 0 deleted, 2 skipped, 1 failed"
