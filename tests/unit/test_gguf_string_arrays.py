"""A hostile GGUF string array cannot stall the start (issue 27): a string's length says
where the next starts, so strings are walked one by one; the walk is bounded in all
(MAX_WALKED_ELEMENTS strings, MAX_WALKED_ARRAYS nested arrays) and an array that would pass
the bound is refused from its length, before any of it is walked. Proven by counting the
strings walked and the bytes read for two sizes of the same file, never by a clock."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from daemon.model import gguf_header as gh
from daemon.model.gguf_header import GgufError, SkippedArray, read_header


def s(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw)) + raw


def head(n_keys: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, n_keys)


def string_array(key: str, n: int, each: bytes = b"") -> bytes:
    return s(key.encode()) + struct.pack("<IIQ", gh.ARRAY, gh.STRING, n) + s(each) * n


@pytest.fixture
def parsers(monkeypatch):
    """Every parser read_header makes, to read its counts afterwards."""
    made = []

    class Counting(gh._Parser):
        def __init__(self, cur):
            super().__init__(cur)
            made.append(self)

    monkeypatch.setattr(gh, "_Parser", Counting)
    return made


def _bytes_read() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar")


def work(path: Path, parsers: list) -> tuple[int, int, str]:
    before = _bytes_read()
    with pytest.raises(GgufError) as refused:
        read_header(path)
    return parsers[-1].walked, _bytes_read() - before, str(refused.value)


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="counts bytes read through /proc/self/io")
def test_a_40_mb_array_of_empty_strings_is_refused_from_its_length_as_cheaply_as_a_20_mb_one(tmp_path, parsers):
    small, large = tmp_path / "20mb.gguf", tmp_path / "40mb.gguf"
    small.write_bytes(head(1) + string_array("tokenizer.ggml.tokens", 2_500_000))
    large.write_bytes(head(1) + string_array("tokenizer.ggml.tokens", 5_000_000))
    walked_small, read_small, why = work(small, parsers)
    walked_large, read_large, _ = work(large, parsers)
    assert str(small) in why and "strings" in why and str(gh.MAX_WALKED_ELEMENTS) in why
    assert walked_small == walked_large == 0  # not one string walked
    assert read_small < 2 * 2**20 and read_large < 2 * 2**20  # one read block, not 20 or 40 MB


def test_strings_spread_over_many_arrays_are_walked_at_most_to_the_bound(tmp_path, parsers, monkeypatch):
    monkeypatch.setattr(gh, "MAX_WALKED_ELEMENTS", 10_000)
    counts = []
    for n_arrays in (20, 40):  # 40,000 and 80,000 one-byte strings, in arrays of 2,000 (too long to keep)
        path = tmp_path / f"{n_arrays}.gguf"
        path.write_bytes(head(n_arrays) + b"".join(string_array(f"junk.{i}", 2000, b"x") for i in range(n_arrays)))
        walked, _, why = work(path, parsers)
        counts.append(walked)
    assert counts == [10_000, 10_000]  # the same work for twice the file


def test_nested_arrays_are_bounded_too(tmp_path, parsers):
    n = gh.MAX_WALKED_ARRAYS + 1
    path = tmp_path / "nested.gguf"
    path.write_bytes(head(1) + s(b"junk") + struct.pack("<IIQ", gh.ARRAY, gh.ARRAY, n)
                     + struct.pack("<IQ", gh.UINT8, 0) * n)
    with pytest.raises(GgufError, match="nested arrays"):
        read_header(path)
    assert parsers[-1].walked_arrays == 0


def test_a_real_vocabulary_and_its_merges_still_read(tmp_path, parsers):
    path = tmp_path / "vocab.gguf"
    n = 262_144
    path.write_bytes(head(3) + s(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", gh.ARRAY, gh.STRING, n)
                     + b"".join(s(f"tok{i}".encode()) for i in range(n))
                     + string_array("tokenizer.ggml.merges", 300_000, b"a b")
                     + s(b"general.architecture") + struct.pack("<I", gh.STRING) + s(b"llama"))
    header = read_header(path)
    assert header.metadata["tokenizer.ggml.tokens"] == SkippedArray(gh.STRING, n)
    assert header.metadata["general.architecture"] == "llama"
    assert parsers[-1].walked == n + 300_000
