"""No drift across sleep/wake cycles: 18 cycles in `make test`, 48 under `make soak`
(or the time budget, whichever comes first) of the bundled model with a draft, through every tier in turn
(drowsy, light, deep). After each sleep: the daemon's RSS (against the first
cycle of the same tier), and (where NVML
exists) the old worker's GPU bytes; after each wake: the greedy answer, its
decode speed and the draft's acceptance, and the woken worker's threads and
RSS. Bounds: the daemon's RSS within 2 MiB of the first cycle of its tier, the
worker's RSS within 8 MiB and its threads the same, draft acceptance within 5%,
output token for token the same, 0 GPU bytes. Decode speed is printed, not
asserted: a time on a shared machine measures the neighbours (a CI run at load
1.7 on 2 cores read 66 -> 70 CPU ms/token with nothing drifted); what would make
a worker slower (memory or threads piling up) is counted instead.

DORMOUSE_DRIFT_CYCLES (default 18, 6 per tier; 48 under `make soak`; 100 or more for the long run) and DORMOUSE_DRIFT_SECONDS (default 300)
bound it; at least MIN_CYCLES must run."""

import os
import statistics
import time

import psutil
import pytest

from tests.reliability.test_reliability import figures
from tests.soak import rounds

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(900)]
MIN_CYCLES = 12
WINDOW = 6  # cycles summarised (first against last, printed): one slow step on a shared machine is noise
BODY = {"prompt": "List the planets of the solar system:", "n_predict": 16, "temperature": 0, "cache_prompt": False}
# The decode-cost sample: a second, warm request. Fewer tokens than the answer: the cost per token is
# the same, and the best of a window of cycles is compared, so a short sample is enough (the cycles
# are most of the suite's time: 100 of them at 2 decodes each).
WARM_BODY = {**BODY, "n_predict": 8}


