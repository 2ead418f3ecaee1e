"""Chunking by a document's layout (chunk_document): heading paths, tables split by rows with
the header repeated, code cut at top-level definitions, pages and slides per chunk, and plain
text chunked exactly as before."""

from __future__ import annotations

import pytest

from services.common.domain.layout import Layout
from services.common.domain.models import Chunker, KnowledgeBase
from services.common.embedders import LocalEmbedder
from services.embed.chunking import chunk_document, chunk_text

MINILM_MAX = 254


@pytest.fixture(scope="module")
def tokenizer() -> object:
    # Only the tokenizer is used: the model itself is never loaded here.
    return LocalEmbedder().tokenizer()


def kb(chunk_size: int = 200) -> KnowledgeBase:
    return KnowledgeBase(
        org_id="org", kb_id="kb", name="kb", chunker=Chunker.recursive, chunk_size=chunk_size
    )


def no_prefix(headings: tuple[str, ...]) -> int:
    return 0


def test_markdown_chunks_carry_their_heading_path_and_never_cross_a_heading(tokenizer) -> None:
    """Each section is chunked on its own; a chunk's headings are those above it, outermost
    first; a "#" inside fenced code is not a heading; a heading alone adds no chunk."""
    text = (
        "# Lab notes\n\nIntro paragraph about the lab.\n\n## Setup\n\n### Cooling\n\n"
        "The chiller runs on walnutprism coolant.\n\n```sh\n# not a heading\nrun\n```\n\n"
        "## Results\n\nAll **good**.\n"
    )
    layout = Layout(checksum="", format="markdown")
    chunks = chunk_document(
        text, layout, kb(), tokenizer, max_tokens=MINILM_MAX, prefix_tokens=no_prefix
    )
    paths = [(c.headings, c.text.splitlines()[-1]) for c in chunks]
    assert paths == [
        (("Lab notes",), "Intro paragraph about the lab."),
        (("Lab notes", "Setup", "Cooling"), "```"),
        (("Lab notes", "Results"), "All **good**."),
    ]
    assert "walnutprism" in chunks[1].text and "# not a heading" in chunks[1].text
    assert [c.index for c in chunks] == [0, 1, 2]
    assert all(text[c.start : c.end] == c.text for c in chunks)


def test_tables_split_by_rows_with_the_header_repeated(tokenizer) -> None:
    rows = "".join(
        f"| host-{i} | rack {i % 7} | serving traffic in zone {i} |\n" for i in range(60)
    )
    text = "# Inventory\n\n| host | rack | role |\n| --- | --- | --- |\n" + rows + "\nAfter.\n"
    chunks = chunk_document(
        text,
        Layout(checksum="", format="markdown"),
        kb(chunk_size=80),
        tokenizer,
        max_tokens=MINILM_MAX,
        prefix_tokens=no_prefix,
    )
    tables = [c for c in chunks if "host-" in c.text]
    assert len(tables) > 3
    for chunk in tables:
        assert chunk.text.startswith("| host | rack | role |\n| --- | --- | --- |\n"), chunk.text
        assert chunk.headings == ("Inventory",)
        assert chunk.token_count <= 80
    shown = "".join(c.text.split("| --- | --- | --- |\n", 1)[1] + "\n" for c in tables)
    assert [f"host-{i} " in shown for i in range(60)] == [True] * 60, "every row, once"
    assert chunks[-1].text == "After."


def test_code_is_cut_at_top_level_definitions(tokenizer) -> None:
    """Whole functions are packed together up to the size; no function is cut while it
    fits a chunk."""
    functions = [
        f'def step_{i}(value: int) -> int:\n    """Step {i} of the pipeline."""\n'
        + "".join(f"    value = value * {j} + {i}\n" for j in range(8))
        + "    return value\n"
        for i in range(12)
    ]
    text = '"""A module."""\n\nimport os\n\n\n' + "\n\n".join(functions)
    chunks = chunk_document(
        text,
        Layout(checksum="", format="code", language="Python"),
        kb(chunk_size=160),
        tokenizer,
        max_tokens=MINILM_MAX,
        prefix_tokens=no_prefix,
    )
    assert len(chunks) > 2
    for chunk in chunks:
        starts = [line for line in chunk.text.splitlines() if line.startswith("def ")]
        assert starts, chunk.text
        assert chunk.text.rstrip().endswith("return value"), "ends at a definition's end"


def test_a_chunk_stays_on_its_page_and_names_it(tokenizer) -> None:
    """Pages (and slides) are chunk boundaries, even where both would fit one chunk."""
    page_one = "First page words. " * 5
    page_two = "Second page with quasarfjord."
    text = page_one + "\n\n" + page_two
    layout = Layout(
        checksum="", format="markdown", unit="page", pages=[(0, 1), (len(page_one) + 2, 2)]
    )
    chunks = chunk_document(
        text, layout, kb(), tokenizer, max_tokens=MINILM_MAX, prefix_tokens=no_prefix
    )
    assert [(c.text, c.pages) for c in chunks] == [(page_one.strip(), (1,)), (page_two, (2,))]


def test_plain_text_is_chunked_as_before(tokenizer) -> None:
    """Without a layout, or with a plain-text one, chunks are those of `chunk_text` with the
    same room left for the title."""
    text = "\n\n".join(f"Paragraph {i}. " + "words and more words " * 30 for i in range(10))
    before = chunk_text(text, kb(), tokenizer, max_tokens=MINILM_MAX - 5)
    for layout in (None, Layout(checksum="", format="text")):
        after = chunk_document(
            text, layout, kb(), tokenizer, max_tokens=MINILM_MAX, prefix_tokens=lambda h: 5
        )
        assert [(c.text, c.start, c.end) for c in after] == [
            (c.text, c.start, c.end) for c in before
        ]
        assert all(c.headings == () and c.pages == () for c in after)
