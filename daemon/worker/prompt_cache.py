"""The prompt cache in three tiers: the slots, host RAM, disk.

When a slot is given to another prompt, the prefix it held goes to the RAM
tier (`prompt_cache_ram_bytes`); a prompt looks for the entry that lets it
keep the most (longest common prefix, within the reuse rule) across its
slot, the RAM tier and the disk tier, restores it and reads only the rest.

The RAM tier stores entries by block (prompt_blocks.py): the positions of a
full-attention cache in blocks keyed by a chained hash of their tokens, so a
prefix that several entries share (a system prompt, a conversation's earlier
turns) is held once; a window cache stays with its entry. An entry whose
tokens are a prefix of a new one is dropped when the new one restores all it
did (full attention); a window state cannot be cut back, so there the
shorter entry stays. Least recently used entries go first when the tier is
over budget.

Checkpoints (issue 26): on a model with sliding-window layers a slot keeps
its window (kv_cache.take_checkpoint: llama_state_seq_get_data_ext with
LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) at each prompt's end before generation,
where a prompt begins to differ from what the slot held (a turn boundary),
and every `cache_checkpoint_every` prompt tokens. When the slot's prefix
comes here, each checkpoint past what the slot keeps becomes an entry of its
own: the full-attention blocks of the slot's entry up to its length (shared,
the last block cut as it is joined) and its window, its only own bytes; the
writer gives it a file. Every tier is looked up through a PrefixIndex
(kv_files) and only within the request's cache scope.

Every entry is also written to the disk tier (disk_tier.SavedPrompts: the
sealed files of daemon/model/kv_files.py, kept within `kv_cache_disk_bytes`)
by one writer thread, so that a sleep, an eviction or a shutdown only waits
for what is still queued, and a wake or a restart finds them there. The
writer joins the blocks itself: the decode thread pays for one copy out of
llama.cpp and one into the blocks, never for a file.
"""

from __future__ import annotations

import ctypes
import os
import queue
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from daemon import protocol as p
from daemon.worker import prompt_blocks as blocks
from daemon.model.kv_files import PrefixIndex, scope_id
from daemon.worker.disk_reads import DiskRead, DiskReader
from daemon.worker.disk_tier import SavedPrompts
from daemon.worker.kv_cache import NO_ROOM, best_indexed, checkpoint_state, held_by, load_state, slot_state
from daemon.worker.llama_lib import llama
from daemon.worker.reuse import ReuseRule
from daemon.worker.slot import Slot

WHOLE_SHARE = 0.5  # of the RAM tier's budget at most, the recent entries' states kept whole (RamTier.whole)
WRITE_QUEUE = 16  # entries waiting for the disk at most; past it a write is skipped (counted), never waited for
READ_FIRST_SECONDS = 1.0  # the writer waits this long at most for the disk reads in flight before each write
FLUSH_SECONDS = 10.0  # a sleep waits this long at most for the queued writes (teardown_timeout is 15 s)
TIERS = ("slot", "ram", "disk")


@dataclass
class Entry:
    tokens: list[int]
    parts: list  # the state's prefix bytes, then per cache: block keys (list[bytes]), or owned Cells / bytes
    own_bytes: int  # bytes no other entry shares (the window cache, a state kept whole)
    state_bytes: int  # the state's size once joined
    scope: str = ""  # kv_files.scope_id() of the cache scope that wrote it


@dataclass
class Counts:
    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    restored_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    misses: int = 0
    evictions: dict[str, int] = field(default_factory=lambda: {"ram": 0, "disk": 0})
    write_errors: int = 0
    writes_skipped: int = 0
    written_bytes: int = 0
    files_written: int = 0
    checkpoints: int = 0  # window checkpoints put in the RAM tier
    checkpoint_bytes: int = 0  # their own bytes (the window), the full-attention blocks being shared
    # disk hits by where the file was: state_dir ("own") or shared_cache_dir ("shared", disk_tier.origin_of)
    origin_hits: dict[str, int] = field(default_factory=lambda: {"own": 0, "shared": 0})
    origin_tokens: dict[str, int] = field(default_factory=lambda: {"own": 0, "shared": 0})


