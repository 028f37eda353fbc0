"""The prompt cache's RAM and disk tiers: how fast a restore is, and what a
disk restore costs the other streams (issue 26, tier speed).

On the bundled model in this process (the worker's own Engine and
PromptCache, no daemon), one prompt of --tokens tokens is saved, then:

- RAM tier: a restore of its entry kept whole (one llama_state_seq_set_data)
  and by blocks (joined first, the path every entry took before), beside
  this machine's memcpy;
- disk tier: a restore of its file (one open into a reused buffer, the
  xxh3 seal checked each time, then checked once per worker), beside the
  format-2 path (two opens, bytes, blake2b) and this machine's sequential
  read of a file in the page cache;
- the largest gap between two tokens of a generating stream while another
  request restores that file: read off the decode thread (now), on it (as
  before), beside the same stream's gap with nothing else to do and with
  another prompt read in full (one prompt chunk between two tokens: the
  bound the issue sets).

Rates are medians over --repeats; gaps are medians of each run's largest.

    .venv/bin/python -m bench.tier_speed [--tokens 3500] [--repeats 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np

from bench.common import bundled_model, table
from bench.prompt_tiers import machine_rates
from daemon import protocol as p

OTHER = [2, *range(3000, 3100)]  # the generating stream's prompt


def engine_for(model: str, state: Path, threads: int):
    from daemon.worker.engine import Engine
    from daemon.worker.runtime import Runtime

    spec = p.ModelSpec(model=model, ctx_size=8192, parallel=2, threads=threads, kv_dir=str(state / "kv" / "m"),
                       kv_disk_bytes=2**34, prompt_cache_ram_bytes=2**31, kv_min_tokens=64)
    runtime = Runtime(spec)
    runtime.load()
    engine = Engine(runtime, lambda message: None)
    return engine


def run(engine, prompt: list[int], max_tokens: int, **kw) -> None:
    engine.submit(p.Submit(f"r{time.monotonic_ns()}", p.SamplingParams(max_tokens=max_tokens, temperature=0),
                           prompt=prompt, **kw))
    while engine.busy:
        engine.step()


def forget(engine, prompt: list[int]) -> None:
    """No slot holds the prompt any more (the next one comes from a tier)."""
    from daemon.worker.llama_lib import llama

    for slot in engine.slots:
        if slot.cache[:len(prompt)] == prompt:
            llama.llama_memory_seq_rm(engine.memory, slot.id, -1, -1)
            slot.truncate(0)


def rate(size: int, seconds: list[float]) -> float:
    return size / statistics.median(seconds) / 1e9


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm: buffers grown, pages touched
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def ram_rates(engine, saved: list[int], repeats: int) -> dict:
    from daemon.model.kv_files import scope_id

    cache, slot = engine.saved, engine.slots[0]
    entry = cache.ram.find(saved, scope_id(""))
    assert entry is not None and id(entry) in cache.ram.whole, "the saved prompt is not in the RAM tier, whole"
    size = entry.state_bytes
    whole = timed(lambda: cache._restore(slot, entry, "ram"), repeats)
    copy = cache.ram.whole[id(entry)]
    target = np.empty_like(copy)
    memcpy = timed(lambda: np.copyto(target, copy), repeats)
    cache.ram._drop_whole(id(entry))  # the blocks alone: joined into the scratch buffer, then set_data
    blocks = timed(lambda: cache._restore(slot, entry, "ram"), repeats)
    return {"state_bytes": size, "whole_gbps": rate(size, whole), "blocks_gbps": rate(size, blocks),
            "memcpy_same_bytes_gbps": rate(size, memcpy)}


def format_2_copy(path: Path, into: Path) -> Path:
    """The same entry as a file of format 2 (blake2b seal), as the daemon wrote them before."""
    from daemon.model import kv_files

    header, offset = kv_files.read_header(path)
    state = path.read_bytes()[offset:]
    body = msgspec.msgpack.encode(msgspec.structs.replace(header, checksum=kv_files.seal(header, state, 2)))
    into.mkdir(parents=True, exist_ok=True)
    old = into / path.name
    old.write_bytes(kv_files.PREFIX.pack(kv_files.MAGIC, 2, len(body)) + body + state)
    return old


def disk_rates(engine, saved: list[int], repeats: int, scratch: Path) -> dict:
    from daemon.model import kv_files
    from daemon.worker import prompt_blocks as blocks
    from daemon.worker.kv_cache import load_state

    cache, slot = engine.saved, engine.slots[0]
    entry, _ = cache.disk.best(saved + [7], "")
    assert entry is not None, "the saved prompt is not on disk"
    size, buffer = entry.state_bytes, np.empty(entry.state_bytes, np.uint8)

    def restore(check_each: bool) -> None:
        if check_each:
            cache.disk.verified.held.clear()
        state, reason = cache.disk.read(entry, buffer)
        assert reason is None and cache.disk.install(slot, entry, state) is None

    checked_each = timed(lambda: restore(True), repeats)
    read_only = timed(lambda: cache.disk.read(entry, buffer), repeats)
    checked_once = timed(lambda: restore(False), repeats)
    old = format_2_copy(entry.path, scratch / "kv" / "old")

    def restore_format_2() -> None:  # the path before: header read, then a second open, bytes, blake2b
        header, offset = kv_files.read_header(old)
        state = kv_files.read_state(old, header, offset)
        assert load_state(engine.ctx, engine.reuse, slot, entry.tokens, blocks.restreamed(state, 2))

    before = timed(restore_format_2, repeats)
    return {"state_bytes": size, "restore_checked_each_gbps": rate(size, checked_each),
            "restore_checked_once_gbps": rate(size, checked_once), "read_and_check_gbps": rate(size, read_only),
            "format_2_restore_gbps": rate(size, before)}


def largest_gap(engine, other_request, steps: int, off_thread: bool | None) -> float:
    """The largest gap between two tokens of a generating stream over `steps`
    steps after `other_request` (None: nothing else) is submitted."""
    cache = engine.saved
    run_before = cache.before_assign
    if off_thread is False:  # the restore as before: read and checked on the decode thread
        cache.before_assign = lambda *a, **kw: run_before(*a, **{**kw, "off_thread": False})
    try:
        engine.submit(p.Submit("other", p.SamplingParams(max_tokens=steps + 64, temperature=0, ignore_eos=True),
                               prompt=OTHER, cache_prompt=False))
        while not any(s.job is not None and s.job.n_generated > 1 for s in engine.slots):
            engine.step()
        stream = next(s for s in engine.slots if s.job is not None)
        if other_request is not None:
            engine.submit(other_request)
        times, seen = [time.perf_counter()], stream.job.n_generated
        for _ in range(steps):
            engine.step()
            if stream.job is not None and stream.job.n_generated > seen:
                times.append(time.perf_counter())
                seen = stream.job.n_generated
        engine.cancel("other")
        while engine.busy:
            engine.step()
    finally:
        cache.before_assign = run_before
    return float(np.max(np.diff(times)))


def gaps(engine, saved: list[int], repeats: int, steps: int) -> dict:
    def restore_request() -> p.Submit:
        forget(engine, saved)
        return p.Submit("restore", p.SamplingParams(max_tokens=1, temperature=0), prompt=saved + [5, 6, 7])

    fresh = p.Submit("fresh", p.SamplingParams(max_tokens=1, temperature=0), prompt=saved + [5, 6, 7],
                     cache_prompt=False)
    engine.saved.ram = None  # every restore from disk
    out: dict[str, list[float]] = {"alone": [], "fresh_read": [], "restore_on_decode_thread": [],
                                   "restore_off_thread": []}
    for _ in range(repeats):
        out["alone"].append(largest_gap(engine, None, steps, None))
        out["fresh_read"].append(largest_gap(engine, fresh, steps, None))
        out["restore_on_decode_thread"].append(largest_gap(engine, restore_request(), steps, False))
        out["restore_off_thread"].append(largest_gap(engine, restore_request(), steps, True))
    return {**{name: statistics.median(values) for name, values in out.items()}, "runs": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=3500, help="the saved prompt's tokens (a slot holds 4096)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    saved = [2, *range(1000, 1000 + args.tokens - 1)]
    with tempfile.TemporaryDirectory(prefix="tier-speed-") as state:
        engine = engine_for(bundled_model(), Path(state), args.threads)
        run(engine, saved, 1)
        engine.saved.stash(next(s for s in engine.slots if s.cache[:len(saved)] == saved), 0)  # to RAM and disk
        engine.saved.writes.join()
        ram = ram_rates(engine, saved, args.repeats)
        disk = disk_rates(engine, saved, args.repeats, Path(state))
        gap = gaps(engine, saved, max(3, args.repeats // 2), steps=24)
        machine = machine_rates()
        engine.close()
    ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
    print(f"\n{args.tokens}-token prompt, state {ram['state_bytes'] / 2**20:.1f} MiB; machine: "
          f"memcpy {machine['memcpy_gbps']} GB/s, sequential read {machine['sequential_read_gbps']} GB/s")
    print(table(["tier", "restore", "GB/s", "of memcpy / of sequential read"], [
        ["RAM", "kept whole (now)", ram["whole_gbps"], ram["whole_gbps"] / machine["memcpy_gbps"]],
        ["RAM", "by blocks, joined first (before)", ram["blocks_gbps"], ram["blocks_gbps"] / machine["memcpy_gbps"]],
        ["RAM", "memcpy of the same bytes", ram["memcpy_same_bytes_gbps"], ""],
        ["disk", "xxh3 checked each time (now)", disk["restore_checked_each_gbps"],
         disk["restore_checked_each_gbps"] / machine["sequential_read_gbps"]],
        ["disk", "checked once per worker (now, again)", disk["restore_checked_once_gbps"],
         disk["restore_checked_once_gbps"] / machine["sequential_read_gbps"]],
        ["disk", "read + check alone (reader thread)", disk["read_and_check_gbps"],
         disk["read_and_check_gbps"] / machine["sequential_read_gbps"]],
        ["disk", "format 2: two opens, bytes, blake2b (before)", disk["format_2_restore_gbps"],
         disk["format_2_restore_gbps"] / machine["sequential_read_gbps"]],
    ]))
    print("\nlargest gap between two tokens of a generating stream (median of each run's largest):")
    print(table(["while", "largest gap"], [
        ["nothing else (baseline)", ms(gap["alone"])],
        [f"another prompt of {args.tokens} tokens read in full (one prompt chunk a step)", ms(gap["fresh_read"])],
        ["a disk restore read on the decode thread (before)", ms(gap["restore_on_decode_thread"])],
        ["a disk restore read off the decode thread (now)", ms(gap["restore_off_thread"])],
    ]))
    figures = {"ram": ram, "disk": disk, "gaps_seconds": gap, "machine": machine, "tokens": args.tokens}
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
