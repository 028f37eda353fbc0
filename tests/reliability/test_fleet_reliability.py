"""The fleet under a random mix: 150 requests (300 under `make soak`) over the three models of the
fleet tests (tests/fixtures/fleet.py: the bundled model under two contexts
and the tiny random llama), 1 to 4 at a time, against a memory budget that
fits any two of them. Seeded, so a failure replays.

Checked: no request fails (a 503 with Retry-After that the client retried is
counted apart, as a retry, not an error; here a retry means a stall, and
fails the test too); never more than one load at a time (the daemon's own
high-water mark, and a scrape every 50 ms); the daemon's RSS and open fds
are flat between request 50 and the last.
Printed: wakes and evictions per model, load waits, retries, latency, wall time.
"""

from __future__ import annotations

import concurrent.futures
import random
import statistics
import threading
import time

import httpx
import psutil
import pytest

from tests.conftest import DaemonProcess
from tests.fixtures.fleet import (
    FITS_TWO,
    fleet_config,
    metric,
    mib,
    props,
    statuses,
    three_models,
)
from tests.fixtures.tiny_model import write_tiny_model
from tests.metrics_text import value
from tests.soak import rounds

pytestmark = pytest.mark.reliability

REQUESTS = rounds(150, 300)
SEED = 1203
MAX_RETRIES = 3  # per request; only for a 503 that says when to come back
STICKY = 0.6  # how often a request asks for the same model as the one before it


def figures(name: str, **values) -> None:
    print(f"\n[{name}] " + ", ".join(f"{k}={v}" for k, v in values.items()))


def make_trace(rng: random.Random, n: int) -> list[list[dict]]:
    """Batches of 1-4 concurrent requests, each for a random model, endpoint and
    length. Six times in ten a request asks for the model the one before it
    asked for, as traffic does (a conversation's turns): fewer swaps than a
    uniform mix, so the requests fit in a few minutes on 2 cores, and still
    dozens of them."""
    batches, left, model = [], n, rng.choice(FITS_TWO)
    while left:
        size = min(left, rng.randint(1, 4))
        batch = []
        for _ in range(size):
            model = model if rng.random() < STICKY else rng.choice(FITS_TWO)
            tokens = rng.randint(1, 4)
            if rng.random() < 0.5:
                batch.append({"path": "/v1/completions",
                              "body": {"model": model, "prompt": f"Note {rng.randint(0, 999)}:", "max_tokens": tokens}})
            else:
                batch.append({"path": "/v1/chat/completions",
                              "body": {"model": model, "max_tokens": tokens,
                                       "messages": [{"role": "user", "content": f"Say {rng.randint(0, 999)}"}]}})
        batches.append(batch)
        left -= size
    return batches


class Outcome:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self.retries = 0


def send(http: httpx.Client, request: dict, outcome: Outcome) -> None:
    start = time.monotonic()
    for attempt in range(MAX_RETRIES + 1):
        response = http.post(request["path"], json=request["body"])
        if response.status_code == 503 and "Retry-After" in response.headers and attempt < MAX_RETRIES:
            with outcome.lock:
                outcome.retries += 1
            time.sleep(min(float(response.headers["Retry-After"]), 5))
            continue
        break
    ok = response.status_code == 200 and response.json()["model"] == request["body"]["model"]
    with outcome.lock:
        if ok:
            outcome.latencies.append(time.monotonic() - start)
        else:
            outcome.errors.append(f"{request['body']['model']} {response.status_code} {response.text[:200]}")


def settle(d: DaemonProcess) -> tuple[int, int, int]:
    """Every model asleep with its spare worker started: the same process shape
    at each sample, so the daemon's fds (one channel per worker) are comparable.
    Returns (RSS of the daemon process, its open fds, its child processes)."""
    assert d.http.post("/sleep").json()["ok"]
    for _ in range(600):  # 30 s at most
        if all(props(d.http, m)["spare_worker_pid"] for m in FITS_TWO):
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the spare workers did not all start")
    time.sleep(0.5)  # closed client connections reach the daemon
    daemon = psutil.Process(d.pid)
    return daemon.memory_info().rss, daemon.num_fds(), len(daemon.children())


