"""Issue 16, section 3: a hostile GGUF metadata section cannot stall the start.

The daemon reads every model's header before HTTP binds. 20,000 keys of
1 KiB arrays (21 MB) took 35 s and 160 MB: each element became a Python
object. Now what the reader decodes is bounded (MAX_KEPT_BYTES) whatever the
file holds, long arrays are seeked past, and the header, its key count and
its tensor count are bounded, each refusal a GgufError naming the file.
Costs are proven by counting (memory allocated, bytes read, values made),
never by a clock.
"""

from __future__ import annotations

import struct
import tracemalloc
from pathlib import Path

import pytest

from daemon.model import gguf_header as gh
from daemon.model.footprint import predict
from daemon.model.gguf_header import GgufError, SkippedArray, SkippedString, read_header

UINT8, UINT32, STRING, ARRAY = gh.UINT8, gh.UINT32, gh.STRING, gh.ARRAY


def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def head(n_keys: int, n_tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_keys)


def u8_array(key: str, n: int) -> bytes:
    return s(key) + struct.pack("<IIQ", ARRAY, UINT8, n) + bytes(n)


def hostile_keys(path: Path, n_keys: int, array_bytes: int = 1024) -> Path:
    """The reproduction: n_keys keys, each an array of array_bytes uint8 (kept-size arrays)."""
    with path.open("wb") as f:
        f.write(head(n_keys))
        for i in range(n_keys):
            f.write(u8_array(f"junk.{i:05d}", array_bytes))
    return path


