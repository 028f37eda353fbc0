"""The real HAProxy (Debian's 2.6) in front of three real daemons, running
deploy/haproxy/haproxy.cfg unchanged (its addresses come from the
environment). What the agent check and the tiers of that file promise:
a burst on sleeping replicas wakes one, an awake replica takes everything
while it has free slots, a killed replica's requests are retried elsewhere,
and a rolling restart loses nothing.

Before the daemons, fast tests drive the same HAProxy with stand-ins (tiny
HTTP servers with agents) to pin down what the design rests on: every
routing tier, an agent's "drain" outliving the process that said it, and
the health checks' Host and key.

The daemons share one module fixture (starting three costs ~10 s on 2
cores); each test first brings them to the state it needs. Every wait is
bounded; figures are printed (`-s`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import ROOT, free_port
from tests.metrics_text import value

pytestmark = [
    pytest.mark.reliability,
    pytest.mark.skipif(shutil.which("haproxy") is None,
                       reason="haproxy is not installed (.ci/run installs Debian's; apt-get install haproxy)"),
]

CFG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
SLEEP_IDLE = "2"  # seconds: short, so that the tests can wait for all three to sleep
COMPLETION = {"prompt": "The capital of France is", "max_tokens": 4}
CLIENT_TIMEOUT = 90.0  # hang protection: a request not answered by then counts as hung


def figures(name: str, **values) -> None:
    print(f"\n[{name}] " + ", ".join(f"{k}={v}" for k, v in values.items()))


def until(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(interval)
    raise AssertionError(f"{what}: not within {timeout}s")


class Replica:
    """One `dormouse serve` on fixed ports, so that it can be restarted where
    HAProxy expects it (tests.conftest.DaemonProcess picks a new port)."""

    def __init__(self, name: str, model: str, log_dir: Path) -> None:
        self.name = name
        self.model = model
        self.port, self.agent_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.http = httpx.Client(base_url=self.url, timeout=10)

    def start(self) -> None:
        log = open(self.log_path, "ab")
        # Each replica its own state directory, as on separate machines.
        env = {**os.environ, "DORMOUSE_STATE_DIR": str(self.log_path.with_suffix(".state"))}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daemon", "serve", "--model", self.model, "--threads", "1",
             "--port", str(self.port), "--agent-port", str(self.agent_port),
             "--sleep-idle-seconds", SLEEP_IDLE, "--log-format", "json"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()

    def state(self) -> str | None:
        try:
            return self.http.get("/health").json().get("state")
        except (httpx.TransportError, ValueError):
            return None

    def wait_state(self, *states: str, timeout: float = 60) -> str:
        def reached():
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            return self.state() in states
        until(reached, timeout, f"{self.name} reaching {states} (last {self.state()})")
        return self.state()

    def metric(self, name: str, **labels) -> float:
        return value(self.http.get("/metrics").text, name, **labels)

    def answered(self) -> float:
        """Completions this process answered 200."""
        return self.metric("dormouse_requests_total", status="200")

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM, as systemd or Kubernetes would send it; the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        """SIGKILL the daemon and its worker (a killed daemon cannot reap it)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        self.proc.kill()
        self.proc.wait()
        for child in children:
            try:
                child.kill()
                child.wait(10)
            except psutil.NoSuchProcess:
                pass

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class HAProxy:
    """deploy/haproxy/haproxy.cfg in the foreground (-db) on a free port."""

    def __init__(self, replicas: list, workdir: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.socket_path = str(workdir / "haproxy.sock")
        self.log_path = workdir / "haproxy.log"
        env = {**os.environ, **(env or {}), "DORMOUSE_BIND": f"127.0.0.1:{self.port}",
               "DORMOUSE_HAPROXY_SOCKET": self.socket_path}
        for i, r in enumerate(replicas, 1):
            env[f"DORMOUSE_R{i}"] = f"127.0.0.1:{r.port}"
            env[f"DORMOUSE_R{i}_AGENT"] = str(r.agent_port)
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)  # a previous HAProxy's, in the same directory
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(["haproxy", "-db", "-f", str(CFG)], env=env, stdout=log,
                                         stderr=subprocess.STDOUT)
        until(self._answering, 10, "haproxy's runtime API")

    def _answering(self) -> bool:
        assert self.proc.poll() is None, self.log()
        try:
            return "Name: HAProxy" in self.command("show info")
        except OSError:  # not bound yet
            return False

    def command(self, line: str) -> str:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(self.socket_path)
            s.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def rows(self) -> dict[str, dict[str, str]]:
        """"backend/server" -> its row of `show stat` (status, weight, check_status, ...)."""
        lines = self.command("show stat").splitlines()
        header = lines[0].lstrip("# ").split(",")
        found = {}
        for line in lines[1:]:
            row = dict(zip(header, line.split(",")))
            if row.get("svname") not in (None, "FRONTEND", "BACKEND"):
                found[f"{row['pxname']}/{row['svname']}"] = row
        return found

    def servers(self) -> dict[str, tuple[str, int]]:
        """"backend/server" -> (status, weight) as HAProxy sees it now."""
        return {name: (row["status"], int(row["weight"] or 0)) for name, row in self.rows().items()}

    def usable(self) -> set[str]:
        """Servers HAProxy may pick: up with a weight above 0."""
        return {name for name, (status, weight) in self.servers().items() if status.startswith("UP") and weight > 0}

    def wait_usable(self, expected: set[str], timeout: float = 15) -> None:
        until(lambda: self.usable() == expected, timeout, f"haproxy's usable servers becoming {sorted(expected)} "
              f"(now {sorted(self.usable())})", interval=0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def logged(self, since: int) -> list[tuple[str, str, str]]:
        """(backend/server, status, retries) of each request HAProxy logged
        after byte `since` of its log (httplog; retries "+N" when redispatched)."""
        found = []
        for line in self.log_path.read_bytes()[since:].decode(errors="replace").splitlines():
            parts = line.split()
            if len(parts) > 10 and parts[2] == "dormouse" and "/" in parts[3]:
                found.append((parts[3], parts[5], parts[10].split("/")[-1]))
        return found

    def lines_used(self, since: int) -> dict[str, int]:
        return dict(Counter(server for server, _, _ in self.logged(since)))

    def retried(self, since: int) -> int:
        return sum(1 for _, _, retries in self.logged(since) if retries != "0")

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


ALL_ASLEEP = {"dormouse/r1-wake", "dormouse/r2-wake", "dormouse/r3-wake"} | {
    f"dormouse_overflow/r{i}" for i in (1, 2, 3)}


def awake_set(*names: str) -> set[str]:
    """What HAProxy should see with these replicas awake and idle, the others asleep."""
    usable = {f"dormouse/{n}" for n in names} | {f"dormouse_overflow/r{i}" for i in (1, 2, 3)}
    return usable | {f"dormouse/{n}-wake" for n in ("r1", "r2", "r3") if n not in names}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, bundled_model):
    workdir = tmp_path_factory.mktemp("haproxy")
    replicas = [Replica(f"r{i}", bundled_model, workdir) for i in (1, 2, 3)]
    proxy = None
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            r.wait_state("ready", "sleeping", timeout=120)
        proxy = HAProxy(replicas, workdir)
        yield replicas, proxy
    finally:
        if proxy is not None:
            proxy.stop()
        for r in replicas:
            if r.stop(timeout=30) is None:
                r.kill()
            r.http.close()


