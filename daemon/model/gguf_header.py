"""Read a GGUF file's header: metadata and tensor infos, never the weights.

The daemon sizes a model before loading it, so it reads the header itself:
plain struct over the file, no llama.cpp, no numpy. The file is untrusted
input, read before HTTP binds: every count and length is checked against
what the rest of the file could hold before anything is allocated or looped
over, the header may not run past MAX_HEADER_BYTES, and what the reader
makes (values it decodes) is bounded by MAX_KEPT_BYTES however many keys the
file has. Any problem is one GgufError naming the file and the offset.

Long arrays (the 262k-token vocabulary, its scores and merges) and long
strings are walked past, not decoded: an array of numbers is one seek, an
array of strings one length read per string; only the element type and the
length are kept (the footprint needs no more: the vocabulary's size is its
length). A string's length says where the next one starts, so a string
array cannot be seeked past in one step: the strings and nested arrays
walked one by one are bounded in all (MAX_WALKED_ELEMENTS, far above any
real vocabulary and its merges), and an array that would pass the bound is
refused from its length alone, before any of it is walked: 40 MB of empty
strings (5 million) cost one read, not seconds.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Union

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # v1 used 32-bit counts; llama.cpp no longer reads it
DEFAULT_ALIGNMENT = 32

# Bounds on what a header may ask of the reader. Real headers: 6.5 MB for
# Gemma 3's 262k-token vocabulary, about 10 MB with Llama 3's merges, under
# 30 MB for old files that embed a whole tokenizer.json; under 100 keys;
# under 2,000 tensors (DeepSeek V3), about 30,000 with experts stored apart.
MAX_HEADER_BYTES = 64 * 2**20
MAX_KEYS = 1 << 16
MAX_TENSORS = 1 << 17
# What the reader decodes, in all: per-layer arrays (head counts, sliding-window
# flags: a few KB), names and a chat template (tens of KB). Past this budget
# values are walked past like long ones, so 20,000 keys of 1 KiB arrays cost
# the same memory as 2,000 (each element is counted as the 8 bytes of its
# pointer, each string as its bytes).
MAX_KEPT_BYTES = 4 * 2**20
MAX_KEPT_ARRAY = 1024  # elements; longer arrays are vocabularies, never needed whole
MAX_NESTING = 8
MAX_KEY_BYTES = 65535  # the GGUF spec's limit for a key
MAX_STRING_BYTES = 16 * 1024 * 1024  # longer is refused; a chat template is tens of KB
MAX_TENSOR_NAME_BYTES = 63  # GGML_MAX_NAME is 64 including the NUL
MAX_DIMS = 4  # GGML_MAX_DIMS
# Strings walked past one at a time, in all (a real model: a vocabulary of at most 262k
# tokens and as many merges, under 600k; 2M take about a second on a busy core), and
# nested arrays (no model llama.cpp loads has an array of arrays; each costs a few us).
MAX_WALKED_ELEMENTS = 1 << 21
MAX_WALKED_ARRAYS = 1 << 16
_READ_BLOCK = 1 << 20
_POINTER_BYTES = 8


class GgufError(ValueError):
    """The file is not a GGUF file this reader accepts; the message says why."""


# ggml type id -> (name, elements per block, bytes per block), from ggml.h and
# ggml-common.h. Ids 4, 5 (Q4_2, Q4_3), 31-33 and 36-38 (repacked layouts)
# were removed from ggml; llama.cpp refuses files that use them, and so do we.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),  # two fp16 (d, s) + 32 int8
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
}
GGML_TYPE_IDS = {name: type_id for type_id, (name, _, _) in GGML_TYPES.items()}


def ggml_row_bytes(ggml_type: int, n_elements: int) -> int:
    """Bytes for n_elements of one type, rounding a partial block up (llama.cpp
    refuses partial blocks in tensors; the KV-cache estimate may meet one)."""
    _, block, size = GGML_TYPES[ggml_type]
    return -(-n_elements // block) * size


# GGUF metadata value types
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_SCALARS = {
    UINT8: struct.Struct("<B"), INT8: struct.Struct("<b"), UINT16: struct.Struct("<H"), INT16: struct.Struct("<h"),
    UINT32: struct.Struct("<I"), INT32: struct.Struct("<i"), FLOAT32: struct.Struct("<f"), BOOL: struct.Struct("<B"),
    UINT64: struct.Struct("<Q"), INT64: struct.Struct("<q"), FLOAT64: struct.Struct("<d"),
}
_U32 = _SCALARS[UINT32]
_U64 = _SCALARS[UINT64]
_STRING_MIN_BYTES = 8  # its length
_ARRAY_MIN_BYTES = 12  # element type and length


@dataclass(frozen=True)
class SkippedArray:
    """A long array (or one past the decoding budget) that was walked past: what it holds and how many."""

    element_type: int
    length: int


@dataclass(frozen=True)
class SkippedString:
    """A string past the decoding budget, walked past: its length in bytes."""

    length: int


Value = Union[int, float, bool, str, tuple, SkippedArray, SkippedString]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int  # from the start of the data section
    n_bytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.ggml_type][0]


@dataclass(frozen=True)
class GgufHeader:
    path: Path
    version: int
    file_size: int
    data_offset: int
    metadata: dict[str, Value]
    tensors: tuple[TensorInfo, ...]

    @property
    def tensor_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)


class _Cursor:
    """Reads the file in blocks, never past MAX_HEADER_BYTES; every read and
    skip is checked against the file's size first."""

    def __init__(self, f: BinaryIO, path: Path, size: int) -> None:
        self.f, self.path, self.size = f, path, size
        self.end = min(size, MAX_HEADER_BYTES)  # where the header must have ended
        self.pos = 0
        self._buf = b""
        self._buf_start = 0

    def error(self, problem: str) -> GgufError:
        return GgufError(f"{self.path}: {problem}")

    def remaining(self) -> int:
        return self.end - self.pos

    def _past_end(self, n: int, doing: str) -> GgufError:
        if self.pos + n > self.size:
            return self.error(f"truncated: {n} bytes {doing} at offset {self.pos}, the file has {self.size}")
        return self._too_long(f"{n} bytes {doing} at offset {self.pos}")

    def _too_long(self, what: str) -> GgufError:
        return self.error(f"the header runs past {MAX_HEADER_BYTES // 2**20} MiB ({what}); a real model's is "
                          f"under 30 MiB")

    def check_room(self, n: int, what: str) -> None:
        """`what` needs at least n more bytes of header: refused before anything is read or made for it."""
        if n > self.remaining():
            if self.pos + n > self.size:
                raise self.error(f"{what} at offset {self.pos} cannot fit in a file of {self.size} bytes")
            raise self._too_long(f"{what} at offset {self.pos}")

    def _window(self, n: int) -> int:
        """Make bytes [pos, pos+n) available; returns their index in the buffer."""
        if n > self.remaining():
            raise self._past_end(n, "needed")
        start = self.pos - self._buf_start
        if start < 0 or start + n > len(self._buf):
            self.f.seek(self.pos)
            self._buf = self.f.read(min(max(n, _READ_BLOCK), self.remaining()))
            self._buf_start = self.pos
            start = 0
            if len(self._buf) < n:
                raise self.error(f"truncated while reading at offset {self.pos} (did the file change?)")
        return start

    def unpack(self, fmt: struct.Struct) -> int | float:
        start = self._window(fmt.size)
        self.pos += fmt.size
        return fmt.unpack_from(self._buf, start)[0]

    def unpack_many(self, fmt: struct.Struct, count: int) -> tuple:
        """`count` scalars of one type in one call (a 1024-element array is one unpack, not 1024)."""
        many = struct.Struct(f"<{count}{fmt.format[-1]}")
        start = self._window(many.size)
        self.pos += many.size
        return many.unpack_from(self._buf, start)

    def take(self, n: int) -> bytes:
        start = self._window(n)
        self.pos += n
        return self._buf[start:start + n]

    def skip(self, n: int) -> None:
        if n > self.remaining():
            raise self._past_end(n, "to skip")
        self.pos += n

    def skip_strings(self, count: int) -> None:
        """Walk past `count` length-prefixed strings: one length read each, no
        object made, within the buffer as long as it lasts (a vocabulary of
        262k tokens is a tight loop, not 262k method calls)."""
        while count:
            i = self._window(_STRING_MIN_BYTES)
            buf, base, buffered = self._buf, self._buf_start, len(self._buf)
            while count and i + _STRING_MIN_BYTES <= buffered:
                i += _STRING_MIN_BYTES + _U64.unpack_from(buf, i)[0]
                count -= 1
            # The last length read may point past the buffer, the header or the file.
            if base + i > self.end:
                raise self._past_end(base + i - self.pos, "of strings to skip")
            self.pos = base + i


