"""A sequence's saved state cut into blocks of positions, so that a prefix two
prompts share (a system prompt, a conversation's earlier turns) is held once.

llama.cpp's per-sequence state (llama_state_seq_get_data) is a u32 magic
and the i32 seq_id it was taken from (llama-context.cpp; a restore checks the
magic and ignores the id), then for each KV cache of the model (one, or two
for a sliding-window model: the full layers, then the window layers):

    u32 n_stream | per stream: u32 cell_count, then if any cells:
        per cell: i32 pos, u32 n_seq_id (= 1), i32 seq_id
        u32 v_trans, u32 n_layer
        per layer: i32 k_type, u64 k_row, cell_count * k_row bytes
        v_trans = 0: per layer: i32 v_type, u64 v_row, cell_count * v_row bytes
        v_trans = 1: per layer: i32 v_type, u32 v_el, u32 n_embd_v, then for each
                     of the n_embd_v rows, cell_count * v_el bytes

(llama-kv-cache.cpp, state_write_meta / state_write_data; a restore reads
cells in any order and places them itself, and ignores the saved seq_id.)

A cache whose cells are positions 0..n-1 (full attention) is cut into
blocks of BLOCK positions: block i holds positions [i*BLOCK, (i+1)*BLOCK) of
every layer, keyed by a chained hash of the tokens up to its end, so equal
prefixes give equal keys whatever follows. A window cache (only its last
positions) stays one piece per entry: it is what makes an entry restorable
at its own length only. A layout this parser does not know (cells with
extra fields, a recurrent state, a layer without V) is kept whole: the entry
still works, without sharing. Pure numpy: the unit tests build states here.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np

BLOCK = 256  # positions per block: small enough to share a system prompt, large enough to copy at memcpy speed
_U32 = struct.Struct("<I")
_META = np.dtype([("pos", "<i4"), ("n_seq", "<u4"), ("seq", "<i4")])


class UnknownLayout(ValueError):
    """The state is not one this parser can cut: keep it whole."""


@dataclass(frozen=True)
class Layers:
    """The per-layer shape of one cache's cells (everything but the cells)."""

    v_trans: bool
    k: tuple[tuple[int, int], ...]  # (k_type, k_row) per layer
    v: tuple[tuple[int, int, int], ...]  # (v_type, v_row or v_el, n_embd_v or 0) per layer


@dataclass
class Cells:
    """One cache's cells of a sequence, sorted by position."""

    n_stream: int
    stream: int  # the stream that holds them
    layers: Layers
    meta: np.ndarray  # _META, one per cell
    k: list[np.ndarray]  # per layer: (cells, k_row) uint8
    v: list[np.ndarray]  # per layer: (cells, v_row) uint8, or (n_embd_v, cells, v_el) when transposed

    @property
    def positions(self) -> np.ndarray:
        return self.meta["pos"]

    def full(self) -> bool:
        """Positions 0..n-1, each once: cut into blocks, and any prefix of it is a prefix's state."""
        pos = self.positions
        return bool(len(pos)) and int(pos[0]) == 0 and bool(np.all(np.diff(pos) == 1))

    def take(self, lo: int, hi: int) -> "Cells":
        """Cells [lo, hi) as contiguous copies: a block owns its bytes, it does not keep its entry's alive."""
        vs = [np.ascontiguousarray(v[:, lo:hi]) if self.layers.v_trans else v[lo:hi].copy() for v in self.v]
        return Cells(self.n_stream, self.stream, self.layers, self.meta[lo:hi].copy(),
                     [k[lo:hi].copy() for k in self.k], vs)

    def head(self, n: int) -> "Cells":
        """The first n cells, as views (no copy): a checkpoint's cut of a shared block, joined at once."""
        if n >= len(self.meta):
            return self
        vs = [v[:, :n] for v in self.v] if self.layers.v_trans else [v[:n] for v in self.v]
        return Cells(self.n_stream, self.stream, self.layers, self.meta[:n], [k[:n] for k in self.k], vs)

    @property
    def nbytes(self) -> int:
        return self.meta.nbytes + sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)