def all_asleep(replicas: list[Replica], proxy: HAProxy) -> None:
    for r in replicas:
        r.wait_state("sleeping", timeout=60)
    proxy.wait_usable(ALL_ASLEEP)


def post(client: httpx.Client, body: dict = COMPLETION) -> tuple[int, dict | str]:
    """(status, body); status 0 for a transport error, -1 for a hang (the client's bound)."""
    try:
        r = client.post("/v1/completions", json=body)
    except httpx.TimeoutException as exc:
        return -1, repr(exc)
    except httpx.TransportError as exc:
        return 0, repr(exc)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text[:300]


@dataclass
class StandIn:
    """An HTTP server that answers its name, with an agent port."""
    name: str
    port: int = field(default_factory=free_port)
    agent_port: int = field(default_factory=free_port)
    hits: int = 0
    answered: Counter = field(default_factory=Counter)  # agent answers, by role


@asynccontextmanager
async def stand_ins(tmp_path: Path, agent_answer, env: dict[str, str] | None = None, health=None):
    """Three stand-ins behind HAProxy; `agent_answer(stand_in)` is each one's
    asyncio connection handler for the agent port, `health(request)` the
    status of /health (200 when not given)."""
    from aiohttp import web

    servers = [StandIn(f"r{i}") for i in (1, 2, 3)]
    cleanups = []
    try:
        for s in servers:
            async def handle(request, s=s):
                if request.path == "/health":
                    return web.json_response({}, status=health(request) if health else 200)
                s.hits += 1
                if request.path == "/busy":  # what a daemon answers when its queue is full
                    return web.json_response({"error": {"code": "queue_full"}}, status=503, headers={"Retry-After": "7"})
                return web.json_response({"replica": s.name})
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", handle)
            runner = web.AppRunner(app)
            await runner.setup()
            cleanups.append(runner.cleanup)
            await web.TCPSite(runner, "127.0.0.1", s.port).start()
            agent = await asyncio.start_server(agent_answer(s), "127.0.0.1", s.agent_port)
            cleanups.append(lambda agent=agent: _close(agent))
        proxy = await asyncio.to_thread(HAProxy, servers, tmp_path, env)
        cleanups.append(lambda: asyncio.to_thread(proxy.stop))
        yield servers, proxy
    finally:
        for cleanup in reversed(cleanups):
            await cleanup()


