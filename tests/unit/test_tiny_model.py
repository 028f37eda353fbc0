"""The tiny test model (tests/fixtures/tiny_model.py) as the daemon's footprint
predictor reads it: the fleet tests size their memory budget from this
prediction, so it must read the file, not fall back to the file's size.
(tests/e2e/test_fleet.py loads the same file in llama.cpp.)"""

from __future__ import annotations

import pytest

pytest.importorskip("gguf")

from daemon.model.footprint import kv_cache_bytes, predict, shape_of  # noqa: E402
from daemon.model.gguf_header import read_header  # noqa: E402
from tests.fixtures import tiny_model as tiny  # noqa: E402


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny.write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def expected_tensor_bytes() -> int:
    e, f, v, kv = tiny.N_EMBD, tiny.N_FF, tiny.N_VOCAB, tiny.N_HEAD_KV * tiny.N_EMBD // tiny.N_HEAD
    per_layer = 2 * e + e * e + 2 * e * kv + e * e + 3 * e * f  # norms, q, k + v, output, gate + up + down
    return 4 * (2 * v * e + e + tiny.N_LAYER * per_layer)  # F32: embeddings, output, output norm, layers


def test_header_has_what_llama_cpp_reads(path):
    header = read_header(path)
    meta = header.metadata
    assert meta["general.architecture"] == "llama" and meta["tokenizer.ggml.model"] == "llama"
    for key, want in (("block_count", tiny.N_LAYER), ("embedding_length", tiny.N_EMBD),
                      ("feed_forward_length", tiny.N_FF), ("attention.head_count", tiny.N_HEAD),
                      ("attention.head_count_kv", tiny.N_HEAD_KV), ("context_length", tiny.CONTEXT_LENGTH),
                      ("rope.dimension_count", tiny.N_EMBD // tiny.N_HEAD)):
        assert meta[f"llama.{key}"] == want, key
    assert "llama.attention.layer_norm_rms_epsilon" in meta
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]) == (tiny.BOS, tiny.EOS)
    assert header.tensor_bytes == expected_tensor_bytes()
    assert len(header.tensors) == 3 + 9 * tiny.N_LAYER


def test_vocabulary_has_every_byte_fallback_and_unique_pieces():
    tokens, scores, types = tiny.vocabulary()
    assert len(tokens) == len(scores) == len(types) == tiny.N_VOCAB == len(set(tokens))
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert [tokens.index(f"<0x{b:02X}>") for b in range(256)] == list(range(3, 259))
    assert {types[i] for i in range(3, 259)} == {tiny.BYTE}
    for word in tiny.WORDS:  # reachable by merges: every prefix is a piece
        assert all(tiny.SPACE + word[:k] in tokens for k in range(1, len(word) + 1)), word


def test_the_predictor_reads_the_tiny_model(path):
    shape = shape_of(read_header(path))
    head = tiny.N_EMBD // tiny.N_HEAD
    assert (shape.n_embd, shape.n_ff, shape.n_vocab, shape.n_swa) == (tiny.N_EMBD, tiny.N_FF, tiny.N_VOCAB, 0)
    assert [(layer.k_width, layer.v_width, layer.sliding) for layer in shape.layers] == \
        [(tiny.N_HEAD_KV * head, tiny.N_HEAD_KV * head, False)] * tiny.N_LAYER

    small = predict(path, ctx_size=512, parallel=2)
    assert small.model == expected_tensor_bytes()
    # 512 cells in two streams of 256; K and V in f16 for each layer.
    kv = kv_cache_bytes(shape, ctx_size=512, parallel=2, batch_size=512, type_k=1, type_v=1, swa_full=True)
    assert kv == tiny.N_LAYER * 512 * 2 * (tiny.N_HEAD_KV * head) * 2
    assert small.context > kv  # plus the output and compute buffers
    # More context, more bytes: the fleet tests tell models apart by this.
    assert predict(path, ctx_size=2048, parallel=2).context > small.context
