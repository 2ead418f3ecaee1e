"""Chunking by KB settings: chonkie's chunkers, capped at the embedding model's token limit,
returning exact spans of the input."""

from __future__ import annotations

import random
from itertools import pairwise

import pytest

from services.common.domain.models import Chunker, KnowledgeBase
from services.common.embedders import LiteLLMEmbedder, LocalEmbedder
from services.embed.chunking import MAX_CHARS_PER_TOKEN, Chunk, chunk_text

MINILM_MAX = 254
ALL_CHUNKERS = list(Chunker)
VOCABULARY = (
    "The NATS server replays JetStream messages; Qdrant stores Vectors! ERR_4521 v1.2.3 "
    "nats-server Überprüfung naïve café 東京 Unbelievably antidisestablishmentarianism "
    "acknowledgements, retries and back-off jitter. Why? Because."
)


@pytest.fixture(scope="module")
def minilm() -> LocalEmbedder:
    # Only the tokenizer is used: the model itself is never loaded here.
    return LocalEmbedder()


def kb(chunker: Chunker, chunk_size: int = 200, chunk_overlap: int = 0) -> KnowledgeBase:
    return KnowledgeBase(
        org_id="org",
        kb_id="kb",
        name="kb",
        chunker=chunker,
        chunk_size=chunk_size,
        chunk_overlap=chunk_overlap,
    )


def long_text(seed: int = 7) -> str:
    """Mixed-case prose with paragraphs, very long sentences, identifiers, non-ASCII text and
    words longer than a chunk: every shape that can push a chunk over the limit."""
    rng = random.Random(seed)
    words = VOCABULARY.split()
    paragraphs = []
    for p in range(40):
        sentences = []
        for _ in range(rng.randint(1, 6)):
            n = rng.randint(300, 500) if p % 9 == 0 else rng.randint(4, 40)
            sentences.append(" ".join(rng.choice(words) for _ in range(n)) + ".")
        paragraphs.append(" ".join(sentences))
    paragraphs.insert(5, "https://example.com/" + "AbCdEf0123" * 300)  # one 3000-char word
    paragraphs.insert(20, "x" * 4000)
    return "\n\n".join(paragraphs)


def assert_spans(text: str, chunks: list[Chunk]) -> None:
    assert chunks
    assert [c.index for c in chunks] == list(range(len(chunks)))
    for c in chunks:
        assert text[c.start : c.end] == c.text
        assert c.text == c.text.strip()
    assert [c.start for c in chunks] == sorted(c.start for c in chunks)


@pytest.mark.parametrize("chunker", ALL_CHUNKERS)
def test_no_chunk_exceeds_the_minilm_limit(chunker: Chunker, minilm: LocalEmbedder) -> None:
    """With a KB chunk size above the model's limit, every chunk still fits in 254 MiniLM
    tokens (special tokens excluded), so the model never cuts a chunk silently."""
    text = long_text()
    chunks = chunk_text(
        text,
        kb(chunker, chunk_size=512, chunk_overlap=32),
        minilm.tokenizer(),
        max_tokens=minilm.max_tokens,
    )
    counts = [minilm.count_tokens(c.text) for c in chunks]
    assert max(counts) <= MINILM_MAX
    assert [c.token_count for c in chunks] == counts
    # The cap is a cap, not a target: chunks are filled close to it.
    assert max(counts) > MINILM_MAX * 0.9


@pytest.mark.parametrize("chunker", ALL_CHUNKERS)
def test_chunks_are_exact_spans_covering_the_text(chunker: Chunker, minilm: LocalEmbedder) -> None:
    """Each chunk is `text[start:end]` with original case and accents (no decoded tokens),
    and together the chunks cover every non-whitespace character."""
    text = long_text(seed=3)
    chunks = chunk_text(text, kb(chunker), minilm.tokenizer(), max_tokens=MINILM_MAX)
    assert_spans(text, chunks)
    covered = bytearray(len(text))
    for c in chunks:
        covered[c.start : c.end] = b"\x01" * (c.end - c.start)
    assert all(covered[i] or text[i].isspace() for i in range(len(text)))
    assert any("Überprüfung" in c.text for c in chunks)


@pytest.mark.parametrize("chunker", ALL_CHUNKERS)
def test_kb_chunk_size_below_the_limit_wins(chunker: Chunker, minilm: LocalEmbedder) -> None:
    """A KB asking for 64-token chunks gets chunks of at most 64 tokens."""
    text = long_text(seed=11)
    small = chunk_text(text, kb(chunker, chunk_size=64), minilm.tokenizer(), max_tokens=254)
    large = chunk_text(text, kb(chunker, chunk_size=254), minilm.tokenizer(), max_tokens=254)
    assert max(c.token_count for c in small) <= 64
    assert len(small) > len(large)


