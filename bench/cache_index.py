"""The prompt cache's lookup cost against the number of entries held (issue
26): the index from chained block keys (kv_files.PrefixIndex, the RAM and
disk tiers' lookup) beside the scan it replaced (kv_cache.best_entry), for
10, 1,000 and 10,000 entries of 300-700 tokens and an ~840-token prompt (the
next turn of one of them, and a prompt that matches none).

    .venv/bin/python -m bench.cache_index
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from bench.common import table
from daemon.model.kv_files import PrefixIndex
from daemon.worker.kv_cache import best_entry, best_indexed
from daemon.worker.reuse import ReuseRule

LOOKUPS = 200


@dataclass(eq=False)
class Entry:
    tokens: list[int]
    scope: str = ""


def per_lookup(fn, prompts) -> float:
    start = time.perf_counter()
    for i in range(LOOKUPS):
        fn(prompts[i % len(prompts)])
    return (time.perf_counter() - start) / LOOKUPS


def main() -> None:
    rows = []
    for label, rule in (("full attention", ReuseRule(512)), ("window 512", ReuseRule(512, n_swa=512))):
        for n_entries in (10, 1_000, 10_000):
            rng = random.Random(26)
            index, entries = PrefixIndex(), []
            for _ in range(n_entries):
                entry = Entry([rng.randrange(50_000) for _ in range(rng.randint(300, 700))])
                index.add(entry, rule.replaces(len(entry.tokens)))
                entries.append(entry)
            hits = [entries[i].tokens + [rng.randrange(50_000) for _ in range(140)] for i in range(5)]
            misses = [[rng.randrange(50_000) for _ in range(840)] for _ in range(5)]
            index.work = 0
            indexed = per_lookup(lambda t: best_indexed(rule, index, t), hits + misses)
            work = index.work / LOOKUPS
            scanned = per_lookup(lambda t: best_entry(rule, entries, t), hits[:1] + misses[:1]) \
                if n_entries <= 10_000 else float("nan")
            rows.append([label, n_entries, f"{indexed * 1e6:.0f} us", f"{work:.1f}", f"{scanned * 1e6:.0f} us"])
    print(table(["model", "entries", "index: per lookup", "index: probes+compares", "scan: per lookup"], rows))


if __name__ == "__main__":
    main()
