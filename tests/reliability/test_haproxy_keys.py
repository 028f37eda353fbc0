"""Many distinct keys through the generated HAProxy config (issue 31's
hostile input, count-bounded; `python -m bench.haproxy_keys` goes to a
million): affinity by key holds no state per key. HAProxy's RSS grows by
less than a small bound from 2,000 to 20,000 distinct keys, while the same
traffic through the same file plus a stick table keyed by the key (state
per key, the thing affinity must not have) grows past it: the measure can
see per-key state. Every replica's share of the keys stays within the
balance factor (150% of the mean, and no less than the mean / 1.5).

Memory is counted, not time: the stand-ins (bench/haproxy_keys.py: tiny
aiohttp apps and the daemon's own agent) make the requests cheap, and the
bound is on bytes."""

from __future__ import annotations

from bench.haproxy_keys import measure, quiet_cfg
from tests.reliability.test_haproxy import figures

from tests.reliability.test_haproxy import pytestmark  # noqa: E402,F401 (reliability; skipped without haproxy)

BASELINE_KEYS, KEYS = 2_000, 20_000
# HAProxy's RSS may move by a few pages (its pools, the allocator) with no state per key;
# a stick table entry for a key of this length is well over 100 bytes: 18,000 keys, > 2 MiB.
GROWTH_BOUND = 1 * 2**20
BALANCE_FACTOR = 1.5  # haproxy.cfg's hash-balance-factor 150
CONTROL = ("    stick-table type string len 256 size 1m expire 1h store http_req_cnt\n"
           "    http-request track-sc0 var(txn.key)\n")


def growth(points: list[dict]) -> int:
    return points[-1]["rss"] - points[0]["rss"]


def test_distinct_keys_cost_haproxy_no_memory_and_spread_evenly(tmp_path):
    points = measure([BASELINE_KEYS, KEYS], tmp_path, quiet_cfg(tmp_path), warmup=1_000)
    (tmp_path / "control").mkdir()
    control = measure([BASELINE_KEYS, KEYS], tmp_path / "control",
                      quiet_cfg(tmp_path / "control", extra_frontend=CONTROL), warmup=1_000)
    last = points[-1]
    serve = last["serve"]
    mean = sum(serve.values()) / len(serve)
    figures(f"{KEYS} distinct keys through haproxy.cfg", rss_at_2000_kib=points[0]["rss"] // 1024,
            rss_at_20000_kib=last["rss"] // 1024, growth_kib=growth(points) // 1024,
            control_growth_kib=growth(control) // 1024, requests_per_replica=serve,
            max_over_mean=round(max(serve.values()) / mean, 3), min_over_mean=round(min(serve.values()) / mean, 3),
            statuses=last["statuses"])
    assert last["statuses"] == {200: KEYS}
    assert last["elsewhere"] == 0  # every request on a serve line: the ring, not a backup
    assert growth(points) < GROWTH_BOUND
    assert growth(control) > GROWTH_BOUND  # per-key state shows, so the bound above means something
    assert all(mean / BALANCE_FACTOR <= n <= mean * BALANCE_FACTOR for n in serve.values()), serve
