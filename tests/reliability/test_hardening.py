"""Issue 9's reliability checks, on the real model: a hung worker during two
streams, and a crowd of hostile requests beside one normal stream. Bounded in
count and time; each prints its figures."""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import signal
import statistics
import threading
import time

import httpx
import pytest

from config import Settings
from daemon.server import stop_budget
from tests.e2e.test_walking_daemon import metric
from tests.reliability.test_reliability import figures

pytestmark = pytest.mark.reliability

LIVENESS = 3.0


def stream_until_error(url: str, body: dict, started: threading.Barrier, out: list) -> None:
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        waiting = True
        for line in r.iter_lines():
            if waiting and line.startswith("data: {"):
                started.wait(30)
                waiting = False
            if line.startswith("data: ") and '"error"' in line:
                out.append((time.monotonic(), json.loads(line[6:])["error"]))
                return
            if line == "data: [DONE]":
                out.append((time.monotonic(), None))
                return


def test_hung_worker_during_two_streams(start_daemon):
    """SIGSTOP the worker mid-stream: both streams fail naming the hang within
    the liveness bound, the daemon sleeps again afterwards, SIGTERM ends in budget."""
    env = {"DORMOUSE_WORKER_LIVENESS_TIMEOUT": str(LIVENESS), "DORMOUSE_EARLY_CRASH_SECONDS": "0"}
    d = start_daemon("--sleep-idle-seconds", "2", env=env)
    d.wait_state("ready")
    worker = d.props()["last_wake"]["worker_pid"]
    started = threading.Barrier(3)
    errors: list = []
    body = {"prompt": "Tell a long story about a hung worker", "max_tokens": 400, "ignore_eos": True, "stream": True}
    threads = [threading.Thread(target=stream_until_error, args=(d.url, body, started, errors)) for _ in range(2)]
    for t in threads:
        t.start()
    started.wait(60)
    os.kill(worker, signal.SIGSTOP)
    stopped_at = time.monotonic()
    for t in threads:
        t.join(LIVENESS * 10)
    assert len(errors) == 2 and all(e is not None for _, e in errors), errors
    assert all("hung" in e["message"] and e["code"] == "worker_exited" for _, e in errors)
    delays = [at - stopped_at for at, _ in errors]
    # The daemon is not stuck: it is asleep (the hung worker is gone), serves the next
    # request, and its idle timer puts it to sleep again (nothing left in flight).
    assert d.wait_state("sleeping", timeout=10)["state"] == "sleeping"
    r = d.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200
    d.wait_state("sleeping", timeout=30)
    budget = stop_budget(Settings())
    began = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    code = d.proc.wait(budget + 10)
    took = time.monotonic() - began
    figures("hung worker", liveness_timeout=LIVENESS, error_after_seconds=[round(x, 2) for x in delays],
            sigterm_seconds=round(took, 2), stop_budget=budget)
    assert code == 0
    assert max(delays) < LIVENESS * 3  # noticed by the liveness check, not by a client giving up


def test_sigterm_with_a_stopped_worker_ends_within_its_budget(start_daemon):
    """No liveness check at all: the shutdown's own bounds still end it."""
    env = {"DORMOUSE_WORKER_LIVENESS_TIMEOUT": "0", "DORMOUSE_TEARDOWN_TIMEOUT": "3"}
    d = start_daemon("--sleep-idle-seconds", "-1", "--shutdown-timeout", "2", env=env)
    d.wait_state("ready")
    worker = d.props()["last_wake"]["worker_pid"]
    started = threading.Barrier(2)
    out: list = []
    body = {"prompt": "Tell a long story", "max_tokens": 400, "ignore_eos": True, "stream": True}
    t = threading.Thread(target=stream_until_error, args=(d.url, body, started, out))
    t.start()
    started.wait(60)
    os.kill(worker, signal.SIGSTOP)
    budget = stop_budget(Settings(shutdown_timeout=2, teardown_timeout=3))
    began = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    code = d.proc.wait(budget + 10)
    took = time.monotonic() - began
    t.join(10)
    figures("SIGTERM with a stopped worker", seconds=round(took, 2), budget=budget, exit_code=code)
    assert took <= budget
    with pytest.raises(ProcessLookupError):
        os.kill(worker, 0)  # the stopped worker was killed, not left behind