IO_MAGIC = 0xAF143CD8  # llama-context.cpp's io_magic


@dataclass
class Parsed:
    """A state: its 8-byte prefix, then per cache its cells (bytes: a cache with no cells, kept raw)."""

    prefix: bytes
    caches: list[Cells | bytes]


def _cells(view: memoryview, at: int) -> tuple[Cells | bytes, int]:
    start = at
    (n_stream,) = _U32.unpack_from(view, at)
    at += 4
    if not 0 < n_stream <= 4096:
        raise UnknownLayout(f"n_stream {n_stream}")
    found: Cells | None = None
    for s in range(n_stream):
        (count,) = _U32.unpack_from(view, at)
        at += 4
        if count == 0:
            continue
        if found is not None:
            raise UnknownLayout("cells in two streams")
        meta = np.frombuffer(view, _META, count, at)
        at += meta.nbytes
        if np.any(meta["n_seq"] != 1):
            raise UnknownLayout("a cell of several sequences, or extra cell fields")
        v_trans, n_layer = struct.unpack_from("<II", view, at)
        at += 8
        if v_trans > 1 or not 0 < n_layer <= 4096:
            raise UnknownLayout(f"v_trans {v_trans}, n_layer {n_layer}")
        ks, k_shape = [], []
        for _ in range(n_layer):
            k_type, k_row = struct.unpack_from("<iQ", view, at)
            at += 12
            ks.append(np.frombuffer(view, np.uint8, count * k_row, at).reshape(count, k_row))
            at += count * k_row
            k_shape.append((k_type, k_row))
        vs, v_shape = [], []
        for _ in range(n_layer):
            if v_trans:
                v_type, v_el, n_embd = struct.unpack_from("<iII", view, at)
                at += 12
                size = n_embd * count * v_el
                vs.append(np.frombuffer(view, np.uint8, size, at).reshape(n_embd, count, v_el))
                v_shape.append((v_type, v_el, n_embd))
            else:
                v_type, v_row = struct.unpack_from("<iQ", view, at)
                at += 12
                size = count * v_row
                vs.append(np.frombuffer(view, np.uint8, size, at).reshape(count, v_row))
                v_shape.append((v_type, v_row, 0))
            at += size
        found = Cells(n_stream, s, Layers(bool(v_trans), tuple(k_shape), tuple(v_shape)), meta, ks, vs)
    if found is None:
        return bytes(view[start:at]), at
    return _sorted(found), at


def _sorted(cells: Cells) -> Cells:
    order = np.argsort(cells.positions, kind="stable")
    if np.all(order == np.arange(len(order))):
        return cells  # the usual case: cells in position order, still views of the state
    v = [a[:, order] for a in cells.v] if cells.layers.v_trans else [a[order] for a in cells.v]
    return Cells(cells.n_stream, cells.stream, cells.layers, cells.meta[order], [a[order] for a in cells.k], v)


def parse(state: bytes | bytearray | memoryview | np.ndarray) -> Parsed:
    """Raises UnknownLayout when the bytes are not caches this parser knows, end to end."""
    view = memoryview(state).cast("B")
    if len(view) < 8 or _U32.unpack_from(view, 0)[0] != IO_MAGIC:
        raise UnknownLayout("no sequence state magic")
    caches, at = [], 8
    try:
        while at < len(view):
            cache, at = _cells(view, at)
            caches.append(cache)
    except (struct.error, ValueError) as exc:
        if isinstance(exc, UnknownLayout):
            raise
        raise UnknownLayout(f"ends inside a cache ({exc})") from None
    if at != len(view) or not 0 < len(caches) <= 2:
        raise UnknownLayout(f"{len(caches)} caches")
    return Parsed(bytes(view[:8]), caches)


