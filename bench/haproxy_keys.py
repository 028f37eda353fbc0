"""A million distinct conversation keys through the generated HAProxy config
(issue 31's hostile input): affinity by key must hold no state per key.
HAProxy's `balance hash` with `hash-type consistent` hashes each request's
key onto a ring of the servers' points and keeps nothing of the key; this
shows it on the real binary, by HAProxy's RSS as the distinct keys grow.

The backends are stand-ins, not models: three tiny aiohttp apps (in a child
process) that answer every path with their name, and the daemon's own agent
(daemon/http/agent.py) answering every line as an idle daemon with free
slots does. HAProxy runs deploy/haproxy/haproxy.cfg (the committed,
generated file) with its per-request log line taken out, so that a million
lines are not written to disk. Each request is a chat completion with its
own prompt_cache_key; the spread is HAProxy's own count of the requests each
server line took (`show stat`).

    .venv/bin/python -m bench.haproxy_keys                     # 10k, 100k, 1M keys
    .venv/bin/python -m bench.haproxy_keys 2000 20000          # other checkpoints

tests/reliability/test_haproxy_keys.py runs a count-bounded version (20,000
keys) and a control with a stick table keyed by the key, which does grow.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time
import uuid
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.common import free_port, table

ROOT = Path(__file__).resolve().parents[1]
CFG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
REPLICAS = ("r1", "r2", "r3")  # fleet.toml's, which the committed cfg names
MODEL = "chat"  # fleet.toml's default model
LOG_LINE = "    log stdout format raw local0 info\n"
CONNECTIONS = 32  # requests in flight at once: constant, so HAProxy's buffers stay what they are


@dataclass(frozen=True)
class Backend:
    name: str
    port: int
    agent_port: int


class _Quiet:
    def info(self, *args, **kwargs) -> None:
        pass

    warning = debug = error = info


async def _serve(backends: list[Backend], ready) -> None:
    from aiohttp import web

    from daemon.http.agent import Agent, ReplicaSnapshot

    # An idle daemon, its one model awake with free slots: "up 100%" on the serve and
    # overflow lines, "up 0%" on the warm and wake lines (the agent's own table).
    idle = ReplicaSnapshot("ready", 64, ((MODEL, ReplicaSnapshot("ready", 64)),))
    runners = []
    for b in backends:
        async def answer(request, name=b.name):
            return web.json_response({"replica": name})
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", answer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", b.port).start()
        runners.append(runner)
        await asyncio.start_server(Agent(lambda: idle, _Quiet()).answer, "127.0.0.1", b.agent_port)
    ready.set()
    await asyncio.Event().wait()


def _serve_forever(backends: list[Backend], ready) -> None:
    asyncio.run(_serve(backends, ready))


@contextmanager
def stand_in_backends():
    """Three stand-in replicas in a child process (the client keeps this process's core)."""
    backends = [Backend(name, free_port(), free_port()) for name in REPLICAS]
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_serve_forever, args=(backends, ready), daemon=True)
    child.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the stand-in backends did not start")
        yield backends
    finally:
        child.terminate()
        child.join(10)


def quiet_cfg(directory: Path, cfg: Path = CFG, extra_frontend: str = "") -> Path:
    """The cfg without its per-request log line; `extra_frontend` appended to the frontend."""
    text = cfg.read_text()
    assert LOG_LINE in text, "haproxy.cfg's log line moved: update bench/haproxy_keys.py"
    text = text.replace(LOG_LINE, "")
    if extra_frontend:
        anchor = "    default_backend "
        assert anchor in text
        text = text.replace(anchor, extra_frontend + anchor, 1)
    out = directory / "haproxy-keys.cfg"
    out.write_text(text)
    return out


@contextmanager
def haproxy(backends: list[Backend], workdir: Path, cfg: Path):
    from tests.reliability.test_haproxy import HAProxy

    env = {}
    for b in backends:
        env[f"DORMOUSE_{b.name.upper()}"] = f"127.0.0.1:{b.port}"
        env[f"DORMOUSE_{b.name.upper()}_AGENT"] = str(b.agent_port)
    proxy = HAProxy([], workdir, env=env, cfg=cfg)
    try:
        serve = {f"{kind}.{MODEL}/{b.name}" for b in backends for kind in ("model", "overflow")}
        proxy.wait_usable(serve, model=MODEL, timeout=30)
        yield proxy
    finally:
        proxy.stop()