class RamTier:
    """Entries by block, within a byte budget. Runs on the decode thread only.

    The most recently stored entries are also kept whole (their state as
    llama.cpp gave it, `whole`), in the room the entries leave, at most
    WHOLE_SHARE of the budget, counted in it: a restore of one is a single
    llama_state_seq_set_data from it, where joining the blocks first cost a
    second copy of every byte. A whole copy never pushes an entry out: the
    copies go first when the tier is over budget (the blocks still hold
    every entry), so a full tier restores from its blocks."""

    def __init__(self, budget: int, rule: ReuseRule) -> None:
        self.budget = budget
        self.rule = rule
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # id(entry) -> entry, least recently used first
        self.store: dict[bytes, list] = {}  # block key -> [Cells, entries using it]
        self.index = PrefixIndex()  # the entries by chained block keys: a lookup never scans them
        self.bytes = 0
        self.evictions = 0
        self.whole: OrderedDict[int, np.ndarray] = OrderedDict()  # id(entry) -> its state joined, least recent first
        self.whole_bytes = 0

    def best(self, tokens: list[int], scope: str = "") -> tuple[Entry | None, int]:
        return best_indexed(self.rule, self.index, tokens, scope)

    def find(self, tokens: list[int], scope: str = "") -> Entry | None:
        """The entry of exactly these tokens in this scope."""
        return self.index.exact(tokens, scope)

    def holds(self, tokens: list[int], scope: str = "") -> bool:
        """An entry restores these tokens: their own, or a longer one that can be cut back to them."""
        return held_by(self.rule, self.index, tokens, scope)

    def put(self, tokens: list[int], state: np.ndarray, scope: str = "") -> Entry | None:
        """Store a state; the entry, or None when it cannot fit at all."""
        if len(state) > self.budget:
            return None
        try:
            parsed = blocks.parse(state)
        except blocks.UnknownLayout:
            parsed = None
        if parsed is None:
            entry = Entry(list(tokens), [state.copy()], len(state), len(state))
        else:
            entry = self._blocked(tokens, parsed, len(state), scope)
        entry.scope = scope
        if self.rule.replaces(len(tokens)):  # a window state does not serve its prefixes: they stay (checkpoints)
            for old, shared in self.index.candidates(tokens, scope):
                if shared == len(old.tokens) < len(tokens) and id(old) in self.entries:
                    self._drop(old)  # superseded: the new entry restores all it did
        admitted = self._admit(entry)
        if admitted is not None and parsed is not None:
            self._keep_whole(admitted, state)
        return admitted

    def _keep_whole(self, entry: Entry, state: np.ndarray) -> None:
        """A whole copy of the entry's state, the least recently stored copies
        making room (WHOLE_SHARE of the budget at most; none past the budget)."""
        cap = int(self.budget * WHOLE_SHARE)
        if len(state) > cap:
            return
        while self.whole and (self.whole_bytes + len(state) > cap or self.bytes + len(state) > self.budget):
            self._drop_whole(next(iter(self.whole)))
        if self.bytes + len(state) > self.budget:
            return  # the blocks fill the budget: the entry is restored from them
        self.whole[id(entry)] = np.array(state, np.uint8, copy=True)
        self.whole_bytes += len(state)
        self.bytes += len(state)

    def _drop_whole(self, key: int) -> None:
        copy = self.whole.pop(key, None)
        if copy is not None:
            self.whole_bytes -= len(copy)
            self.bytes -= len(copy)

    def _admit(self, entry: Entry) -> Entry | None:
        self.entries[id(entry)] = entry
        self.index.add(entry, self.rule.replaces(len(entry.tokens)))
        self.bytes += entry.own_bytes
        while self.bytes > self.budget and self.whole:  # the whole copies first: the blocks restore them too
            self._drop_whole(next(iter(self.whole)))
        while self.bytes > self.budget and self.entries:
            oldest = next(iter(self.entries.values()))
            self._drop(oldest)
            self.evictions += 1
            if oldest is entry:
                return None
        return entry

    def put_checkpoint(self, base: Entry, n: int, window: np.ndarray) -> Entry | None:
        """A checkpoint of `base`'s sequence at n tokens (kv_cache.take_checkpoint's
        window when it held them): the full-attention blocks of `base` up to n,
        shared (the last one cut at n as it is joined), and the window, its own
        bytes. None when `base` is not stored by block or it is held already."""
        tokens = base.tokens[:n]
        if n <= 0 or n > len(base.tokens) or len(base.parts) != 3 or not isinstance(base.parts[1], list) \
                or self.find(tokens, base.scope) is not None or len(window) <= 8:
            return None
        n_blocks = -(-n // blocks.BLOCK)
        keys: list = list(base.parts[1][:n_blocks])
        cut = n - (n_blocks - 1) * blocks.BLOCK
        last = keys[-1]
        if len(self.store[last][0].meta) > cut:
            keys[-1] = (last, cut)
        for key in keys:
            self.store[key if isinstance(key, bytes) else key[0]][1] += 1
        raw = bytes(memoryview(window)[8:])
        entry = Entry(tokens, [base.parts[0], keys, raw], len(base.parts[0]) + len(raw), 0, base.scope)
        entry.state_bytes = blocks.state_size(self.caches(entry))
        return self._admit(entry)

    def _blocked(self, tokens: list[int], parsed: blocks.Parsed, size: int, scope: str = "") -> Entry:
        parts: list = [parsed.prefix]
        own = len(parsed.prefix)
        for index, cache in enumerate(parsed.caches):
            if isinstance(cache, bytes) or not cache.full() or len(cache.meta) != len(tokens):
                owned = cache if isinstance(cache, bytes) else cache.take(0, len(cache.meta))
                parts.append(owned)
                own += len(owned) if isinstance(owned, bytes) else owned.nbytes
                continue
            n_blocks = -(-len(tokens) // blocks.BLOCK)
            # Keyed by scope too: a block shared across scopes would show in the tier's bytes
            # (/metrics, /props) whether another scope holds a prefix.
            keys = [bytes([index]) + scope.encode() + k for k in blocks.block_keys(tokens, n_blocks)]
            for i, key in enumerate(keys):
                held = self.store.get(key)
                if held is None:  # a new block: its own copy (it must not keep this whole state alive)
                    block = cache.take(i * blocks.BLOCK, min((i + 1) * blocks.BLOCK, len(tokens)))
                    self.store[key] = held = [block, 0]
                    self.bytes += block.nbytes
                held[1] += 1
            parts.append(keys)
        return Entry(list(tokens), parts, own, size)

    def _drop(self, entry: Entry) -> None:
        del self.entries[id(entry)]
        self._drop_whole(id(entry))
        self.index.remove(entry)
        self.bytes -= entry.own_bytes
        for part in entry.parts[1:]:
            if isinstance(part, list):
                for key in part:
                    held = self.store[key if isinstance(key, bytes) else key[0]]
                    held[1] -= 1
                    if held[1] == 0:
                        del self.store[key if isinstance(key, bytes) else key[0]]
                        self.bytes -= held[0].nbytes

    def caches(self, entry: Entry) -> list:
        """The entry's parts as join_into takes them (the blocks themselves: a
        writer holding this list keeps them alive whatever the tier drops).
        An entry kept whole: its state alone (joined() hands it over as it is)."""
        whole = self.whole.get(id(entry))
        if whole is not None:
            return [whole]
        out = []
        for part in entry.parts:
            if isinstance(part, list):  # a key, or (key, n): the block's first n positions (a checkpoint's cut)
                out.append([self.store[key][0] if isinstance(key, bytes) else self.store[key[0]][0].head(key[1])
                            for key in part])
            elif isinstance(part, blocks.Cells):
                out.append([part])
            else:
                out.append(part)
        return out

    def touch(self, entry: Entry) -> None:
        self.entries.move_to_end(id(entry))
        if id(entry) in self.whole:
            self.whole.move_to_end(id(entry))

    def summary(self) -> dict[str, int]:
        return {"entries": len(self.entries), "blocks": len(self.store), "bytes": self.bytes,
                "budget_bytes": self.budget, "evictions": self.evictions,
                "prefixes": sorted((len(e.tokens) for e in self.entries.values()), reverse=True)[:32]}


def _grown(old: int, need: int, cap: int) -> int:
    """A scratch buffer's next size: at least doubled (a conversation's state grows every turn, and
    each new buffer's pages are faulted in once more), never past the RAM budget unless `need` is."""
    return max(need, min(2 * old, cap))


def _give_back_freed_memory() -> None:
    """Return the freed blocks' pages to the system (glibc keeps freed heap memory for reuse
    otherwise, and the fleet counted it as given back)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _lowest_priority() -> None:
    """This thread at nice 19 (Linux: setpriority on a thread id sets that thread's own)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):  # not Linux, or not allowed: the default priority
        pass


def joined(caches: list, scratch: np.ndarray | None = None) -> np.ndarray:
    """The state of an entry's parts, in `scratch` when it is large enough: a
    buffer used again has no page to fault in (a fresh one costs as much as
    the copy itself)."""
    if len(caches) == 1 and isinstance(caches[0], np.ndarray):
        return caches[0]  # a state kept whole
    size = blocks.state_size(caches)
    out = scratch[:size] if scratch is not None and len(scratch) >= size else np.empty(size, np.uint8)
    blocks.join_into(out, caches)
    return out


class PromptCache:
    """The tiers together, as the engine sees them (engine.saved)."""

    def __init__(self, ctx: ctypes.c_void_p, model: ctypes.c_void_p, spec: p.ModelSpec, rule: ReuseRule) -> None:
        self.ctx = ctx
        self.rule = rule
        self.min_tokens = spec.kv_min_tokens
        self.ram = RamTier(spec.prompt_cache_ram_bytes, rule) if spec.prompt_cache_ram_bytes > 0 else None
        self.disk = None
        self.rejected_at_load: dict[str, int] = {}
        if spec.kv_dir and spec.kv_disk_bytes > 0:
            try:
                self.disk = SavedPrompts(ctx, model, spec, rule)
                self.rejected_at_load = dict(self.disk.rejected_at_load)
            except OSError as exc:  # the state directory is unreadable: serve without it
                print(f"dormouse worker: saved prompt caches unavailable: {exc}", file=sys.stderr, flush=True)
        self.counts = Counts()
        self.reader = DiskReader(self.disk)  # disk restores read and checked off the decode thread
        self.writes: queue.Queue = queue.Queue(WRITE_QUEUE)
        self.writer: threading.Thread | None = None
        self.timings = {"ram_save": [0, 0.0], "ram_restore": [0, 0.0], "disk_restore": [0, 0.0]}  # bytes, seconds
        self._scratch = np.empty(0, np.uint8)  # restores from RAM join into it
        self._taken = np.empty(0, np.uint8)  # saves are taken out of llama.cpp into it
        # Whether the slot can take a state of n tokens now: a shared KV pool (kv_unified) frees cells for
        # it, or says there are none while busy slots hold them (the engine sets it). Without room a restore
        # is a miss, never a rejected file: the file is sound, the pool is full.
        self.room_for: Callable[[Slot, int], bool] = lambda slot, n: True
        self.pool_shared = spec.kv_unified  # a refused state may only have found no cells (disk_tier.install)

    @property
    def enabled(self) -> bool:
        return self.ram is not None or self.disk is not None

    # -- before a slot is given to a prompt ---------------------------------------

    def before_assign(self, slot: Slot, tokens: list[int], live: int, scope: str = "",
                      off_thread: bool = False) -> tuple[int, float, str, str | None, str] | DiskRead:
        """Restore the best entry of RAM or disk of the prompt's cache `scope`
        into `slot` when it keeps more than the `live` tokens the slot may
        keep, having stashed what the slot held if it would be lost. Returns
        (tokens restored, seconds, lookup, rejected reason, tier); lookup is
        "hit", "miss", or "" (not looked). off_thread: a disk entry is read
        and checked by the reader thread instead, and the DiskRead is returned:
        the slot waits for it (finish_read, once it is done)."""
        start = time.perf_counter()
        name, scope = scope, scope_id(scope)
        # A restore must keep at least what is worth an entry (kv_min_tokens): not a whole state
        # read and loaded to keep the BOS token or a template header that a fresh read gets at once.
        found, keep, tier = None, max(live, self.min_tokens - 1), ""
        if len(tokens) >= self.min_tokens:
            if self.ram is not None:
                entry, n = self.ram.best(tokens, scope)
                if entry is not None and n > keep:
                    found, keep, tier = entry, n, "ram"
            if self.disk is not None:
                entry, n = self.disk.best(tokens, scope)
                if entry is not None and n > keep:
                    found, keep, tier = entry, n, "disk"
        if found is None:
            self.stash(slot, live)
            lookup = "miss" if len(tokens) >= self.min_tokens and live < self.min_tokens else ""
            if lookup:
                self.counts.misses += 1
            return 0, 0.0, lookup, None, ""
        # A RAM entry's blocks are held, and the entry made the most recently used, before anything is
        # stashed: the stash below (or room_for's evictions into RAM) may push entries out of a full tier.
        parts = self.ram.caches(found) if tier == "ram" else None
        if parts is not None:
            self.ram.touch(found)
        self.stash(slot, 0)
        if tier == "disk":  # read and checked by the reader thread, whichever thread waits for it
            read = self.reader.start(found, name, start)
            if off_thread:
                return read
            read.done.wait()
            return self.finish_read(slot, read)
        return self._restored(slot, name, self._restore(slot, found, parts), tier, start)

    def finish_read(self, slot: Slot, read: DiskRead) -> tuple[int, float, str, str | None, str]:
        """The decode thread's half of a disk restore read off it (read.done is
        set): the checked state into the slot, one llama_state_seq_set_data.
        Returns what before_assign does."""
        rejected = read.reason
        self.last_origin = self.disk.origin_of(read.entry)  # counted() follows on this thread
        if rejected is None and not self.room_for(slot, len(read.entry.tokens)):
            rejected = NO_ROOM
        elif rejected is None:
            rejected = self.disk.install(slot, read.entry, read.state)
            if rejected is None:
                self._time("disk_restore", read.entry.state_bytes, read.started)
        self.reader.release(read)
        return self._restored(slot, read.scope, rejected, "disk", read.started)

    def _restored(self, slot: Slot, scope: str, rejected: str | None, tier: str,
                  start: float) -> tuple[int, float, str, str | None, str]:
        if rejected == NO_ROOM:  # the pool is full, the entry sound: what the slot itself keeps serves, if any
            return 0, time.perf_counter() - start, "", None, ""
        if rejected is not None or not slot.cache:
            self.counts.misses += 1
            return 0, time.perf_counter() - start, "miss", rejected, ""
        slot.scope = scope  # the entry was this scope's
        return len(slot.cache), time.perf_counter() - start, "hit", None, tier

    def counted(self, tier: str, restored: int) -> None:
        """A request's prompt kept `restored` tokens from `tier` (after the engine's trim)."""
        if tier:
            self.counts.hits[tier] += 1
            self.counts.restored_tokens[tier] += restored
        if tier == "disk":
            origin = getattr(self, "last_origin", "own")
            self.counts.origin_hits[origin] += 1
            self.counts.origin_tokens[origin] += restored

    def _restore(self, slot: Slot, entry, parts: list) -> str | None:
        """A RAM entry, its `parts` taken before anything could push it out, into the slot (a disk entry goes
        through the reader: before_assign)."""
        if not self.room_for(slot, len(entry.tokens)):
            return NO_ROOM
        start = time.perf_counter()
        if len(self._scratch) < entry.state_bytes:  # grows to the largest entry restored, kept for the next
            self._scratch = np.empty(_grown(len(self._scratch), entry.state_bytes, self.ram.budget), np.uint8)
        state = joined(parts, self._scratch)
        ok = load_state(self.ctx, self.rule, slot, entry.tokens, state)
        self._time("ram_restore", len(state), start)
        return None if ok else NO_ROOM if self.pool_shared else "corrupt"

    def _time(self, what: str, size: int, start: float) -> None:
        record = self.timings[what]
        record[0] += size
        record[1] += time.perf_counter() - start

    def stash(self, slot: Slot, keep: int) -> None:
        """Keep the slot's prefix in RAM (and queue it for disk) before it is
        cut to `keep` tokens, when what would be lost is worth an entry."""
        n = len(slot.cache)
        if n - keep < self.min_tokens or self.ram is None and self.disk is None:
            return  # the slot keeps most of it: nothing worth an entry would be lost
        if self.rule.deterministic and keep > self.rule.savable(slot.exact):
            return  # saving would cut cells the next prompt keeps
        tokens = slot.cache[:slot.cache.index(-1)] if -1 in slot.cache else slot.cache
        scope = scope_id(slot.scope)
        if self.ram is not None and self.ram.holds(tokens, scope):
            base = self.ram.find(tokens, scope)
            if base is not None:
                self._stash_checkpoints(slot, base, keep)
            return
        start = time.perf_counter()
        if self.ram is not None and len(self._taken) < self.ram.budget:  # the size of a slot's state at most
            size = llama.llama_state_seq_get_size(self.ctx, slot.id)
            if len(self._taken) < size <= self.ram.budget:  # grows to the largest state saved, kept for the next
                self._taken = np.empty(_grown(len(self._taken), size, self.ram.budget), np.uint8)
        taken = slot_state(self.ctx, self.rule, slot, self.min_tokens, self._largest(), out=self._taken)
        if taken is None:
            return
        tokens, state = taken  # a view of self._taken when it was large enough: copied before it is kept
        entry = self.ram.put(tokens, state, scope) if self.ram is not None else None
        self._time("ram_save", len(state), start)
        if entry is not None:
            self.counts.evictions["ram"] = self.ram.evictions
            self._queue(tokens, self.ram.caches(entry), scope)
            self._stash_checkpoints(slot, entry, keep)
        else:  # too large for RAM, or no RAM tier: straight to disk, in a buffer of its own
            if self.ram is not None:
                self.counts.evictions["ram"] = self.ram.evictions
            self._queue(tokens, [state.copy() if np.may_share_memory(state, self._taken) else state], scope)

    def _stash_checkpoints(self, slot: Slot, base: Entry, keep: int) -> None:
        """The slot's checkpoints past `keep` (those the slot is about to lose) to
        RAM, beside `base` (the slot's whole prefix, stored by block): each
        adds its window bytes only; and to the writer, for disk."""
        if self.ram is None or base.tokens != slot.cache[:len(base.tokens)] or base.scope != scope_id(slot.scope) \
                or self.rule.replaces(len(base.tokens)):
            return  # (a state that holds its whole window can be cut back to any checkpoint's length itself)
        for checkpoint in slot.checkpoints:
            if keep < checkpoint.n < len(base.tokens) and checkpoint.n >= self.min_tokens:
                if checkpoint.whole or len(base.parts) == 1:  # a recurrent state (a hybrid's too): an entry by itself
                    tokens = base.tokens[:checkpoint.n]  # (no attention blocks to share with base)
                    state = checkpoint.state if checkpoint.whole else checkpoint_state(base.parts[0], checkpoint)
                    held = state is None or self.ram.find(tokens, base.scope) is not None
                    entry = None if held else self.ram.put(tokens, state, base.scope)
                else:
                    entry = self.ram.put_checkpoint(base, checkpoint.n, checkpoint.state)
                self.counts.evictions["ram"] = self.ram.evictions
                if entry is not None:
                    self.counts.checkpoints += 1
                    self.counts.checkpoint_bytes += entry.own_bytes
                    self._queue(entry.tokens, self.ram.caches(entry), entry.scope)

    def shrink(self, budget: int) -> int:
        """Lower the RAM tier's budget (the fleet, before it evicts a model):
        the least recently used entries go (they are on disk already, or
        queued for it). Returns the bytes the tier holds now."""
        if self.ram is None:
            return 0
        self.ram.budget = max(0, min(self.ram.budget, budget))
        while self.ram.bytes > self.ram.budget and self.ram.entries:
            self.ram._drop(next(iter(self.ram.entries.values())))
            self.ram.evictions += 1
        self.counts.evictions["ram"] = self.ram.evictions
        self._scratch = self._taken = np.empty(0, np.uint8)
        _give_back_freed_memory()
        return self.ram.bytes

    def _largest(self) -> int:
        return max(self.ram.budget if self.ram is not None else 0, self.disk.budget if self.disk is not None else 0)

    # -- the disk writer ---------------------------------------------------------------

    def _queue(self, tokens: list[int], caches: list, scope: str = "", wait: bool = False) -> None:
        if self.disk is None:
            return
        if self.writer is None:
            self.writer = threading.Thread(target=self._write_loop, name="prompt-cache-writer", daemon=True)
            self.writer.start()
        try:
            self.writes.put((list(tokens), caches, scope), block=wait, timeout=FLUSH_SECONDS if wait else None)
        except queue.Full:
            self.counts.writes_skipped += 1  # the disk is slower than the turns: this one stays in RAM only

    def _write_loop(self) -> None:
        _lowest_priority()  # a write nobody waits for: the decode thread's cores go to the decode
        while True:
            item = self.writes.get()
            try:
                if item is None:
                    return
                tokens, caches, scope = item
                self.reader.idle.wait(READ_FIRST_SECONDS)  # a restore someone waits for goes first
                written = self.disk.write(tokens, joined(caches), scope)
                self.counts.written_bytes += written
                self.counts.files_written += written > 0
            except Exception as exc:  # noqa: BLE001 - a full disk or a read-only directory: count, serve on
                self.counts.write_errors += 1
                if self.counts.write_errors == 1:
                    print(f"dormouse worker: a prompt cache was not written to disk: {exc}", file=sys.stderr, flush=True)
            finally:
                self.writes.task_done()

    # -- sleep, eviction, shutdown -----------------------------------------------------

    def save(self, slots: list[Slot]) -> tuple[p.Phase, int, int]:
        """Before the teardown: every slot's prefix to the tiers, every RAM
        entry not on disk yet to the writer, then wait (at most FLUSH_SECONDS)
        for the writes. Returns the timed phase with the bytes this worker
        wrote to disk, the files it wrote, and the failures."""
        start = time.perf_counter()
        for slot in slots:
            self.stash(slot, 0)
        if self.disk is not None and self.ram is not None:
            for entry in list(self.ram.entries.values()):
                if not self.disk.holds(entry.tokens, entry.scope):
                    self._queue(entry.tokens, self.ram.caches(entry), entry.scope, wait=True)
        if self.writer is not None:
            try:
                self.writes.put(None, timeout=FLUSH_SECONDS)
            except queue.Full:
                pass
            self.writer.join(max(0.0, FLUSH_SECONDS - (time.perf_counter() - start)))
            if self.writer.is_alive():  # the disk is too slow for the budget: what is still queued is lost
                self.counts.write_errors += self.writes.qsize()
            self.writer = None
        if self.ram is not None:  # on disk now (or lost to a failing disk): a drowsy worker must not keep it
            self.ram.entries.clear()
            self.ram.index.clear()
            self.ram.store.clear()
            self.ram.whole.clear()
            self.ram.bytes = self.ram.whole_bytes = 0
        self._scratch = self._taken = np.empty(0, np.uint8)
        _give_back_freed_memory()
        c = self.counts
        phase = p.Phase("kv_save", time.perf_counter() - start, c.written_bytes, skipped=c.files_written == 0)
        return phase, c.files_written, c.write_errors

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per tier, for Done (the daemon's /props and metrics)."""
        c = self.counts
        out: dict[str, dict[str, Any]] = {
            tier: {"hits": c.hits[tier], "restored_tokens": c.restored_tokens[tier]} for tier in TIERS}
        out["ram"].update(self.ram.summary() if self.ram is not None else {"entries": 0, "bytes": 0, "budget_bytes": 0})
        out["ram"]["evictions"] = c.evictions["ram"]
        out["disk"].update(self.disk.summary() if self.disk is not None else {"entries": 0, "bytes": 0})
        out["disk"].update({"write_errors": c.write_errors, "writes_skipped": c.writes_skipped,
                            "written_bytes": c.written_bytes})
        out["disk"]["origin"] = {origin: {"hits": c.origin_hits[origin], "restored_tokens": c.origin_tokens[origin]}
                                 for origin in ("own", "shared")}
        out["misses"] = {"count": c.misses}
        out["ram"].update({"checkpoints": c.checkpoints, "checkpoint_bytes": c.checkpoint_bytes})
        for what, (size, seconds) in self.timings.items():
            tier = "ram" if what.startswith("ram") else "disk"
            out[tier][f"{what}_gbps"] = round(size / seconds / 1e9, 3) if seconds > 0 else 0.0
        return out
