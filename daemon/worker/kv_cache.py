"""The disk tier of the prompt cache, and the moves of a slot's state in and
out of llama.cpp that every tier shares (daemon/worker/prompt_cache.py holds
the tiers together).

Uses llama.cpp's per-sequence state API (llama_state_seq_get_data /
_set_data): a slot is one sequence, so its cells travel alone, whatever the
other slots hold. The file format and the index are daemon/model/kv_files.py.
"""

from __future__ import annotations

import ctypes
import threading
from importlib import metadata
from pathlib import Path

import numpy as np

from daemon import protocol as p
from daemon.model.kv_files import (FORMAT_VERSION, KvEntry, KvFileError, KvHeader, KvIndex, model_fingerprint,
                                   read_header, read_state, write_file)
from daemon.worker.llama_lib import llama
from daemon.worker.reuse import ReuseRule
from daemon.worker.slot import Slot, common_prefix


def context_layout(ctx: ctypes.c_void_p, model: ctypes.c_void_p, rule: ReuseRule) -> dict[str, object]:
    """What decides whether saved KV bytes mean the same thing in a new context,
    and whether they were decoded as a fresh read decodes them (the chunk size
    of the deterministic mode; 0: saved without that promise)."""
    params = llama.llama_context_default_params()  # the worker keeps llama.cpp's cache types and SWA mode
    return {
        "exact_chunk": rule.chunk if rule.deterministic else 0,
        "llama_cpp": metadata.version("llama_cpp_python"),
        "n_ctx_slot": llama.llama_n_ctx_seq(ctx),
        "n_layer": llama.llama_model_n_layer(model),
        "n_embd": llama.llama_model_n_embd(model),
        "type_k": int(params.type_k),
        "type_v": int(params.type_v),
        "swa_full": True,  # the worker sets it (runtime.py), and one stream per slot
    }


def best_entry(rule: ReuseRule, entries, tokens: list[int]):
    """Of `entries` (each with .tokens), the one that would keep the most of
    `tokens`, and how many. A saved state holds only the last window of
    sliding-window layers (or a recurrent snapshot), so an entry can be
    trimmed only as far as that allows (ReuseRule). Longest first, and an
    entry that could not beat the best so far is not compared: this runs on
    the thread that decodes."""
    best, most = None, 0
    for entry in sorted(entries, key=lambda e: len(e.tokens), reverse=True):
        n = len(entry.tokens)
        if min(n, len(tokens) - 1) <= most:
            continue
        lowest = rule.lowest_saved(n)
        if tokens[:n] == entry.tokens:  # the usual case, compared in C
            shared = n
        elif lowest > 0:  # a window or a snapshot: a shorter share could serve only the regenerate of n - 1
            shared = n - 1 if tokens[:n - 1] == entry.tokens[:n - 1] else 0
        else:
            shared = common_prefix(entry.tokens, tokens)
        keep = rule.keepable(shared, len(tokens), exact=n if lowest == 0 else 0, pos_min=lowest, n_held=n)
        if keep > most:
            best, most = entry, keep
    return best, most


def load_state(ctx: ctypes.c_void_p, rule: ReuseRule, slot: Slot, tokens: list[int], state) -> bool:
    """Put a saved state (bytes or a uint8 numpy array, read in place: no copy)
    into the slot's sequence. False, the slot left empty, when llama.cpp
    refused it or holds other positions than `tokens`: a checksum proves the
    bytes are the ones written, not that they hold these positions."""
    memory = llama.llama_get_memory(ctx)
    llama.llama_memory_seq_rm(memory, slot.id, -1, -1)
    if isinstance(state, (bytes, bytearray)):
        pointer = ctypes.cast(ctypes.c_char_p(bytes(state)), ctypes.POINTER(ctypes.c_uint8))
    else:
        pointer = state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    loaded = llama.llama_state_seq_set_data(ctx, pointer, len(state), slot.id)
    if loaded == 0 or llama.llama_memory_seq_pos_max(memory, slot.id) != len(tokens) - 1:
        llama.llama_memory_seq_rm(memory, slot.id, -1, -1)
        slot.cache.clear()
        slot.exact = 0
        return False
    slot.cache[:] = tokens
    # Exact (the layout says they were saved so) only where every position from 0 sits in its own cell.
    whole = llama.llama_memory_seq_pos_min(memory, slot.id) == 0
    slot.exact = len(tokens) if rule.deterministic and whole else 0
    return True