def rss(proxy) -> int:
    return psutil.Process(proxy.proc.pid).memory_info().rss


def requests_by_line(proxy) -> Counter:
    """HAProxy's own count of the requests each server line took (show stat's stot)."""
    return Counter({name: int(row["stot"] or 0) for name, row in proxy.rows().items()
                    if name.startswith((f"model.{MODEL}/", f"overflow.{MODEL}/"))})


async def _one_connection(port: int, keys: list[str], statuses: Counter) -> None:
    # A raw keep-alive HTTP/1.1 client: a million requests through an HTTP library's
    # client would cost this machine's two cores more than HAProxy and the stand-ins do.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for key in keys:
            body = (b'{"model": "%s", "prompt_cache_key": "%s", "messages": [{"role": "user", "content": "hi"}]}'
                    % (MODEL.encode(), key.encode()))
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            status = int((await reader.readline()).split()[1])
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            statuses[status] += 1
    finally:
        writer.close()


def send_keys(port: int, keys: list[str], connections: int = CONNECTIONS) -> Counter:
    """Each key once, over `connections` keep-alive connections; the statuses."""
    statuses: Counter = Counter()

    async def all_of_them() -> None:
        await asyncio.gather(*(_one_connection(port, keys[i::connections], statuses) for i in range(connections)))
    asyncio.run(all_of_them())
    return statuses


def distinct_keys(start: int, stop: int, prefix: str) -> list[str]:
    return [f"{prefix}-{i:08d}" for i in range(start, stop)]


def measure(checkpoints: list[int], workdir: Path, cfg: Path, warmup: int = 1000) -> list[dict]:
    """Distinct keys up to each checkpoint; per checkpoint HAProxy's RSS and the spread so far.
    The first `warmup` keys fill HAProxy's pools (connections, buffers) before the baseline."""
    prefix = uuid.uuid4().hex[:12]
    found = []
    with stand_in_backends() as backends, haproxy(backends, workdir, cfg) as proxy:
        statuses = send_keys(proxy.port, distinct_keys(0, warmup, prefix))
        sent, baseline, started = warmup, rss(proxy), time.monotonic()
        for target in checkpoints:
            statuses += send_keys(proxy.port, distinct_keys(sent, target, prefix))
            sent = target
            lines = requests_by_line(proxy)
            serve = {b.name: lines[f"model.{MODEL}/{b.name}"] for b in backends}
            found.append({"keys": target, "rss": rss(proxy), "rss_growth": rss(proxy) - baseline,
                          "baseline_rss": baseline, "serve": serve, "elsewhere": sum(lines.values()) - sum(serve.values()),
                          "statuses": dict(statuses), "seconds": round(time.monotonic() - started, 1)})
    return found


def spread(serve: dict[str, int]) -> str:
    mean = sum(serve.values()) / len(serve)
    return " / ".join(str(v) for v in serve.values()) + f" (max {max(serve.values()) / mean:.3f} x mean)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.haproxy_keys", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="*", type=int, default=[10_000, 100_000, 1_000_000])
    args = parser.parse_args(argv)
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for point in measure(sorted(args.checkpoints), Path(tmp), quiet_cfg(Path(tmp))):
            rows.append([point["keys"], f"{point['rss'] / 2**20:.2f}", f"{point['rss_growth'] / 2**20:+.2f}",
                         spread(point["serve"]), point["elsewhere"], point["statuses"], point["seconds"]])
            print(table(HEADERS, rows[-1:]), flush=True)
    print(f"\n{CONNECTIONS} connections; the growth is counted from HAProxy's RSS after the first 1,000 keys")
    print(table(HEADERS, rows))


HEADERS = ["distinct keys", "HAProxy RSS MiB", "growth MiB", "requests per replica (serve lines)",
           "on other lines", "statuses", "seconds"]

if __name__ == "__main__":
    main()
