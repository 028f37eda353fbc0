"""The GPU half of bench/gpu_check.sh: with a CUDA build of llama-cpp-python,
serve the bundled model fully offloaded, sleep, and check through NVML that
the worker gave every byte back; then wake and print the resume phases.

`python -m bench.gpu_check tiers --big-gb 16`: on a GGUF of that size that it
writes itself (bench/wake_tiers.py's writer), every load mode from a warm and
from a cold page cache (the weights phase in GB/s: the measured default for
this device kind is the fastest), then each sleep tier's resume, with the
worker's GPU bytes after each sleep (drowsy keeps the weights there; light
and deep must leave 0)."""

from __future__ import annotations

import sys
import time

from bench.common import Daemon, bundled_model, table


def check_model() -> str:
    """The bundled model where its package is installed; else (an offline bundle, bench/gpu_bundle.sh,
    leaves the 253 MB package out) a ~0.3 GB llama GGUF written here: the same teardown to check."""
    try:
        return bundled_model()
    except ImportError:
        import tempfile
        from pathlib import Path

        from bench.wake_tiers import write_big_model

        work = Path(tempfile.gettempdir()) / "dormouse-bench"
        work.mkdir(exist_ok=True)
        print("the bundled model's package is not installed: a 0.3 GB GGUF written here stands in")
        return str(write_big_model(work / "small-llama-f16.gguf", 0.3))


