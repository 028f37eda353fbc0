"""Operations against the real daemon: systemd notify and socket activation,
reload on SIGHUP, graceful SIGTERM, metrics that promtool accepts, JSON logs."""

import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, DaemonProcess
from tests.metrics_text import samples, value

pytestmark = pytest.mark.e2e


class NotifySocket:
    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.messages: list[dict[str, str]] = []

    def pump(self) -> None:
        while True:
            try:
                data = self.sock.recv(4096).decode()
            except (socket.timeout, BlockingIOError):
                return
            self.messages.append(dict(line.split("=", 1) for line in data.splitlines() if "=" in line))

    def wait_for(self, key: str, value: str | None = None, timeout: float = 60) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            self.pump()
            for message in self.messages[seen:]:
                if key in message and (value is None or message[key] == value):
                    return message
            seen = 0
            time.sleep(0.05)
        raise AssertionError(f"no {key}={value} in {self.messages}")


def test_systemd_notify_watchdog_reload_and_stop(tmp_path, bundled_model):
    notify = NotifySocket(tmp_path / "notify.sock")
    config = tmp_path / "d.toml"
    config.write_text("sleep_idle_seconds = 300\n")
    d = DaemonProcess("--model", bundled_model, "--threads", "2", "--config", str(config),
                      env={"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "1000000"}, log_path=tmp_path / "d.log")
    try:
        ready = notify.wait_for("READY", "1")
        assert ready["STATUS"] in ("state: starting", "state: loading")  # READY before the model is loaded
        assert ready["MAINPID"] == str(d.pid)
        notify.wait_for("STATUS", "state: ready")
        notify.wait_for("WATCHDOG", "1")
        d.wait_state("ready")
        assert d.props()["sleep_idle_seconds"] == 300

        config.write_text("sleep_idle_seconds = 1\nlog_level = \"debug\"\n")
        worker = d.props()["last_wake"]["worker_pid"]
        notify.messages.clear()
        d.proc.send_signal(signal.SIGHUP)
        reloading = notify.wait_for("RELOADING", "1")
        assert int(reloading["MONOTONIC_USEC"]) > 0
        notify.wait_for("READY", "1")
        assert d.props()["sleep_idle_seconds"] == 1
        assert d.props()["last_wake"]["worker_pid"] == worker  # the model was not dropped
        d.wait_state("sleeping", timeout=30)  # the new timeout is in force
        notify.wait_for("STATUS", "state: sleeping")

        d.proc.send_signal(signal.SIGTERM)
        notify.wait_for("STOPPING", "1")
        assert d.proc.wait(30) == 0
    finally:
        d.stop()


def test_sigterm_lets_in_flight_request_finish_then_tears_down(tmp_path, bundled_model):
    d = DaemonProcess("--model", bundled_model, "--threads", "2", log_path=tmp_path / "d.log")
    try:
        d.wait_state("ready")
        result = {}

        def request():
            result["r"] = httpx.post(d.url + "/v1/completions", timeout=60,
                                     json={"prompt": "Tell a story", "max_tokens": 60, "ignore_eos": True})

        t = threading.Thread(target=request)
        t.start()
        time.sleep(0.5)
        d.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        with pytest.raises(httpx.HTTPError):  # no new connections once draining has ended, or 503 before
            r = httpx.post(d.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=5)
            r.raise_for_status()
        t.join(60)
        assert result["r"].status_code == 200
        assert result["r"].json()["usage"]["completion_tokens"] == 60
        assert d.proc.wait(30) == 0
        events = [json.loads(line) for line in d.log().splitlines() if line.startswith("{")]
        sleep = [e for e in events if e["event"] == "sleep.done"]
        assert sleep and sleep[-1]["reason"] == "shutdown" and sleep[-1]["clean"] is True
    finally:
        d.stop()


def test_socket_activation_serves_on_inherited_socket(tmp_path, bundled_model):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    log = open(tmp_path / "d.log", "wb")
    fd = listener.fileno()
    # What systemd does: the socket at fd 3, LISTEN_PID naming the process that execs the daemon.
    launcher = (f"import os, sys; os.dup2({fd}, 3); os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1'); "
                f"os.execv(sys.executable, [sys.executable, '-m', 'daemon', 'serve', '--model', {bundled_model!r}, "
                f"'--threads', '2', '--port', '1'])")
    proc = subprocess.Popen([sys.executable, "-c", launcher], cwd=ROOT, pass_fds=(fd,), stdout=log,
                            stderr=subprocess.STDOUT)
    listener.close()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").json()["state"] == "ready":
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        log.close()
    events = [json.loads(line) for line in (tmp_path / "d.log").read_text().splitlines() if line.startswith("{")]
    (listening,) = [e for e in events if e["event"] == "http.listening"]
    assert listening["socket_activated"] is True and listening["addresses"] == [f"127.0.0.1:{port}"]
    # --port 1 was not used, and the log says so and where the address is set instead
    (unused,) = [e for e in events if e["event"] == "http.address_setting_unused"]
    assert unused["configured"].endswith(":1") and "ListenStream" in unused["fix"]


def test_the_socket_unit_says_its_address_is_its_own():
    unit = (ROOT / "systemd" / "dormouse.socket").read_text()
    comment = " ".join(line.lstrip("# ") for line in unit.splitlines() if line.startswith("#"))
    assert "ListenStream=127.0.0.1:8080" in unit
    assert "not read from dormouse.toml" in comment and "systemctl edit dormouse.socket" in comment
    assert "127.0.0.1:8080" in (ROOT / "systemd" / "README.md").read_text()


def test_units_pass_systemd_analyze_verify(tmp_path):
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed")
    dormouse = Path(sys.executable).parent / "dormouse"
    for unit in ("dormouse.service", "dormouse.socket"):
        text = (ROOT / "systemd" / unit).read_text().replace("/opt/dormouse/.venv/bin/dormouse", str(dormouse))
        (tmp_path / unit).write_text(text)
    proc = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "dormouse.service"),
                           str(tmp_path / "dormouse.socket")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "dormouse" not in proc.stderr, proc.stderr


def test_metrics_pass_promtool_and_cover_design(start_daemon):
    d = start_daemon("--sleep-idle-seconds", "-1")
    d.wait_state("ready")
    d.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
    d.http.post("/sleep")
    d.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
    text = d.http.get("/metrics").text
    for name in ("dormouse_state", "dormouse_resume_seconds", "dormouse_resume_phase_seconds", "dormouse_sleep_seconds",
                 "dormouse_sleeps_total", "dormouse_wakes_total", "dormouse_memory_bytes",
                 "dormouse_time_to_first_token_seconds", "dormouse_inter_token_seconds",
                 "dormouse_request_duration_seconds", "dormouse_prompt_tokens_total", "dormouse_generated_tokens_total",
                 "dormouse_requests_in_flight", "dormouse_requests_waiting", "dormouse_slots",
                 "dormouse_speculative_draft_tokens_total", "dormouse_speculative_accepted_tokens_total",
                 "dormouse_worker_restarts_total", "dormouse_gpu_memory_used_bytes"):
        assert f"# TYPE {name} " in text, name
    assert value(text, "dormouse_state", state="ready") == 1
    assert value(text, "dormouse_sleeps_total", reason="admin") == 1
    assert samples(text, "dormouse_memory_bytes", component="model", device="CPU")
    assert value(text, "dormouse_time_to_first_token_seconds_count", start="cold") == 1
    assert ":" not in "".join(line.split("{")[0].split(" ")[0] for line in text.splitlines() if not line.startswith("#"))
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), proc.stdout + proc.stderr


def test_json_logs_are_whole_json_lines_with_levels_state_changes_and_request_ids(start_daemon):
    d = start_daemon("--sleep-idle-seconds", "-1")
    d.wait_state("ready")
    r = d.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200
    time.sleep(0.2)
    lines = [line for line in d.log().splitlines() if line.strip()]
    # Every line the daemon writes is one JSON object and nothing else (jq, Docker, Fluent Bit,
    # Vector); no journald "<6>" prefix on a stream that is not journald's.
    events = [json.loads(line) for line in lines]
    assert all(isinstance(e, dict) and e["level"] in ("debug", "info", "warning", "error") for e in events)
    states = [e for e in events if e["event"] == "state"]
    assert [(e["before"], e["after"]) for e in states[:2]] == [("starting", "loading"), ("loading", "ready")]
    (request,) = [e for e in events if e["event"] == "request"]
    assert request["request_id"].startswith("comp-") and request["status"] == 200
    assert any(e["event"] == "worker.stderr" for e in events)  # llama.cpp's warnings are relayed
    (begin,) = [e for e in events if e["event"] == "load.begin"]  # a long load is not a silent one
    assert begin["bytes"] > 200 * 2**20 and begin["file"].endswith(".gguf")
