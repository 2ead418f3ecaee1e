"""amx.c's encoder of all-MiniLM-L6-v2 (documents in batches, queries one by one) against
torch fp32, and the build of its library. Skipped where the CPU has no AMX or there is no C
compiler; the build's fallbacks are tested everywhere."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
from pathlib import Path

import numpy as np
import pytest

from services.common.embedders import amx
from services.common.embedders.local import (
    LocalEmbedder,
    OnnxEncoder,
    cpu_flags,
    local_spec,
)
from tests.conftest import MODEL_CACHE_DIR
from tests.integration.test_embedders import (  # noqa: F401 (fixture)
    MINILM,
    local,
    real_chunks,
)


@pytest.fixture(scope="module")
def library() -> Path:
    built = amx.build(MODEL_CACHE_DIR, cpu_flags())
    if built is None:
        pytest.skip("no AMX on this CPU, or no C compiler: amx.c's encoder is not used here")
    return built


def _encoder() -> amx.AmxEncoder:
    spec = local_spec(MINILM)
    library = amx.build(MODEL_CACHE_DIR, cpu_flags())
    assert library is not None
    return amx.AmxEncoder(library, Path(spec.path()), spec.max_seq_length)


EDGES = ["word " * 400, "", "x"]  # past the model's 256 word pieces, empty, one letter


def test_documents_on_amx_match_fp32(
    library: Path,
    local: LocalEmbedder,  # noqa: F811
    real_chunks: list[str],  # noqa: F811
) -> None:
    """Document batches through `kb_encode_documents` embed every real chunk, and texts cut
    at the model's limit, empty or one letter, as fp32 does: cosine ≥ 0.9999 (torch's own
    bfloat16 encoder reaches 0.9998), unit length."""
    texts = [*real_chunks, *EDGES]
    ours = _encoder().encode(texts, query=False)
    fp32 = local.encode(texts)  # onnxruntime fp32, the same as torch fp32
    assert float(np.min(np.sum(ours * fp32, axis=1))) >= 0.9999
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_a_text_in_a_batch_is_embedded_as_alone(
    library: Path,
    real_chunks: list[str],  # noqa: F811
) -> None:
    """Texts packed into one call, and batches split into several calls (past
    `DOCUMENT_ROWS` rows), leave each text's vector bit for bit what it is alone: nothing of
    one text reaches another's."""
    encoder = _encoder()
    texts = [*EDGES, *real_chunks]
    lengths = [len(e.ids) for e in encoder._tokenizer.encode_batch(texts)]
    rows = sum(-(-n // amx.ROWS) * amx.ROWS for n in lengths)
    assert rows > amx.DOCUMENT_ROWS  # more than one call
    together = encoder.encode(texts, query=False)
    alone = np.vstack([encoder.encode([t], query=False) for t in texts])
    assert np.array_equal(together, alone)
    reversed_order = encoder.encode(texts[::-1], query=False)
    assert np.array_equal(reversed_order[::-1], together)


def test_auto_embeds_queries_and_documents_on_amx(library: Path) -> None:
    """`auto` builds the library once in the server process, embeds queries there on it,
    and its single-threaded children embed documents on it, torch never imported in them."""
    auto = LocalEmbedder(MINILM, backend="auto", cache_dir=MODEL_CACHE_DIR)
    auto.load()
    assert isinstance(auto._encoder._queries, amx.AmxEncoder)  # type: ignore[union-attr]
    members = auto._encoder._documents.members  # type: ignore[union-attr]
    assert {m.kind for m in members} == {"amx-bf16"}
    for member in members:
        assert "libtorch" not in Path(f"/proc/{member._child.pid}/maps").read_text()
    # A query embeds on the caller's thread, not through the query lane.
    assert auto.queries_inline
    calls = auto.queries.stats.calls
    text = "where is the configuration file read from"
    vector = asyncio.run(auto.embed([text], query=True))[0]
    assert auto.queries.stats.calls == calls
    assert np.array_equal(np.asarray(vector, dtype=np.float32), auto.encode([text], query=True)[0])


def test_the_library_is_built_once_and_reused(tmp_path: Path) -> None:
    """The first build compiles into the cache; the next finds it and does not rewrite it.
    Where the CPU lacks a flag the kernels need, nothing is compiled."""
    flags = set(amx.CPU_FLAGS)
    built = amx.build(tmp_path, flags)
    if built is None:
        pytest.skip("no C compiler that builds the kernels here")
    stamp = built.stat().st_mtime_ns
    assert amx.build(tmp_path, flags) == built and built.stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "native").iterdir()] == [built.name]
    assert amx.build(tmp_path / "other", flags - {"amx_bf16"}) is None
    assert not (tmp_path / "other").exists()


