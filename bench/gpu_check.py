"""The GPU half of bench/gpu_check.sh: with a CUDA build of llama-cpp-python,
serve the bundled model fully offloaded, sleep, and check through NVML that
the worker gave every byte back; then wake and print the resume phases."""

from __future__ import annotations

import sys
import time

from bench.common import Daemon, bundled_model, table


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
    d = Daemon("--sleep-idle-seconds", "-1", "--n-gpu-layers", "-1", model=bundled_model(), threads=4)
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


if __name__ == "__main__":
    sys.exit(main())
