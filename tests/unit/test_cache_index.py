"""The prompt cache's lookup goes through an index from chained block keys
(kv_files.PrefixIndex): its work follows the prompt's blocks, not the
entries held (issue 26), and it finds what a scan of every entry finds, in
the request's scope only."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from daemon.model.kv_files import MAX_SHARERS, PrefixIndex
from daemon.worker.kv_cache import best_entry, best_indexed
from daemon.worker.reuse import ReuseRule


@dataclass(eq=False)
class E:
    tokens: list[int]
    scope: str = ""


def filled(n_entries: int, rule: ReuseRule, rng: random.Random) -> tuple[PrefixIndex, list[E]]:
    index, entries = PrefixIndex(), []
    for _ in range(n_entries):
        entry = E([rng.randrange(50_000) for _ in range(rng.randint(300, 700))])
        index.add(entry, rule.replaces(len(entry.tokens)))
        entries.append(entry)
    return index, entries


@pytest.mark.parametrize("rule", [ReuseRule(512), ReuseRule(512, n_swa=512)], ids=["full", "window"])
def test_a_lookup_costs_the_same_with_10_or_10000_entries(rule):
    work = {}
    for n_entries in (10, 10_000):
        rng = random.Random(1)
        index, entries = filled(n_entries, rule, rng)
        target = entries[3]
        prompt = target.tokens + [7, 8, 9]  # the next turn of one conversation
        index.work = 0
        found, keep = best_indexed(rule, index, prompt)
        assert found is target and keep == len(target.tokens)
        miss = [rng.randrange(50_000) for _ in range(800)]
        assert best_indexed(rule, index, miss) == (None, 0)
        work[n_entries] = index.work
    # Probes and comparisons: at most the bounded bucket (MAX_SHARERS entries compared past the deepest
    # shared block) fills up; nothing grows with 1,000 times the entries.
    assert work[10] <= work[10_000] <= work[10] + MAX_SHARERS, work


def test_the_index_finds_what_a_scan_finds():
    rng = random.Random(7)
    for rule in (ReuseRule(64), ReuseRule(64, n_swa=128)):
        index = PrefixIndex(block=16)
        entries = []
        base = [rng.randrange(20) for _ in range(400)]
        for _ in range(60):  # entries sharing prefixes of random lengths, some cut, some extended
            n = rng.randint(1, 400)
            entry = E(base[:n] + [rng.randrange(20) for _ in range(rng.randint(0, 40))])
            index.add(entry, rule.replaces(len(entry.tokens)))
            entries.append(entry)
        for _ in range(300):
            n = rng.randint(2, 440)
            prompt = base[:n] + [rng.randrange(20) for _ in range(rng.randint(0, 30))]
            if rng.random() < 0.3:
                prompt = list(rng.choice(entries).tokens) or [1, 2]  # a regenerate
            _, scanned = best_entry(rule, entries, prompt)
            _, indexed = best_indexed(rule, index, prompt)
            if rule.n_swa == 0:  # full attention: a share within a block may pass the MAX_SHARERS latest
                assert indexed <= scanned and indexed >= scanned - 16, (prompt, scanned, indexed)
            else:
                assert indexed == scanned, (len(prompt), scanned, indexed)


def test_an_entry_is_found_in_its_own_scope_only():
    rule = ReuseRule(512)
    index = PrefixIndex()
    tokens = list(range(1000))
    alice = E(tokens, scope="a")
    index.add(alice, True)
    assert best_indexed(rule, index, tokens + [1], "a") == (alice, 1000)
    assert best_indexed(rule, index, tokens + [1], "b") == (None, 0)
    assert best_indexed(rule, index, tokens + [1], "") == (None, 0)
    assert index.exact(tokens, "a") is alice and index.exact(tokens, "b") is None
    index.remove(alice)
    assert best_indexed(rule, index, tokens + [1], "a") == (None, 0) and len(index) == 0
    assert not index.tails and not index.sharers


def test_a_window_entry_keeps_its_checkpoint_and_the_checkpoint_shares_the_full_attention_blocks():
    """A longer window state cannot be cut back, so it never drops a shorter
    entry (the checkpoint that serves a regenerate); a checkpoint adds its
    window's bytes only, and joins to the state of its own tokens."""
    import numpy as np

    from daemon.worker import prompt_blocks as blocks
    from daemon.worker.prompt_cache import RamTier, joined
    from tests.unit.test_cache_blocks import state

    rule = ReuseRule(512, n_swa=300)
    ram = RamTier(2**30, rule)
    tokens = list(range(700))
    base = ram.put(tokens, state(700, window=300))
    before = ram.bytes
    window = state(600, window=300)  # the window of the same sequence at 600 tokens (its full cache unused)
    raw_window = blocks.parse(window)
    cut = [raw_window.prefix, [raw_window.caches[1]]]  # what llama_state_seq_get_data_ext(PARTIAL_ONLY) writes
    size = blocks.state_size(cut)
    partial = np.empty(size, np.uint8)
    blocks.join_into(partial, cut)
    checkpoint = ram.put_checkpoint(base, 600, partial)
    assert checkpoint is not None and checkpoint.tokens == tokens[:600]
    assert ram.bytes - before == checkpoint.own_bytes == len(partial)  # the window only: the blocks are shared
    assert np.array_equal(joined(ram.caches(checkpoint)), state(600, window=300))  # its own state, whole
    assert ram.best(tokens[:600]) == (checkpoint, 599)  # a regenerate: the last token read again
    assert ram.best(tokens) == (base, 699)
    longer = ram.put(list(range(800)), state(800, window=300))
    assert longer is not None and len(ram.entries) == 3  # nothing dropped: neither serves a regenerate of 600
    assert ram.put(tokens[:600], state(600, window=300), scope="other") is not None  # scopes apart
    assert ram.best(tokens[:600], "other")[1] == 599
    assert ram.best(list(range(800)) + [1], "other")[1] == 600  # its own entry; never the 800 of scope ""
    assert ram.best(list(range(800)) + [1], "third") == (None, 0)


