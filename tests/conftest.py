"""Shared fixtures: an in-process daemon on a fake worker, and a real daemon
process on the bundled model."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from config import Settings
from daemon.model.controller import Controller
from daemon.http.app import build_app
from daemon.logs import configure_logging, get_logger
from daemon.metrics import Metrics

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def bundled_model() -> str:
    from daemon.model.files import bundled_model as write_bundled

    return str(write_bundled(Settings()))


@asynccontextmanager
async def fake_daemon(**overrides):
    """Controller + HTTP app in this process; the worker is tests.fakes.fake_worker."""
    from aiohttp.test_utils import TestClient, TestServer

    configure_logging("json", "warning")
    defaults = {"worker_module": "tests.fakes.fake_worker", "sleep_idle_seconds": -1, "spawn_ahead": False}
    settings = Settings(**{**defaults, **overrides})
    metrics = Metrics()
    controller = Controller(settings, "/models/fake.gguf", metrics, get_logger())
    app = build_app(controller, settings, metrics, get_logger())
    client = TestClient(TestServer(app))
    await client.start_server()
    import asyncio

    owner = asyncio.create_task(controller.run())
    try:
        yield controller, client
    finally:
        if not owner.done():
            await controller.shutdown(5)
        await owner
        await client.close()


class DaemonProcess:
    """A real `python -m daemon serve` on a free port."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daemon", "serve", "--port", str(self.port), "--log-format", "json", *args],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        )
        self.http = httpx.Client(base_url=self.url, timeout=60)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_state(self, *states: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            try:
                last = self.http.get("/health").json()
                if last["state"] in states:
                    return last
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"daemon did not reach {states} in {timeout}s (last {last}):\n{self.log()[-3000:]}")

    def props(self) -> dict:
        return self.http.get("/props").json()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.http.close()
        self._log.close()
        return self.proc.returncode


@pytest.fixture
def start_daemon(tmp_path, bundled_model):
    started: list[DaemonProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> DaemonProcess:
        d = DaemonProcess("--model", bundled_model, "--threads", "2", *args, env=env,
                          log_path=tmp_path / f"daemon{len(started)}.log")
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()


@pytest.fixture(scope="session")
def projector(tmp_path_factory) -> str:
    """The tiny test projector (tests/fixtures/projector.py)."""
    from tests.fixtures.projector import write_projector

    return str(write_projector(tmp_path_factory.mktemp("mmproj") / "tiny-mmproj.gguf"))
