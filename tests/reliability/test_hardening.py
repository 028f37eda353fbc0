"""Issue 9's reliability checks, on the real model: a hung worker during two
streams, and a crowd of hostile requests beside one normal stream. Bounded in
count and time; each prints its figures."""

from __future__ import annotations

import json
import os
import signal
import statistics
import threading
import time

import httpx
import pytest

from bench.hostile_crowd import crowd_beside_stream, steady_gaps, stream_stamps
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


def test_hostile_crowd_beside_a_normal_stream(start_daemon):
    """200 hostile requests beside one normal stream: the stream gets every
    token, nothing is killed, every hostile request gets a 400 or a bounded
    answer. How much the crowd slows the stream is a figure, printed here and
    measured as a ratio by bench/hostile_crowd.py (no timing bound in a test)."""
    d = start_daemon("--sleep-idle-seconds", "-1", "--parallel", "4", "--ctx-size", "2048")
    d.wait_state("ready")
    worker = d.props()["last_wake"]["worker_pid"]
    alone = steady_gaps(stream_stamps(d.url))
    began = time.monotonic()
    stamps, sent, answers, exitcode = crowd_beside_stream(d.url, 200, 4)
    beside = steady_gaps(stamps)
    outcomes = {what: {status for status, _ in pairs} for what, pairs in answers.items()}
    figures("hostile crowd", requests=sent, crowd_seconds=round(time.monotonic() - began, 1),
            gap_alone_ms=round(statistics.mean(alone) * 1000, 1), gap_beside_ms=round(statistics.mean(beside) * 1000, 1),
            max_gap_ms=(round(max(alone) * 1000, 1), round(max(beside) * 1000, 1)))
    print(json.dumps({k: sorted(v) for k, v in sorted(outcomes.items())}, indent=1))
    assert sent == 200 and exitcode == 0
    assert len(stamps) == 96 + 1  # a chunk per token, every token delivered, then the closing chunk
    assert all(codes <= {200, 400, 413} for codes in outcomes.values()), outcomes
    assert all(tokens <= 3 for pairs in answers.values() for status, tokens in pairs if status == 200)
    assert outcomes["a 6 MB prompt"] == {400} and outcomes["negative max_tokens"] == {400}
    assert d.props()["last_wake"]["worker_pid"] == worker
    assert metric(d, "dormouse_worker_restarts_total") == 0
