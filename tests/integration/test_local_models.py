"""Any local model, not one: a second, tiny BERT made here (random weights saved with
transformers, a tokenizer built from a small vocabulary, no download) served by the same
path as the bundled MiniLM; and the CUDA device where a GPU is present."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from services.common.embedders import LocalEmbedder
from services.common.embedders.engine import ModelConfig, TorchEncoder
from services.common.embedders.selection import cuda_available
from tests.conftest import MODEL_CACHE_DIR

WORDS = "the a of to and in is it for on with as by this that search index text query model"
QUERIES = ["search the index", "a query", "text model", "it is"]
DOCUMENTS = [
    "the model is a text index for search and query " * 3,
    "this is it",
    "with the query in the text as it is on the index " * 6,
    "and to of for by that",
]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sentence-transformers directory: 3 layers of width 48, [CLS] pooling, 64 tokens."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    model_dir = tmp_path_factory.mktemp("tiny-bert")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS.split()]
    vocab += [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"] + list("abcdefghijklmnopqrstuvwxyz")
    (model_dir / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(model_dir / "vocab.txt")).save_pretrained(model_dir)
    torch.manual_seed(7)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=128,
    )
    BertModel(config).eval().save_pretrained(model_dir, safe_serialization=True)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    (model_dir / "modules.json").write_text(json.dumps(modules))
    (model_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64}))
    (model_dir / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 48, "pooling_mode_cls_token": True}
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (model_dir / "2_Normalize").mkdir()
    return model_dir


async def test_a_second_model_serves_with_shapes_from_its_config(
    tiny_bert: Path, tmp_path: Path
) -> None:
    """Dimensions, layers, sequence limit and pooling come from the directory; its queries
    and documents (one past the 64-token cut) embed within cosine 0.999 of torch fp32."""
    config = ModelConfig.read(tiny_bert)
    assert (config.dim, config.layers, config.max_seq_length, config.pooling) == (48, 3, 64, "cls")
    model = LocalEmbedder(
        "local/tiny-bert", model_dir=tiny_bert, backend="onnx", cache_dir=tmp_path
    )
    assert (model.dim, model.max_tokens, model.model) == (48, 62, "local/tiny-bert")
    reference = TorchEncoder(tiny_bert)
    for texts, query in ((QUERIES, True), (DOCUMENTS, False)):
        vectors = np.asarray(await model.embed(texts, query=query), dtype=np.float32)
        assert vectors.shape == (len(texts), 48)
        assert float(cosines(vectors, reference.encode(texts, query=query)).min()) >= 0.999
    assert model.count_tokens("search the index") == 3


def test_a_directory_with_a_projection_after_pooling_is_refused(tiny_bert: Path) -> None:
    """Modules that change vectors after pooling are not served (wrong vectors otherwise)."""
    modules = json.loads((tiny_bert / "modules.json").read_text())
    modules.append(
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    )
    other = tiny_bert.parent / "with-dense"
    other.mkdir(exist_ok=True)
    for name in ("config.json", "sentence_bert_config.json"):
        (other / name).write_text((tiny_bert / name).read_text())
    (other / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="Dense"):
        ModelConfig.read(other)


@pytest.mark.skipif(
    not cuda_available(), reason="no CUDA device that torch can use: the GPU path is not run"
)
def test_on_a_gpu_documents_and_queries_embed_on_cuda_close_to_torch_fp32_on_cpu() -> None:
    """`auto` picks the GPU where torch sees one and runs documents there in fp16, within
    cosine 0.999 of the CPU reference; queries go to whichever engine answered one faster at
    load, the GPU (0.999 again) or the CPU's own (int8 there: 0.98, as
    `test_int8_precision_stays_close_to_torch_fp32` holds it)."""
    auto = LocalEmbedder(backend="auto", cache_dir=MODEL_CACHE_DIR)
    assert (auto.selection.device, auto.selection.engine) == ("cuda", "torch")
    assert auto.selection.precision == "fp16"
    auto.load()
    cpu = LocalEmbedder(backend="torch", device="cpu")
    texts = [*QUERIES, *DOCUMENTS, "word " * 400]
    documents = cosines(auto.encode(texts), cpu.encode(texts))
    assert float(documents.min()) >= 0.999
    queries = cosines(auto.encode(texts, query=True), cpu.encode(texts, query=True))
    on_cpu_int8 = auto.query_engine == "cpu" and auto.selection.query_cpu == "int8"
    assert float(queries.min()) >= (0.98 if on_cpu_int8 else 0.999)


def test_queries_go_to_the_cpu_engine_where_it_answers_faster_than_the_torch_one() -> None:
    """The load path a GPU takes, run with torch on the CPU in the GPU's place: the CPU's
    int8 engine is timed against it, answers one query faster (as on the H200), and from
    then on embeds the queries while documents stay on torch; the two agree (cosine ≥ 0.98,
    int8's bound), so queries and documents of one KB still meet."""
    embedder = LocalEmbedder(backend="torch", device="cpu", cache_dir=MODEL_CACHE_DIR)
    embedder.selection = dataclasses.replace(embedder.selection, query_cpu="int8")
    embedder.load()
    assert embedder.query_engine == "cpu"
    texts = [*QUERIES, *DOCUMENTS]
    reference = TorchEncoder(embedder.model_dir)
    queries, documents = embedder.encode(texts, query=True), embedder.encode(texts)
    assert np.allclose(documents, reference.encode(texts, query=False), atol=1e-5)
    assert not np.allclose(queries, documents, atol=1e-4)  # another engine answered
    assert float(cosines(queries, documents).min()) >= 0.98
