"""Issue 26, Ctrl-C: a terminal sends SIGINT (and SIGHUP, SIGTSTP) to its whole
foreground process group. The worker must never die of it (it runs in a session
of its own and ignores the terminal's signals); the daemon, on SIGINT as on
SIGTERM, sleeps its model in order, saves its prompt caches, says what it saved,
and exits without a traceback. A restart on the same state directory serves the
same conversation from disk."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, free_port

pytestmark = pytest.mark.e2e

PROMPT = " ".join(f"Note {i}: the river passes the mill at dawn, and the baker sells rye bread." for i in range(30))


class GroupLeader:
    """`python -m daemon serve` leading its own process group, as under a terminal."""

    def __init__(self, model: str, state: Path, log_path: Path) -> None:
        self.port = free_port()
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daemon", "serve", "--model", model, "--threads", "1", "--port", str(self.port),
             "--log-format", "json", "--state-dir", str(state), "--sleep-idle-seconds", "-1", "--parallel", "1",
             "--ctx-size", "2048"],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pgid = os.getpgid(self.proc.pid)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=300)

    def wait_ready(self) -> dict:
        for _ in range(1200):  # bounded by count; 0.1 s apart
            assert self.proc.poll() is None, self.log()
            try:
                props = self.http.get("/props").json()
                if props["state"] == "ready":
                    return props
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"never ready:\n{self.log()[-3000:]}")

    def complete(self, prompt: str, max_tokens: int = 4) -> dict:
        r = self.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_exit(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.http.close()
            self._log.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.http.close()
        self._log.close()


def test_ctrl_c_to_the_process_group_saves_the_cache_and_a_restart_restores_it(bundled_model, tmp_path):
    state = tmp_path / "state"
    first = GroupLeader(bundled_model, state, tmp_path / "first.log")
    try:
        props = first.wait_ready()
        worker = props["last_wake"]["worker_pid"]
        assert os.getpgid(worker) != first.pgid  # the terminal's signals do not reach it
        # Even sent to it directly, the terminal's signals leave the worker serving.
        os.kill(worker, signal.SIGINT)
        os.kill(worker, signal.SIGHUP)
        answer = first.complete(PROMPT)
        assert answer["usage"]["prompt_tokens"] > 256  # kv_cache_min_tokens: saved at a sleep
        assert first.http.get("/props").json()["last_wake"]["worker_pid"] == worker
        # SIGHUP to the group (a terminal closing): the daemon reloads, the worker serves on.
        os.killpg(first.pgid, signal.SIGHUP)
        for _ in range(100):
            if '"reload.done"' in first.log():
                break
            time.sleep(0.1)
        assert '"reload.done"' in first.log()
        assert first.http.get("/health").json()["state"] == "ready"
        assert first.http.get("/props").json()["last_wake"]["worker_pid"] == worker

        os.killpg(first.pgid, signal.SIGINT)  # Ctrl-C
        assert first.wait_exit() == 0
    finally:
        first.close()
    log = first.log()
    print(f"\n{log[-1500:]}")
    assert "Traceback" not in log and "KeyboardInterrupt" not in log
    assert '"shutdown.signal"' in log and '"SIGINT"' in log
    saved = [line for line in log.splitlines() if '"worker.kv_saved"' in line]
    assert len(saved) == 1, saved
    record = json.loads(saved[0][saved[0].index("{"):])
    assert record["files"] >= 1 and record["bytes"] > 0 and record["errors"] == 0, record
    assert '"clean": true' in next(line for line in log.splitlines() if '"sleep.done"' in line)

    second = GroupLeader(bundled_model, state, tmp_path / "second.log")
    try:
        second.wait_ready()
        extended = second.complete(PROMPT + " Who buys the bread at noon?")
        cached = extended["usage"]["prompt_tokens_details"]["cached_tokens"]
        print(f"restart: {cached} of {extended['usage']['prompt_tokens']} prompt tokens from disk")
        assert cached > 256  # nothing else holds it after a restart: it came from disk
        second.proc.send_signal(signal.SIGTERM)
        assert second.wait_exit() == 0
    finally:
        second.close()
    assert "Traceback" not in second.log()
    assert '"shutdown.signal"' in second.log() and '"SIGTERM"' in second.log()
