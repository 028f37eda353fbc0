"""The RAM tier's block store (daemon/worker/prompt_blocks.py, prompt_cache.RamTier)
on states built here in llama.cpp's per-sequence format: a state cut into
blocks joins back to the same bytes, a shared prefix is held once, the tier
stays within its budget whatever it is given."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from daemon.worker import prompt_blocks as blocks
from daemon.worker.prompt_cache import RamTier, joined
from daemon.worker.reuse import ReuseRule

K_ROW = 8  # bytes per cell per layer: small, the layout is what matters


def cache_bytes(positions: list[int], tokens_seed: int, n_layer: int = 2, v_trans: bool = False, stream: int = 1,
                n_stream: int = 3) -> bytes:
    """One llama_kv_cache's part of a sequence state (llama-kv-cache.cpp state_write),
    cell values derived from (position, layer, seed) so equal prefixes give equal bytes."""
    out = struct.pack("<I", n_stream)
    count = len(positions)
    for s in range(n_stream):
        out += struct.pack("<I", count if s == stream else 0)
        if s != stream or not count:
            continue
        for pos in positions:
            out += struct.pack("<iIi", pos, 1, stream)
        out += struct.pack("<II", int(v_trans), n_layer)

        def cell(pos: int, layer: int, kind: int) -> bytes:
            return bytes(((pos * 7 + layer * 13 + kind * 31 + tokens_seed + i) % 251) for i in range(K_ROW))

        for layer in range(n_layer):
            out += struct.pack("<iQ", 1, K_ROW) + b"".join(cell(p, layer, 0) for p in positions)
        for layer in range(n_layer):
            if v_trans:
                n_embd, el = 4, 2
                out += struct.pack("<iII", 1, el, n_embd)
                for j in range(n_embd):
                    out += b"".join(cell(p, layer, 1 + j)[:el] for p in positions)
            else:
                out += struct.pack("<iQ", 1, K_ROW) + b"".join(cell(p, layer, 1) for p in positions)
    return out


def state(n: int, seed: int = 0, window: int = 0, v_trans: bool = False, order=None, stream: int = 1) -> np.ndarray:
    """A full-attention cache of positions 0..n-1 (in `order`), and with `window`
    a window cache of the last `window` positions, as Gemma 3's iSWA writes them."""
    positions = list(range(n)) if order is None else order
    data = struct.pack("<Ii", blocks.IO_MAGIC, 1) + cache_bytes(positions, seed, v_trans=v_trans, stream=stream)
    if window:
        data += cache_bytes(list(range(max(0, n - window), n)), seed + 1, n_layer=3, v_trans=v_trans, stream=stream)
    return np.frombuffer(data, np.uint8).copy()


@pytest.mark.parametrize("stream", [0, 1, 2])  # the slot's stream: first, between, last of three
@pytest.mark.parametrize("v_trans", [False, True])
def test_a_state_cut_into_blocks_joins_back_to_the_same_bytes(v_trans, stream):
    raw = state(700, window=300, v_trans=v_trans, stream=stream)
    parsed = blocks.parse(raw)
    full, window = parsed.caches
    assert full.full() and not window.full()
    assert full.layers.v_trans is v_trans
    cut = [parsed.prefix, [full.take(0, 256), full.take(256, 512), full.take(512, 700)], [window]]
    out = np.empty(blocks.state_size(cut), np.uint8)
    assert blocks.join_into(out, cut) == len(raw)
    assert np.array_equal(out, raw)


def test_cells_out_of_position_order_are_sorted_and_still_restore_the_same_positions():
    order = list(range(300, 500)) + list(range(0, 300))  # a ring that wrapped
    parsed = blocks.parse(state(500, order=order))
    assert parsed.caches[0].full()
    assert list(parsed.caches[0].positions[:3]) == [0, 1, 2]
    again = joined([parsed.prefix, [parsed.caches[0]]])
    assert np.array_equal(again, state(500))  # the same cells, in position order


@pytest.mark.parametrize("bad", [b"", b"\x00" * 16, bytes(state(10))[:-1], bytes(state(10)) + b"\x00",
                                 struct.pack("<Ii", blocks.IO_MAGIC, 0) + struct.pack("<I", 2**31)])
def test_a_layout_the_parser_does_not_know_is_refused_never_misread(bad):
    with pytest.raises(blocks.UnknownLayout):
        blocks.parse(np.frombuffer(bad, np.uint8))