async def _close(server: asyncio.AbstractServer) -> None:
    server.close()


async def settle(servers: list[StandIn]) -> None:
    """Until every line's agent has answered twice since now: the second
    answer was computed after any change made before this call, and HAProxy
    applied the first of those before the second was asked (agent-inter)."""
    roles = ("serve", "wake", "overflow")
    before = {s.name: Counter(s.answered) for s in servers}
    deadline = time.monotonic() + 15

    def done() -> bool:
        return all(s.answered[r] >= before[s.name][r] + 2 for s in servers for r in roles)

    while not done():
        assert time.monotonic() < deadline, f"agents not asked twice in 15 s: {[s.answered for s in servers]}"
        await asyncio.sleep(0.05)


def test_haproxy_tiers_with_stand_in_agents(tmp_path):
    """The routing the design rests on, on the real HAProxy with no daemon:
    stand-ins whose agents (daemon.http.agent.Agent) report states set here."""
    from daemon.http.agent import Agent, ReplicaSnapshot

    asleep, free, full = ReplicaSnapshot("asleep", 0), ReplicaSnapshot("ready", 2), ReplicaSnapshot("ready", 0)
    waking, stopping = ReplicaSnapshot("waking", 0), ReplicaSnapshot("stopping", 0)
    states: dict[str, ReplicaSnapshot] = {}
    results: dict[str, object] = {}

    class Quiet:
        def info(self, *a, **k):
            pass

    def agent_for(s: StandIn):
        agent = Agent(lambda: states[s.name], Quiet())
        agent.answered = s.answered  # counted where settle() looks
        return agent.answer

    async def scenario() -> None:
        async with stand_ins(tmp_path, agent_for) as (servers, proxy):
            async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
                async def phase(label: str, *snapshots: ReplicaSnapshot) -> None:
                    states.update({s.name: snap for s, snap in zip(servers, snapshots)})
                    await settle(servers)
                    seen = Counter()
                    for _ in range(12):
                        response = await client.post("/x", json={})
                        seen[response.json()["replica"] if response.status_code == 200 else response.status_code] += 1
                    results[label] = dict(seen)

                await phase("all asleep", asleep, asleep, asleep)
                await phase("r2 awake", asleep, free, asleep)
                await phase("r2 and r3 awake", asleep, free, free)
                await phase("r2 saturated", asleep, full, asleep)
                await phase("r2 saturated, r3 waking", asleep, full, waking)
                await phase("all saturated", full, full, full)
                # A daemon's own 503 reaches the client with its Retry-After,
                # and is not retried (the request may have crashed a worker).
                states.update(r1=free)
                await settle(servers)
                hits = servers[0].hits
                response = await client.post("/busy", json={})
                results["daemon 503"] = (response.status_code, response.headers.get("retry-after"),
                                         servers[0].hits - hits)
                await phase("all stopping", stopping, stopping, stopping)
                response = await client.post("/x", json={})
                results["503"] = (response.headers.get("retry-after"), response.json()["error"]["code"])

    states.update(r1=asleep, r2=asleep, r3=asleep)
    asyncio.run(scenario())
    figures("tiers (12 requests per phase)", **{k.replace(" ", "_").replace(",", ""): v for k, v in results.items()})
    assert results["all asleep"] == {"r1": 12}  # the first sleeping replica only: one wake
    assert results["r2 awake"] == {"r2": 12}  # the awake one, not the sleeping r1 listed before it
    assert results["r2 and r3 awake"] == {"r2": 12}  # balance first: r3 goes idle and falls asleep
    assert results["r2 saturated"] == {"r1": 12}  # one sleeper woken (the first), r3 stays asleep
    assert results["r2 saturated, r3 waking"] == {"r3": 12}  # wait for that wake rather than wake r1
    all_full = results["all saturated"]
    assert set(all_full) == {"r1", "r2", "r3"} and sum(all_full.values()) == 12  # overflow: queues spread
    assert results["daemon 503"] == (503, "7", 1)
    assert results["all stopping"] == {503: 12}
    assert results["503"] == ("1", "no_replica")  # HAProxy's own 503 reads like the daemon's


