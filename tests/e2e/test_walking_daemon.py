"""The walking daemon end to end: the real bundled model in a real worker
process, HTTP to a real daemon process."""

import concurrent.futures
import os
import time

import httpx
import psutil
import pytest

pytestmark = pytest.mark.e2e


def complete(d, prompt="The capital of France is", **body):
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, **body}
    return d.http.post("/v1/completions", json=body)


def worker_pids(d):
    return [c.pid for c in psutil.Process(d.pid).children(recursive=True)]


def holds_file(pid: int, path: str) -> bool:
    real = os.path.realpath(path)
    proc = psutil.Process(pid)
    return any(m.path == real for m in proc.memory_maps()) or any(f.path == real for f in proc.open_files())


def metric(d, name: str, **labels) -> float:
    """The daemon's value for a series (summed over models and unnamed labels)."""
    from tests.metrics_text import value

    return value(d.http.get("/metrics").text, name, **labels)


def test_completion_sleep_wake_cycle(start_daemon, bundled_model):
    d = start_daemon("--sleep-idle-seconds", "2")
    d.wait_state("ready")
    response = complete(d)
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["text"]
    assert text.strip(), "the model produced no text"

    loaded_pid = d.props()["last_wake"]["worker_pid"]
    assert holds_file(loaded_pid, bundled_model)

    d.wait_state("sleeping", timeout=30)
    props = d.props()
    assert props["is_sleeping"] is True
    assert not psutil.pid_exists(loaded_pid) or psutil.Process(loaded_pid).status() == psutil.STATUS_ZOMBIE
    assert [ph["name"] for ph in props["last_sleep"]["phases"]] == [
        "kv_save", "draft_context", "draft_model", "context", "model", "mmproj", "backend"]
    assert props["last_sleep"]["clean"] is True
    freed = {ph["name"]: ph["freed_bytes"] for ph in props["last_sleep"]["phases"]}
    assert freed["model"] > 100 * 2**20 and freed["context"] > 0

    # The worker spawned ahead holds no model and has not initialised a backend.
    deadline = time.monotonic() + 10
    while not d.props()["spare_worker_pid"] and time.monotonic() < deadline:
        time.sleep(0.05)
    spare = d.props()["spare_worker_pid"]
    assert worker_pids(d) == [spare]
    assert not holds_file(spare, bundled_model)
    maps = {m.path for m in psutil.Process(spare).memory_maps()}
    assert any("libllama" in path for path in maps), "the spare has its libraries loaded"
    assert psutil.Process(spare).memory_info().rss < 60 * 2**20

    # Health, props, slots and metrics while asleep do not wake it.
    for path in ("/health", "/props", "/slots", "/metrics"):
        assert d.http.get(path).status_code == 200
    time.sleep(0.3)
    assert d.http.get("/health").json() == {"status": "ok", "state": "sleeping", "tier": "deep"}

    # The next request wakes it, using the spare, and gets the same greedy answer.
    response = complete(d)
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == text
    wake = d.props()["last_wake"]
    assert wake["reason"] == "request" and wake["prespawned"] is True and wake["worker_pid"] == spare
    assert metric(d, "dormouse_wakes_total", reason="request") == 1


def test_sixteen_concurrent_requests_cause_one_wake(start_daemon):
    d = start_daemon("--sleep-idle-seconds", "1", "--parallel", "4")
    d.wait_state("ready")
    d.wait_state("sleeping", timeout=30)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        clients = [httpx.Client(base_url=d.url, timeout=120) for _ in range(16)]
        futures = [pool.submit(c.post, "/v1/completions", json={"prompt": f"Count to {i}:", "max_tokens": 6})
                   for i, c in enumerate(clients)]
        responses = [f.result() for f in futures]
        for c in clients:
            c.close()
    assert [r.status_code for r in responses] == [200] * 16
    assert all(r.json()["usage"]["completion_tokens"] >= 1 for r in responses)
    assert metric(d, "dormouse_wakes_total", reason="request") == 1


def test_health_during_sleep_does_not_reset_idle_timer(start_daemon):
    d = start_daemon("--sleep-idle-seconds", "2")
    d.wait_state("ready")
    started = time.monotonic()
    while time.monotonic() - started < 6 and d.http.get("/health").json()["state"] == "ready":
        d.http.get("/props")
        d.http.get("/metrics")
        time.sleep(0.1)
    assert d.http.get("/health").json()["state"] in ("unloading", "sleeping")


def test_missing_and_non_gguf_model_exit_nonzero_with_message(tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT

    for path, needle in ((tmp_path / "nope.gguf", "does not exist"), (ROOT / "README.md", "is not a GGUF file")):
        proc = subprocess.run([sys.executable, "-m", "daemon", "serve", "--model", str(path)], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2
        assert needle in proc.stderr and str(path) in proc.stderr


def test_corrupt_gguf_goes_failed_and_daemon_keeps_answering(start_daemon, tmp_path, bundled_model):
    """A file cut short before the start is refused at once, in one line; one cut
    short while the model sleeps fails the wake, and the daemon keeps answering."""
    import shutil
    import subprocess
    import sys

    from tests.conftest import ROOT

    broken = tmp_path / "truncated.gguf"
    with open(bundled_model, "rb") as src:
        broken.write_bytes(src.read(1 << 20))  # right magic, cut off after 1 MiB
    refused = subprocess.run([sys.executable, "-m", "daemon", "serve", "--model", str(broken)], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "truncated.gguf" in refused.stderr and "Traceback" not in refused.stderr

    model = tmp_path / "cut-later.gguf"
    shutil.copyfile(bundled_model, model)
    d = start_daemon("--model", str(model), "--sleep-idle-seconds", "-1")
    d.wait_state("ready")
    assert d.http.post("/sleep").status_code == 200
    with open(model, "r+b") as f:
        f.truncate(1 << 20)
    response = complete(d)
    assert response.status_code == 503
    assert "cut-later.gguf" in response.json()["error"]["message"]
    health = d.wait_state("failed")
    assert "cut-later.gguf" in health["error"]
    assert d.http.get("/health").status_code == 503
    assert d.proc.poll() is None