def peak_bytes_while(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def values_made(metadata: dict) -> int:
    """Elements the reader turned into Python objects (tuples' items, nested ones too)."""
    def count(value) -> int:
        return len(value) + sum(count(v) for v in value if isinstance(v, tuple)) if isinstance(value, tuple) else 0
    return sum(count(v) for v in metadata.values())


def test_twenty_thousand_keys_of_1_kib_arrays_make_a_bounded_number_of_objects(tmp_path):
    path = hostile_keys(tmp_path / "hostile.gguf", 20_000)
    assert path.stat().st_size > 20 * 2**20
    header = None

    def parse():
        nonlocal header
        header = read_header(path)

    peak = peak_bytes_while(parse)
    assert len(header.metadata) == 20_000
    # Decoded values fit the budget; the rest are walked past, their length kept.
    assert values_made(header.metadata) * 8 <= gh.MAX_KEPT_BYTES
    skipped = [v for v in header.metadata.values() if isinstance(v, SkippedArray)]
    assert skipped and all(v == SkippedArray(UINT8, 1024) for v in skipped)
    # Was 160 MB: 20 M elements of 8-byte pointers. Now the budget, the keys and one read block.
    assert peak < 16 * 2**20, peak


def test_memory_stays_flat_from_4_000_to_20_000_keys(tmp_path):
    small = hostile_keys(tmp_path / "small.gguf", 4_000)
    large = hostile_keys(tmp_path / "large.gguf", 20_000)
    made = [values_made(read_header(small).metadata), values_made(read_header(large).metadata)]
    assert made[0] == made[1]  # both stop at the budget: five times the keys, not five times the objects


def test_a_header_past_64_mib_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "long-header.gguf"
    length = gh.MAX_HEADER_BYTES + 2**20
    with path.open("wb") as f:
        f.write(head(1) + s("pad") + struct.pack("<IIQ", ARRAY, UINT8, length))
        f.truncate(f.tell() + length + 64)  # sparse: the array's bytes cost no disk
    with pytest.raises(GgufError) as info:
        read_header(path)
    assert str(path) in str(info.value) and "64 MiB" in str(info.value)


def test_more_keys_than_any_model_has_are_refused_before_reading_them(tmp_path):
    path = tmp_path / "keys.gguf"
    n = gh.MAX_KEYS + 1
    path.write_bytes(head(n) + b"".join(s(f"k{i}") + struct.pack("<IB", UINT8, 0) for i in range(n)))
    with pytest.raises(GgufError, match=rf"{n} metadata keys .*more than the {gh.MAX_KEYS}") as info:
        read_header(path)
    assert str(path) in str(info.value)


def test_more_tensors_than_any_model_has_are_refused(tmp_path):
    path = tmp_path / "tensors.gguf"
    n = gh.MAX_TENSORS + 1
    info = b"".join(s(f"t{i}") + struct.pack("<IQIQ", 1, 1, 0, 0) for i in range(n))
    path.write_bytes(head(0, n_tensors=n) + info)
    with pytest.raises(GgufError, match=rf"{n} tensors .*more than the {gh.MAX_TENSORS}"):
        read_header(path)


def test_strings_past_the_budget_are_walked_past(tmp_path):
    path = tmp_path / "strings.gguf"
    one_mib = "x" * 2**20
    n = gh.MAX_KEPT_BYTES // 2**20 + 1
    path.write_bytes(head(n) + b"".join(s(f"text.{i}") + struct.pack("<I", STRING) + s(one_mib) for i in range(n)))
    values = list(read_header(path).metadata.values())
    assert values[:-1] == [one_mib] * (n - 1) and values[-1] == SkippedString(2**20)


def test_a_vocabulary_is_walked_with_one_read_per_block_not_one_object_per_string(tmp_path):
    path = tmp_path / "vocab.gguf"
    n = 300_000
    path.write_bytes(head(1) + s("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, STRING, n)
                     + b"".join(s(f"tok{i}") for i in range(n)))
    header = None

    def parse():
        nonlocal header
        header = read_header(path)

    peak = peak_bytes_while(parse)
    assert header.metadata["tokenizer.ggml.tokens"] == SkippedArray(STRING, n)
    assert peak < 4 * 2**20, peak  # one read block (1 MiB) and change, for a 4.3 MB array of strings


def _bytes_read() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="counts bytes read through /proc/self/io")
def test_a_long_array_of_numbers_is_seeked_past_not_read(tmp_path):
    path = tmp_path / "scores.gguf"
    n = 10 * 2**20  # 40 MB of float32 scores
    with path.open("wb") as f:
        f.write(head(2) + s("tokenizer.ggml.scores") + struct.pack("<IIQ", ARRAY, gh.FLOAT32, n))
        f.seek(n * 4, 1)
        f.write(s("general.architecture") + struct.pack("<I", STRING) + s("llama"))
    before = _bytes_read()
    header = read_header(path)
    read = _bytes_read() - before
    assert header.metadata["general.architecture"] == "llama"
    assert read < 3 * 2**20, read  # two read blocks, not 40 MB


def test_per_layer_arrays_before_the_junk_are_kept_and_the_model_sizes(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "junk-after.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_uint32("llama.embedding_length", 64)
    writer.add_uint32("llama.feed_forward_length", 128)
    writer.add_array("llama.attention.head_count", [4, 4])
    writer.add_array("llama.attention.head_count_kv", [2, 1])
    writer.add_token_list([f"t{i}" for i in range(40)])
    for i in range(3_000):
        writer.add_array(f"junk.{i}", [0] * 512)
    writer.add_tensor("token_embd.weight", np.zeros((40, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    header = read_header(path)
    assert header.metadata["llama.attention.head_count_kv"] == (2, 1)
    assert isinstance(header.metadata["junk.2999"], SkippedArray)
    assert predict(path, ctx_size=256, parallel=1).context > 0


def test_a_per_layer_array_pushed_past_the_budget_is_a_clear_error_not_a_crash(tmp_path):
    """Junk first spends the decoding budget down to 8 bytes: the head counts
    (two uint32, 16 bytes of pointers) are walked past, and sizing says which key."""
    path = tmp_path / "junk-first.gguf"
    arrays = gh.MAX_KEPT_BYTES // (8 * 1024) - 1
    filler = gh.MAX_KEPT_BYTES - len("llama") - arrays * 8 * 1024 - 8
    keys = [s("general.architecture") + struct.pack("<I", STRING) + s("llama")]
    keys += [u8_array(f"junk.{i:04d}", 1024) for i in range(arrays)]
    keys += [s("junk.filler") + struct.pack("<I", STRING) + s("x" * filler)]
    keys += [s(f"llama.{key}") + struct.pack("<II", UINT32, value)
             for key, value in (("block_count", 2), ("embedding_length", 64))]
    keys += [s("llama.attention.head_count") + struct.pack("<IIQII", ARRAY, UINT32, 2, 4, 4)]
    path.write_bytes(head(len(keys)) + b"".join(keys))
    assert read_header(path).metadata["llama.attention.head_count"] == SkippedArray(UINT32, 2)
    with pytest.raises(GgufError, match="llama.attention.head_count") as info:
        predict(path, ctx_size=256, parallel=1)
    assert str(path) in str(info.value)