def join_into(out: np.ndarray, caches: list[list[Cells] | bytes]) -> int:
    """Write the state of `caches` into `out` (uint8, at least state_size()
    bytes): each cache a list of blocks in position order, or its raw bytes.
    One copy of every byte, straight into the buffer llama.cpp reads."""
    at = 0

    def put(data) -> None:
        nonlocal at
        raw = np.frombuffer(data, np.uint8) if isinstance(data, (bytes, bytearray)) else data.reshape(-1).view(np.uint8)
        out[at:at + raw.size] = raw
        at += raw.size

    for cache in caches:
        if isinstance(cache, (bytes, bytearray)):
            put(cache)
            continue
        first = cache[0]
        count = sum(len(b.meta) for b in cache)
        put(_U32.pack(first.n_stream))
        for s in range(first.stream):  # each stream's count comes before its own cells: the empty ones first
            put(_U32.pack(0))
        put(_U32.pack(count))
        for b in cache:
            put(b.meta)
        layers = first.layers
        put(struct.pack("<II", int(layers.v_trans), len(layers.k)))
        for li, (k_type, k_row) in enumerate(layers.k):
            put(struct.pack("<iQ", k_type, k_row))
            for b in cache:
                put(b.k[li])
        for li, (v_type, v_size, n_embd) in enumerate(layers.v):
            if layers.v_trans:
                put(struct.pack("<iII", v_type, v_size, n_embd))
                rows = out[at:at + n_embd * count * v_size].reshape(n_embd, count * v_size)
                col = 0
                for b in cache:  # row j of the transposed V: each block's cells of row j, side by side
                    width = b.v[li].shape[1] * v_size
                    rows[:, col:col + width] = b.v[li].reshape(n_embd, width)
                    col += width
                at += rows.size
            else:
                put(struct.pack("<iQ", v_type, v_size))
                for b in cache:
                    put(b.v[li])
        for s in range(first.stream + 1, first.n_stream):
            put(_U32.pack(0))
    return at


def restreamed(state, n_stream: int):
    """The state for a context of `n_stream` streams (one per slot: another
    --parallel, the same context per slot). A sequence's cells are in one
    stream and llama.cpp puts them in the stream of the sequence it restores
    into, but it refuses a state whose stream count differs. The state
    itself when it already matches or is not a layout this parser knows."""
    try:
        parsed = parse(state)
    except UnknownLayout:
        return state
    if all(isinstance(c, bytes) or c.n_stream == n_stream for c in parsed.caches):
        if all(not isinstance(c, bytes) or _U32.unpack_from(c, 0)[0] == n_stream for c in parsed.caches):
            return state
    caches: list = []
    for cache in parsed.caches:
        if isinstance(cache, bytes):  # a cache with no cells: its stream count, then a zero count per stream
            caches.append(_U32.pack(n_stream) + bytes(4 * n_stream))
        else:
            caches.append([Cells(n_stream, 0, cache.layers, cache.meta, cache.k, cache.v)])
    out = np.empty(8 + state_size(caches), np.uint8)
    out[:8] = np.frombuffer(parsed.prefix, np.uint8)
    join_into(out[8:], caches)
    return out


def state_size(caches: list[list[Cells] | bytes]) -> int:
    total = 0
    for cache in caches:
        if isinstance(cache, (bytes, bytearray)):
            total += len(cache)
            continue
        first = cache[0]
        total += 4 + 4 * first.n_stream + 8 + 12 * (len(first.layers.k) + len(first.layers.v))
        total += sum(b.nbytes for b in cache)
    return total


def block_keys(tokens: list[int], n_blocks: int, block: int = BLOCK) -> list[bytes]:
    """Key of block i: a hash of key i-1 and the block's tokens, so a key names
    the whole prefix up to the block's end (vLLM's and SGLang's scheme). The
    last block may be partial: its key names its own tokens only."""
    keys, previous = [], b""
    for i in range(n_blocks):
        chunk = tokens[i * block:(i + 1) * block]
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(struct.pack(f"<{len(chunk)}i", *chunk))
        previous = digest.digest()
        keys.append(previous)
    return keys