class _Budget:
    """What the reader may still decode, in bytes (MAX_KEPT_BYTES for one file)."""

    def __init__(self) -> None:
        self.left = MAX_KEPT_BYTES

    def spend(self, n: int) -> bool:
        if n > self.left:
            return False
        self.left -= n
        return True


def read_header(path: str | Path) -> GgufHeader:
    """Parse a GGUF v2/v3 header. Raises GgufError (also for an unreadable file)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            return _Parser(_Cursor(f, path, size)).header()
    except OSError as exc:
        raise GgufError(f"{path}: cannot be read: {exc.strerror or exc}") from None


class _Parser:
    def __init__(self, cur: _Cursor) -> None:
        self.cur = cur
        self.budget = _Budget()
        self.walked = 0  # strings walked past one by one (at most MAX_WALKED_ELEMENTS)
        self.walked_arrays = 0  # nested arrays walked past one by one (at most MAX_WALKED_ARRAYS)

    def header(self) -> GgufHeader:
        cur = self.cur
        magic = cur.take(4) if cur.size >= 4 else b""
        if magic != MAGIC:
            raise cur.error(f"not a GGUF file (starts with {bytes(magic[:4])!r}, expected {MAGIC!r})")
        version = cur.unpack(_U32)
        if version not in SUPPORTED_VERSIONS:
            if int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
                raise cur.error("big-endian GGUF files are not supported")
            raise cur.error(f"GGUF version {version} is not supported (only {SUPPORTED_VERSIONS})")
        n_tensors = cur.unpack(_U64)
        n_keys = cur.unpack(_U64)
        # Each key holds at least a 1-byte name, its length, a type and a 1-byte value.
        self._check_count(n_keys, MAX_KEYS, _STRING_MIN_BYTES + 1 + 4 + 1, "metadata keys")
        metadata: dict[str, Value] = {}
        for _ in range(n_keys):
            at = cur.pos
            key = self._name(MAX_KEY_BYTES, "key")
            if key in metadata:
                raise cur.error(f"duplicate metadata key {key!r} at offset {at}")
            metadata[key] = self._value(cur.unpack(_U32), depth=0)

        # A tensor info holds at least a 1-byte name, n_dims, one dim, a type and an offset.
        self._check_count(n_tensors, MAX_TENSORS, _STRING_MIN_BYTES + 1 + 4 + 8 + 4 + 8, "tensors")
        infos = [self._tensor_info() for _ in range(n_tensors)]

        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise cur.error(f"general.alignment {alignment!r} is not a positive power of two")
        data_offset = -(-cur.pos // alignment) * alignment
        tensors = _place_tensors(cur, infos, data_offset, alignment)
        return GgufHeader(cur.path, version, cur.size, data_offset, metadata, tensors)

    def _check_count(self, count: int, cap: int, min_bytes_each: int, what: str) -> None:
        cur = self.cur
        if count > cap:
            raise cur.error(f"{count} {what} at offset {cur.pos}: more than the {cap} this reader accepts")
        cur.check_room(count * min_bytes_each, f"{count} {what}")

    def _name(self, max_bytes: int, what: str) -> str:
        cur = self.cur
        at = cur.pos
        n = cur.unpack(_U64)
        if n > max_bytes:
            raise cur.error(f"{what} of {n} bytes at offset {at} is longer than {max_bytes}")
        raw = cur.take(n)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise cur.error(f"{what} at offset {at} is not UTF-8") from None

    def _string(self) -> str | SkippedString:
        cur = self.cur
        at = cur.pos
        n = cur.unpack(_U64)
        if n > MAX_STRING_BYTES:
            raise cur.error(f"string of {n} bytes at offset {at} is longer than {MAX_STRING_BYTES}")
        if not self.budget.spend(n):
            cur.skip(n)
            return SkippedString(n)
        # Values are text for people (names, templates): an odd byte should not make a model unusable.
        return cur.take(n).decode("utf-8", errors="replace")

    def _value(self, value_type: int, depth: int) -> Value:
        scalar = _SCALARS.get(value_type)
        if scalar is not None:
            value = self.cur.unpack(scalar)
            return bool(value) if value_type == BOOL else value
        if value_type == STRING:
            return self._string()
        if value_type == ARRAY:
            return self._array(depth)
        raise self.cur.error(f"unknown metadata value type {value_type} at offset {self.cur.pos - 4}")

    def _array_head(self, depth: int) -> tuple[int, int]:
        """An array's element type and length, both checked against the file."""
        cur = self.cur
        at = cur.pos
        if depth >= MAX_NESTING:
            raise cur.error(f"arrays nested deeper than {MAX_NESTING} at offset {at}")
        element_type = cur.unpack(_U32)
        if element_type not in _SCALARS and element_type not in (STRING, ARRAY):
            raise cur.error(f"unknown array element type {element_type} at offset {at}")
        length = cur.unpack(_U64)
        cur.check_room(length * _min_bytes(element_type), f"array of {length} elements (from offset {at})")
        return element_type, length

    def _array(self, depth: int) -> tuple | SkippedArray:
        element_type, length = self._array_head(depth)
        if length <= MAX_KEPT_ARRAY and self.budget.spend(length * _POINTER_BYTES):
            scalar = _SCALARS.get(element_type)
            if scalar is None:
                return tuple(self._value(element_type, depth + 1) for _ in range(length))
            values = self.cur.unpack_many(scalar, length)
            return tuple(bool(v) for v in values) if element_type == BOOL else values
        self._skip_elements(element_type, length, depth)
        return SkippedArray(element_type, length)

    def _skip_elements(self, element_type: int, length: int, depth: int) -> None:
        if element_type in _SCALARS:
            self.cur.skip(length * _SCALARS[element_type].size)
            return
        # Refused from the length, before any of it is walked.
        if element_type == STRING:
            if self.walked + length > MAX_WALKED_ELEMENTS:
                raise self.cur.error(f"an array of {length} strings (before offset {self.cur.pos}) takes the "
                                     f"header's strings past {MAX_WALKED_ELEMENTS}; a real model's hold under "
                                     f"1,000,000")
            self.walked += length
        else:
            if self.walked_arrays + length > MAX_WALKED_ARRAYS:
                raise self.cur.error(f"an array of {length} arrays (before offset {self.cur.pos}) takes the "
                                     f"header's nested arrays past {MAX_WALKED_ARRAYS}; a real model has none")
            self.walked_arrays += length
        if element_type == STRING:
            self.cur.skip_strings(length)
        else:
            for _ in range(length):
                self._skip_elements(*self._array_head(depth + 1), depth + 1)

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        cur = self.cur
        at = cur.pos
        name = self._name(MAX_TENSOR_NAME_BYTES, "tensor name")
        n_dims = cur.unpack(_U32)
        if n_dims > MAX_DIMS:
            raise cur.error(f"tensor {name!r} at offset {at} has {n_dims} dimensions (at most {MAX_DIMS})")
        dims = cur.unpack_many(_U64, n_dims)
        ggml_type = cur.unpack(_U32)
        offset = cur.unpack(_U64)
        return name, dims, ggml_type, offset


