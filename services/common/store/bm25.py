"""BM25 sparse vectors for Qdrant's `bm25` vector: local term-frequency weights, IDF by Qdrant.

Term ids are 32-bit blake2b hashes of the normalised term, so every process and machine that
indexes or queries a collection agrees on them without a shared vocabulary. The collection's
sparse vector must be created with the IDF modifier; this module only supplies the
document-side TF saturation (`encode_document`) and unit query weights (`encode_query`), and,
when several KBs are searched at once, query weights that make every KB score with the IDF
of all of them together (`shared_idf_queries`).
"""

from __future__ import annotations

import functools
import hashlib
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Mapping

from services.common.store.base import SparseVector, TermStats, idf

# A word, optionally joined to more words by `.` or `-` (`_` is already a word character):
# `foo_bar`, `ERR_4521`, `v1.2.3`, `nats-server` stay whole. A trailing `.` ends a sentence
# rather than joining, because the joiner must be followed by another word character.
_TOKEN_RE = re.compile(r"\w+(?:[.\-]\w+)*")
_PART_RE = re.compile(r"[^._\-]+")
_ASCII_WORD_RE = re.compile(r"[a-z]+")
_VOWELS = frozenset("aeiouy")

# Small, conventional English list; apostrophe fragments (`don't` → `don`, `t`) included.
_STOPWORDS_TEXT = """
    a about above after again against all am an and any are aren as at be because been before
    being below between both but by can couldn d did didn do does doesn doing don down during
    each few for from further had hadn has hasn have haven having he her here hers herself him
    himself his how i if in into is isn it its itself just ll m ma me more most mustn my myself
    no nor not now o of off on once only or other our ours ourselves out over own re s same
    shan she should shouldn so some such t than that the their theirs them themselves then there
    these they this those through to too under until up ve very was wasn we were weren what when
    where which while who whom why will with won wouldn y you your yours yourself yourselves
"""
STOPWORDS: frozenset[str] = frozenset(_STOPWORDS_TEXT.split())


def _has_vowel(stem: str) -> bool:
    return any(c in _VOWELS for c in stem)


def stem(word: str) -> str:
    """A deliberately light English stemmer (plural, -ing/-ed/-ly, final -e).

    Only plain ASCII words of four or more letters are touched, and a stem keeps at least
    three letters, so short words, identifiers and non-English words pass through unchanged.
    Queries and documents go through the same function, which is what makes matches line up.
    """
    if len(word) < 4 or not _ASCII_WORD_RE.fullmatch(word):
        return word
    w = word
    if w.endswith("ies") and len(w) > 4:
        w = w[:-3] + "y"
    elif w.endswith("s") and not w.endswith(("ss", "us", "is")):
        w = w[:-1]
    for suffix in ("ing", "ed", "ly"):
        if w.endswith(suffix):
            base = w[: -len(suffix)]
            if len(base) >= 3 and _has_vowel(base):
                w = base
                # running → runn → run; but keep fill, pass, buzz.
                if len(w) >= 4 and w[-1] == w[-2] and w[-1] not in _VOWELS | {"l", "s", "z"}:
                    w = w[:-1]
            break
    # cache / caches / cached / caching all end as `cach`.
    if w.endswith("e") and len(w) > 3:
        w = w[:-1]
    return w


# Words repeat: a document's terms are mostly ones seen before, and stemming and hashing each
# occurrence again took most of `encode_document` (200 man pages, 1,155 chunks: 0.20 s, 0.11
# with these memos).
_MEMO_TERMS = 1 << 15


@functools.lru_cache(maxsize=_MEMO_TERMS)
def _normalise(term: str) -> str | None:
    if term in STOPWORDS:
        return None
    return stem(term)


def tokenize(text: str) -> list[str]:
    """Text → BM25 terms: casefolded Unicode words, stopwords dropped, lightly stemmed.

    Identifier-like tokens (`foo_bar`, `ERR_4521`, `v1.2.3`, `nats-server`) are kept whole,
    unstemmed, and their parts are emitted too, so `nats-server` matches `nats` and `server`.
    """
    if not text:
        return []
    folded = unicodedata.normalize("NFKC", text).casefold()
    terms: list[str] = []
    for match in _TOKEN_RE.finditer(folded):
        token = match.group()
        parts = _PART_RE.findall(token)
        if len(parts) > 1:
            terms.append(token)
        else:
            parts = [token]
        for part in parts:
            normalised = _normalise(part)
            if normalised:
                terms.append(normalised)
    return terms


@functools.lru_cache(maxsize=_MEMO_TERMS)
def term_id(term: str) -> int:
    """Stable unsigned 32-bit id for a term (Python's `hash()` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(term.encode("utf-8"), digest_size=4).digest(), "big")


def _term_frequencies(terms: Iterable[str]) -> Counter[int]:
    # Counted per id so that a (rare) hash collision merges the two terms instead of
    # producing duplicate indices, which Qdrant rejects.
    return Counter(term_id(t) for t in terms)


def encode_document(
    text: str, avg_len: float = 256.0, k1: float = 1.2, b: float = 0.75
) -> SparseVector:
    """BM25 document weights `tf·(k1+1) / (tf + k1·(1 − b + b·len/avg_len))`, indices sorted."""
    terms = tokenize(text)
    if not terms:
        return SparseVector(indices=[], values=[])
    length_norm = k1 * (1.0 - b + b * len(terms) / avg_len)
    tf = _term_frequencies(terms)
    indices = sorted(tf)
    values = [tf[i] * (k1 + 1.0) / (tf[i] + length_norm) for i in indices]
    return SparseVector(indices=indices, values=values)


def encode_query(text: str) -> SparseVector:
    """One unit weight per distinct query term; Qdrant multiplies in the IDF."""
    indices = sorted(_term_frequencies(tokenize(text)))
    return SparseVector(indices=indices, values=[1.0] * len(indices))


def shared_idf_queries(
    query: SparseVector, stats: Mapping[str, TermStats]
) -> dict[str, SparseVector]:
    """Per KB, `query` weighted so that the engine, which multiplies in that KB's own IDF,
    scores with the IDF of all the KBs together: weight · idf(all) / idf(KB).

    Each collection's IDF counts only its own points, so the same term weighs differently
    in different KBs, and the more so the smaller and the further from the subject a KB
    is: a term rare in an unrelated KB lifts its chunks above better matches elsewhere.
    With shared statistics, BM25 scores of several KBs rank as one KB holding all their
    chunks would. A KB holding none of a term leaves it out of its query."""
    points = sum(s.points for s in stats.values())
    df = {t: sum(s.df.get(t, 0) for s in stats.values()) for t in query.indices}
    out = {}
    for kb, own in stats.items():
        kept = [(t, w) for t, w in zip(query.indices, query.values, strict=True) if own.df.get(t)]
        out[kb] = SparseVector(
            indices=[t for t, _ in kept],
            values=[w * idf(points, df[t]) / idf(own.points, own.df[t]) for t, w in kept],
        )
    return out