def test_a_failed_build_gives_no_library_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A compiler that fails, or none at all, gives no library (documents then run on torch
    and queries on onnxruntime), leaves nothing half-written in the cache, and logs why."""
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: error: unsupported option' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    with caplog.at_level(logging.WARNING):
        assert amx.build(tmp_path / "cache", set(amx.CPU_FLAGS)) is None
    assert "unsupported option" in caplog.text
    assert not list((tmp_path / "cache" / "native").iterdir())
    monkeypatch.setenv("CC", "")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert amx.build(tmp_path / "cache", set(amx.CPU_FLAGS)) is None
    assert "no C compiler" in caplog.text


def test_a_library_shipped_beside_the_source_is_used_without_a_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An image compiles the library beside `amx.c` at build time (`python -m
    services.common.embedders.amx`); at run time that one is used, with no compiler and
    nothing written to the model cache."""
    source = tmp_path / "package" / "amx.c"
    source.parent.mkdir()
    source.write_bytes(amx.SOURCE.read_bytes())
    monkeypatch.setattr(amx, "SOURCE", source)
    try:
        amx.main()
    except (OSError, subprocess.SubprocessError):
        pytest.skip("no C compiler that builds the kernels here")
    [shipped] = source.parent.glob("amx-*.so")
    monkeypatch.setenv("CC", "")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert amx.build(tmp_path / "cache", set(amx.CPU_FLAGS)) == shipped
    assert not (tmp_path / "cache").exists()


QUERIES = [
    "copy files and directories",
    "how do I find which process listens on a port",
    "restart the service after changing its configuration",
    "x",
    "",
    "word " * 400,  # past the model's 256 word pieces: cut as for every other path
]


def test_queries_on_amx_match_fp32(
    library: Path,
    local: LocalEmbedder,  # noqa: F811
    real_chunks: list[str],  # noqa: F811
) -> None:
    """The whole encoder in amx.c embeds queries (and real chunks, as long queries) as
    fp32 does: cosine ≥ 0.9999 on every text, unit length."""
    encoder = _encoder()
    texts = [*QUERIES, *real_chunks[:24]]
    ours = encoder.encode(texts, query=True)
    fp32 = local.encode(texts, query=True)  # onnxruntime fp32, the same as torch fp32
    assert float(np.min(np.sum(ours * fp32, axis=1))) >= 0.9999
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_amx_refuses_another_model_and_onnx_answers(
    library: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """amx.c computes all-MiniLM-L6-v2's shape only: another config is refused, and `auto`
    then embeds queries on onnxruntime, with the reason in the log."""
    spec = local_spec(MINILM)
    model_dir = Path(spec.path())
    other = tmp_path / "model"
    other.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 12}))
    with pytest.raises(ValueError, match="not the model"):
        amx.AmxEncoder(library, other, 256)

    def refuse(*_: object) -> None:
        raise ValueError("not the model amx.c computes")

    monkeypatch.setattr(amx, "AmxEncoder", refuse)
    auto = LocalEmbedder(MINILM, backend="auto", cache_dir=MODEL_CACHE_DIR)
    with caplog.at_level(logging.WARNING):
        auto.load(documents=False)
    assert "amx_encoder_unavailable" in caplog.text
    assert isinstance(auto._encoder._queries, OnnxEncoder)  # type: ignore[union-attr]


# Run in a fresh interpreter: one pinned to a single core (no second core: the encode runs
# alone), and one that forks after its first encode (the child's library has no helper
# thread until it starts its own). Each prints its vectors and how many of its own encodes
# had the helper.
_CHILD = """
import os, sys
import numpy as np
from tests.integration.test_amx_encoder import QUERIES, _encoder
if sys.argv[1] == "one-core":
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
encoder = _encoder()
texts = QUERIES + [t.upper() for t in QUERIES[:3]]
vectors = encoder.encode(texts, query=True)
if sys.argv[1] == "fork":
    read, write = os.pipe()
    if os.fork() == 0:
        inherited = encoder.helped_encodes()
        os.write(write, encoder.encode(texts, query=True).tobytes())
        os.write(write, str(encoder.helped_encodes() - inherited).encode())
        os._exit(0)
    os.close(write)
    os.wait()
    data = b""
    while chunk := os.read(read, 1 << 20):
        data += chunk
    size = vectors.nbytes
    vectors = np.frombuffer(data[:size], dtype=np.float32).reshape(vectors.shape)
    helped = int(data[size:])
else:
    helped = encoder.helped_encodes()
np.save(sys.stdout.buffer, vectors)
sys.stdout.buffer.write(str(helped).encode())
"""


def _child(mode: str) -> tuple[np.ndarray, int]:
    import io
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _CHILD, mode],
        capture_output=True,
        check=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    stream = io.BytesIO(done.stdout)
    vectors = np.load(stream)
    return vectors, int(stream.read())


def test_queries_on_two_cores_are_the_vectors_of_one(library: Path) -> None:
    """A second core computes part of each product (amx.c's helper) where the process may
    use one: the vectors are bit for bit those of an encode alone on a single core, with
    several threads encoding at once (one has the helper, the others compute alone), and in
    a forked child, which starts a helper of its own. (A query that starts before the
    helper is back from the last computes alone, so back to back not every encode has it;
    the first of a process always does.)"""
    import os
    from concurrent.futures import ThreadPoolExecutor

    texts = [*QUERIES, *(t.upper() for t in QUERIES[:3])]
    alone, helped_alone = _child("one-core")
    assert helped_alone == 0
    encoder = _encoder()
    before = encoder.helped_encodes()
    ours = encoder.encode(texts, query=True)
    if len(os.sched_getaffinity(0)) > 1:
        assert 1 <= encoder.helped_encodes() - before <= len(texts)
    assert np.array_equal(ours, alone)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda t: encoder.encode([t], query=True)[0], texts * 8))
    assert all(np.array_equal(v, ours[i % len(texts)]) for i, v in enumerate(results))

    forked, helped_in_child = _child("fork")
    assert np.array_equal(forked, alone)
    if len(os.sched_getaffinity(0)) > 1:
        assert 1 <= helped_in_child <= len(texts)