def test_two_conversations_sharing_a_system_prompt_hold_its_blocks_once():
    tier = RamTier(2**30, ReuseRule(chunk=512))
    system = list(range(1000, 1000 + 512))  # two whole blocks
    a, b = system + [1, 2, 3] * 100, system + [4, 5, 6] * 100

    ea = tier.put(a, state(len(a)))
    alone = tier.bytes
    eb = tier.put(b, state(len(b)))
    assert ea is not None and eb is not None
    assert len(tier.store) == 2 + 2 * 2  # the 2 shared blocks once, then 2 blocks of each own part
    assert tier.bytes < 2 * alone
    assert np.array_equal(joined(tier.caches(ea)), state(len(a)))
    assert np.array_equal(joined(tier.caches(eb)), state(len(b)))


def test_two_scopes_share_no_block():
    """A block shared across scopes would show in the tier's bytes (/metrics, /props) whether
    another scope holds a prefix: each scope holds its own."""
    from daemon.model.kv_files import scope_id

    tier = RamTier(2**30, ReuseRule(chunk=512))
    system = list(range(1000, 1000 + 512))
    a, b = system + [1, 2, 3] * 100, system + [4, 5, 6] * 100
    ea = tier.put(a, state(len(a)), scope_id("alice"))
    alone = tier.bytes
    eb = tier.put(b, state(len(b)), scope_id("bob"))
    assert len(tier.store) == 2 * (2 + 2)  # nothing shared: bob's system prompt blocks are his own
    assert tier.bytes >= 2 * alone - 64
    assert np.array_equal(joined(tier.caches(eb)), state(len(b)))
    assert tier.best(b, scope_id("carol"))[0] is None and tier.best(b, scope_id("bob"))[0] is eb
    assert tier.best(b, scope_id("alice"))[0] is ea  # alice's own entry (the shared system prompt), never bob's


def test_an_entry_that_a_new_one_extends_is_not_kept_twice():
    tier = RamTier(2**30, ReuseRule(chunk=512))
    turn1 = list(range(600))
    tier.put(turn1, state(600))
    tier.put(turn1 + list(range(5000, 5300)), state(900))
    assert [len(e.tokens) for e in tier.entries.values()] == [900]
    assert tier.best(turn1 + list(range(5000, 5300)) + [7])[1] == 900


def test_a_window_model_entry_serves_only_prompts_that_extend_it_whole():
    rule = ReuseRule(chunk=512, n_swa=512)
    tier = RamTier(2**30, rule)
    tokens = list(range(1500))
    tier.put(tokens, state(1500, window=512))
    assert tier.best(tokens + [1, 2])[1] == 1500
    assert tier.best(tokens[:1200] + [1, 2])[1] == 0  # the window at 1200 is not in the entry


@pytest.mark.parametrize("budget", [1, 5000, 50_000, 200_000])
def test_thousands_of_distinct_prompts_stay_within_the_budget(budget):
    tier = RamTier(budget, ReuseRule(chunk=512))
    for i in range(2000):
        tier.put([i, *range(300)], state(301, seed=i % 97))
        assert tier.bytes <= budget
    held = sum(b[0].nbytes for b in tier.store.values()) + sum(e.own_bytes for e in tier.entries.values())
    assert held == tier.bytes  # the count is what the blocks and entries hold
    if budget < len(state(301)):  # not even one entry fits
        assert not tier.entries and not tier.store
    else:
        assert tier.evictions > 0 and tier.entries  # the most recent stay


def test_least_recently_used_goes_first():
    size = len(state(300))
    tier = RamTier(int(size * 2.5), ReuseRule(chunk=512))
    a, b, c = ([k, *range(299)] for k in (1, 2, 3))
    ea = tier.put(a, state(300, seed=1))
    tier.put(b, state(300, seed=2))
    tier.touch(ea)  # a restored: b is now the oldest
    tier.put(c, state(300, seed=3))
    assert sorted(e.tokens[0] for e in tier.entries.values()) == [1, 3]


def test_chained_keys_name_the_whole_prefix():
    x = blocks.block_keys(list(range(600)), 3)
    y = blocks.block_keys([9] + list(range(1, 600)), 3)
    assert x[0] != y[0] and x[1] != y[1]  # block 1 has the same tokens, not the same prefix
    assert blocks.block_keys(list(range(600)), 3) == x


