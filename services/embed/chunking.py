"""Chunking a document's text by the KB's settings, within the embedding model's token limit.

chonkie does the splitting; this module picks the chunker, caps the chunk size at what the
model reads (a longer chunk would be cut silently by the model), and returns chunks as spans
of the input so that highlights and neighbours can be cut from the stored text.

With the document's layout (`chunk_document`), chunks follow its structure: a markdown
section is never split across headings and each chunk carries its heading path; a table is
split by rows, each piece repeating the header row (the one case where a chunk's text is not
a plain span); code is split at its top-level definitions; and a chunk of a paged document
stays on one page or slide and names it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from chonkie import RecursiveChunker, RecursiveRules, SentenceChunker, TokenChunker
from chonkie.tokenizer import AutoTokenizer, CharacterTokenizer, TokenizerProtocol

from services.common.domain.layout import Layout
from services.common.domain.models import Chunker, KnowledgeBase

# chonkie's default levels (paragraphs, sentences, pauses, words) without the last one, which
# splits a still-too-long word by decoding token ids: lossy for WordPiece (lowercased,
# re-spaced), so its chunks stop being spans of the input. A word longer than a chunk comes
# back whole instead and is cut on token offsets below, like the `token` chunker.
_RULES = RecursiveRules(
    levels=[lvl for lvl in RecursiveRules().levels or [] if lvl.delimiters or lvl.whitespace]
)


# Hard cap on characters per token of the chunk size: English averages about four, and a
# chunk of long tokens only gets smaller. Every chunk fits the KB's size in characters too.
MAX_CHARS_PER_TOKEN = 16


@dataclass(frozen=True)
class Chunk:
    text: str
    index: int
    start: int  # character offsets into the input: text == input[start:end] (but tables)
    end: int
    token_count: int
    headings: tuple[str, ...] = ()  # the headings above it, outermost first
    pages: tuple[int, ...] = ()  # the pages (or slides) it lies on


def chunk_text(text: str, kb: KnowledgeBase, tokenizer: object, *, max_tokens: int) -> list[Chunk]:
    """Split `text` by `kb.chunker`; every chunk has at most min(kb.chunk_size, max_tokens)
    tokens as `tokenizer` counts them (special tokens excluded), and at most
    MAX_CHARS_PER_TOKEN characters per token of that size."""
    if not text.strip():
        return []
    size = max(1, min(kb.chunk_size, max_tokens))
    overlap = kb.chunk_overlap
    if kb.chunk_size > size:
        # Capped by the model: keep the overlap's share of the chunk, not its absolute size
        # (400 of 1000 would leave windows advancing a few tokens at a time).
        overlap = overlap * size // kb.chunk_size
    # chonkie requires overlap < size.
    overlap = max(0, min(overlap, size - 1))
    counter = AutoTokenizer(tokenizer)

    spans: list[tuple[int, int]]
    # Token counts a chunker already made, by span, where they are exact (see `fit`).
    counted: dict[tuple[int, int], int] = {}
    if kb.chunker is Chunker.token:
        spans = _token_spans(text, tokenizer, counter, size, overlap)
    else:
        chunker = _chunker(kb.chunker, tokenizer, size, overlap)
        spans = []
        cursor = 0
        exact = kb.chunker is Chunker.recursive and _counts_add_up(tokenizer)
        for piece in chunker.chunk(text):
            start, end = _locate(text, piece.text, piece.start_index, cursor)
            spans.append((start, end))
            if exact:
                counted[(start, end)] = piece.token_count
            cursor = start

    chunks: list[Chunk] = []

    def add(start: int, end: int, count: int) -> None:
        chunks.append(
            Chunk(text=text[start:end], index=len(chunks), start=start, end=end, token_count=count)
        )

    max_chars = size * MAX_CHARS_PER_TOKEN

    def fit(start: int, end: int, known: int | None = None) -> None:
        start, end = _trim(text, start, end)
        if start >= end:
            return
        if known is not None and known <= size and end - start <= max_chars:
            # The chunker's own count, exact for this tokenizer (`_counts_add_up`);
            # trimmed whitespace holds no tokens. Counting again took 40 % of chunking.
            add(start, end, known)
            return
        if end - start > max_chars:
            # A hard cut first: a tokenizer may count a huge run without separators as one
            # token (WordPiece's [UNK] for any word over 100 characters), which would leave
            # a megabyte in one chunk and, through search results, in one bus message.
            for s, e in _char_spans(text, start, end, max_chars):
                fit(s, e)
            return
        count = counter.count_tokens(text[start:end])
        if count <= size:
            add(start, end, count)
            return
        # Safety net: a sentence or a word longer than the limit, or a chunker that counted
        # differently, must not hand the model a chunk it would cut.
        for sub_start, sub_end in _token_spans(text[start:end], tokenizer, counter, size, 0):
            fit(start + sub_start, start + sub_end)

    for span in spans:
        fit(*span, counted.get(span))
    return chunks


@functools.lru_cache(maxsize=32)
def _chunker(
    kind: Chunker, tokenizer: object, size: int, overlap: int
) -> RecursiveChunker | SentenceChunker:
    """One chonkie chunker per kind, tokenizer and size, shared by every document (and
    thread: chonkie's chunkers keep no state between calls). Building one logs the
    tokenizer's `str()`, which for a WordPiece tokenizer prints its whole vocabulary (a
    cost per document: docs/benchmarks.md, "Figures behind the code")."""
    if kind is Chunker.sentence:
        return SentenceChunker(
            tokenizer=_protocol(tokenizer), chunk_size=size, chunk_overlap=overlap
        )
    # RecursiveChunker has no overlap parameter in chonkie 1.7: it splits on paragraphs,
    # then sentences, then words, and never repeats text across chunks, so `chunk_overlap`
    # only applies to the sentence and token chunkers.
    return RecursiveChunker(tokenizer=_protocol(tokenizer), chunk_size=size, rules=_RULES)


# Paragraphs, sentences, pauses, words longer than a chunk, accents and CJK: what the
# recursive chunker cuts at, for the check in `_counts_add_up`.
_PROBE = (
    "Überprüfung der Konfiguration: nats-server v2.10.3 (JetStream) — naïve café 東京.\n\n"
    "The scheduler assigns each task to the least loaded worker; when a worker stops "
    "answering, its tasks return to the queue, are retried with back-off, and reported as "
    "failed after five tries. Antidisestablishmentarianism-like identifiers ERR_4521 "
    "and foo.bar_baz(x, y) stay whole?\n" * 3
)


@functools.lru_cache(maxsize=8)
def _counts_add_up(tokenizer: object) -> bool:
    """Whether the recursive chunker's token counts are exact for this tokenizer, so that
    a chunk need not be counted again.

    chonkie counts each split and adds up the counts of the splits it merges, so the counts
    are exact when the tokenizer's count of a text is the sum of its counts of pieces cut
    at whitespace or punctuation, where the chunker cuts. That holds for BERT's WordPiece
    (the bundled model's): its normaliser works character by character, its pre-tokeniser
    cuts at whitespace and at every punctuation mark, and each word is split on its own.
    (Byte-level BPE, for one, merges across a leading space.) And chonkie must count rather
    than estimate, as 1.7 does: checked once per tokenizer on a probe text."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    if not (
        isinstance(tokenizer, Tokenizer)
        and isinstance(tokenizer.model, models.WordPiece)
        and isinstance(tokenizer.pre_tokenizer, pre_tokenizers.BertPreTokenizer)
        and isinstance(tokenizer.normalizer, normalizers.BertNormalizer | None)
    ):
        return False
    pieces = _chunker(Chunker.recursive, tokenizer, 24, 0).chunk(_PROBE)
    return len(pieces) > 1 and all(
        piece.token_count == len(tokenizer.encode(piece.text, add_special_tokens=False).ids)
        for piece in pieces
    )