def test_agent_drain_outlives_the_process(tmp_path):
    """Why the agent says "up 0%" and never "drain": HAProxy keeps an agent's
    drain (an administrative state) after the agent answers "up 100%" again,
    so a restarted daemon would get no traffic unless every reply said
    "ready", which would also cancel an operator's maintenance."""
    from daemon.http.agent import parse_role

    # r1's agent says drain, then up 100%; r2's says up 0%, then up 100%.
    steps = [{"r1": "drain\n", "r2": "up 0%\n", "r3": "up 100%\n"},
             {"r1": "up 100%\n", "r2": "up 100%\n", "r3": "up 100%\n"}]
    reply = dict(steps[0])

    def agent_for(s: StandIn):
        async def answer(reader, writer):
            role = parse_role(await reader.read(64))  # agent-send comes first
            writer.write(reply[s.name].encode())
            await writer.drain()
            writer.close()
            s.answered[role] += 1
        return answer

    async def scenario() -> list:
        seen = []
        async with stand_ins(tmp_path, agent_for) as (servers, proxy):
            for step in steps:
                reply.update(step)
                await settle(servers)
                view = await asyncio.to_thread(proxy.servers)
                seen.append((view["dormouse/r1"], view["dormouse/r2"]))
        return seen

    (drained, zero), (after_drain, after_zero) = asyncio.run(scenario())
    figures("haproxy's (status, weight) after an agent's reply", drain=drained, drain_then_up_100=after_drain,
            up_0=zero, up_0_then_up_100=after_zero)
    assert drained[0].startswith("DRAIN") and after_drain[0].startswith("DRAIN")  # sticky
    assert zero == ("UP", 0)  # weight 0: no new requests (the tiers test shows it) ...
    assert after_zero == ("UP", 1)  # ... and the next answer replaces it