def test_shrinking_the_ram_tier_drops_the_least_recently_used_first():
    from daemon.worker.prompt_cache import Counts, PromptCache

    cache = PromptCache.__new__(PromptCache)  # the RAM side alone: no llama.cpp context needed
    cache.ram, cache.counts = RamTier(2**30, ReuseRule(chunk=512)), Counts()
    cache._scratch = cache._taken = np.empty(0, np.uint8)
    for k in range(4):
        cache.ram.put([k, *range(299)], state(300, seed=k))
    one = cache.ram.bytes // 4
    assert cache.shrink(int(one * 2.5)) <= one * 2.5
    assert sorted(e.tokens[0] for e in cache.ram.entries.values()) == [2, 3]
    assert cache.counts.evictions["ram"] == 2
    assert cache.shrink(0) == 0 and not cache.ram.store


# -- the tiers together (PromptCache) without llama.cpp: the RAM side and the disk writer --

def bare_cache(ram_budget: int = 2**30, disk=None, min_tokens: int = 64):
    """A PromptCache with its RAM tier and a stand-in disk tier; no llama.cpp context."""
    import queue

    from daemon.worker.disk_reads import DiskReader
    from daemon.worker.prompt_cache import WRITE_QUEUE, Counts, PromptCache

    cache = PromptCache.__new__(PromptCache)
    cache.ctx, cache.rule, cache.min_tokens = None, ReuseRule(chunk=512), min_tokens
    cache.ram = RamTier(ram_budget, cache.rule) if ram_budget else None
    cache.disk, cache.rejected_at_load, cache.counts = disk, {}, Counts()
    cache.writes, cache.writer, cache.reader = queue.Queue(WRITE_QUEUE), None, DiskReader(disk)
    cache.timings = {"ram_save": [0, 0.0], "ram_restore": [0, 0.0], "disk_restore": [0, 0.0]}
    cache._scratch = cache._taken = np.empty(0, np.uint8)
    return cache


class FailingDisk:
    """The disk tier of a full disk, or of a read-only state directory: every write raises."""

    def __init__(self, errno_: int, gate=None) -> None:
        self.errno, self.gate, self.calls, self.budget = errno_, gate, 0, 2**30

    def holds(self, tokens, scope="") -> bool:
        return False

    def best(self, tokens, scope=""):
        return None, 0

    def write(self, tokens, state, scope="") -> int:
        self.calls += 1
        if self.gate is not None:
            self.gate.wait(30)
        raise OSError(self.errno, "simulated")

    def summary(self) -> dict:
        return {"entries": 0, "bytes": 0, "evictions": 0}


@pytest.mark.parametrize("errno_name", ["ENOSPC", "EROFS", "EACCES"])
def test_a_full_disk_or_read_only_directory_is_counted_and_the_ram_tier_serves_on(errno_name):
    import errno

    disk = FailingDisk(getattr(errno, errno_name))
    cache = bare_cache(disk=disk)
    for k in range(5):
        tokens = [k, *range(299)]
        entry = cache.ram.put(tokens, state(300, seed=k))
        cache._queue(tokens, cache.ram.caches(entry))
    cache.writes.join()  # the writer thread tried them all
    assert cache.counts.write_errors == disk.calls == 5
    assert len(cache.ram.entries) == 5  # what RAM holds still serves
    assert cache.ram.best([3, *range(299), 7])[1] == 300
    # A sleep: what is not on disk yet is queued again (a write skipped while serving gets its
    # second chance here), and the writer fails every one of them: counted, never raised.
    phase, files, errors = cache.save([])
    assert files == 0 and errors == disk.calls == 10
    assert phase.skipped and cache.writer is None
    assert cache.summary()["disk"]["write_errors"] == errors
    assert cache.ram.bytes == 0 and not cache.ram.store  # released: the worker goes, or dozes without it


def test_a_disk_slower_than_the_turns_skips_writes_and_never_blocks_the_caller():
    import threading
    import time

    from daemon.worker.prompt_cache import WRITE_QUEUE

    gate = threading.Event()
    cache = bare_cache(disk=FailingDisk(28, gate))
    start = time.perf_counter()
    for k in range(WRITE_QUEUE + 10):
        cache._queue([k, *range(99)], [state(100, seed=k)])
    queued_in = time.perf_counter() - start
    gate.set()
    cache.save([])
    assert cache.counts.writes_skipped >= 9  # the queue was full: skipped, not waited for
    assert queued_in < 5  # never waited for the disk (a generous bound: the writes wait 30 s)


