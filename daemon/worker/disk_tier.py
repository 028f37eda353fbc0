"""The disk tier of the prompt cache: files of daemon/model/kv_files.py, one
per entry, found through their index and restored into a slot by
kv_cache.load_state (daemon/worker/prompt_cache.py holds the tiers together).

A restore is two halves: read() opens, reads and checks the file (any
thread: disk_reads.py runs it off the decode thread), install() hands the
checked bytes to llama.cpp (the decode thread, one llama_state_seq_set_data).
A file is never installed before its seal is checked (read_sealed).

With shared_cache_dir set, a second set of files lives there
(shared_tier.SharedPrompts, which several replicas read and write): a lookup
takes the longer of the two tiers' best entries, a write goes to both, and
origin_of() tells the prompt cache which one a restore came from (/metrics
counts disk hits by origin, own or shared)."""

from __future__ import annotations

import ctypes
import sys
import threading
from pathlib import Path

from daemon import protocol as p
import numpy as np

from daemon.model.kv_files import (FORMAT_VERSION, KvEntry, KvFileError, KvHeader, KvIndex, VerifiedSeals,
                                   model_fingerprint, read_header, read_sealed, write_file)
from daemon.worker import prompt_blocks as blocks
from daemon.worker.kv_cache import NO_ROOM, best_indexed, context_layout, held_by, load_state
from daemon.worker.reuse import ReuseRule
from daemon.worker.shared_tier import SharedPrompts
from daemon.worker.slot import Slot


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
        self.index.cut_back = rule.replaces
        self.rejected_at_load = dict(self.index.rejected)
        self.evicted = 0  # files deleted to stay within the budget
        self.n_stream = 1 if spec.kv_unified else max(1, spec.parallel)  # one stream per slot, or one shared
        # In a shared pool a state llama.cpp refuses may only have found no cells (cells and positions differ
        # for images on M-RoPE models, so the free count is an estimate): a miss, the checked file kept.
        self.pool_shared = spec.kv_unified
        self.verified = VerifiedSeals()  # files checked once in this worker (read by any thread, under the lock)
        self.shared: SharedPrompts | None = None
        if spec.kv_shared_dir:
            try:
                self.shared = SharedPrompts(Path(spec.kv_shared_dir), spec.model, self.index.layout, rule, self.budget)
            except OSError as exc:  # the model file itself unreadable for its fingerprint: no shared tier
                print(f"dormouse worker: the shared prompt cache is off: {exc}", file=sys.stderr, flush=True)

    def best(self, tokens: list[int], scope: str = "") -> tuple[KvEntry | None, int]:
        """The best file for `tokens` among those of `scope` (a kv_files.scope_id), own or shared."""
        with self.lock:
            own = best_indexed(self.rule, self.index.prefix, tokens, scope)
        if self.shared is None:
            return own
        shared = self.shared.best(tokens, scope)
        return shared if shared[0] is not None and shared[1] > own[1] else own

    def origin_of(self, entry: KvEntry) -> str:
        return "shared" if self.shared is not None and self.shared.owns(entry) else "own"

    def holds(self, tokens: list[int], scope: str = "") -> bool:
        """A file of the scope (a kv_files.scope_id) already restores these tokens (or more of them,
        where a longer state can be cut back), in the own tier and in the shared one (when reachable)."""
        return self._own_holds(tokens, scope) and (self.shared is None or self.shared.holds(tokens, scope))

    def _own_holds(self, tokens: list[int], scope: str = "") -> bool:
        with self.lock:
            return held_by(self.rule, self.index.prefix, tokens, scope)

    def read(self, entry: KvEntry, out: np.ndarray | None = None) -> tuple[np.ndarray | None, str | None]:
        """(the file's checked state, None) or (None, why not): any thread. The
        state is a view of `out` when it is large enough. A file that fails a
        check is deleted and counted here, never returned."""
        if self.shared is not None and self.shared.owns(entry):
            return self.shared.read(entry, out)
        try:
            header, state = read_sealed(entry.path, out, self.verified)
        except KvFileError as exc:  # unreadable (gone, a link, a directory turned link) too: never trusted again
            self._reject(entry, exc.reason)
            return None, exc.reason
        if header.tokens != entry.tokens or header.scope != entry.scope:
            self._reject(entry, "corrupt")  # its name is its tokens' hash: a file replaced with other contents
            return None, "corrupt"
        return state, None

    def install(self, slot: Slot, entry: KvEntry, state) -> str | None:
        """Put a state read() checked into the slot (the decode thread). None, NO_ROOM or "corrupt"."""
        shared = self.shared is not None and self.shared.owns(entry)
        if not load_state(self.ctx, self.rule, slot, entry.tokens, blocks.restreamed(state, self.n_stream)):
            if self.pool_shared:
                return NO_ROOM
            if shared:
                self.shared._reject(entry, "corrupt")
            else:
                self._reject(entry, "corrupt")
            return "corrupt"
        if shared:
            self.shared.touch(entry)
            return None
        try:
            with self.lock:
                self.index.touch(entry)  # least recently used goes first; best effort
        except OSError:
            pass
        return None

    def write(self, tokens: list[int], state, scope: str = "") -> int:
        """Write one entry (sealed, atomically); the bytes written, 0 when it was
        already held or cannot fit. Raises OSError or KvFileError (the own tier's: the shared tier counts
        its own failures and never raises)."""
        if len(state) > self.budget:
            return 0
        shared = self.shared.write(tokens, state, scope) if self.shared is not None else 0
        if self._own_holds(tokens, scope):
            return shared
        header = KvHeader(FORMAT_VERSION, self.index.model, self.index.layout, tokens, len(state), "", scope=scope)
        path = write_file(self.index.directory, header, memoryview(state))  # seals header and state together
        _, offset = read_header(path)
        with self.lock:
            self.index.add(path, tokens, header.state_bytes, offset, scope=header.scope,
                           supersede=self.rule.replaces(len(tokens)))
            self.evicted += self.index.keep_within(self.budget)
        return (path.stat().st_size if path.exists() else 0) + shared

    def summary(self) -> dict[str, int]:
        with self.lock:
            out = {"entries": len(self.index.entries), "bytes": self.index.disk_bytes, "evictions": self.evicted}
        if self.shared is not None:
            out["shared"] = self.shared.summary()
        return out

    def _forget(self, entry: KvEntry) -> None:
        with self.lock:
            self.index.forget(entry)

    def _reject(self, entry: KvEntry, reason: str) -> None:
        try:
            with self.lock:
                self.index.reject(entry.path, reason)
        except OSError:  # a read-only state directory: forget the file, serve on
            self._forget(entry)