def main() -> int:
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)

    def gpu_bytes(pid: int) -> int:
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        return sum(p.usedGpuMemory or 0 for p in procs if p.pid == pid)

    def daemon_gpu_bytes(d: Daemon) -> int:
        import psutil

        root = psutil.Process(d.proc.pid)
        return sum(gpu_bytes(p.pid) for p in [root, *root.children(recursive=True)])

    used_before = pynvml.nvmlDeviceGetMemoryInfo(handle).used
    d = Daemon("--sleep-idle-seconds", "-1", "--n-gpu-layers", "-1", model=check_model(), threads=4)
    ok = True
    try:
        d.wait_state("ready", timeout=300)
        props = d.props()
        loaded_pid = props["last_wake"]["worker_pid"]
        loaded = gpu_bytes(loaded_pid)
        devices = [x for x in props["model"]["devices"] if x["type"] == "gpu"]
        print(f"loaded: worker {loaded_pid} holds {loaded / 2**20:.1f} MiB on the GPU (NVML); "
              f"ggml devices: {[x['description'] for x in devices]}")
        print("memory by component:", props["model"]["memory_by_device"])
        ok &= loaded > 0
        first = d.stream_first_token("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8})

        sleep = d.http.post("/sleep").json()["last_sleep"]
        time.sleep(0.5)
        after = gpu_bytes(loaded_pid)
        all_daemon = daemon_gpu_bytes(d)
        print(table(["teardown step", "seconds", "freed bytes"],
                    [[p["name"], p["seconds"], p["freed_bytes"]] for p in sleep["phases"]]))
        print(f"asleep: old worker {loaded_pid} holds {after} bytes; all daemon processes hold {all_daemon} bytes "
              f"(NVML reclaim wait {sleep['memory_returned']['seconds']:.3f} s); "
              f"device used before start {used_before / 2**20:.0f} MiB, now "
              f"{pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20:.0f} MiB")
        ok &= after == 0 and all_daemon == 0 and sleep["memory_returned"]["gpu_released"]

        ttft, _, _ = d.stream_first_token("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8})
        wake = d.props()["last_wake"]
        print(table(["resume phase", "seconds"], [[p["name"], p["seconds"]] for p in wake["phases"]]))
        print(f"resume (request to first token): {ttft:.3f} s; warm first token before sleep: {first[0]:.3f} s")
    finally:
        d.stop()
    print("GPU CHECK", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


LOAD_MODES = ("auto", "mmap", "none", "direct_io", "mmap+mlock")


def tiers(big_gb: float) -> int:
    """Load modes and sleep tiers on a big GGUF, fully offloaded."""
    import os
    import tempfile
    from pathlib import Path

    import pynvml

    from bench.wake_tiers import BODY, drop_cache, read_rate, warm_cache, write_big_model

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)

    def gpu_bytes(pid: int) -> int:
        return sum(p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == pid)

    work = Path(os.environ.get("GPU_CHECK_DIR", tempfile.gettempdir())) / "dormouse-gpu-check"
    work.mkdir(parents=True, exist_ok=True)
    model = str(write_big_model(work / f"big-{big_gb:g}gb-f16.gguf", big_gb))
    size = os.path.getsize(model)
    rate = read_rate(model)
    print(f"model {model}: {size / 1e9:.2f} GB; sequential read {rate / 1e9:.2f} GB/s (size/rate {size / rate:.2f} s)")
    rows, ok = [], True
    for mode in LOAD_MODES:
        for cache in ("warm", "cold"):
            warm_cache(model) if cache == "warm" else drop_cache(model)
            d = Daemon("--sleep-idle-seconds", "-1", "--n-gpu-layers", "-1", model=model, threads=8,
                       env={"DORMOUSE_LOAD_MODE": mode, "DORMOUSE_WARMUP": "false",
                            "DORMOUSE_STATE_DIR": str(work / "state")})
            try:
                d.wait_state("ready", "failed", timeout=580)
                wake = d.props().get("last_wake") or {}
                weights = sum(p["seconds"] for p in wake.get("phases", []) if p["name"] == "model")
                rows.append([mode, cache, wake.get("seconds", float("nan")), weights,
                             size / weights / 1e9 if weights else float("nan")])
            finally:
                d.stop()
    print(table(["load mode", "page cache", "load seconds", "weights phase s", "weights GB/s"], rows))
    best = {cache: min((r for r in rows if r[1] == cache), key=lambda r: r[2])[0] for cache in ("warm", "cold")}
    print(f"fastest load mode: warm cache {best['warm']}, cold cache {best['cold']}")

    d = Daemon("--sleep-idle-seconds", "-1", "--n-gpu-layers", "-1", model=model, threads=8,
               env={"DORMOUSE_DEEP_AFTER": "-1", "DORMOUSE_LOAD_MODE": best["cold"],
                    "DORMOUSE_STATE_DIR": str(work / "state")})
    tier_rows = []
    try:
        d.wait_state("ready", timeout=580)
        d.stream_first_token("/v1/completions", BODY)
        for name, tier in (("drowsy", "drowsy"), ("light", "light"), ("deep, warm cache", "deep"),
                           ("deep, cold cache", "deep")):
            pid = d.props()["last_wake"]["worker_pid"]
            d.http.post("/sleep", json={"tier": tier}).raise_for_status()
            time.sleep(0.5)
            left = gpu_bytes(pid)
            if tier != "drowsy":
                ok &= left == 0
            if name.endswith("cold cache"):
                drop_cache(model)
            elif name.startswith("deep"):
                warm_cache(model)
            ttft = d.stream_first_token("/v1/completions", BODY)[0]
            wake = d.props()["last_wake"]
            weights = sum(p["seconds"] for p in wake["phases"] if p["name"] == "model")
            predicted = (wake.get("predicted") or {}).get("seconds", float("nan"))
            tier_rows.append([name, left / 2**20, ttft, wake["seconds"], predicted,
                              size / weights / 1e9 if weights else float("nan")])
    finally:
        d.stop()
    print(table(["tier", "worker MiB on GPU asleep", "resume to first token s", "wake s", "predicted s",
                 "weights GB/s"], tier_rows))
    print("GPU TIERS CHECK", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help"):  # without touching NVML (no GPU here is fine)
        sys.exit(print(__doc__))
    if len(sys.argv) > 1 and sys.argv[1] == "tiers":
        import argparse

        parser = argparse.ArgumentParser(prog="python -m bench.gpu_check tiers")
        parser.add_argument("--big-gb", type=float, default=16.0)
        sys.exit(tiers(parser.parse_args(sys.argv[2:]).big_gb))
    sys.exit(main())
