"""amx.c's kernels (attention on AMX tiles, layer norm) against torch's own, and the bfloat16
document encoder that runs on them. Skipped where the CPU has no AMX or there is no C
compiler; the build's fallbacks are tested everywhere."""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from services.common.embedders import amx
from services.common.embedders.local import (
    LocalEmbedder,
    OnnxEncoder,
    TorchEncoder,
    cpu_flags,
    local_spec,
)
from tests.conftest import MODEL_CACHE_DIR
from tests.integration.test_embedders import (  # noqa: F401 (fixture)
    MINILM,
    local,
    real_chunks,
)

HEADS = 12


@pytest.fixture(scope="module")
def kernels() -> amx.AmxKernels:
    loaded = amx.load(amx.build(MODEL_CACHE_DIR, cpu_flags()))
    if loaded is None:
        pytest.skip("no AMX on this CPU, or no C compiler: the encoder keeps torch's kernels")
    return loaded


def _attention_inputs(lengths: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(n + len(lengths))
    qkv = torch.randn(len(lengths), n, 3 * HEADS * 32, generator=generator) * 1.5
    return qkv.bfloat16(), torch.tensor(lengths, dtype=torch.int32)


def _torch_attention(qkv: torch.Tensor, lengths: torch.Tensor, *, exact: bool) -> torch.Tensor:
    batch, n, _ = qkv.shape
    seen = torch.arange(n) < lengths[:, None]
    q, k, v = qkv.view(batch, n, 3, HEADS, 32).permute(2, 0, 3, 1, 4).unbind(0)
    if exact:
        q, k, v = q.float(), k.float(), v.float()
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=seen[:, None, None, :], scale=32**-0.5
    )
    return out.transpose(1, 2).reshape(batch, n, -1).float()


@pytest.mark.parametrize(
    ("n", "lengths"),
    [(16, [16, 1, 9]), (48, [48, 17, 31, 33, 2]), (208, [208, 193, 100, 64, 15]), (256, [256])],
)
def test_amx_attention_rounds_as_torch_bfloat16_does(
    kernels: amx.AmxKernels, n: int, lengths: list[int]
) -> None:
    """Over each text's real positions, the kernel's attention is as close to fp32 as
    torch's bfloat16 attention is (its error at most 10 % larger and 0.03 at worst); blocks
    of 16 padded queries come out as zeros, which nothing reads."""
    qkv, length = _attention_inputs(lengths, n)
    ours = kernels.attention(qkv, length, HEADS, 32**-0.5).float()
    exact = _torch_attention(qkv, length, exact=True)
    theirs = _torch_attention(qkv, length, exact=False)
    for i, real in enumerate(lengths):
        error = (ours[i, :real] - exact[i, :real]).abs().max().item()
        torch_error = (theirs[i, :real] - exact[i, :real]).abs().max().item()
        assert error <= max(1.1 * torch_error, 1e-3) and error < 0.03, (i, error, torch_error)
        padded_from = -(-real // 16) * 16
        assert not ours[i, padded_from:].any()


def test_amx_layer_norm_rounds_as_torch_bfloat16_does(kernels: amx.AmxKernels) -> None:
    """The kernel's layer norm, in place, differs from torch's on bfloat16 by at most one
    rounding step of bfloat16 in a few elements."""
    generator = torch.Generator().manual_seed(7)
    x = (torch.randn(5, 37, 384, generator=generator) * 3 + 0.5).bfloat16()
    norm = torch.nn.LayerNorm(384, eps=1e-12).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(384, generator=generator))
        norm.bias.copy_(torch.randn(384, generator=generator))
        expected = norm(x).float()
    assert kernels.fits_layer_norm(x, norm)
    ours = kernels.layer_norm_(x, norm)
    assert ours.data_ptr() == x.data_ptr()
    differ = ours.float() != expected
    assert differ.float().mean() < 1e-3
    steps = (ours.float() - expected).abs() / expected.abs().clamp(min=2**-10)
    assert float(steps.max()) <= 2**-7


def test_the_kernels_decline_what_they_do_not_compute(kernels: amx.AmxKernels) -> None:
    """Shapes and types outside the kernels' own go to torch's kernels instead."""
    qkv, _ = _attention_inputs([40], 48)
    assert kernels.fits_attention(qkv, 32)
    assert not kernels.fits_attention(qkv, 64)  # another head size
    assert not kernels.fits_attention(qkv[:, :40], 32)  # not a multiple of 16
    assert not kernels.fits_attention(qkv.float(), 32)
    norm = torch.nn.LayerNorm(384).bfloat16()
    assert not kernels.fits_layer_norm(torch.zeros(2, 384), norm)  # fp32 input
    assert not kernels.fits_layer_norm(torch.zeros(2, 40, dtype=torch.bfloat16), norm)