@pytest.mark.parametrize("chunker", [Chunker.token, Chunker.sentence])
def test_overlap_repeats_text_between_neighbours(chunker: Chunker, minilm: LocalEmbedder) -> None:
    """With chunk_overlap, the token and sentence chunkers start a chunk before the previous
    one ends; without it they do not."""
    text = " ".join(f"Sentence number {i} talks about topic {i % 7}." for i in range(300))
    tok = minilm.tokenizer()
    overlapping = chunk_text(text, kb(chunker, 100, 30), tok, max_tokens=MINILM_MAX)
    disjoint = chunk_text(text, kb(chunker, 100, 0), tok, max_tokens=MINILM_MAX)
    assert_spans(text, overlapping)
    assert all(b.start < a.end for a, b in pairwise(overlapping))
    assert all(b.start >= a.end for a, b in pairwise(disjoint))


def test_recursive_chunker_has_no_overlap(minilm: LocalEmbedder) -> None:
    """chonkie 1.7's RecursiveChunker takes no overlap: chunk_overlap is ignored, not an
    error, and chunks never share text."""
    text = long_text(seed=5)
    chunks = chunk_text(text, kb(Chunker.recursive, 120, 40), minilm.tokenizer(), max_tokens=254)
    assert all(b.start >= a.end for a, b in pairwise(chunks))


def test_overlap_scales_with_a_capped_chunk_size(minilm: LocalEmbedder) -> None:
    """A KB asking for 1000-token chunks with 400 overlap (fine for a large model) gets
    254-token chunks overlapping by about the same share, not by 400 tokens."""
    text = " ".join(f"Sentence number {i} talks about topic {i % 7}." for i in range(400))
    tok = minilm.tokenizer()
    chunks = chunk_text(text, kb(Chunker.token, 1000, 400), tok, max_tokens=MINILM_MAX)
    assert max(c.token_count for c in chunks) <= MINILM_MAX
    shared = [minilm.count_tokens(text[b.start : a.end]) for a, b in pairwise(chunks)]
    assert all(80 <= n <= 110 for n in shared[:-1])  # 400 * 254 // 1000 = 101


@pytest.mark.parametrize("chunker", ALL_CHUNKERS)
@pytest.mark.parametrize("text", ["", "   ", "\n\n\t  \n"])
def test_empty_text_gives_no_chunks(chunker: Chunker, text: str, minilm: LocalEmbedder) -> None:
    """Empty or whitespace-only text yields no chunks (nothing to embed)."""
    assert chunk_text(text, kb(chunker), minilm.tokenizer(), max_tokens=MINILM_MAX) == []


@pytest.mark.parametrize("chunker", ALL_CHUNKERS)
def test_short_text_is_one_chunk(chunker: Chunker, minilm: LocalEmbedder) -> None:
    """A text under the limit is a single chunk: itself, minus surrounding whitespace."""
    text = "  Hello NATS-Server, meet Qdrant.\n"
    [chunk] = chunk_text(text, kb(chunker), minilm.tokenizer(), max_tokens=MINILM_MAX)
    assert chunk.text == "Hello NATS-Server, meet Qdrant."
    assert (chunk.start, chunk.end, chunk.index) == (2, 33, 0)
    assert chunk.token_count == minilm.count_tokens(chunk.text)


@pytest.mark.parametrize("chunker", ALL_CHUNKERS)
def test_character_tokenizer_counts_characters(chunker: Chunker) -> None:
    """chonkie's offline `character` tokenizer (the LiteLLM fallback) bounds chunk length."""
    text = long_text(seed=9)
    chunks = chunk_text(text, kb(chunker, 300, 20), "character", max_tokens=8191)
    assert_spans(text, chunks)
    assert max(len(c.text) for c in chunks) <= 300


@pytest.mark.parametrize("chunker", ALL_CHUNKERS)
def test_tiktoken_tokenizer_for_remote_models(chunker: Chunker) -> None:
    """A LiteLLM model's tiktoken tokenizer works offline, respects the limit, and treats
    special-token text such as `<|endoftext|>` as ordinary text."""
    remote = LiteLLMEmbedder("openai/text-embedding-3-small")
    text = long_text(seed=4).replace("Because.", "Because <|endoftext|>.")
    chunks = chunk_text(text, kb(chunker, 256, 16), remote.tokenizer(), max_tokens=8191)
    assert_spans(text, chunks)
    assert max(remote.count_tokens(c.text) for c in chunks) <= 256
    assert any("<|endoftext|>" in c.text for c in chunks)


