"""Footprints: the GGUF header reader, the prediction, and the store of measurements.

Test files are written with the `gguf` package (a test dependency only; the
daemon reads headers with its own reader), so shapes and bytes are known.
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from daemon.model import footprint as fp  # noqa: E402
from daemon.model.footprint import Footprint, LayerCache, ModelShape, kv_cache_bytes, predict, shape_of  # noqa: E402
from daemon.model.footprint_store import FootprintStore, footprint_key  # noqa: E402
from daemon.model.gguf_header import GGML_TYPES, GgufError, SkippedArray, read_header  # noqa: E402

Q = gguf.GGMLQuantizationType


# -- writing test models --

def _quantized(rows: int, row_elements: int, qtype: Q) -> np.ndarray:
    """Raw bytes of a quantized matrix: gguf takes them as uint8 rows and works out the shape."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return np.zeros((rows, row_elements // block * size), dtype=np.uint8)


def write_model(path: Path, *, arch: str = "llama", n_layer: int = 2, n_embd: int = 64, n_head: int = 4,
                n_head_kv: int | list[int] | None = 2, n_ff: int = 256, n_vocab: int = 40,
                metadata: dict | None = None, split_max_tensors: int = 0) -> tuple[Path, int]:
    """A small model of known tensor bytes; returns (path, sum of tensor bytes)."""
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    writer.add_uint32(f"{arch}.block_count", n_layer)
    writer.add_uint32(f"{arch}.embedding_length", n_embd)
    writer.add_uint32(f"{arch}.feed_forward_length", n_ff)
    writer.add_uint32(f"{arch}.attention.head_count", n_head)
    if isinstance(n_head_kv, list):
        writer.add_array(f"{arch}.attention.head_count_kv", n_head_kv)
    elif n_head_kv is not None:
        writer.add_uint32(f"{arch}.attention.head_count_kv", n_head_kv)
    writer.add_token_list([f"tok{i}" for i in range(n_vocab)])
    for key, value in (metadata or {}).items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        else:
            writer.add_uint32(key, value)
    expected = 0

    def tensor(name: str, data: np.ndarray, nbytes: int, qtype: Q | None = None) -> None:
        nonlocal expected
        writer.add_tensor(name, data, raw_dtype=qtype)
        expected += nbytes

    tensor("token_embd.weight", _quantized(n_vocab, n_embd, Q.Q8_0), n_vocab * n_embd // 32 * 34, Q.Q8_0)
    tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32), n_embd * 4)
    for il in range(n_layer):
        tensor(f"blk.{il}.attn_q.weight", np.zeros((n_embd, n_embd), dtype=np.float16), n_embd * n_embd * 2)
        tensor(f"blk.{il}.ffn_up.weight", _quantized(n_embd, n_ff, Q.Q4_K), n_embd * n_ff // 256 * 144, Q.Q4_K)
        tensor(f"blk.{il}.ffn_down.weight", _quantized(n_ff, n_embd, Q.Q4_0), n_ff * n_embd // 32 * 18, Q.Q4_0)
        tensor(f"blk.{il}.attn_k.weight", _quantized(n_embd, n_embd, Q.BF16), n_embd * n_embd * 2, Q.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, expected


# -- the header reader --

def test_tensor_bytes_are_exact(tmp_path):
    path, expected = write_model(tmp_path / "m.gguf", n_layer=3)
    header = read_header(path)
    assert header.version == 3
    assert header.tensor_bytes == expected
    by_name = {t.name: t for t in header.tensors}
    assert len(by_name) == 2 + 3 * 4
    ffn_up = by_name["blk.1.ffn_up.weight"]
    assert (ffn_up.dims, ffn_up.type_name, ffn_up.n_bytes) == ((256, 64), "Q4_K", 64 * 144)
    assert by_name["token_embd.weight"].dims == (64, 40)
    assert header.data_offset % 32 == 0


def test_type_table_agrees_with_the_gguf_package():
    for qtype, (block, size) in gguf.GGML_QUANT_SIZES.items():
        if qtype == Q.Q8_1:
            continue  # gguf-py still has the old float layout (40 bytes); ggml's block_q8_1 is two fp16 + 32 int8
        assert GGML_TYPES[int(qtype)][1:] == (block, size), qtype.name


def test_metadata_values_of_every_type(tmp_path):
    path = tmp_path / "kv.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.5)
    writer.add_uint64("t.u64", 2**63)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.25)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_array("t.short", [1, 2, 3])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_array("t.strings", ["a", "bc"])
    writer.add_array("t.long_ints", list(range(5000)))
    writer.add_array("t.long_strings", [f"s{i}" for i in range(3000)])
    writer.add_custom_alignment(64)
    writer.add_tensor("x", np.zeros(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    header = read_header(path)
    meta = header.metadata
    assert (meta["t.u8"], meta["t.i8"], meta["t.u16"], meta["t.i16"]) == (200, -5, 60000, -30000)
    assert (meta["t.u32"], meta["t.i32"]) == (4_000_000_000, -2_000_000_000)
    assert (meta["t.u64"], meta["t.i64"]) == (2**63, -(2**62))
    assert (meta["t.f32"], meta["t.f64"], meta["t.bool"], meta["t.str"]) == (0.5, 0.25, True, "héllo")
    assert meta["t.short"] == (1, 2, 3)
    assert meta["t.nested"] == ((1, 2), (3,))
    assert meta["t.strings"] == ("a", "bc")
    # Long arrays are walked past: only what they hold and how many.
    assert meta["t.long_ints"] == SkippedArray(element_type=gguf.GGUFValueType.INT32, length=5000)
    assert meta["t.long_strings"] == SkippedArray(element_type=gguf.GGUFValueType.STRING, length=3000)
    assert header.data_offset % 64 == 0
    assert header.tensors[0].n_bytes == 64


def test_the_bundled_vocabulary_is_skipped_not_decoded():
    from config import Settings
    from daemon.model.files import bundled_model

    header = read_header(bundled_model(Settings()))
    assert header.metadata["tokenizer.ggml.tokens"] == SkippedArray(gguf.GGUFValueType.STRING, 262144)
    assert header.metadata["general.architecture"] == "gemma3"


# -- hostile files: each one is a GgufError, never struct.error, MemoryError or UnicodeDecodeError --

def _s(text: bytes | str) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _file(*, magic: bytes = b"GGUF", version: int = 3, n_tensors: int = 0, n_kv: int = 0, body: bytes = b"",
          pad_to: int = 0) -> bytes:
    raw = magic + struct.pack("<IQQ", version, n_tensors, n_kv) + body
    return raw + b"\0" * max(0, pad_to - len(raw))


def _kv_u32(key: str, value: int) -> bytes:
    return _s(key) + struct.pack("<II", gguf.GGUFValueType.UINT32, value)


def _tensor(name: str, dims: tuple[int, ...], ggml_type: int = 0, offset: int = 0) -> bytes:
    return _s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + \
        struct.pack("<IQ", ggml_type, offset)


STRING, ARRAY, UINT8 = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT8

HOSTILE = {
    "empty": b"",
    "wrong magic": b"GGML" + bytes(40),
    "version 1": _file(version=1),
    "version 99": _file(version=99),
    "big-endian": b"GGUF" + struct.pack(">IQQ", 3, 0, 0),
    "key of 2**60 bytes": _file(n_kv=1, body=struct.pack("<Q", 2**60) + b"k", pad_to=1024),
    "string value of 2**60 bytes": _file(n_kv=1, body=_s("k") + struct.pack("<IQ", STRING, 2**60) + b"abc"),
    "array of 2**40 bytes": _file(n_kv=1, body=_s("k") + struct.pack("<IIQ", ARRAY, UINT8, 2**40), pad_to=1024),
    "array of 2**40 strings": _file(n_kv=1, body=_s("k") + struct.pack("<IIQ", ARRAY, STRING, 2**40), pad_to=1024),
    "2**40 keys": _file(n_kv=2**40, pad_to=1024),
    "2**40 tensors": _file(n_tensors=2**40, pad_to=1024),
    "tensor of 2**40 elements in 1 KB": _file(n_tensors=1, body=_tensor("t", (2**20, 2**20)), pad_to=1024),
    "tensor dims overflow": _file(n_tensors=1, body=_tensor("t", (2**64 - 1,) * 4), pad_to=1024),
    "unknown ggml type": _file(n_tensors=1, body=_tensor("t", (4,), ggml_type=99), pad_to=1024),
    "removed ggml type (Q4_2)": _file(n_tensors=1, body=_tensor("t", (32,), ggml_type=4), pad_to=1024),
    "five dimensions": _file(n_tensors=1, body=_tensor("t", (1, 1, 1, 1, 1)), pad_to=1024),
    "partial block": _file(n_tensors=1, body=_tensor("t", (33,), ggml_type=8), pad_to=1024),
    "misaligned tensor": _file(n_tensors=1, body=_tensor("t", (1,), offset=3), pad_to=1024),
    "tensor past the end": _file(n_tensors=1, body=_tensor("t", (8,), offset=1024), pad_to=1024),
    "duplicate tensor": _file(n_tensors=2, body=_tensor("t", (1,)) + _tensor("t", (1,), offset=32), pad_to=1024),
    "tensor name of 100 bytes": _file(n_tensors=1, body=_tensor("t" * 100, (1,)), pad_to=1024),
    "duplicate key": _file(n_kv=2, body=_kv_u32("k", 1) + _kv_u32("k", 2)),
    "key not UTF-8": _file(n_kv=1, body=_s(b"\xff\xfe") + struct.pack("<II", gguf.GGUFValueType.UINT32, 1)),
    "unknown value type": _file(n_kv=1, body=_s("k") + struct.pack("<II", 99, 0), pad_to=64),
    "unknown array element type": _file(n_kv=1, body=_s("k") + struct.pack("<IIQ", ARRAY, 99, 1), pad_to=64),
    "arrays nested 100 deep": _file(n_kv=1, body=_s("k") + struct.pack("<I", ARRAY)
                                    + struct.pack("<IQ", ARRAY, 1) * 100 + struct.pack("<IQ", UINT8, 0)),
    "alignment 0": _file(n_kv=1, body=_kv_u32("general.alignment", 0)),
    "alignment 3": _file(n_kv=1, body=_kv_u32("general.alignment", 3)),
}


# What each message must name (the file's path is always in it).
PROBLEM = {
    "empty": "not a GGUF file", "wrong magic": "not a GGUF file", "version 1": "version 1",
    "version 99": "version 99", "big-endian": "big-endian", "key of 2**60 bytes": "key of 1152921504606846976 bytes",
    "string value of 2**60 bytes": "string of 1152921504606846976 bytes",
    "array of 2**40 bytes": "array of 1099511627776 elements", "array of 2**40 strings": "array of 1099511627776",
    "2**40 keys": "1099511627776 metadata keys", "2**40 tensors": "1099511627776 tensors",
    "tensor of 2**40 elements in 1 KB": "needs more bytes", "tensor dims overflow": "needs more bytes",
    "unknown ggml type": "unknown ggml type 99", "removed ggml type (Q4_2)": "unknown ggml type 4",
    "five dimensions": "5 dimensions", "partial block": "Q8_0 blocks", "misaligned tensor": "not aligned",
    "tensor past the end": "ends past", "duplicate tensor": "duplicate tensor", "tensor name of 100 bytes": "name",
    "duplicate key": "duplicate metadata key", "key not UTF-8": "not UTF-8", "unknown value type": "value type 99",
    "unknown array element type": "element type 99", "arrays nested 100 deep": "nested",
    "alignment 0": "alignment", "alignment 3": "alignment",
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_header_is_a_gguf_error(tmp_path, case):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(HOSTILE[case])
    with pytest.raises(GgufError) as info:
        read_header(path)
    assert str(path) in str(info.value)
    assert PROBLEM[case] in str(info.value)


def test_missing_file_and_directory_are_gguf_errors(tmp_path):
    with pytest.raises(GgufError, match="cannot be read"):
        read_header(tmp_path / "absent.gguf")
    with pytest.raises(GgufError, match="cannot be read"):
        read_header(tmp_path)


def test_every_truncation_of_a_valid_file_is_a_gguf_error(tmp_path):
    path, _ = write_model(tmp_path / "whole.gguf", n_layer=1, n_embd=32, n_ff=256, n_vocab=8)
    whole = path.read_bytes()
    header_end = read_header(path).data_offset
    cut = tmp_path / "cut.gguf"
    # Every byte of the header; past it only the tensors' extent is at stake.
    for size in list(range(header_end)) + list(range(header_end, len(whole), 61)):
        cut.write_bytes(whole[:size])
        with pytest.raises(GgufError):
            read_header(cut)


def test_truncations_of_a_file_with_a_skipped_vocabulary(tmp_path):
    path, _ = write_model(tmp_path / "whole.gguf", n_layer=1, n_vocab=3000)
    whole = path.read_bytes()
    header_end = read_header(path).data_offset
    cut = tmp_path / "cut.gguf"
    for size in list(range(0, header_end, 97)) + [header_end - 1, len(whole) - 1]:
        cut.write_bytes(whole[:size])
        with pytest.raises(GgufError):
            read_header(cut)


def test_corrupted_header_bytes_parse_or_raise_gguf_error(tmp_path):
    path, _ = write_model(tmp_path / "whole.gguf", n_layer=1, n_embd=32, n_ff=256, n_vocab=8)
    whole = path.read_bytes()
    end = read_header(path).data_offset
    bad = tmp_path / "bad.gguf"
    rng = random.Random(7)
    for position in range(end):
        for value in (0x00, 0xFF, rng.randrange(256)):
            bad.write_bytes(whole[:position] + bytes([value]) + whole[position + 1:])
            try:
                read_header(bad)
            except GgufError:
                pass


def test_garbage_after_the_magic_is_a_gguf_error(tmp_path):
    rng = random.Random(11)
    path = tmp_path / "garbage.gguf"
    for _ in range(200):
        path.write_bytes(b"GGUF" + struct.pack("<I", 3) + rng.randbytes(rng.randrange(0, 4096)))
        try:
            read_header(path)
        except GgufError:
            pass


# -- the prediction --

def _shape(path: Path) -> ModelShape:
    return shape_of(read_header(path))


F16 = int(Q.F16)
Q8_0 = int(Q.Q8_0)


def test_kv_cache_bytes_are_exact(tmp_path):
    path, _ = write_model(tmp_path / "m.gguf", n_layer=4, n_embd=64, n_head=4, n_head_kv=2)
    shape = _shape(path)
    # head width 64 / 4 = 16, two KV heads: 32 elements of K and of V per cell and layer.
    assert {(layer.k_width, layer.v_width, layer.sliding) for layer in shape.layers} == {(32, 32, False)}
    # ctx 1000 -> 1024 (padded to 256); 3 slots -> 341 each -> 512 cells per stream.
    kv = kv_cache_bytes(shape, ctx_size=1000, parallel=3, batch_size=512, type_k=F16, type_v=F16, swa_full=True)
    assert kv == 3 * 512 * 4 * (32 * 2 + 32 * 2)
    # q8_0: 34 bytes per block of 32.
    kv_q8 = kv_cache_bytes(shape, ctx_size=1000, parallel=3, batch_size=512, type_k=Q8_0, type_v=F16, swa_full=True)
    assert kv_q8 == 3 * 512 * 4 * (34 + 32 * 2)


def test_kv_heads_per_layer_and_explicit_head_lengths(tmp_path):
    path, _ = write_model(tmp_path / "m.gguf", n_layer=4, n_head_kv=[2, 0, 1, 2],
                          metadata={"llama.attention.key_length": 48, "llama.attention.value_length": 32})
    shape = _shape(path)
    assert [(layer.k_width, layer.v_width) for layer in shape.layers] == [(96, 64), (0, 0), (48, 32), (96, 64)]
    kv = kv_cache_bytes(shape, ctx_size=256, parallel=1, batch_size=512, type_k=F16, type_v=F16, swa_full=True)
    assert kv == 256 * 2 * (96 + 64 + 0 + 48 + 32 + 96 + 64)


def test_without_head_count_kv_every_head_keeps_its_cache(tmp_path):
    path, _ = write_model(tmp_path / "m.gguf", n_layer=1, n_embd=64, n_head=4, n_head_kv=None)
    assert _shape(path).layers == (LayerCache(64, 64, False),)


def test_gemma3_slides_on_five_of_six_layers(tmp_path):
    path, _ = write_model(tmp_path / "g.gguf", arch="gemma3", n_layer=12, n_embd=64, n_head=4, n_head_kv=1,
                          metadata={"gemma3.attention.sliding_window": 128})
    shape = _shape(path)
    assert [layer.sliding for layer in shape.layers] == [True] * 5 + [False] + [True] * 5 + [False]
    cell = 16 * 2 * 2  # K and V, 16 elements each, f16
    full = kv_cache_bytes(shape, ctx_size=8192, parallel=1, batch_size=512, type_k=F16, type_v=F16, swa_full=True)
    assert full == 12 * 8192 * cell
    # Without swa_full a sliding layer keeps window + ubatch cells, padded to 256: 128 + 512 -> 768.
    windowed = kv_cache_bytes(shape, ctx_size=8192, parallel=1, batch_size=512, type_k=F16, type_v=F16,
                              swa_full=False)
    assert windowed == (2 * 8192 + 10 * 768) * cell
    # ... never more than the full context.
    small = kv_cache_bytes(shape, ctx_size=512, parallel=2, batch_size=512, type_k=F16, type_v=F16, swa_full=False)
    assert small == 2 * 12 * 256 * cell


def test_sliding_pattern_from_the_file_and_unknown_architectures(tmp_path):
    flags, _ = write_model(tmp_path / "flags.gguf", arch="newarch", n_layer=4,
                           metadata={"newarch.attention.sliding_window": 64,
                                     "newarch.attention.sliding_window_pattern": [True, False, True, False]})
    assert [layer.sliding for layer in _shape(flags).layers] == [True, False, True, False]
    period, _ = write_model(tmp_path / "period.gguf", arch="newarch", n_layer=4,
                            metadata={"newarch.attention.sliding_window": 64,
                                      "newarch.attention.sliding_window_pattern": 4})
    assert [layer.sliding for layer in _shape(period).layers] == [True, True, True, False]
    # A window on an architecture we do not know: sized as full attention (an over-estimate).
    unknown, _ = write_model(tmp_path / "unknown.gguf", arch="newarch", n_layer=4,
                             metadata={"newarch.attention.sliding_window": 64})
    assert not any(layer.sliding for layer in _shape(unknown).layers)


def test_predict_sums_weights_draft_and_projector(tmp_path):
    model, model_bytes = write_model(tmp_path / "m.gguf", n_layer=3)
    draft, draft_bytes = write_model(tmp_path / "d.gguf", n_layer=1)
    projector, projector_bytes = write_model(tmp_path / "p.gguf", arch="clip", n_layer=1)
    alone = predict(model, ctx_size=2048, parallel=2)
    assert alone.model == model_bytes
    assert alone.draft_model == alone.draft_context == alone.mmproj == 0
    assert alone.context > kv_cache_bytes(_shape(model), ctx_size=2048, parallel=2, batch_size=512, type_k=F16,
                                          type_v=F16, swa_full=True)
    full = predict(model, ctx_size=2048, parallel=2, model_draft=draft, mmproj=projector)
    assert (full.model, full.draft_model, full.mmproj) == (model_bytes, draft_bytes, projector_bytes)
    assert full.draft_context > 0
    assert full.total == sum(full.components().values())
    assert Footprint.from_components({**full.components(), "backend": 0, "warmup": 0}) == full


def test_predict_counts_every_part_of_a_split_model(tmp_path):
    _, whole_bytes = write_model(tmp_path / "whole.gguf", n_layer=3)
    write_model(tmp_path / "split.gguf", n_layer=3, split_max_tensors=5)
    parts = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(parts) == 3
    assert predict(parts[0], ctx_size=512, parallel=1).model == whole_bytes
    parts[2].unlink()
    with pytest.raises(GgufError, match="cannot be read"):
        predict(parts[0], ctx_size=512, parallel=1)


def test_predict_refuses_bad_settings_and_incomplete_models(tmp_path):
    model, _ = write_model(tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="q3_x"):
        predict(model, ctx_size=512, parallel=1, cache_type_k="q3_x")
    with pytest.raises(ValueError):
        predict(model, ctx_size=512, parallel=0)
    bare = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(str(bare), "llama")
    writer.add_tensor("x", np.zeros(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GgufError, match="block_count"):
        predict(bare, ctx_size=512, parallel=1)


def test_the_daemon_side_imports_nothing_heavy():
    code = ("import sys, daemon.model.footprint, daemon.model.footprint_store; "
            "heavy = {'numpy', 'gguf', 'llama_cpp'} & set(sys.modules); assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


# -- against reality: the bundled Gemma 3 270M Q4_K_M in the real worker, on CPU --
#
# Measured by hand once per row: `.venv/bin/python -m daemon serve --port 8391
# --threads 2 --sleep-idle-seconds -1 --ctx-size C --parallel P [--batch-size B]
# [--model-draft <the bundled model>]`, then `curl 127.0.0.1:8391/props`:
# last_wake.phases' bytes for model and context (the sums of llama.cpp's
# "buffer size = N MiB" lines, so rounded to 0.01 MiB), daemon killed after.
# llama-cpp-python 0.3.36, CPU build. The compute-buffer allowance in
# footprint.compute_buffer_bytes was fitted to these rows (and to contexts made
# directly with swa_full off and q8_0/q4_0 caches: within 0.13 %).
MEASURED = [
    # ctx, parallel, extra settings, model bytes, context bytes
    (2048, 1, {}, 246583132, 61624811),
    (2048, 4, {}, 246583132, 61624811),
    (4096, 1, {}, 246583132, 103567851),
    (4096, 4, {}, 246583132, 100422123),
    (8192, 1, {}, 246583132, 187453931),
    (8192, 4, {}, 246583132, 178016747),
    (32768, 4, {}, 246583132, 643584491),
    (4096, 3, {}, 246583132, 109901250),
    (4096, 8, {}, 246583132, 103567851),
    (4096, 4, {"batch_size": 128}, 246583132, 84871741),
    (4096, 4, {"batch_size": 2048}, 246583132, 162613166),
]
# kv_unified: one stream of ctx_size cells the slots share (llama_n_ctx_seq is the whole pool, 1280 for 1100).
MEASURED_UNIFIED = [(4096, 4, 106713579), (2048, 4, 64770539), (8192, 4, 190599659), (4096, 1, 103567851),
                    (1100, 3, 48035266)]
# With the model as its own draft (draft_max 16): draft_model 246583132, draft_context 100422123,
# context 100422123: the main context reserves its graph for max(parallel, 4) outputs
# (ModelSpec.outputs_max; it was 4 x 17 = 68 outputs and 152483921 bytes before that was fixed).
MEASURED_WITH_DRAFT = (4096, 4, 246583132, 100422123, 246583132, 100422123)


@pytest.fixture(scope="module")
def bundled() -> Path:
    from config import Settings
    from daemon.model.files import bundled_model

    return bundled_model(Settings())


@pytest.fixture(scope="module")
def bundled_header(bundled):
    return read_header(bundled)


def test_bundled_model_prediction_matches_the_worker_at_4096_by_4(bundled):
    predicted = predict(bundled, ctx_size=4096, parallel=4)
    _, _, _, model, context = next(row for row in MEASURED if row[:3] == (4096, 4, {}))
    assert predicted.model == pytest.approx(model, rel=0.25)
    assert predicted.context == pytest.approx(context, rel=0.25)
    assert predicted.total == pytest.approx(model + context, rel=0.25)


@pytest.mark.parametrize("ctx_size, parallel, extra, model, context", MEASURED)
def test_bundled_model_context_matches_each_measurement(bundled, bundled_header, monkeypatch, ctx_size, parallel,
                                                        extra, model, context):
    monkeypatch.setattr(fp, "read_header", lambda path: bundled_header)  # its header is read once for all rows
    predicted = predict(bundled, ctx_size=ctx_size, parallel=parallel, **extra)
    assert predicted.model == pytest.approx(model, rel=0.25)
    assert predicted.context == pytest.approx(context, rel=0.25)


@pytest.mark.parametrize("ctx_size, parallel, context", MEASURED_UNIFIED)
def test_bundled_model_context_with_a_shared_kv_pool(bundled, bundled_header, monkeypatch, ctx_size, parallel,
                                                     context):
    monkeypatch.setattr(fp, "read_header", lambda path: bundled_header)
    predicted = predict(bundled, ctx_size=ctx_size, parallel=parallel, kv_unified=True)
    assert predicted.context == pytest.approx(context, rel=0.01)
    if parallel == 1:  # one slot: the same context either way
        assert predicted.context == predict(bundled, ctx_size=ctx_size, parallel=1).context


def test_a_shared_pool_counts_one_stream_not_one_per_slot(tmp_path):
    model, _ = write_model(tmp_path / "m.gguf")
    shape = fp.shape_of(read_header(model))
    # 1100 cells: padded to 1280 in one stream, or to 4 x 512 as 4 streams of 1280 / 4 = 320 (padded to 512)
    one = kv_cache_bytes(shape, ctx_size=1100, parallel=1, batch_size=512, type_k=F16, type_v=F16, swa_full=True)
    shared = kv_cache_bytes(shape, ctx_size=1100, parallel=4, batch_size=512, type_k=F16, type_v=F16, swa_full=True,
                            kv_unified=True)
    split = kv_cache_bytes(shape, ctx_size=1100, parallel=4, batch_size=512, type_k=F16, type_v=F16, swa_full=True)
    assert shared == one and split == one * 2048 // 1280


def test_bundled_model_with_itself_as_draft(bundled):
    ctx_size, parallel, model, context, draft_model, draft_context = MEASURED_WITH_DRAFT
    predicted = predict(bundled, ctx_size=ctx_size, parallel=parallel, model_draft=bundled)
    assert predicted.model == pytest.approx(model, rel=0.25)
    assert predicted.context == pytest.approx(context, rel=0.25)
    assert predicted.draft_model == pytest.approx(draft_model, rel=0.25)
    assert predicted.draft_context == pytest.approx(draft_context, rel=0.25)


# -- the store of measurements --

class RecordingLogger:
    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict]] = []

    def warning(self, event: str, **fields) -> None:
        self.warnings.append((event, fields))


def test_store_round_trips_across_instances(tmp_path):
    store = FootprintStore(tmp_path)
    assert store.get("k") is None
    store.put("k", {"model": 10, "context": 20})
    assert store.get("k") == {"model": 10, "context": 20}
    assert FootprintStore(tmp_path).get("k") == {"model": 10, "context": 20}
    assert json.loads((tmp_path / "footprints.json").read_text())["entries"]["k"] == {"model": 10, "context": 20}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["footprints.json"]  # no temporary file left


def test_store_creates_its_directory(tmp_path):
    FootprintStore(tmp_path / "a" / "b").put("k", {"model": 1})
    assert FootprintStore(tmp_path / "a" / "b").get("k") == {"model": 1}


def test_store_keeps_the_most_recently_put(tmp_path):
    store = FootprintStore(tmp_path, max_entries=3)
    for key in ("a", "b", "c"):
        store.put(key, {"model": 1})
    store.put("a", {"model": 2})  # put again: now the newest
    store.put("d", {"model": 1})
    reopened = FootprintStore(tmp_path, max_entries=3)
    assert [reopened.get(k) is not None for k in "abcd"] == [True, False, True, True]
    assert reopened.get("a") == {"model": 2}


def test_store_is_bounded_to_256_by_default(tmp_path):
    store = FootprintStore(tmp_path)
    for i in range(300):
        store.put(f"k{i}", {"model": i})
    entries = json.loads((tmp_path / "footprints.json").read_text())["entries"]
    assert len(entries) == 256
    assert FootprintStore(tmp_path).get("k43") is None
    assert FootprintStore(tmp_path).get("k44") == {"model": 44}


@pytest.mark.parametrize("content", [
    b"{not json", b"\xff\xfe\x00garbage", b"[]", b'{"version": 1, "entries": []}',
    b'{"version": 2, "entries": {}}', b'{"version": 1, "entries": {"k": {"model": "big"}}}',
    b'{"version": 1, "entries": {"k": {"model": -1}}}', b"[" * 100_000, b"",
])
def test_store_ignores_a_bad_file_then_overwrites_it(tmp_path, content):
    (tmp_path / "footprints.json").write_bytes(content)
    log = RecordingLogger()
    store = FootprintStore(tmp_path, logger=log)
    assert store.get("k") is None
    assert [event for event, _ in log.warnings] in (["footprint_store.unreadable"], ["footprint_store.wrong_shape"])
    store.put("k", {"model": 5})
    assert FootprintStore(tmp_path).get("k") == {"model": 5}


def test_store_survives_an_unreadable_file_and_a_failed_write(tmp_path):
    (tmp_path / "footprints.json").mkdir()  # a directory where the file should be
    log = RecordingLogger()
    store = FootprintStore(tmp_path, logger=log)
    assert store.get("k") is None
    store.put("k", {"model": 5})  # the rename onto a directory fails: logged, kept in memory
    assert store.get("k") == {"model": 5}
    assert [event for event, _ in log.warnings] == ["footprint_store.unreadable", "footprint_store.write_failed"]
    assert [p.name for p in tmp_path.iterdir()] == ["footprints.json"]
    FootprintStore(tmp_path).get("k")  # no logger: silent, no crash


def test_store_refuses_components_that_are_not_byte_counts(tmp_path):
    with pytest.raises(ValueError):
        FootprintStore(tmp_path).put("k", {"model": 1.5})


def test_key_changes_with_each_file_and_setting(tmp_path):
    model, _ = write_model(tmp_path / "m.gguf")
    draft, _ = write_model(tmp_path / "d.gguf", n_layer=1)
    base = footprint_key(model, 4096, 4)
    assert footprint_key(model, 4096, 4) == base
    assert footprint_key(str(model), 4096, 4, "f16", "f16", None, None, -1) == base
    others = [
        footprint_key(model, 8192, 4), footprint_key(model, 4096, 1),
        footprint_key(model, 4096, 4, cache_type_k="q8_0"), footprint_key(model, 4096, 4, cache_type_v="q8_0"),
        footprint_key(model, 4096, 4, model_draft=draft), footprint_key(model, 4096, 4, mmproj=draft),
        footprint_key(model, 4096, 4, n_gpu_layers=10), footprint_key(model, 4096, 4, batch_size=256),
        footprint_key(model, 4096, 4, kv_unified=True),
    ]
    assert len(set(others + [base])) == len(others) + 1
    stat = model.stat()
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    touched = footprint_key(model, 4096, 4)
    assert touched != base
    with model.open("ab") as f:
        f.write(b"\0")
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert footprint_key(model, 4096, 4) != touched
    with_draft = footprint_key(model, 4096, 4, model_draft=draft)
    os.utime(draft, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5))
    assert footprint_key(model, 4096, 4, model_draft=draft) != with_draft


# -- what grows after a load (issue 16, section 5) --

def write_projector_header(path: Path, *, width: int, ffn: int, image: int, patch: int, heads: int, blocks: int,
                    first_projection: int, text_embd: int = 640) -> Path:
    """A llava-style ("mlp") projector header of this shape; the tensors only
    need the right shapes (the prediction reads mm.0's width)."""
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string("clip.projector_type", "mlp")
    for key, value in (("image_size", image), ("patch_size", patch), ("embedding_length", width),
                       ("feed_forward_length", ffn), ("projection_dim", text_embd), ("attention.head_count", heads),
                       ("block_count", blocks)):
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_tensor("v.patch_embd.weight", np.zeros((width, 3, patch, patch), dtype=np.float16))
    writer.add_tensor("mm.0.weight", np.zeros((first_projection, width), dtype=np.float32))
    writer.add_tensor("mm.2.weight", np.zeros((text_embd, first_projection), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# The projector's compute buffer as this llama.cpp (llama-cpp-python 0.3.36, CPU
# build) reserves it at mtmd_init_from_file's warm-up ("CPU compute buffer size =
# N MiB", so rounded to 0.01 MiB), loaded beside the bundled model (text width 640).
PROJECTORS_MEASURED = [
    # width, ffn, image, patch, heads, blocks, mm.0 width, compute buffer bytes
    (32, 64, 32, 8, 2, 1, 64, 41943), (32, 64, 64, 8, 2, 1, 64, 188743), (32, 64, 128, 8, 2, 1, 64, 754974),
    (32, 64, 128, 8, 2, 3, 64, 786432), (128, 64, 128, 8, 2, 1, 64, 849346), (32, 512, 128, 8, 2, 1, 512, 1216348),
    (32, 64, 128, 8, 8, 1, 64, 754974), (32, 64, 128, 16, 2, 1, 64, 293601), (256, 1024, 224, 14, 4, 1, 1024, 1971322),
    (1024, 4096, 336, 14, 16, 1, 4096, 13159628), (32, 512, 128, 8, 2, 1, 64, 754974),
    (32, 64, 128, 8, 2, 1, 512, 1216348), (32, 2048, 128, 8, 2, 1, 64, 754974), (512, 64, 128, 8, 2, 2, 64, 2820669),
    (512, 2048, 128, 8, 2, 2, 64, 3869245), (128, 64, 128, 8, 2, 2, 64, 723517), (512, 64, 128, 8, 8, 2, 64, 2820669),
    (512, 64, 256, 8, 2, 2, 64, 11282677), (512, 64, 128, 8, 2, 4, 64, 2820669), (128, 1024, 128, 8, 2, 2, 64, 1509949),
]
MIB_ROUNDING = 0.005 * 2**20


@pytest.mark.parametrize("width, ffn, image, patch, heads, blocks, first, measured", PROJECTORS_MEASURED)
def test_projector_compute_buffer_is_never_under_the_measurement(tmp_path, width, ffn, image, patch, heads, blocks,
                                                                  first, measured):
    path = write_projector_header(tmp_path / "p.gguf", width=width, ffn=ffn, image=image, patch=patch, heads=heads,
                           blocks=blocks, first_projection=first)
    predicted = fp.projector_compute_bytes(read_header(path), 640)
    assert predicted >= measured - MIB_ROUNDING
    if blocks > 1:  # llava skips a projector's last block: a one-block one never runs its layer term
        assert predicted <= 1.5 * measured


def test_predict_counts_the_projector_weights_and_its_compute_buffer(tmp_path, bundled):
    path = write_projector_header(tmp_path / "p.gguf", width=512, ffn=64, image=256, patch=8, heads=2, blocks=2,
                           first_projection=64)
    header = read_header(path)
    predicted = predict(bundled, ctx_size=512, parallel=1, mmproj=path)
    compute = fp.projector_compute_bytes(header, 640)
    assert compute > header.tensor_bytes  # here the buffer is the larger part: it was left out before
    assert predicted.mmproj == header.tensor_bytes + compute
    audio, _ = write_model(tmp_path / "audio.gguf", arch="clip", n_layer=1)  # no clip.vision keys
    assert fp.projector_compute_bytes(read_header(audio), 640) == 0


# llama_state_seq_get_size after decoding n tokens into sequence 0 of a fresh
# context of the bundled model: (ctx_size, parallel, batch_size, tokens, bytes).
SAVED_STATES_MEASURED = [(4096, 1, 512, 1000, 10954936), (4096, 1, 512, 3000, 17122936),
                         (4096, 4, 512, 1000, 10954960), (2048, 1, 128, 2000, 14038936)]


@pytest.mark.parametrize("ctx_size, parallel, batch_size, tokens, measured", SAVED_STATES_MEASURED)
def test_saved_state_bytes_match_llama_cpp(bundled_header, ctx_size, parallel, batch_size, tokens, measured):
    predicted = fp.saved_state_bytes(shape_of(bundled_header), tokens, type_k=F16, type_v=F16)
    assert measured <= predicted <= measured + 8192


def test_the_prompt_cache_transfer_counts_a_full_slot_twice(bundled, bundled_header, monkeypatch):
    monkeypatch.setattr(fp, "read_header", lambda path: bundled_header)
    full_slot = fp.saved_state_bytes(shape_of(bundled_header), 4096, type_k=F16, type_v=F16)
    assert predict(bundled, ctx_size=8192, parallel=2).kv_transfer == 2 * full_slot  # 8192 / 2 cells a slot
    assert predict(bundled, ctx_size=8192, parallel=2, prompt_cache=False).kv_transfer == 0
    assert predict(bundled, ctx_size=8192, parallel=2, embeddings=True).kv_transfer == 0


def test_counted_keeps_what_grows_at_its_prediction_when_the_load_measured_less():
    """The reproduction's numbers: an embeddings context measured at load (789 MiB
    in all) under its prediction (1298 MiB); one long input later the worker held 1197."""
    mib = 2**20
    predicted = Footprint(model=235 * mib, context=1063 * mib, kv_transfer=0)
    measured = {"model": 235 * mib - 4096, "context": 554 * mib}
    got = fp.counted(predicted, measured)
    assert got.model == 235 * mib - 4096  # weights: the measurement, exact
    assert got.context == 1063 * mib and got.total >= 1197 * mib
    # What grew beyond the prediction counts as measured; extra phases (the warm-up) are the context's.
    bigger = fp.counted(predicted, {"model": 235 * mib, "context": 1100 * mib, "warmup": 4 * mib, "mmproj": mib})
    assert (bigger.context, bigger.mmproj) == (1104 * mib, mib)
    # A part the load did not report keeps its predicted weights; no prediction: the measurement.
    assert fp.counted(Footprint(model=10, context=1, draft_model=7), {"model": 9}).draft_model == 7
    assert fp.counted(None, {"model": 9, "context": 2}) == Footprint(model=9, context=2)


def test_a_stored_measurement_is_plausible_only_near_the_prediction_and_within_the_budget():
    assert fp.plausible({"model": 300, "context": 100}, 369)
    assert not fp.plausible({"model": 10**12}, 369 * 2**20)  # the reproduction: refused the model forever
    assert not fp.plausible({"model": 100}, 369)  # under half: a fake worker, a broken ledger
    assert fp.plausible({"model": 700}, 369) and not fp.plausible({"model": 739}, 369)
    assert not fp.plausible({"model": 400}, 369, budget=399)  # cannot fit: the prediction stands instead