def _char_spans(text: str, start: int, end: int, max_chars: int) -> list[tuple[int, int]]:
    """Windows of at most `max_chars` characters, ended at whitespace when there is some in
    a window's second half."""
    out: list[tuple[int, int]] = []
    while start < end:
        stop = min(start + max_chars, end)
        if stop < end:
            cut = max(
                text.rfind(" ", start + max_chars // 2, stop),
                text.rfind("\n", start + max_chars // 2, stop),
            )
            if cut > start:
                stop = cut
        out.append((start, stop))
        start = stop
    return out


def _protocol(tokenizer: object) -> str | TokenizerProtocol:
    # Embedders hand out tokenizers as `object` (tokenizers.Tokenizer, tiktoken.Encoding or
    # "character"); chonkie's AutoTokenizer sorts them out at run time.
    return cast("str | TokenizerProtocol", tokenizer)


def _trim(text: str, start: int, end: int) -> tuple[int, int]:
    # Chunkers keep separators ("\n\n", trailing spaces); they carry no meaning for search.
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


def _locate(text: str, piece: str, hint: int, cursor: int) -> tuple[int, int]:
    """Offsets of `piece` in `text`: chonkie's own when they check out, else a search."""
    if text[hint : hint + len(piece)] == piece:
        return hint, hint + len(piece)
    found = text.find(piece, cursor)
    if found < 0:
        found = text.find(piece)
    if found < 0:
        raise ValueError(f"chunk is not a span of the input: {piece[:60]!r}")
    return found, found + len(piece)


def _token_offsets(text: str, tokenizer: object) -> list[tuple[int, int]] | None:
    """Character span of each token (special tokens excluded), or None if unknowable."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return list(tokenizer.encode(text, add_special_tokens=False).offsets)
    if isinstance(tokenizer, CharacterTokenizer) or tokenizer == "character":
        return [(i, i + 1) for i in range(len(text))]
    try:
        import tiktoken
    except ImportError:  # pragma: no cover - tiktoken ships with litellm
        return None
    if isinstance(tokenizer, tiktoken.Encoding):
        ids = tokenizer.encode(text, disallowed_special=())
        _, starts = tokenizer.decode_with_offsets(ids)
        ends = [*starts[1:], len(text)]
        return list(zip(starts, ends, strict=True))
    return None


def _starts_word(text: str, offsets: list[tuple[int, int]], k: int) -> bool:
    """Whether a chunk may begin at token k without cutting a word in two."""
    if k == 0 or k >= len(offsets):
        return True
    begin = offsets[k][0]
    if begin > offsets[k - 1][1] or begin == 0:
        return True  # whitespace (or nothing) between the two tokens
    return not (text[begin - 1].isalnum() and text[begin].isalnum())


def _token_spans(
    text: str, tokenizer: object, counter: AutoTokenizer, size: int, overlap: int
) -> list[tuple[int, int]]:
    """Windows of at most `size` tokens, `overlap` tokens shared, as character spans.

    chonkie's TokenChunker decodes token ids back into text, which is not lossless for a
    WordPiece tokenizer (lowercased, re-spaced: the chunks stop being spans of the input) nor
    for byte-level BPE at multi-byte characters. So windows are cut on the tokenizer's
    character offsets instead, and moved back to a word boundary when one is near, because a
    word cut in two re-tokenises into more pieces than it had inside the whole text.
    TokenChunker remains the path for tokenizers that cannot report offsets.
    """
    offsets = _token_offsets(text, tokenizer)
    if offsets is None:
        pieces = TokenChunker(
            tokenizer=_protocol(tokenizer), chunk_size=size, chunk_overlap=overlap
        )
        out, cursor = [], 0
        for piece in pieces.chunk(text):
            start, end = _locate(text, piece.text, piece.start_index, cursor)
            out.append((start, end))
            cursor = start
        return out

    n = len(offsets)
    spans: list[tuple[int, int]] = []
    first = 0
    while first < n:
        last = min(first + size, n)  # exclusive
        if last < n:
            for k in range(last, first + size // 2, -1):
                if _starts_word(text, offsets, k):
                    last = k
                    break
        # Re-tokenising a span can yield more tokens than it had in context (a word longer
        # than half a window cut in two; BPE merging differently once the leading space is
        # trimmed); shrink until the trimmed span itself fits.
        while True:
            start, end = _trim(text, offsets[first][0], offsets[last - 1][1])
            if last - first <= 1 or counter.count_tokens(text[start:end]) <= size:
                break
            last -= 1
        spans.append((start, end))
        if last >= n:
            break
        nxt = max(first + 1, last - overlap)
        # Begin the overlap on a word boundary too, when one is inside the overlap.
        for k in range(nxt, last):
            if _starts_word(text, offsets, k):
                nxt = k
                break
        first = nxt
    return spans


# ---- structure ------------------------------------------------------------------------------

_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_TABLE_RULE = re.compile(r"^\s*\|?(\s*:?-{3,}:?\s*\|)+\s*:?-*:?\s*$")
_MARKUP = re.compile(r"\\(?=[^\w\s])|[*_`]")


@dataclass(frozen=True)
class _Block:
    kind: str  # "prose", "table" or "code"
    start: int
    end: int


@dataclass(frozen=True)
class _Fit:
    """How one section's chunks are sized: the KB's chunker within `limit` tokens (the
    model's input less the section's prefix), `size` = min(chunk_size, limit)."""

    kb: KnowledgeBase
    tokenizer: object
    counter: AutoTokenizer
    size: int
    limit: int

    def span(self, text: str, start: int, end: int) -> list[Chunk]:
        """`chunk_text` of text[start:end], with offsets into the whole text."""
        return [
            _with(c, start=c.start + start, end=c.end + start)
            for c in chunk_text(text[start:end], self.kb, self.tokenizer, max_tokens=self.limit)
        ]


def chunk_document(
    text: str,
    layout: Layout | None,
    kb: KnowledgeBase,
    tokenizer: object,
    *,
    max_tokens: int,
    prefix_tokens: Callable[[tuple[str, ...]], int],
) -> list[Chunk]:
    """Chunks of a document by its layout (see the module docstring). `prefix_tokens` says
    how many tokens the heading path put before a chunk for embedding will take, so that
    prefix and chunk together fit the model. Plain text is chunked as `chunk_text` does."""
    if layout is None or layout.format == "text":
        chunks = chunk_text(text, kb, tokenizer, max_tokens=max_tokens - prefix_tokens(()))
    else:
        counter = AutoTokenizer(tokenizer)
        sections: list[tuple[int, int, tuple[str, ...]]] = (
            _sections(text) if layout.format == "markdown" else [(0, len(text), ())]
        )
        # A chunk stays on one page (or slide), so that it cites exactly where it lies.
        sections = _split_at(sections, [start for start, _ in layout.pages])
        chunks = []
        for start, end, headings in sections:
            limit = max(1, max_tokens - prefix_tokens(headings))
            fit = _Fit(kb, tokenizer, counter, max(1, min(kb.chunk_size, limit)), limit)
            for block in _blocks(text, start, end, layout.format):
                if block.kind == "table":
                    pieces = _table_chunks(text, block, fit)
                elif block.kind == "code":
                    pieces = _code_chunks(text, block, fit)
                else:
                    pieces = fit.span(text, block.start, block.end)
                chunks += [_with(c, headings=headings) for c in pieces]
    return [
        _with(
            c,
            index=i,
            pages=tuple(layout.pages_of(c.start, c.end)) if layout is not None else (),
        )
        for i, c in enumerate(chunks)
    ]


def _with(chunk: Chunk, **changes: object) -> Chunk:
    values = {**chunk.__dict__, **changes}
    return Chunk(**values)  # type: ignore[arg-type]


def _sections(text: str) -> list[tuple[int, int, tuple[str, ...]]]:
    """Markdown sections: (start, end, heading path) from each ATX heading to the next one
    (headings inside fenced code do not count). A section that is only its heading line
    is dropped: its heading lives on in the paths of the sections below it."""
    marks: list[tuple[int, tuple[str, ...]]] = [(0, ())]
    path: list[tuple[int, str]] = []
    fence: str | None = None
    offset = 0
    for line in text.splitlines(keepends=True):
        opened = _FENCE.match(line)
        if fence is not None:
            if opened and opened.group(1) == fence:
                fence = None
        elif opened:
            fence = opened.group(1)
        else:
            heading = _HEADING.match(line.rstrip("\r\n"))
            if heading:
                level = len(heading.group(1))
                title = _MARKUP.sub("", heading.group(2)).strip()
                path = [(lvl, t) for lvl, t in path if lvl < level]
                if title:
                    path.append((level, title))
                marks.append((offset, tuple(t for _, t in path)))
        offset += len(line)
    sections = []
    for (start, headings), (end, _) in zip(marks, [*marks[1:], (len(text), ())], strict=True):
        body = text[start:end]
        first, _, rest = body.lstrip().partition("\n")
        if not body.strip() or (_HEADING.match(first) and not rest.strip()):
            continue
        sections.append((start, end, headings))
    return sections


def _split_at(
    sections: list[tuple[int, int, tuple[str, ...]]], cuts: list[int]
) -> list[tuple[int, int, tuple[str, ...]]]:
    out = []
    for start, end, headings in sections:
        inside = [c for c in cuts if start < c < end]
        for s, e in zip([start, *inside], [*inside, end], strict=True):
            out.append((s, e, headings))
    return out


def _blocks(text: str, start: int, end: int, fmt: str) -> list[_Block]:
    """A section cut into prose and tables (markdown), or a whole source file (code)."""
    if fmt == "code":
        return [_Block("code", start, end)]
    blocks: list[_Block] = []
    lines = text[start:end].splitlines(keepends=True)
    offsets = [start]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    prose = start
    i = 0
    while i < len(lines):
        is_table = (
            lines[i].lstrip().startswith("|")
            and i + 1 < len(lines)
            and _TABLE_RULE.match(lines[i + 1].rstrip("\r\n")) is not None
        )
        if not is_table:
            i += 1
            continue
        j = i + 2
        while j < len(lines) and lines[j].lstrip().startswith("|"):
            j += 1
        if offsets[i] > prose:
            blocks.append(_Block("prose", prose, offsets[i]))
        blocks.append(_Block("table", offsets[i], offsets[j]))
        prose = offsets[j]
        i = j
    if prose < end:
        blocks.append(_Block("prose", prose, end))
    return [b for b in blocks if text[b.start : b.end].strip()]


def _table_chunks(text: str, block: _Block, fit: _Fit) -> list[Chunk]:
    """Rows grouped up to the chunk size; every group after the first repeats the header
    row and its rule line, so that each chunk reads as a table on its own."""
    lines = text[block.start : block.end].splitlines(keepends=True)
    header = "".join(lines[:2])
    header_tokens = fit.counter.count_tokens(header)
    out: list[Chunk] = []
    group_start = block.start
    cursor = block.start + len(header)
    group_tokens = header_tokens
    first = True

    def flush(upto: int) -> None:
        nonlocal group_start, group_tokens, first
        if upto > group_start:
            s, e = _trim(text, group_start, upto)
            body = text[s:e]
            shown = body if first else header + body
            out.append(Chunk(shown, 0, s, e, fit.counter.count_tokens(shown)))
            first = False
        group_start = upto
        group_tokens = header_tokens

    for line in lines[2:]:
        tokens = fit.counter.count_tokens(line)
        if header_tokens + tokens > fit.size:
            # A row too long for a chunk with its header: split on its own.
            flush(cursor)
            out += fit.span(text, cursor, cursor + len(line))
            cursor += len(line)
            group_start = cursor
            continue
        if group_tokens + tokens > fit.size:
            flush(cursor)
        group_tokens += tokens
        cursor += len(line)
    flush(cursor)
    return out


def _code_chunks(text: str, block: _Block, fit: _Fit) -> list[Chunk]:
    """Source code cut at its top-level definitions: a definition (with the comments and
    decorators right above it) starts where a line at column 0 follows a blank line. Whole
    definitions are packed together up to the chunk size; a longer one is split by the
    KB's chunker (at its blank lines first)."""
    pieces: list[tuple[int, int]] = []
    offset = block.start
    piece_start = block.start
    blank_before = False
    for line in text[block.start : block.end].splitlines(keepends=True):
        stripped = line.strip()
        top_level = bool(stripped) and not line[0].isspace() and line[0] not in "})]"
        if top_level and blank_before and offset > piece_start:
            pieces.append((piece_start, offset))
            piece_start = offset
        blank_before = not stripped
        offset += len(line)
    pieces.append((piece_start, block.end))

    out: list[Chunk] = []
    group: tuple[int, int] | None = None
    group_tokens = 0
    for start, end in pieces:
        tokens = fit.counter.count_tokens(text[start:end])
        if group is not None and group_tokens + tokens <= fit.size:
            group, group_tokens = (group[0], end), group_tokens + tokens
            continue
        if group is not None:
            out += fit.span(text, *group)
        group, group_tokens = (start, end), tokens
    if group is not None:
        out += fit.span(text, *group)
    return out