def _min_bytes(value_type: int) -> int:
    if value_type in _SCALARS:
        return _SCALARS[value_type].size
    return _STRING_MIN_BYTES if value_type == STRING else _ARRAY_MIN_BYTES


def _place_tensors(cur: _Cursor, infos: list[tuple[str, tuple[int, ...], int, int]], data_offset: int,
                   alignment: int) -> tuple[TensorInfo, ...]:
    data_bytes = max(cur.size - data_offset, 0)
    seen: set[str] = set()
    tensors = []
    total = 0
    for name, dims, ggml_type, offset in infos:
        if name in seen:
            raise cur.error(f"duplicate tensor {name!r}")
        seen.add(name)
        if ggml_type not in GGML_TYPES:
            raise cur.error(f"tensor {name!r} has unknown ggml type {ggml_type}")
        type_name, block, type_size = GGML_TYPES[ggml_type]
        n_elements = 1
        for dim in dims:
            n_elements *= dim
        # A size that the data section cannot hold is refused before anything else uses it.
        if n_elements * type_size > data_bytes * block:
            raise cur.error(f"tensor {name!r} {list(dims)} of {type_name} needs more bytes than the file's "
                            f"{data_bytes} bytes of data")
        if dims and dims[0] % block:
            raise cur.error(f"tensor {name!r}: row of {dims[0]} is not a whole number of {type_name} blocks of {block}")
        n_bytes = n_elements // block * type_size
        if offset % alignment:
            raise cur.error(f"tensor {name!r} at data offset {offset} is not aligned to {alignment}")
        if offset + n_bytes > data_bytes:
            raise cur.error(f"tensor {name!r} ({n_bytes} bytes at data offset {offset}) ends past the file's "
                            f"{data_bytes} bytes of data")
        total += n_bytes
        tensors.append(TensorInfo(name, dims, ggml_type, offset, n_bytes))
    if total > data_bytes:
        raise cur.error(f"tensors claim {total} bytes; the file holds {data_bytes} bytes of data")
    return tuple(tensors)