def test_bfloat16_encoder_on_the_amx_kernels_embeds_as_on_torchs(
    kernels: amx.AmxKernels,
    real_chunks: list[str],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the library the bfloat16 encoder runs every layer's attention and both layer
    norms on it, and embeds every real chunk (and edge inputs, padded in batches) as it
    does on torch's kernels: cosine ≥ 0.9999."""
    spec = local_spec(MINILM)
    path = amx.build(MODEL_CACHE_DIR, cpu_flags())
    on_amx = TorchEncoder(Path(spec.path()), spec, 32, bf16=True, amx_kernels=path)
    on_torch = TorchEncoder(Path(spec.path()), spec, 32, bf16=True)
    assert on_amx.kind == "torch-bf16-fused-amx" and on_torch.kind == "torch-bf16-fused"
    calls = {"attention": 0, "layer_norm": 0}

    def counted(name: str, method: object) -> object:
        def call(*args: object) -> object:
            calls[name] += 1
            return method(*args)  # type: ignore[operator]

        return call

    layer = on_amx._st[0].auto_model.encoder.layer[0]
    shared = layer.attention.self.kernels
    assert isinstance(shared, amx.AmxKernels) and layer.output.kernels is shared
    monkeypatch.setattr(shared, "attention", counted("attention", shared.attention))
    monkeypatch.setattr(shared, "layer_norm_", counted("layer_norm", shared.layer_norm_))
    texts = [*real_chunks, "word " * 400, "", "x"]
    ours = on_amx.encode(texts, query=False)
    sub_batches = -(-len(texts) // 16)
    assert calls == {"attention": 6 * sub_batches, "layer_norm": 12 * sub_batches}
    cos = np.sum(ours * on_torch.encode(texts, query=False), axis=1)
    assert float(cos.min()) >= 0.9999


def test_auto_children_run_on_the_amx_kernels(kernels: amx.AmxKernels) -> None:
    """`auto` builds the library once in the server process, embeds queries there on it,
    and its single-threaded bfloat16 children load it."""
    auto = LocalEmbedder(MINILM, backend="auto", cache_dir=MODEL_CACHE_DIR)
    auto.load()
    assert isinstance(auto._encoder._queries, amx.AmxQueryEncoder)  # type: ignore[union-attr]
    assert {m.kind for m in auto._encoder._documents.members} == {"torch-bf16-fused-amx"}  # type: ignore[union-attr]


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


def test_a_failed_build_leaves_torchs_kernels_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A compiler that fails, or none at all, gives no library (the encoder keeps torch's
    kernels), leaves nothing half-written in the cache, and logs why."""
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
    assert amx.load(None) is None


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


def _query_encoder() -> amx.AmxQueryEncoder:
    from services.common.embedders.tokenizing import model_input_tokenizer

    spec = local_spec(MINILM)
    model_dir = Path(spec.path())
    library = amx.build(MODEL_CACHE_DIR, cpu_flags())
    assert library is not None
    return amx.AmxQueryEncoder(
        library, model_dir, model_input_tokenizer(model_dir, spec.max_seq_length)
    )


def test_queries_on_amx_match_fp32(
    kernels: amx.AmxKernels,
    local: LocalEmbedder,  # noqa: F811
    real_chunks: list[str],  # noqa: F811
) -> None:
    """The whole encoder in amx.c embeds queries (and real chunks, as long queries) as
    fp32 does: cosine ≥ 0.9999 on every text, unit length."""
    encoder = _query_encoder()
    texts = [*QUERIES, *real_chunks[:24]]
    ours = encoder.encode(texts, query=True)
    fp32 = local.encode(texts, query=True)  # onnxruntime fp32, the same as torch fp32
    assert float(np.min(np.sum(ours * fp32, axis=1))) >= 0.9999
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_queries_on_amx_refuse_another_model_and_onnx_answers(
    kernels: amx.AmxKernels,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`kb_encode_query` computes all-MiniLM-L6-v2's shape only: another config is refused,
    and `auto` then embeds queries on onnxruntime, with the reason in the log."""
    from services.common.embedders.tokenizing import model_input_tokenizer

    spec = local_spec(MINILM)
    model_dir = Path(spec.path())
    other = tmp_path / "model"
    other.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 12}))
    library = amx.build(MODEL_CACHE_DIR, cpu_flags())
    assert library is not None
    with pytest.raises(ValueError, match="not the model"):
        amx.AmxQueryEncoder(library, other, model_input_tokenizer(model_dir, 256))

    def refuse(*_: object) -> None:
        raise ValueError("not the model kb_encode_query computes")

    monkeypatch.setattr(amx, "AmxQueryEncoder", refuse)
    auto = LocalEmbedder(MINILM, backend="auto", cache_dir=MODEL_CACHE_DIR)
    with caplog.at_level(logging.WARNING):
        auto.load(documents=False)
    assert "amx_queries_unavailable" in caplog.text
    assert isinstance(auto._encoder._queries, OnnxEncoder)  # type: ignore[union-attr]


# Run in a fresh interpreter: one pinned to a single core (no second core: the encode runs
# alone), and one that forks after its first encode (the child's library has no helper
# thread until it starts its own). Each prints its vectors and how many of its own encodes
# had the helper.
_CHILD = """
import os, sys
import numpy as np
from tests.integration.test_amx_kernels import QUERIES, _query_encoder
if sys.argv[1] == "one-core":
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
encoder = _query_encoder()
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


def test_queries_on_two_cores_are_the_vectors_of_one(kernels: amx.AmxKernels) -> None:
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
    encoder = _query_encoder()
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
