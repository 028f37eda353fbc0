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
from daemon.http.app import build_app
from daemon.logs import configure_logging, get_logger

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bundled_model_path() -> str:
    from daemon.model.files import bundled_model as write_bundled

    return str(write_bundled(Settings()))


@pytest.fixture(scope="session")
def bundled_model() -> str:
    return bundled_model_path()


FAKE_DEFAULTS = {"worker_module": "tests.fakes.fake_worker", "sleep_idle_seconds": -1, "spawn_ahead": False}


@asynccontextmanager
async def fake_fleet(models: dict[str, dict] | None = None, sizes: dict[str, int] | None = None,
                     handler_cancellation: bool = False, **overrides):
    """The fleet, its controllers and the HTTP app in this process, on fake workers
    (tests.fakes.fake_worker). `models`: id -> that model's settings; none: a fleet of
    one ("fake"). `sizes`: id -> predicted bytes. `handler_cancellation`: a client that goes
    away cancels its handler, as in the daemon (daemon/server.py). Yields (fleet, client)."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from daemon.fleet.plans import ModelPlan
    from daemon.metrics import MetricFamilies
    from daemon.model.footprint import Footprint
    from daemon.server import build_fleet

    configure_logging("json", "warning")
    settings = Settings(**{**FAKE_DEFAULTS, **overrides})
    plans = []
    for i, (model_id, own) in enumerate((models or {"fake": {}}).items()):
        own = dict(own)
        aliases, pinned = tuple(own.pop("aliases", ())), own.pop("pinned", False)
        plan = ModelPlan(model_id, settings.model_copy(update=own), f"/models/{model_id}.gguf", aliases, pinned,
                         is_default=i == 0)
        if sizes and model_id in sizes:
            plan.predicted = Footprint(model=sizes[model_id], context=0)
        plans.append(plan)
    families = MetricFamilies()
    fleet = build_fleet(settings, plans, families, get_logger())
    client = TestClient(TestServer(build_app(fleet, settings, families, get_logger()),
                                   handler_cancellation=handler_cancellation))
    await client.start_server()
    tasks = [asyncio.create_task(fleet.run())]
    tasks += [asyncio.create_task(m.controller.run(load_at_start=m.load_at_start)) for m in fleet.models.values()]
    try:
        yield fleet, client
    finally:
        await asyncio.gather(*(c.shutdown(5) for c in fleet.controllers if not c.stopped.is_set()))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()


@asynccontextmanager
async def fake_daemon(**overrides):
    """A fleet of one on a fake worker, in this process. Yields (controller, client)."""
    async with fake_fleet(**overrides) as (fleet, client):
        yield fleet.default_model.controller, client


class DaemonProcess:
    """A real `python -m daemon serve` on a free port."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        # Each daemon its own state directory (one daemon may hold one: daemon/state_lock.py),
        # unless the test names one; and the bundled model written once, not into each.
        own = {"DORMOUSE_STATE_DIR": str(log_path.with_suffix(".state"))} if "--state-dir" not in args else {}
        if "--model" not in args and "--config" not in args:
            args = ("--model", bundled_model_path(), *args)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daemon", "serve", "--port", str(self.port), "--log-format", "json", *args],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env={**own, **os.environ, **(env or {})},
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
