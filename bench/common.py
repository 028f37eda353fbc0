"""Helpers shared by the benchmarks: a daemon process, the bundled model,
RSS of a process tree, simple statistics."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]


def bundled_model() -> str:
    from config import Settings
    from daemon.model.files import bundled_model as write

    return str(write(Settings()))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    def __init__(self, *args: str, model: str | None, threads: int | None = 2, env: dict[str, str] | None = None) -> None:
        """model/threads None: left to the other arguments (a fleet's --config sets them per model);
        env: DORMOUSE_* settings added to this environment."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        chosen = [*(["--model", model] if model else []), *(["--threads", str(threads)] if threads else [])]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daemon", "serve", "--port", str(self.port), *chosen,
             "--log-format", "json", "--log-level", "warning", *args],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})})
        self.http = httpx.Client(base_url=self.url, timeout=300)

    def wait_state(self, *states: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.http.get("/health").json()["state"] in states:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        raise TimeoutError(f"daemon never reached {states}")

    def props(self) -> dict:
        return self.http.get("/props").json()

    def wait_spare(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not self.props()["spare_worker_pid"]:
            if time.monotonic() > deadline:
                raise TimeoutError("no spare worker")
            time.sleep(0.02)

    def tree_rss(self) -> int:
        root = psutil.Process(self.proc.pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])

    def tree_cpu_seconds(self) -> float:
        root = psutil.Process(self.proc.pid)
        total = 0.0
        for p in [root, *root.children(recursive=True)]:
            t = p.cpu_times()
            total += t.user + t.system
        return total

    def stream_first_token(self, path: str, body: dict) -> tuple[float, float, int]:
        """(seconds to first content token, seconds to the end, tokens) for a streamed request."""
        start = time.perf_counter()
        first = None
        n = 0
        with self.http.stream("POST", path, json={**body, "stream": True}) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                choice = chunk["choices"][0] if chunk["choices"] else {}
                text = choice.get("text") or (choice.get("delta") or {}).get("content")
                if text:
                    n += 1
                    if first is None:
                        first = time.perf_counter() - start
        return first or float("nan"), time.perf_counter() - start, n

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.http.close()


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def run_python(code: str) -> dict:
    """Run code in a fresh interpreter (llama.cpp stays out of this process);
    it prints one JSON object as its last line."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ})
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)