def wait_for_spare(d, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not d.props()["spare_worker_pid"]:
        assert time.monotonic() < deadline, "no spare worker within 30 s of a sleep"
        time.sleep(0.02)


def test_sleep_wake_cycles_do_not_drift(start_daemon, bundled_model):
    cycles = int(os.environ.get("DORMOUSE_DRIFT_CYCLES", str(rounds(18, 48))))
    budget = float(os.environ.get("DORMOUSE_DRIFT_SECONDS", "300"))
    d = start_daemon("--sleep-idle-seconds", "-1", "--model-draft", bundled_model, "--parallel", "1",
                     env={"DORMOUSE_DEEP_AFTER": "-1", "DORMOUSE_KV_CACHE_DISK_BYTES": "0"})
    d.wait_state("ready", timeout=180)
    daemon = psutil.Process(d.pid)
    nvml = None
    try:
        from daemon.gpu import Nvml

        nvml = Nvml() if Nvml().available else None
    except Exception:  # noqa: BLE001 - no NVML: the GPU check is skipped, and said so
        nvml = None
    d.http.post("/completion", json=BODY).raise_for_status()  # lazy initialisation, before cycle 1
    tiers = ("drowsy", "light", "deep")
    fds: list[int] = []
    rss, speed, accepted, outputs, gpu_left, wakes, cpu_per_token, load = [], [], [], [], [], [], [], []
    worker_rss: list[int] = []
    worker_threads: list[int] = []
    started = time.monotonic()
    n = 0
    while n < cycles and (time.monotonic() - started < budget or n < MIN_CYCLES):
        tier = tiers[n % len(tiers)]
        pid_before = d.props()["last_wake"]["worker_pid"] if d.props().get("last_wake") else None
        answer = d.http.post("/sleep", json={"tier": tier})
        assert answer.status_code == 200, answer.text
        assert answer.json()["tier"] == tier
        rss.append(daemon.memory_info().rss)
        if tier != "drowsy":  # the spare worker's socket is a descriptor: count once it is there
            wait_for_spare(d)
        fds.append(daemon.num_fds())
        if nvml is not None and tier != "drowsy" and pid_before:
            gpu_left.append(sum(nvml.used_by(pid_before).values()))
        response = d.http.post("/completion", json=BODY)
        assert response.status_code == 200, response.text
        body = response.json()
        timings = body["timings"]
        outputs.append(body["content"])
        speed.append(timings["predicted_per_second"])
        accepted.append(timings.get("draft_n_accepted", 0) / max(timings.get("draft_n", 0), 1))
        wakes.append(d.props()["last_wake"]["seconds"])
        # Decode speed as the woken worker's CPU seconds per token of a second, warm request:
        # on a machine shared with other jobs wall time measures the neighbours; CPU time
        # measures the worker (wall tokens/s is printed beside it).
        worker = psutil.Process(d.props()["last_wake"]["worker_pid"])
        before = sum(worker.cpu_times()[:2])
        warm = d.http.post("/completion", json=WARM_BODY).json()
        cpu_per_token.append((sum(worker.cpu_times()[:2]) - before) / max(warm["timings"]["predicted_n"], 1))
        worker_rss.append(worker.memory_info().rss)
        worker_threads.append(worker.num_threads())
        load.append(os.getloadavg()[0])
        n += 1
    elapsed = time.monotonic() - started
    first_speed, last_speed = statistics.median(speed[:WINDOW]), statistics.median(speed[-WINDOW:])
    # The best of each window: ggml's threads spin while they wait for one another, so on a
    # machine shared with other jobs a descheduled thread costs CPU time too (measured: a median
    # of 158 -> 276 CPU ms/token from load alone); a worker that drifted is slower at its best too.
    first_cpu, last_cpu = min(cpu_per_token[:WINDOW]), min(cpu_per_token[-WINDOW:])
    figures("wake_drift", cycles=n, seconds=round(elapsed, 1), tiers="/".join(tiers),
            rss_first_mib=round(rss[0] / 2**20, 2),
            rss_growth_per_tier_mib=round(max(rss[i] - rss[i % len(tiers)] for i in range(len(rss))) / 2**20, 3),
            rss_last_growth_mib=round((rss[-1] - rss[0]) / 2**20, 3), fds_first=fds[0], fds_max=max(fds),
            decode_tps_first=round(first_speed, 1), decode_tps_last=round(last_speed, 1),
            cpu_ms_per_token_first=round(first_cpu * 1000, 2), cpu_ms_per_token_last=round(last_cpu * 1000, 2),
            draft_acceptance_first=round(accepted[0], 3), draft_acceptance_last=round(accepted[-1], 3),
            wake_seconds_median=round(statistics.median(wakes), 3),
            worker_rss_growth_per_tier_mib=round(max(worker_rss[i] - worker_rss[i % len(tiers)]
                                                     for i in range(len(worker_rss))) / 2**20, 3),
            worker_threads=sorted(set(worker_threads)),
            load_average_max=round(max(load), 2), cores=os.cpu_count(),
            gpu_bytes_after_sleep="not checked (no NVML)" if nvml is None else max(gpu_left, default=0))
    assert n >= MIN_CYCLES
    assert all(o == outputs[0] for o in outputs), "greedy output changed across cycles"
    # Each tier against its own first cycle: the first light sleep is the one that first runs the
    # keeper (and the thread that reads for it), the first drowsy one the first doze.
    growth = max(rss[i] - rss[i % len(tiers)] for i in range(len(rss)))
    assert growth <= 2 * 2**20, f"the daemon's RSS after sleep grew {growth / 2**20:.2f} MiB: {rss}"
    # Each tier's sleep holds the same descriptors every cycle (a worker's socket, a keeper's mapping),
    # against that tier's first cycle; one may be open for a moment (measured: 12 instead of 11 once
    # in 100 cycles), and a leak would grow past it.
    assert all(fds[i] <= fds[i % len(tiers)] + 1 for i in range(len(fds))), f"descriptors leaked: {fds}"
    # The woken worker (the same process every drowsy cycle, a fresh one every light or deep one)
    # against its tier's first: a worker that kept what it should have freed grows here.
    worker_growth = max(worker_rss[i] - worker_rss[i % len(tiers)] for i in range(len(worker_rss)))
    assert worker_growth <= 8 * 2**20, f"the worker's RSS grew {worker_growth / 2**20:.2f} MiB: {worker_rss}"
    assert all(t == worker_threads[i % len(tiers)] for i, t in enumerate(worker_threads)), \
        f"the worker's threads changed across cycles: {worker_threads}"
    assert all(abs(a - accepted[0]) <= 0.05 for a in accepted), "draft acceptance drifted"
    assert all(b == 0 for b in gpu_left)