def test_a_full_attention_entry_still_supersedes_its_prefixes():
    from daemon.worker.prompt_cache import RamTier
    from tests.unit.test_cache_blocks import state

    ram = RamTier(2**30, ReuseRule(512))
    ram.put(list(range(300)), state(300))
    ram.put(list(range(700)), state(700))
    assert [len(e.tokens) for e in ram.entries.values()] == [700]


def test_a_state_of_another_stream_count_is_rewritten_for_this_context():
    """Another --parallel, the same context per slot: llama.cpp refuses a state
    whose stream count differs, so a restore rewrites it (the cells are the same)."""
    from daemon.worker import prompt_blocks as blocks
    from tests.unit.test_cache_blocks import state

    raw = state(400, window=300, stream=1)  # taken from a slot of a three-stream context (the helper's layout)
    parsed = blocks.parse(raw)
    assert {c.n_stream for c in parsed.caches} != {1}
    out = blocks.restreamed(raw, 1)
    again = blocks.parse(out)
    assert [c.n_stream for c in again.caches] == [1, 1] and [c.stream for c in again.caches] == [0, 0]
    for a, b in zip(parsed.caches, again.caches):
        assert (a.meta == b.meta).all() and all((x == y).all() for x, y in zip(a.k, b.k))
    assert blocks.restreamed(out, 1) is out  # already this context's


def test_a_scope_never_appears_in_a_file_name_or_header_in_clear(tmp_path):
    from daemon.model.kv_files import FORMAT_VERSION, KvHeader, read_header, scope_id, write_file

    sid = scope_id('["team-key","salt"]')
    assert "team" not in sid and len(sid) == 32 and scope_id("") == ""
    header = KvHeader(FORMAT_VERSION, {"m": 1}, {"l": 1}, [1, 2, 3], 4, "", scope=sid)
    path = write_file(tmp_path / "kv" / "m", header, b"abcd")
    unscoped = write_file(tmp_path / "kv" / "m", KvHeader(FORMAT_VERSION, {"m": 1}, {"l": 1}, [1, 2, 3], 4, ""),
                          b"abcd")
    assert path.name != unscoped.name and b"team" not in path.read_bytes()
    assert read_header(path)[0].scope == sid and read_header(unscoped)[0].scope == ""