def test_a_random_mix_over_three_models_with_room_for_two(tmp_path, bundled_model):
    tiny = write_tiny_model(tmp_path / "tiny-llama.gguf")
    toml, budget, sizes = fleet_config(tmp_path, three_models(bundled_model, str(tiny)))
    rng = random.Random(SEED)
    batches = make_trace(rng, REQUESTS)
    d = DaemonProcess("--config", str(toml), "--log-level", "info", log_path=tmp_path / "daemon.log")
    outcome = Outcome()
    loading_seen: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        with httpx.Client(base_url=d.url, timeout=30) as http:
            for _ in range(20_000):  # ~16 min at most; the test stops it long before
                if stop.is_set():
                    return
                loading_seen.append(metric(http, "dormouse_fleet_loads_in_progress"))
                time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    samples = {}
    try:
        d.wait_state("ready", timeout=120)
        watcher.start()
        began = time.monotonic()
        done = 0
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for batch in batches:
                # A client per batch: its connections are closed before a sample is taken.
                with httpx.Client(base_url=d.url, timeout=300) as http:
                    list(pool.map(lambda request: send(http, request, outcome), batch))
                done += len(batch)
                if outcome.retries:
                    break  # a stall (see the last assertion): the figures so far say enough
                if done >= 50 and "at 50" not in samples:
                    samples["at 50"] = (done, *settle(d))
        wall = time.monotonic() - began
        samples["at end"] = (done, *settle(d))
        stop.set()
        watcher.join(60)
        text = d.http.get("/metrics").text
        wakes = {m: int(value(text, "dormouse_wakes_total", model=m, reason="request")) for m in FITS_TWO}
        evictions = {m: int(value(text, "dormouse_fleet_evictions_total", model=m)) for m in FITS_TWO}
        waits = {m: int(value(text, "dormouse_fleet_load_waits_total", model=m)) for m in FITS_TWO}
        most_loading = value(text, "dormouse_fleet_loads_in_progress_max")
        final = statuses(d.http)
    finally:
        stop.set()
        code = d.stop()
    assert code == 0, d.log()[-3000:]

    latencies = sorted(outcome.latencies)
    (n_a, rss_a, fds_a, kids_a), (n_b, rss_b, fds_b, kids_b) = samples.get("at 50", (0,) * 4), samples["at end"]
    figures("fleet mix", requests=REQUESTS, batches=len(batches), budget=mib(budget),
            predicted={m: mib(sizes[m]) for m in FITS_TWO}, wall_seconds=round(wall, 1),
            errors=len(outcome.errors), retries=outcome.retries,
            p50_seconds=round(statistics.median(latencies), 3) if latencies else None,
            p95_seconds=round(latencies[int(0.95 * (len(latencies) - 1))], 3) if latencies else None,
            wakes=wakes, evictions=evictions, load_waits=waits, most_loading_at_once=most_loading,
            scrapes=len(loading_seen), rss_mib=(round(rss_a / 2**20, 1), round(rss_b / 2**20, 1)),
            open_fds=(fds_a, fds_b), children=(kids_a, kids_b), sampled_after=(n_a, n_b), final=final)
    assert outcome.errors == [], outcome.errors[:5]
    # A retry means a load waited all of wake_timeout (120 s) while the models in
    # its way served requests of at most 4 tokens, 4 at a time: not a full
    # budget but a stall (tests/integration/test_fleet_rewake.py has one).
    assert outcome.retries == 0, "a load waited wake_timeout: see the daemon log's fleet.admission_timeout"
    assert len(outcome.latencies) == REQUESTS
    assert most_loading == 1 and loading_seen and max(loading_seen) <= 1
    # The mix really swapped models (with room for two of three, it must).
    assert sum(evictions.values()) >= 10 and all(wakes.values())
    assert rss_b <= rss_a * 1.05 + 4 * 2**20, (rss_a, rss_b)
    assert abs(fds_b - fds_a) <= 2, (fds_a, fds_b)
    assert kids_a == kids_b == len(FITS_TWO)  # one spare per model, no worker left behind