def test_health_checks_send_the_host_and_metrics_key(tmp_path):
    """With allowed_hosts and metrics_key set on the daemons, /health answers
    403/401 to a check without them: the cfg sends DORMOUSE_HOST and, when
    set, DORMOUSE_METRICS_KEY. Stand-ins that check both stay up."""
    from daemon.http.agent import FULL

    seen = []

    def health(request) -> int:
        seen.append((request.host, request.headers.get("Authorization")))
        if request.host != "models.example":
            return 403
        return 200 if request.headers.get("Authorization") == "Bearer s3cret" else 401

    def agent_for(s: StandIn):
        async def answer(reader, writer):
            writer.write(FULL.encode())
            await writer.drain()
            writer.close()
        return answer

    serve_lines = ("dormouse/r1", "dormouse/r2", "dormouse/r3")

    async def scenario(env: dict[str, str], settled) -> set[str]:
        """The serve lines that are up once every one's health is `settled`."""
        async with stand_ins(tmp_path, agent_for, env=env, health=health) as (servers, proxy):
            def rows():
                return {name: row for name, row in proxy.rows().items() if name in serve_lines}
            await asyncio.to_thread(until, lambda: all(settled(row) for row in rows().values()), 15,
                                    "health checks settling")
            return {name for name, row in rows().items() if row["status"].startswith("UP")}

    def passed(row) -> bool:  # a check has run and passed (servers start up before any check)
        return row["check_status"] == "L7OK"

    def down(row) -> bool:
        return row["status"].startswith("DOWN")

    up = asyncio.run(scenario({"DORMOUSE_HOST": "models.example", "DORMOUSE_METRICS_KEY": "s3cret"}, passed))
    without_key = asyncio.run(scenario({"DORMOUSE_HOST": "models.example"}, down))

    figures("health checks", up_with_host_and_key=sorted(up), up_without_key=sorted(without_key), first_check=seen[0])
    assert up == {"dormouse/r1", "dormouse/r2", "dormouse/r3"}
    assert without_key == set()  # the check really is what decides


def test_burst_on_sleeping_replicas_wakes_exactly_one(cluster):
    replicas, proxy = cluster
    all_asleep(replicas, proxy)
    wakes_before = [r.metric("dormouse_wakes_total") for r in replicas]
    with httpx.Client(base_url=proxy.url, timeout=CLIENT_TIMEOUT) as client:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: post(client), range(8)))
    wakes = [r.metric("dormouse_wakes_total") - b for r, b in zip(replicas, wakes_before)]
    figures("burst of 8 on three sleeping replicas", wakes_per_replica=wakes, wakes=sum(wakes),
            statuses=dict(Counter(s for s, _ in answers)))
    assert [s for s, _ in answers] == [200] * 8, answers
    assert sum(wakes) == 1


def test_one_awake_takes_every_request(cluster):
    replicas, proxy = cluster
    all_asleep(replicas, proxy)
    with httpx.Client(base_url=proxy.url, timeout=CLIENT_TIMEOUT) as client:
        assert post(client)[0] == 200  # wakes one
        awake = [r.name for r in replicas if r.state() == "ready"]
        assert len(awake) == 1, awake
        proxy.wait_usable(awake_set(*awake))
        before = [(r.answered(), r.metric("dormouse_wakes_total")) for r in replicas]
        since = proxy.log_size()
        statuses = [post(client)[0] for _ in range(50)]
    after = [(r.answered(), r.metric("dormouse_wakes_total")) for r in replicas]
    per_replica = {r.name: int(a[0] - b[0]) for r, a, b in zip(replicas, after, before)}
    wakes = {r.name: int(a[1] - b[1]) for r, a, b in zip(replicas, after, before)}
    figures("50 sequential requests, one replica awake", requests_per_replica=per_replica, wakes=wakes,
            haproxy_lines=proxy.lines_used(since))
    assert statuses == [200] * 50
    assert per_replica == {r.name: (50 if r.name == awake[0] else 0) for r in replicas}
    assert all(wakes[r.name] == 0 for r in replicas if r.name != awake[0])  # the others stayed asleep


def test_stream_passes_through_as_it_is_written(cluster):
    """SSE through HAProxy: no compression even when the client accepts it, the
    events as the daemon writes them. The figure compares the first event's
    arrival with the whole stream's (the first must not wait for the last)."""
    replicas, proxy = cluster
    body = {"prompt": "Once upon a time", "max_tokens": 48, "stream": True}
    with httpx.Client(base_url=proxy.url, timeout=CLIENT_TIMEOUT) as client:
        assert post(client)[0] == 200  # awake first: the figure is about the stream, not a wake
        started = time.monotonic()
        arrivals, events = [], []
        with client.stream("POST", "/v1/completions", json=body, headers={"Accept-Encoding": "gzip, br"}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            assert "content-encoding" not in r.headers
            for line in r.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic() - started)
                    events.append(line[6:])
    figures("stream through haproxy", events=len(events), first_event_s=round(arrivals[0], 3),
            last_event_s=round(arrivals[-1], 3))
    assert events[-1] == "[DONE]" and len(events) > 2