def hostile_bodies() -> list[tuple[str, dict]]:
    """(what, body): every one must be answered 400 or with a bounded answer."""
    small = {"prompt": "Hello", "max_tokens": 3}
    return [
        ("huge max_tokens", {**small, "max_tokens": 10**12}),
        ("negative max_tokens", {**small, "max_tokens": -5}),
        ("huge top_k", {**small, "top_k": 2**40}),
        ("top_k at the int32 edge", {**small, "top_k": 2**31 - 1}),
        ("negative top_k", {**small, "top_k": -3}),
        ("huge penalty window", {**small, "repeat_penalty": 1.1, "repeat_last_n": 2**29}),
        ("penalty window past int32", {**small, "repeat_penalty": 1.1, "repeat_last_n": 2**40}),
        ("negative penalty window", {**small, "repeat_last_n": -7}),
        ("negative seed", {**small, "seed": -1}),
        ("huge seed", {**small, "seed": 2**70}),
        ("50k logit_bias entries", {**small, "logit_bias": {str(i): 1.0 for i in range(50_000)}}),
        ("1000 logit_bias ids outside the vocabulary", {**small, "logit_bias": {str(10**9 + i): 1.0 for i in range(1000)}}),
        ("1000 valid logit_bias entries", {**small, "logit_bias": {str(i): -1.0 for i in range(1000)}}),
        ("logit_bias not a number", {**small, "logit_bias": {"5": "x"}}),
        ("16 stop strings", {**small, "stop": [f"stop{i}" for i in range(16)]}),
        ("100 stop strings", {**small, "stop": [f"stop{i}" for i in range(100)]}),
        ("a 100 kB stop string", {**small, "stop": ["x" * 100_000]}),
        ("negative temperature", {**small, "temperature": -1}),
        ("temperature as text", {**small, "temperature": "hot"}),
        ("token ids past the vocabulary", {"prompt": [2**31 - 1, 5], "max_tokens": 3}),
        ("a 6 MB prompt", {"prompt": "lorem ipsum " * 500_000, "max_tokens": 3}),
        ("a 6 MB chat message", {"messages": [{"role": "user", "content": "lorem ipsum " * 500_000}], "max_tokens": 3}),
    ]


def run_crowd(url: str, total: int, clients: int, results) -> None:
    """In its own process, so that encoding multi-megabyte bodies does not take
    the GIL from the thread that times the normal stream."""
    bodies = [(what, "/v1/chat/completions" if "messages" in body else "/v1/completions", json.dumps(body).encode())
              for what, body in hostile_bodies()]
    lock = threading.Lock()
    sent = [0]
    outcomes: dict[str, list] = {}

    def client() -> None:
        with httpx.Client(base_url=url, timeout=120, headers={"Content-Type": "application/json"}) as http:
            while True:
                with lock:
                    if sent[0] >= total:
                        return
                    what, path, raw = bodies[sent[0] % len(bodies)]
                    sent[0] += 1
                r = http.post(path, content=raw)
                tokens = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else None
                outcomes.setdefault(what, []).append((r.status_code, tokens))

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client) for _ in range(clients)]:
            future.result()
    results.put((sent[0], outcomes))


def test_hostile_crowd_beside_a_normal_stream(start_daemon):
    """200 hostile requests beside one normal stream: the stream's inter-token gap
    stays within 2x of its gap alone, nothing is killed, every hostile request
    gets a 400 or a bounded answer."""
    d = start_daemon("--sleep-idle-seconds", "-1", "--parallel", "4", "--ctx-size", "2048")
    d.wait_state("ready")
    worker = d.props()["last_wake"]["worker_pid"]

    def normal_stream_gaps() -> list[float]:
        body = {"prompt": "Write about the sea.", "max_tokens": 96, "ignore_eos": True, "temperature": 0, "stream": True}
        stamps = []
        with httpx.stream("POST", d.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.monotonic())
        return [b - a for a, b in zip(stamps[5:], stamps[6:])]  # after the prompt, steady decode

    normal_stream_gaps()  # warm
    gaps_alone = normal_stream_gaps()
    alone = statistics.mean(gaps_alone)  # the mean counts every stall; chunks can arrive in bursts

    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    began = time.monotonic()
    crowd = spawn.Process(target=run_crowd, args=(d.url, 200, 4, results))
    crowd.start()
    time.sleep(1.0)  # the crowd is under way (its process imports first)
    gaps_beside = normal_stream_gaps()
    beside = statistics.mean(gaps_beside)
    sent, answers = results.get(timeout=600)
    crowd.join(30)
    crowd_seconds = time.monotonic() - began
    outcomes = {what: {status for status, _ in pairs} for what, pairs in answers.items()}
    assert all(tokens <= 3 for pairs in answers.values() for status, tokens in pairs if status == 200)
    ratio = beside / alone
    p90 = lambda gaps: statistics.quantiles(gaps, n=10)[-1]  # noqa: E731
    figures("hostile crowd", requests=sent, crowd_seconds=round(crowd_seconds, 1),
            gap_alone_ms=round(alone * 1000, 1), gap_beside_ms=round(beside * 1000, 1), ratio=round(ratio, 2),
            p90_gap_ms=(round(p90(gaps_alone) * 1000, 1), round(p90(gaps_beside) * 1000, 1)),
            max_gap_ms=(round(max(gaps_alone) * 1000, 1), round(max(gaps_beside) * 1000, 1)))
    print(json.dumps({k: sorted(v) for k, v in sorted(outcomes.items())}, indent=1))
    assert sent == 200 and crowd.exitcode == 0
    assert all(codes <= {200, 400, 413} for codes in outcomes.values()), outcomes
    assert d.props()["last_wake"]["worker_pid"] == worker
    assert metric(d, "dormouse_worker_restarts_total") == 0
    assert ratio <= 2.0
