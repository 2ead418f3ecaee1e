"""BM25 sparse encoding: stable hashed term ids, identifier-aware tokens, BM25 weights."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.store.base import SparseVector, TermStats, idf, probed_term_stats
from services.common.store.bm25 import (
    encode_document,
    encode_query,
    shared_idf_queries,
    stem,
    term_id,
    tokenize,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def weights(vector: SparseVector) -> dict[int, float]:
    return dict(zip(vector.indices, vector.values, strict=True))


def test_term_ids_are_stable_across_calls_and_processes() -> None:
    """The same text maps to the same indices in a fresh interpreter with another hash seed,
    so vectors written by one worker match queries from another."""
    text = "NATS JetStream consumers acknowledge ERR_4521 in v1.2.3"
    here = encode_query(text)
    assert here == encode_query(text)
    code = (
        "import json; from services.common.store.bm25 import encode_query; "
        f"v = encode_query({text!r}); print(json.dumps([v.indices, v.values]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    indices, values = json.loads(out.stdout)
    assert indices == here.indices
    assert values == here.values


def test_term_ids_are_unsigned_32_bit() -> None:
    """Ids fit Qdrant's u32 sparse indices and do not depend on Python's salted hash()."""
    ids = [term_id(t) for t in ("nats", "server", "err_4521", "日本語", "")]
    assert all(0 <= i < 2**32 for i in ids)
    digest = hashlib.blake2b(b"nats", digest_size=4).digest()
    assert term_id("nats") == int.from_bytes(digest, "big")


@pytest.mark.parametrize(
    ("text", "whole", "parts"),
    [
        ("nats-server", "nats-server", ["nat", "server"]),
        ("foo_bar", "foo_bar", ["foo", "bar"]),
        ("ERR_4521", "err_4521", ["err", "4521"]),
        ("v1.2.3", "v1.2.3", ["v1", "2", "3"]),
    ],
)
def test_identifiers_are_kept_whole_and_split_into_parts(
    text: str, whole: str, parts: list[str]
) -> None:
    """An identifier matches both exactly and by its parts (`nats-server` ~ `server`)."""
    terms = tokenize(f"see {text} here")
    assert whole in terms
    for part in parts:
        assert part in terms


def test_identifier_query_matches_its_parts() -> None:
    """A document naming `nats-server` shares terms with a query for just `server`."""
    doc = set(encode_document("Start the nats-server binary").indices)
    assert set(encode_query("server").indices) <= doc
    assert set(encode_query("nats-server").indices) <= doc


def test_sentence_punctuation_does_not_join_words() -> None:
    """A full stop ends a word; only `.`/`-` between word characters join."""
    assert tokenize("It failed. Restart it") == ["fail", "restart"]


def test_stopwords_are_dropped_and_case_is_folded() -> None:
    """Function words carry no signal; `The` and `the` are the same (dropped) term."""
    assert tokenize("The server and THE client are in the cluster") == [
        "server",
        "client",
        "cluster",
    ]
    assert encode_query("the of and").indices == []


def test_unicode_words_are_tokens() -> None:
    """Non-ASCII words survive tokenisation unstemmed; compatibility forms are unified."""
    terms = tokenize("Überprüfung naïve café 東京 ＡＢＣ")
    assert terms == ["überprüfung", "naïve", "café", "東京", "abc"]


def test_light_stemming_unifies_inflections() -> None:
    """Plural and -ing/-ed/-ly forms of a word share one term; short words are left alone."""
    assert stem("caches") == stem("cached") == stem("caching") == stem("cache")
    assert stem("queries") == stem("query")
    assert stem("indexes") == stem("indexed") == stem("indexing") == stem("index")
    assert stem("running") == stem("runs") == "run"
    assert stem("status") == "status"
    assert stem("class") == "class"
    assert stem("bus") == "bus"


def test_empty_text_gives_empty_vectors() -> None:
    """No terms → no indices (Qdrant accepts an empty sparse vector)."""
    for text in ("", "   ", "the a of", "!!! ..."):
        assert encode_document(text) == SparseVector(indices=[], values=[])
        assert encode_query(text) == SparseVector(indices=[], values=[])


def test_indices_are_unique_and_sorted() -> None:
    """Qdrant rejects duplicate sparse indices; repeated terms collapse into one entry."""
    vector = encode_document("alpha beta alpha gamma beta alpha nats-server nats server")
    assert vector.indices == sorted(set(vector.indices))
    assert len(vector.values) == len(vector.indices)


def test_term_frequency_saturates() -> None:
    """Weights grow with term frequency but stay below k1 + 1 (BM25 saturation)."""
    k1 = 1.2
    filler = " ".join(f"word{i}" for i in range(20))
    ws = [
        weights(encode_document(f"{'kafka ' * tf}{filler}", k1=k1))[term_id("kafka")]
        for tf in (1, 2, 4, 8, 64)
    ]
    assert ws == sorted(ws)
    assert ws[1] - ws[0] > ws[4] - ws[3]  # diminishing returns
    assert all(w < k1 + 1 for w in ws)


def test_longer_documents_weigh_a_term_less() -> None:
    """Length normalisation: the same tf counts less in a longer document (b > 0)."""
    short = weights(encode_document("kafka " + "x " * 5, avg_len=50))[term_id("kafka")]
    long = weights(encode_document("kafka " + "x " * 200, avg_len=50))[term_id("kafka")]
    assert long < short


def test_document_weight_matches_the_bm25_formula() -> None:
    """tf·(k1+1) / (tf + k1·(1 − b + b·len/avg_len)) with len counted in terms."""
    vector = encode_document("kafka kafka broker", avg_len=4.0, k1=1.5, b=0.5)
    expected = 2 * 2.5 / (2 + 1.5 * (1 - 0.5 + 0.5 * 3 / 4.0))
    assert weights(vector)[term_id("kafka")] == pytest.approx(expected)


def test_query_weights_are_one_per_distinct_term() -> None:
    """Queries carry unit weights (Qdrant applies IDF); repeats do not add weight."""
    vector = encode_query("kafka kafka broker Kafka")
    assert vector.indices == sorted({term_id("kafka"), term_id("broker")})
    assert vector.values == [1.0, 1.0]


def test_shared_idf_queries_give_every_kb_the_idf_of_all_of_them() -> None:
    """The engine multiplies each weight by the KB's own IDF: the product must be the IDF
    over both KBs together (10 + 30 points; term 1 in 9 + 1 of them, term 2 in 3 + 0)."""
    stats = {
        "a": TermStats(points=10, df={1: 9, 2: 3}),
        "b": TermStats(points=30, df={1: 1}),
    }
    query = SparseVector(indices=[1, 2, 3], values=[1.0, 2.0, 1.0])
    out = shared_idf_queries(query, stats)
    assert out["a"].indices == [1, 2] and out["b"].indices == [1]  # no KB holds term 3
    assert out["a"].values[0] * idf(10, 9) == pytest.approx(idf(40, 10))
    assert out["b"].values[0] * idf(30, 1) == pytest.approx(idf(40, 10))
    assert out["a"].values[1] * idf(10, 3) == pytest.approx(2.0 * idf(40, 3))


def test_shared_idf_of_one_kb_is_its_own() -> None:
    query = SparseVector(indices=[1, 2], values=[1.0, 1.0])
    out = shared_idf_queries(query, {"a": TermStats(points=50, df={1: 7, 2: 50})})
    assert out["a"].values == pytest.approx([1.0, 1.0])


@pytest.mark.parametrize("points", [1, 7, 1000, 250_000])
def test_probed_term_stats_invert_the_idf(points: int) -> None:
    """A probe scores idf(points, df) · w; the document frequency is read back exactly."""
    dfs = sorted({1, max(1, points // 3), max(1, points // 2), points})
    probes: dict[int, tuple[float, float] | None] = {
        t: (idf(points, df) * 0.37, 0.37) for t, df in enumerate(dfs)
    }
    probes[len(dfs)] = None
    assert probed_term_stats(points, probes) == TermStats(points, dict(enumerate(dfs)))