def run_load(url: str, stop: threading.Event, results: list, workers: int, body: dict = COMPLETION) -> list[threading.Thread]:
    def loop():
        with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT) as client:
            while not stop.is_set():
                results.append(post(client, body))
    threads = [threading.Thread(target=loop, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    return threads


def tally(results: list) -> dict:
    statuses = Counter(s for s, _ in results)
    clear_503 = sum(1 for s, b in results if s == 503 and isinstance(b, dict) and "error" in b)
    return {"sent": len(results), "ok": statuses.get(200, 0), "clear_503": clear_503,
            "lost": len(results) - statuses.get(200, 0), "hung": statuses.get(-1, 0),
            "other": {s: n for s, n in statuses.items() if s not in (200, 503)}}


def test_awake_replica_killed_mid_burst(cluster):
    replicas, proxy = cluster
    all_asleep(replicas, proxy)
    with httpx.Client(base_url=proxy.url, timeout=CLIENT_TIMEOUT) as client:
        assert post(client)[0] == 200  # wakes one: the victim
    victim = next(r for r in replicas if r.state() == "ready")
    wakes_before = {r.name: r.metric("dormouse_wakes_total") for r in replicas if r is not victim}
    # 24 concurrent requests of 24 tokens: several are in the victim's slots
    # and queue when it dies.
    body = {"prompt": "Count from one to fifty:", "max_tokens": 24}
    since = proxy.log_size()
    with httpx.Client(base_url=proxy.url, timeout=CLIENT_TIMEOUT) as client:
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            futures = [pool.submit(post, client, body) for _ in range(24)]
            until(lambda: victim.metric("dormouse_requests_in_flight") >= 2, 30, "requests in flight on the victim",
                  interval=0.02)
            victim.kill()
            answers = [f.result() for f in futures]
    counts = tally(answers)
    wakes = {name: int(replicas[int(name[1]) - 1].metric("dormouse_wakes_total") - b) for name, b in wakes_before.items()}
    figures("awake replica SIGKILLed mid-burst", victim=victim.name, **counts, wakes_elsewhere=wakes,
            retried_by_haproxy=proxy.retried(since), haproxy_lines=proxy.lines_used(since))
    # Put it back for the next test.
    victim.start()
    victim.wait_state("ready", "sleeping", timeout=120)
    assert counts["hung"] == 0, answers
    assert counts["ok"] + counts["clear_503"] == counts["sent"], answers  # retried, or a clear 503


# The agent must say "up 0%" for a moment before the daemon stops taking
# requests: a SIGTERM turns a daemon to stopping at once, and what HAProxy
# sends it before its next agent check (agent-inter) would be refused 503.
# The daemon's drain grace (`drain_grace_seconds`) closes that window.
def test_rolling_restart_under_load_loses_nothing(cluster):
    replicas, proxy = cluster
    until(lambda: all(r.state() in ("ready", "sleeping") for r in replicas), 60, "all three up")
    stop, results = threading.Event(), []
    since = proxy.log_size()
    threads = run_load(proxy.url, stop, results, workers=2)
    restarts = []
    try:
        for r in replicas:
            time.sleep(1.0)  # steady load before each restart
            started = time.monotonic()
            code = r.stop(timeout=60)
            r.start()
            r.wait_state("ready", "sleeping", timeout=120)
            # Back in HAProxy's rotation (its health check passed) before the next one goes.
            until(lambda: proxy.servers()[f"dormouse/{r.name}"][0].startswith("UP"), 20, f"{r.name} up in haproxy")
            restarts.append((r.name, code, round(time.monotonic() - started, 1)))
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(CLIENT_TIMEOUT + 5)
    counts = tally(results)
    figures("rolling restart of three under steady load", **counts, restarts=restarts,
            retried_by_haproxy=proxy.retried(since), haproxy_lines=proxy.lines_used(since))
    assert all(code == 0 for _, code, _ in restarts), restarts
    assert counts["hung"] == 0
    assert counts["lost"] == 0, [b for s, b in results if s != 200][:5]
