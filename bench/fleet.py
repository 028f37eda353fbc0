"""The fleet: admission by memory (Dormouse) beside admission by count
(Ollama's OLLAMA_MAX_LOADED_MODELS, llama-server's --models-max), the same
seeded trace replayed against both in the same run; and the swap time A->B
beside A's sleep plus B's resume measured alone. ABOUT (also printed in
docs/BENCHMARKS.md) says what is run.

    .venv/bin/python -m bench.fleet [--requests 48] [--cycles 5]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path


from bench.common import Daemon, bundled_model, median, table

# The tests' fixtures write the tiny model and the fleet's TOML; bench runs from the repository root.
from tests.fixtures.fleet import check_config, planned_bytes, write_toml
from tests.fixtures.tiny_model import write_tiny_model
from tests.metrics_text import value

MODELS = ("small", "big", "tiny", "tiny2")
ABOUT = """\
Four models: the bundled Gemma 3 270M under two contexts ("small" 1024,
"big" 4096) and the tiny random llama of the tests (tests/fixtures/tiny_model.py)
under two contexts ("tiny", "tiny2"). The memory budget holds one Gemma
and both tinies, never both Gemmas (as a GPU that holds one large model and
a few small ones). No count says that: "at most 1" is safe but swaps the
tinies in and out; "at most 3" (Ollama's default cap per GPU) holds both Gemmas
at once, over the budget: on a GPU an out-of-memory failure or paging, on
this CPU run only counted ("requests over budget": requests after which the
loaded models' bytes exceed the budget).

The count policy is the count half of Ollama's rule (OLLAMA_MAX_LOADED_MODELS,
3 per GPU by default) and all of llama-server's --models-max; Ollama also
checks its own VRAM estimate, which this emulation leaves out. It is not in
the daemon: it runs from the client, on a Dormouse whose budget admits
everything. Before a request for a model that is not loaded, when N are
loaded, the client unloads the least recently used one (POST /models/unload).
The unload is part of that request's latency, as it would be inside a
server's scheduler.
"""
MiB = 2**20


class FleetDaemon(Daemon):
    def __init__(self, toml: Path) -> None:
        super().__init__("--config", str(toml), model=None, threads=None)  # the TOML sets both per model

    def wait_ready(self, timeout: float = 120) -> None:
        self.wait_state("ready", timeout=timeout)

    def models(self) -> dict[str, dict]:
        return {m["id"]: m for m in self.http.get("/v1/models").json()["data"]}

    def props(self, model: str) -> dict:
        return self.http.get("/props", params={"model": model}).json()

    def wait_spares(self, models: tuple[str, ...], timeout: float = 30) -> None:
        """Sleeping models have their worker started ahead, as after any idle time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.props(m)["spare_worker_pid"] for m in models if self.props(m)["is_sleeping"]):
                return
            time.sleep(0.05)
        raise TimeoutError("no spare worker")

    def complete(self, model: str) -> int:
        return self.http.post("/v1/completions", json={"model": model, "prompt": "The dormouse", "max_tokens": 2,
                                                       "temperature": 0}).status_code


def fleet_tables(bundled: str, tiny: str) -> dict[str, dict]:
    return {"small": {"path": bundled, "ctx_size": 1024, "parallel": 2},
            "big": {"path": bundled, "ctx_size": 4096, "parallel": 2},
            "tiny": {"path": tiny, "ctx_size": 512, "parallel": 2},
            "tiny2": {"path": tiny, "ctx_size": 1024, "parallel": 2}}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[round(q * (len(ordered) - 1))] if ordered else float("nan")


def replay(d: FleetDaemon, trace: list[str], budget: int, count: int | None) -> dict:
    """Replay the trace one request at a time. count=None: the daemon admits by
    memory; count=N: the client keeps at most N loaded, unloading the least recently used."""
    last_used: dict[str, float] = {}
    latencies, errors, unloads, peak, over = [], 0, 0, 0, 0
    for step, model in enumerate(trace):
        start = time.perf_counter()
        if count is not None:
            loaded = [m for m, info in d.models().items() if info["status"] == "loaded"]
            if model not in loaded and len(loaded) >= count:
                victim = min(loaded, key=lambda m: last_used.get(m, -1.0))
                unloads += 1
                if d.http.post("/models/unload", json={"model": victim}).status_code != 200:
                    errors += 1
        status = d.complete(model)
        latencies.append(time.perf_counter() - start)
        last_used[model] = step
        errors += status != 200
        resident = sum(info["footprint_bytes"]["measured"] or info["footprint_bytes"]["predicted"]
                       for info in d.models().values() if info["status"] == "loaded")
        peak = max(peak, resident)
        over += resident > budget
    text = d.http.get("/metrics").text
    return {"swaps": int(sum(value(text, "dormouse_wakes_total", model=m, reason="request") for m in MODELS)),
            "evictions": int(sum(value(text, "dormouse_fleet_evictions_total", model=m) for m in MODELS)),
            "unloads": unloads, "p50": median(latencies), "p95": percentile(latencies, 0.95),
            "errors": errors, "peak": peak, "over": over, "total": sum(latencies)}