def test_a_restore_that_would_keep_fewer_than_min_tokens_is_not_made():
    from daemon.worker.slot import Slot

    cache = bare_cache(min_tokens=64)
    restored = []
    cache._restore = lambda slot, entry, tier: restored.append(len(entry.tokens))
    cache.stash = lambda slot, keep: None
    cache.ram.put([1, *range(100, 400)], state(301))
    # Shares 10 tokens (a template header): not worth reading a state for.
    n, _, lookup, _, tier = cache.before_assign(Slot(0), [1, *range(100, 109), *range(900, 1000)], live=0)
    assert (n, lookup, tier, restored) == (0, "miss", "", [])
    # Shares 100: restored.
    cache.before_assign(Slot(0), [1, *range(100, 199), *range(900, 1000)], live=0)
    assert restored == [301]


# -- issue 26, tier speed: recent entries kept whole, within the budget --

def test_a_recent_entry_is_kept_whole_and_restores_the_same_bytes_without_a_join():
    tier = RamTier(2**20, ReuseRule(chunk=512))
    original = state(700, seed=5, window=64)
    entry = tier.put([1, *range(699)], original)
    parts = tier.caches(entry)
    assert len(parts) == 1 and isinstance(parts[0], np.ndarray)  # whole: handed over as it is, no join
    assert joined(parts) is parts[0] and np.array_equal(parts[0], original)
    assert not np.shares_memory(parts[0], original)  # a copy: the caller's buffer is reused for the next save
    del tier.whole[id(entry)]  # the blocks alone join back to the same bytes
    assert np.array_equal(joined(tier.caches(entry)), original)


def test_whole_copies_stay_within_half_the_budget_and_are_counted():
    one = len(state(300))
    tier = RamTier(one * 20, ReuseRule(chunk=512))
    for k in range(12):  # 12 entries' blocks and 8 whole copies fill the 20 (the copies alone could take 10)
        tier.put([k, *range(299)], state(300, seed=k))
        assert tier.whole_bytes <= tier.budget // 2 and tier.bytes <= tier.budget
    assert len(tier.entries) == 12 and len(tier.whole) == 8 and tier.evictions == 0
    assert list(tier.whole) == [id(e) for e in tier.entries.values()][-len(tier.whole):]  # the most recent
    held = sum(b[0].nbytes for b in tier.store.values()) + sum(e.own_bytes for e in tier.entries.values())
    assert tier.bytes == held + tier.whole_bytes == held + sum(len(w) for w in tier.whole.values())


def test_a_whole_copy_never_pushes_an_entry_out():
    one = len(state(300))
    tier = RamTier(int(one * 2.6), ReuseRule(chunk=512))  # room for two entries' blocks, not for a copy beside them
    for k in range(2):
        tier.put([k, *range(299)], state(300, seed=k))
    assert len(tier.entries) == 2 and tier.evictions == 0  # the copies went, not the entries
    assert tier.bytes <= tier.budget and tier.whole_bytes <= one


def test_a_dropped_or_shrunk_entry_takes_its_whole_copy_with_it():
    from daemon.worker.prompt_cache import Counts, PromptCache

    cache = PromptCache.__new__(PromptCache)
    cache.ram, cache.counts = RamTier(2**22, ReuseRule(chunk=512)), Counts()
    cache._scratch = cache._taken = np.empty(0, np.uint8)
    a = cache.ram.put([1, *range(299)], state(300, seed=1))
    longer = cache.ram.put([1, *range(599)], state(600, seed=1))  # supersedes a (full attention)
    assert id(a) not in cache.ram.entries and id(a) not in cache.ram.whole and id(longer) in cache.ram.whole
    assert cache.shrink(0) == 0 and not cache.ram.whole and cache.ram.whole_bytes == 0


@pytest.mark.parametrize("bad", [np.empty(0, np.uint8), np.zeros(3, np.uint8), np.frombuffer(b"\xd8<\x14\xaf" * 9,
                                                                                                np.uint8)])
def test_a_state_the_parser_refuses_is_kept_once_not_twice(bad):
    tier = RamTier(2**20, ReuseRule(chunk=512))
    entry = tier.put([1, 2, 3], bad)
    assert entry is not None and not tier.whole and tier.bytes == len(bad)  # already whole: no second copy
