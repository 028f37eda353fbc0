"""The prompt cache across sleeps: save each slot's KV state before the
teardown, restore a saved prefix into a slot after a wake.

Uses llama.cpp's per-sequence state API (llama_state_seq_get_data /
_set_data): a slot is one sequence, so its cells travel alone, whatever the
other slots hold. The file format and the index are daemon/model/kv_files.py.
"""

from __future__ import annotations

import ctypes
import time
from importlib import metadata
from pathlib import Path

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


class SavedPrompts:
    def __init__(self, ctx: ctypes.c_void_p, model: ctypes.c_void_p, spec: p.ModelSpec, rule: ReuseRule) -> None:
        self.ctx = ctx
        self.memory = llama.llama_get_memory(ctx)
        self.rule = rule
        self.min_tokens = spec.kv_min_tokens
        self.budget = spec.kv_disk_bytes
        self.index = KvIndex.scan(Path(spec.kv_dir), model_fingerprint(spec.model), context_layout(ctx, model, rule))
        self.rejected_at_load = dict(self.index.rejected)

    # -- after a wake -------------------------------------------------------------

    def restore(self, slot: Slot, tokens: list[int], live: int) -> tuple[int, float, str, str | None]:
        """Restore the saved entry that lets `tokens` keep the most (by longest
        common prefix, within the reuse rule) into `slot` when that beats the
        `live` tokens the slot may keep now. The engine then trims it with the
        same rule. Returns (tokens restored, seconds, lookup, rejected reason):
        lookup is "hit", "miss", or "" when there was nothing to look for."""
        if len(tokens) < self.min_tokens or not self.index.entries:
            return 0, 0.0, "", None
        entry, keep = self._best(tokens)
        if entry is None or keep <= live:
            return 0, 0.0, ("miss" if live < self.min_tokens else ""), None
        start = time.perf_counter()
        try:
            state = self._read(entry)
        except OSError:  # unreadable, or the directory changed under us: a miss
            self.index.entries = [e for e in self.index.entries if e is not entry]
            return 0, time.perf_counter() - start, "miss", "unreadable"
        except KvFileError as exc:
            self._reject(entry, exc.reason)
            return 0, time.perf_counter() - start, "miss", exc.reason
        llama.llama_memory_seq_rm(self.memory, slot.id, -1, -1)
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        loaded = llama.llama_state_seq_set_data(self.ctx, buf, len(state), slot.id)
        # What llama.cpp holds must be what the header says: a checksum proves the
        # bytes are the ones written, not that they hold these positions.
        if loaded == 0 or llama.llama_memory_seq_pos_max(self.memory, slot.id) != len(entry.tokens) - 1:
            llama.llama_memory_seq_rm(self.memory, slot.id, -1, -1)
            slot.cache.clear()
            self._reject(entry, "corrupt")
            return 0, time.perf_counter() - start, "miss", "corrupt"
        slot.cache[:] = entry.tokens
        # Exact (the layout says they were saved so) only where every position from 0 sits in its own cell.
        whole = llama.llama_memory_seq_pos_min(self.memory, slot.id) == 0
        slot.exact = len(entry.tokens) if self.rule.deterministic and whole else 0
        try:
            self.index.touch(entry)  # least recently used goes first; best effort
        except OSError:
            pass
        return len(entry.tokens), time.perf_counter() - start, "hit", None

    def _best(self, tokens: list[int]) -> tuple[KvEntry | None, int]:
        """The entry that would keep the most of `tokens`, and how many. A saved
        state holds only the last window of sliding-window layers (or a
        recurrent snapshot), so an entry can be trimmed only as far as that
        allows (ReuseRule). Longest first, and an entry that could not beat the
        best so far is not compared: this runs on the thread that decodes."""
        best, most = None, 0
        for entry in sorted(self.index.entries, key=lambda e: len(e.tokens), reverse=True):
            n = len(entry.tokens)
            if min(n, len(tokens) - 1) <= most:
                continue
            lowest = self.rule.lowest_saved(n)
            if tokens[:n] == entry.tokens:  # the usual case, compared in C
                shared = n
            elif lowest > 0:  # a window or a snapshot: a shorter share could serve only the regenerate of n - 1
                shared = n - 1 if tokens[:n - 1] == entry.tokens[:n - 1] else 0
            else:
                shared = common_prefix(entry.tokens, tokens)
            keep = self.rule.keepable(shared, len(tokens), exact=n if lowest == 0 else 0, pos_min=lowest, n_held=n)
            if keep > most:
                best, most = entry, keep
        return best, most

    def _reject(self, entry: KvEntry, reason: str) -> None:
        try:
            self.index.reject(entry.path, reason)
        except OSError:  # a read-only state directory: forget the file, serve on
            self.index.entries = [e for e in self.index.entries if e is not entry]

    @staticmethod
    def _read(entry: KvEntry) -> bytes:
        header, offset = read_header(entry.path)  # the file may have changed since the scan
        if header.tokens != entry.tokens:
            raise KvFileError("corrupt", f"{entry.path.name}: tokens changed since it was indexed")
        return read_state(entry.path, header, offset)

    # -- before a sleep -----------------------------------------------------------

    def save(self, slots: list[Slot]) -> tuple[p.Phase, int, int]:
        """Each slot's cached prefix (text only: it stops at the first image),
        written before the context is torn down. A failure is counted, never
        stops the sleep. Returns the timed phase (with the bytes written), the
        files written and the failures."""
        start = time.perf_counter()
        written = saved = errors = 0
        for slot in slots:
            tokens = slot.cache[:slot.cache.index(-1)] if -1 in slot.cache else list(slot.cache)
            if self.rule.deterministic:
                del tokens[self.rule.savable(slot.exact):]  # only cells a restore puts back bit for bit
            if len(tokens) < self.min_tokens or self.index.longest_prefix_of(tokens, len(tokens) - 1):
                continue  # too short to be worth a file, or already saved as it is
            if self.rule.recurrent and len(tokens) < len(slot.cache):
                continue  # a recurrent state cannot be cut back to them
            if not self.rule.recurrent and \
                    llama.llama_memory_seq_pos_min(self.memory, slot.id) > self.rule.lowest_saved(len(tokens)):
                continue  # the window lost cells a restore of them would need (_best assumes it holds them)
            try:
                if len(tokens) < len(slot.cache) and not llama.llama_memory_seq_rm(self.memory, slot.id,
                                                                                  len(tokens), -1):
                    continue  # an image or inexact cells follow, and llama.cpp would not cut them off
                size = llama.llama_state_seq_get_size(self.ctx, slot.id)
                if size > self.budget:
                    continue  # could never be kept: do not write it to delete it
                buf = (ctypes.c_uint8 * size)()
                got = llama.llama_state_seq_get_data(self.ctx, buf, size, slot.id)
                state = ctypes.string_at(buf, got)  # bytes(buf[:got]) went through a list of ints: 50x slower
                del buf  # one slot's state held twice at most, as the footprint counts (kv_transfer)
                header = KvHeader(FORMAT_VERSION, self.index.model, self.index.layout, tokens, len(state), "")
                path = write_file(self.index.directory, header, state)  # seals header and state together
                del state
                _, offset = read_header(path)
                self.index.add(path, tokens, header.state_bytes, offset)
                written += path.stat().st_size
                saved += 1
            except (OSError, KvFileError):
                errors += 1
        self.index.keep_within(self.budget)
        # Listed even when nothing was worth saving (skipped), as the teardown's steps are.
        return p.Phase("kv_save", time.perf_counter() - start, written, skipped=saved == 0), saved, errors