@pytest.mark.parametrize("chunker", ALL_CHUNKERS)
def test_text_without_separators_is_cut_hard(chunker: Chunker, minilm: LocalEmbedder) -> None:
    """256 KiB of one character, which WordPiece counts as a single [UNK] token, still becomes
    chunks of at most chunk_size x MAX_CHARS_PER_TOKEN characters that cover the text."""
    text = "x" * (256 * 1024)
    settings = kb(chunker, chunk_size=100)
    chunks = chunk_text(text, settings, minilm.tokenizer(), max_tokens=MINILM_MAX)
    assert_spans(text, chunks)
    assert max(len(c.text) for c in chunks) <= 100 * MAX_CHARS_PER_TOKEN
    assert sum(len(c.text) for c in chunks) >= len(text)


def test_long_runs_are_cut_at_spaces_when_there_are_some(minilm: LocalEmbedder) -> None:
    """Words of 300 characters (one [UNK] each): cuts fall between words, not inside them."""
    words = [f"{i:03d}" + "y" * 297 for i in range(100)]
    text = " ".join(words)
    chunks = chunk_text(text, kb(Chunker.recursive), minilm.tokenizer(), max_tokens=MINILM_MAX)
    assert_spans(text, chunks)
    assert max(len(c.text) for c in chunks) <= 200 * MAX_CHARS_PER_TOKEN
    assert [w for c in chunks for w in c.text.split()] == words


@pytest.mark.parametrize("size", [64, 100, MINILM_MAX])
@pytest.mark.parametrize("seed", [1, 2])
def test_recursive_chunk_counts_match_a_recount(
    size: int, seed: int, minilm: LocalEmbedder
) -> None:
    """The recursive chunker's own counts are kept for the bundled WordPiece tokenizer
    instead of counting each chunk again: they must equal a recount of the chunk."""
    text = long_text(seed)
    chunks = chunk_text(
        text, kb(Chunker.recursive, chunk_size=size), minilm.tokenizer(), max_tokens=MINILM_MAX
    )
    assert [c.token_count for c in chunks] == [minilm.count_tokens(c.text) for c in chunks]
    assert max(c.token_count for c in chunks) <= size


def test_only_wordpiece_counts_are_taken_from_the_chunker(minilm: LocalEmbedder) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from services.embed.chunking import _counts_add_up

    byte_level = Tokenizer(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert _counts_add_up(minilm.tokenizer())
    assert not _counts_add_up(byte_level)
    assert not _counts_add_up("character")
    assert not _counts_add_up(LiteLLMEmbedder("openai/text-embedding-3-small").tokenizer())


@pytest.mark.parametrize("chunker", [Chunker.recursive, Chunker.sentence])
def test_documents_chunked_on_several_threads_at_once_chunk_as_alone(
    chunker: Chunker,
    minilm: LocalEmbedder,
) -> None:
    """A chonkie chunker is shared by every document of a tokenizer and size, and the
    embed service chunks documents on worker threads: at once, each still comes out as it
    does alone."""
    from concurrent.futures import ThreadPoolExecutor

    texts = [long_text(seed) for seed in range(8)]

    def chunks(text: str) -> list[Chunk]:
        return chunk_text(
            text,
            kb(chunker, chunk_size=120, chunk_overlap=20 if chunker is Chunker.sentence else 0),
            minilm.tokenizer(),
            max_tokens=MINILM_MAX,
        )

    alone = [chunks(t) for t in texts]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(chunks, texts * 3)) == alone * 3


def test_a_chunker_that_estimates_its_counts_is_counted_again(
    minilm: LocalEmbedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """chonkie's counts are trusted only after a probe shows them exact: a release that
    estimated them would otherwise put wrong counts (and chunks over the limit) into the
    index."""
    from dataclasses import replace as replaced

    from services.embed import chunking

    real = chunking._chunker

    class Estimating:
        def __init__(self, inner: object) -> None:
            self.inner = inner

        def chunk(self, text: str) -> list[object]:
            return [replaced(c, token_count=c.token_count - 1) for c in self.inner.chunk(text)]

    monkeypatch.setattr(chunking, "_chunker", lambda *a: Estimating(real(*a)))
    chunking._counts_add_up.cache_clear()
    try:
        assert not chunking._counts_add_up(minilm.tokenizer())
        text = long_text(4)
        chunks = chunk_text(text, kb(Chunker.recursive), minilm.tokenizer(), max_tokens=MINILM_MAX)
        assert [c.token_count for c in chunks] == [minilm.count_tokens(c.text) for c in chunks]
    finally:
        chunking._counts_add_up.cache_clear()