def swap_time(tmp: Path, tables: dict[str, dict], sizes: dict[str, int], cycles: int) -> dict:
    """small -> big with a budget that fits only one, beside small's sleep + big's resume alone."""
    budget = max(sizes["small"], sizes["big"]) + MiB
    toml = write_toml(tmp / "swap.toml", {m: tables[m] for m in ("small", "big")}, memory_budget=budget,
                      threads=2, sleep_idle_seconds=-1, state_dir=str(tmp / "state"))
    d = FleetDaemon(toml)
    swaps, sleeps, resumes, admissions = [], [], [], []
    try:
        d.wait_ready()
        assert d.complete("big") == 200  # once, so that both have had a worker and keep one ready (spawn-ahead)
        for _ in range(cycles):
            # The swap: small is loaded and warm; a request for big puts it to sleep and loads big.
            assert d.complete("small") == 200
            d.wait_spares(("big",))
            time.sleep(0.3)
            start = time.perf_counter()
            assert d.complete("big") == 200
            swaps.append(time.perf_counter() - start)
            admissions.append(d.props("big")["last_wake"].get("admission_seconds", 0.0))
            # Alone: small's sleep by itself, then big's resume with nothing to put to sleep.
            assert d.complete("small") == 200  # (puts big to sleep; not measured)
            d.wait_spares(("big",))
            start = time.perf_counter()
            assert d.http.post("/models/unload", json={"model": "small"}).status_code == 200
            sleeps.append(time.perf_counter() - start)
            d.wait_spares(("small", "big"))
            time.sleep(0.3)
            start = time.perf_counter()
            assert d.complete("big") == 200
            resumes.append(time.perf_counter() - start)
    finally:
        d.stop()
    return {"swap": median(swaps), "sleep": median(sleeps), "resume": median(resumes),
            "admission_wait": median(admissions)}


def run(requests: int = 48, cycles: int = 5, seed: int = 11) -> tuple[str, dict]:
    out: list[str] = []
    print = out.append  # noqa: A001 - the report is collected, then printed or written
    tmp = Path(tempfile.mkdtemp(prefix="dormouse-bench-fleet-"))
    try:
        tiny = str(write_tiny_model(tmp / "tiny-llama.gguf"))
        tables = fleet_tables(bundled_model(), tiny)
        common = {"threads": 2, "sleep_idle_seconds": -1, "state_dir": str(tmp / "state")}
        found = check_config(write_toml(tmp / "probe.toml", tables, **common))
        sizes = {m: planned_bytes(found["models"][m]) for m in MODELS}
        # One Gemma and both tinies, plus half the smaller Gemma: never the two Gemmas.
        gemmas = (sizes["small"], sizes["big"])
        budget = max(gemmas) + sizes["tiny"] + sizes["tiny2"] + min(gemmas) // 2
        rng = random.Random(seed)
        trace = [rng.choice(MODELS) for _ in range(requests)]

        results = {}
        for name, count in (("memory (dormouse)", None), ("count <= 1", 1), ("count <= 3", 3)):
            # The count policy runs on a budget that never refuses: the count alone decides.
            toml = write_toml(tmp / "fleet.toml", tables, memory_budget=budget if count is None else 2**40, **common)
            d = FleetDaemon(toml)
            try:
                d.wait_ready()
                results[name] = replay(d, trace, budget, count)
            finally:
                d.stop()
        swap = swap_time(tmp, tables, sizes, cycles)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"Fleet admission: {requests} requests, one at a time, seeded trace over {', '.join(MODELS)}; "
          f"budget {budget / MiB:.1f} MiB (one Gemma and both tinies, never both Gemmas)\n")
    print("footprints (MiB, as planned): " + ", ".join(f"{m} {sizes[m] / MiB:.1f}" for m in MODELS) + "\n")
    rows = [[name, r["swaps"], r["evictions"] + r["unloads"], r["p50"], r["p95"], r["total"], r["errors"],
             f"{r['peak'] / MiB:.0f}", r["over"]] for name, r in results.items()]
    print(table(["policy", "loads", "put to sleep", "p50 s", "p95 s", "total s", "errors", "peak MiB",
                 "requests over budget"], rows))
    print("\n(count policies: Dormouse with no memory limit, the client unloading the least recently "
          "used model when N are loaded)")
    print(f"\nSwap small -> big, budget fits one (median of {cycles})\n")
    print(table(["what", "seconds"], [
        ["request for big while small is loaded (swap)", swap["swap"]],
        ["small's sleep alone (POST /models/unload)", swap["sleep"]],
        ["big's resume alone (request, nothing to evict)", swap["resume"]],
        ["sleep + resume alone", swap["sleep"] + swap["resume"]],
        ["of the swap: waiting for admission (small's sleep)", swap["admission_wait"]],
    ]))
    return "\n".join(out), {"budget": budget, "sizes": sizes, "trace": trace, "results": results, "swap": swap}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    started = time.monotonic()
    text, data = run(args.requests, args.cycles, args.seed)
    print(text)
    print(f"\n(wall time {time.monotonic() - started:.0f} s)")
    print("\n" + json.dumps(data))


if __name__ == "__main__":
    main()
