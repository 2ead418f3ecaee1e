"""How a GPU is used, decided without one: document batches sized by tokens, fp16 documents on
CUDA with the CPU's engine kept for queries where it answers one faster, and the rule that
picks the query engine from timings measured at load."""

from __future__ import annotations

import random

import pytest

from services.common.embedders import selection
from services.common.embedders.engine import faster_for_queries, token_batches


def padded(batch: list[int], lengths: list[int]) -> int:
    """Tokens a batch costs: every row padded to its longest."""
    return len(batch) * max(lengths[i] for i in batch)


def test_token_batches_cover_every_text_once_within_the_budget_shortest_first() -> None:
    """Every text is in exactly one batch; no batch pads past the budget; texts go shortest
    first, so a batch holds texts of similar length and pads little."""
    rng = random.Random(5)
    lengths = [rng.randint(3, 256) for _ in range(2000)]
    budget = 32 * 256
    batches = token_batches(lengths, budget)
    flat = [i for batch in batches for i in batch]
    assert sorted(flat) == list(range(len(lengths)))
    assert all(padded(b, lengths) <= budget for b in batches)
    assert [lengths[i] for i in flat] == sorted(lengths)
    # Sorted, the padding is a small share of the tokens run (in input order, about half).
    real = sum(lengths)
    assert sum(padded(b, lengths) for b in batches) < 1.05 * real
    in_order = [list(range(i, min(i + 32, len(lengths)))) for i in range(0, len(lengths), 32)]
    assert sum(padded(b, lengths) for b in in_order) > 1.5 * real


def test_a_budget_of_256_full_rows_takes_more_rows_of_short_texts() -> None:
    """256 × the sequence limit holds 256 texts at the limit in a batch, and four times as
    many at a quarter of it: short chunks are not run in small batches."""
    budget = 256 * 256
    assert [len(b) for b in token_batches([256] * 600, budget)] == [256, 256, 88]
    assert [len(b) for b in token_batches([64] * 2048, budget)] == [1024, 1024]


def test_a_text_longer_than_the_budget_runs_alone() -> None:
    """A budget smaller than one text never leaves it out nor stalls: it runs by itself."""
    assert token_batches([10, 500, 20], 100) == [[0, 2], [1]]
    assert token_batches([], 100) == []


def test_queries_go_to_the_engine_with_the_lower_median() -> None:
    """The issue's figures (H200: 8.6 ms p50 on the GPU; the CPU's int8 engine 2.3 to 5.5 ms
    on two cores) send queries to the CPU; a GPU that answers faster keeps them; one slow
    outlier does not decide (the median does); a tie keeps the document engine."""
    gpu = [8.6, 8.4, 8.9, 8.6, 8.7]
    assert faster_for_queries(gpu, [2.3, 2.4, 2.3, 2.5, 2.2]) == "cpu"
    assert faster_for_queries(gpu, [5.5, 5.4, 5.6, 5.5, 5.3]) == "cpu"
    assert faster_for_queries([2.0, 2.1, 2.0], [5.5, 5.4, 5.6]) == "documents"
    assert faster_for_queries(gpu, [2.3, 2.3, 90.0, 2.4, 2.2]) == "cpu"
    assert faster_for_queries([3.0, 3.0, 3.0], [3.0, 3.0, 3.0]) == "documents"
    with pytest.raises(ValueError, match="timings"):
        faster_for_queries([], [2.0])


@pytest.mark.parametrize(("kind", "query_precision"), [("avx2", "int8"), ("other", "fp32")])
def test_on_cuda_documents_run_fp16_and_the_cpu_engine_is_a_query_candidate(
    kind: str, query_precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`auto` on a GPU: torch in fp16 for documents (cosine 0.99976 to fp32 on the H200), and
    this CPU kind's own engine and precision as the candidate for queries."""
    monkeypatch.setattr(selection, "cuda_available", lambda: True)
    monkeypatch.setattr(selection, "cpu_kind", lambda: kind)
    chosen = selection.select("auto", "auto")
    assert (chosen.engine, chosen.device, chosen.precision) == ("torch", "cuda", "fp16")
    assert chosen.query_cpu == query_precision
    assert f"query_cpu={query_precision}" in str(chosen)


def test_an_operator_choice_on_cuda_keeps_queries_on_the_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`KBMESH_LOCAL_PRECISION=fp32` keeps fp32 on the GPU for queries and documents alike,
    as does the torch backend (the reference); on the CPU there is no second engine."""
    monkeypatch.setattr(selection, "cuda_available", lambda: True)
    monkeypatch.setattr(selection, "cpu_kind", lambda: "avx2")
    fp32 = selection.select("auto", "auto", "fp32")
    assert (fp32.precision, fp32.query_cpu) == ("fp32", None)
    reference = selection.select("torch", "auto")
    assert (reference.device, reference.precision, reference.query_cpu) == ("cuda", "fp32", None)
    on_cpu = selection.select("auto", "cpu")
    assert (on_cpu.engine, on_cpu.query_cpu) == ("onnxruntime", None)