def slot_state(ctx: ctypes.c_void_p, rule: ReuseRule, slot: Slot, min_tokens: int, budget: int,
               out: np.ndarray | None = None):
    """(tokens, state as a uint8 numpy array) of what the slot may save, or
    None: too short, not restorable as it stands, or larger than `budget`.
    In the deterministic mode the slot is cut to the cells a restore puts back
    bit for bit (the caller gives the slot away or tears it down next).
    `out`: a buffer to write the state into when it is large enough (the state
    is then a view of it, valid until the next call): pages already touched,
    where a fresh buffer costs a page fault per 4 KiB, as much as the copy."""
    memory = llama.llama_get_memory(ctx)
    tokens = slot.cache[:slot.cache.index(-1)] if -1 in slot.cache else list(slot.cache)
    if rule.deterministic:
        del tokens[rule.savable(slot.exact):]  # only cells a restore puts back bit for bit
    if len(tokens) < min_tokens:
        return None
    if rule.recurrent and len(tokens) < len(slot.cache):
        return None  # a recurrent state cannot be cut back to them
    if not rule.recurrent and llama.llama_memory_seq_pos_min(memory, slot.id) > rule.lowest_saved(len(tokens)):
        return None  # the window lost cells a restore of them would need (best_entry assumes it holds them)
    if len(tokens) < len(slot.cache):
        if not llama.llama_memory_seq_rm(memory, slot.id, len(tokens), -1):
            return None  # an image or inexact cells follow, and llama.cpp would not cut them off
        slot.truncate(len(tokens))
    size = llama.llama_state_seq_get_size(ctx, slot.id)
    if size <= 0 or size > budget:
        return None  # could never be kept: do not copy it to drop it
    # llama.cpp writes straight into it: the one copy out of the KV cache
    state = out[:size] if out is not None and len(out) >= size else np.empty(size, np.uint8)
    got = llama.llama_state_seq_get_data(ctx, state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, slot.id)
    if got <= 0:
        return None
    return tokens, state[:got]


class SavedPrompts:
    """The disk tier: files of daemon/model/kv_files.py, one per entry. The
    writer thread adds files while the decode thread looks them up: the lock
    guards the index."""

    def __init__(self, ctx: ctypes.c_void_p, model: ctypes.c_void_p, spec: p.ModelSpec, rule: ReuseRule) -> None:
        self.ctx = ctx
        self.rule = rule
        self.min_tokens = spec.kv_min_tokens
        self.budget = spec.kv_disk_bytes
        self.lock = threading.Lock()
        self.index = KvIndex.scan(Path(spec.kv_dir), model_fingerprint(spec.model), context_layout(ctx, model, rule))
        self.rejected_at_load = dict(self.index.rejected)
        self.evicted = 0  # files deleted to stay within the budget

    def best(self, tokens: list[int]) -> tuple[KvEntry | None, int]:
        with self.lock:
            return best_entry(self.rule, list(self.index.entries), tokens)

    def holds(self, tokens: list[int]) -> bool:
        """A file already restores these tokens (or more of them)."""
        with self.lock:
            return any(len(e.tokens) >= len(tokens) and e.tokens[:len(tokens)] == tokens
                       for e in self.index.entries)

    def load(self, slot: Slot, entry: KvEntry) -> str | None:
        """Restore a file into the slot; None, or why it failed (the file is forgotten, or deleted as untrusted)."""
        try:
            state = self._read(entry)
        except OSError:  # unreadable, or the directory changed under us: a miss
            self._forget(entry)
            return "unreadable"
        except KvFileError as exc:
            self._reject(entry, exc.reason)
            return exc.reason
        if not load_state(self.ctx, self.rule, slot, entry.tokens, state):
            self._reject(entry, "corrupt")
            return "corrupt"
        try:
            with self.lock:
                self.index.touch(entry)  # least recently used goes first; best effort
        except OSError:
            pass
        return None

    def write(self, tokens: list[int], state) -> int:
        """Write one entry (sealed, atomically); the bytes written, 0 when it was
        already held or cannot fit. Raises OSError or KvFileError."""
        if len(state) > self.budget or self.holds(tokens):
            return 0
        header = KvHeader(FORMAT_VERSION, self.index.model, self.index.layout, tokens, len(state), "")
        path = write_file(self.index.directory, header, memoryview(state))  # seals header and state together
        _, offset = read_header(path)
        with self.lock:
            self.index.add(path, tokens, header.state_bytes, offset)
            self.evicted += self.index.keep_within(self.budget)
        return path.stat().st_size if path.exists() else 0

    def summary(self) -> dict[str, int]:
        with self.lock:
            return {"entries": len(self.index.entries), "bytes": self.index.disk_bytes, "evictions": self.evicted}

    def _forget(self, entry: KvEntry) -> None:
        with self.lock:
            self.index.entries = [e for e in self.index.entries if e is not entry]

    def _reject(self, entry: KvEntry, reason: str) -> None:
        try:
            with self.lock:
                self.index.reject(entry.path, reason)
        except OSError:  # a read-only state directory: forget the file, serve on
            self._forget(entry)

    @staticmethod
    def _read(entry: KvEntry) -> bytes:
        header, offset = read_header(entry.path)  # the file may have changed since the scan
        if header.tokens != entry.tokens:
            raise KvFileError("corrupt", f"{entry.path.name}: tokens changed since it was indexed")
        return read_state(entry.path, header, offset)
