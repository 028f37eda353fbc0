"""The real HAProxy (Debian's 2.6) in front of three real daemons, running
deploy/haproxy/haproxy.cfg unchanged (generated from fleet.toml; its
addresses come from the environment). What the agent check and the tiers of
that file promise: requests go to the model they name, a model failed on one
replica is never routed there while the replica's other models are, a burst
for a sleeping model wakes it on one replica, an awake replica takes
everything while it has free slots, a killed replica's requests are retried
elsewhere, and a rolling restart loses nothing.

Before the daemons, fast tests drive the same HAProxy with stand-ins (tiny
HTTP servers with the daemon's own agent) to pin down what the design rests
on: every routing tier, routing by model (aliases, ?model=, the Ollama and
Anthropic paths, an unknown name, a model no replica can serve), an agent's
"drain" outliving the process that said it, and the health checks' Host and
key.

Two sets of three daemons, each a module fixture: the bundled model in real
workers (starting three costs ~10 s on 2 cores), and the fake worker
(tests/fakes: the real protocol, no llama.cpp) for the tests about which
replica a model's requests reach. Each test first brings them to the state
it needs. Every wait is bounded; figures are printed (`-s`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import asynccontextmanager, contextmanager
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
FLEET_TOML = ROOT / "deploy" / "haproxy" / "fleet.toml"


def _fleet():
    """fleet.toml as deploy/haproxy/generate.py reads it (the names the cfg routes)."""
    spec = importlib.util.spec_from_file_location("deploy_haproxy_generate", CFG.parent / "generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.load_fleet(FLEET_TOML), module.env_name


FLEET, env_name = _fleet()
REPLICAS = FLEET.replicas  # r1, r2, r3
MODELS = {m.id: m for m in FLEET.models}  # chat (default), coder, embed
DEFAULT = FLEET.default_model
OTHER = next(m for m in MODELS if m != DEFAULT)  # coder: tried from r2 on
assert len(REPLICAS) == 3 and MODELS[OTHER].replicas[0] == REPLICAS[1], "the tests assume fleet.toml's shape"
UNSERVABLE = [m for m in MODELS if m not in (DEFAULT, OTHER)][0]  # embed: failed everywhere in the fake cluster

SLEEP_IDLE = 2  # seconds: short, so that the tests can wait for all three to sleep
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


def toml_value(value) -> str:
    return json.dumps(value) if not isinstance(value, bool) else str(value).lower()  # str, int, list of str


class Replica:
    """One `dormouse serve` on fixed ports, so that it can be restarted where
    HAProxy expects it (tests.conftest.DaemonProcess picks a new port). It
    serves every model of fleet.toml, each a [models.ID] table of `path`
    (the same ids and aliases as the cfg routes), plus `tables[ID]`."""

    def __init__(self, name: str, path: str, log_dir: Path, tables: dict[str, dict] | None = None,
                 settings: dict | None = None, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.port, self.agent_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self.config_path = log_dir / f"{name}.toml"
        # Each replica its own state directory, as on separate machines.
        top = {"sleep_idle_seconds": SLEEP_IDLE, "threads": 1, "default_model": DEFAULT,
               "state_dir": str(self.log_path.with_suffix(".state")), **(settings or {})}
        lines = [f"{key} = {toml_value(value)}" for key, value in top.items()]
        for model_id, model in MODELS.items():
            table = {"path": path, "aliases": list(model.aliases), **(tables or {}).get(model_id, {})}
            lines += [f'[models."{model_id}"]'] + [f"{key} = {toml_value(value)}" for key, value in table.items()]
        self.config_path.write_text("\n".join(lines) + "\n")
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.http = httpx.Client(base_url=self.url, timeout=10)

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daemon", "serve", "--config", str(self.config_path),
             "--port", str(self.port), "--agent-port", str(self.agent_port), "--log-format", "json"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env})
        log.close()

    def health(self) -> dict:
        try:
            return self.http.get("/health").json()
        except (httpx.TransportError, ValueError):
            return {}

    def state(self, model: str = DEFAULT) -> str | None:
        """A model's state: the default model's is /health's own, the others' are beside it."""
        health = self.health()
        if model == DEFAULT:
            return health.get("state")
        status = health.get("models", {}).get(model)  # /v1/models' words: loaded, sleeping, failed...
        return {"loaded": "ready", "loading": "waking"}.get(status, status)

    def wait_state(self, *states: str, timeout: float = 60, model: str = DEFAULT) -> str:
        def reached():
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            return self.state(model) in states
        until(reached, timeout, f"{self.name}'s {model} reaching {states} (last {self.state(model)})")
        return self.state(model)

    def metric(self, name: str, **labels) -> float:
        return value(self.http.get("/metrics").text, name, **labels)

    def answered(self, **labels) -> float:
        """Completions this process answered 200 (for one model with model=ID)."""
        return self.metric("dormouse_requests_total", status="200", **labels)

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

    def __init__(self, replicas: list, workdir: Path, env: dict[str, str] | None = None, cfg: Path = CFG) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.socket_path = str(workdir / "haproxy.sock")
        self.log_path = workdir / "haproxy.log"
        env = {**os.environ, **(env or {}), "DORMOUSE_BIND": f"127.0.0.1:{self.port}",
               "DORMOUSE_HAPROXY_SOCKET": self.socket_path}
        for name, r in zip(REPLICAS, replicas):
            env[env_name(name)] = f"127.0.0.1:{r.port}"
            env[env_name(name) + "_AGENT"] = str(r.agent_port)
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)  # a previous HAProxy's, in the same directory
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(["haproxy", "-db", "-f", str(cfg)], env=env, stdout=log,
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

    def usable(self, model: str = DEFAULT) -> set[str]:
        """The lines of a model's backends HAProxy may pick: up with a weight above 0."""
        return {name for name, (status, weight) in self.servers().items()
                if name.split("/")[0] in (f"model.{model}", f"overflow.{model}") and status.startswith("UP") and weight > 0}

    def wait_usable(self, expected: set[str], model: str = DEFAULT, timeout: float = 15) -> None:
        until(lambda: self.usable(model) == expected, timeout, f"haproxy's usable {model} lines becoming "
              f"{sorted(expected)} (now {sorted(self.usable(model))})", interval=0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def logged(self, since: int) -> list[tuple[str, str, str]]:
        """(backend/server, status, retries) of each request HAProxy logged
        after byte `since` of its log (httplog; retries "+N" when redispatched;
        "dormouse/<NOSRV>" for an answer of HAProxy's own)."""
        found = []
        for line in self.log_path.read_bytes()[since:].decode(errors="replace").splitlines():
            parts = line.split()
            if len(parts) > 10 and parts[2] == "dormouse" and "/" in parts[3]:  # the frontend's name
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


def asleep_everywhere(model: str = DEFAULT, down: tuple[str, ...] = ()) -> set[str]:
    """What HAProxy should see of a model asleep on every replica (but those `down` for it)."""
    return {f"model.{model}/{r}-wake" for r in REPLICAS if r not in down} | {
        f"overflow.{model}/{r}" for r in REPLICAS if r not in down}


def awake_set(*names: str, model: str = DEFAULT) -> set[str]:
    """What HAProxy should see with the model awake and idle on these replicas, asleep on the others."""
    usable = {f"model.{model}/{n}" for n in names} | {f"overflow.{model}/{r}" for r in REPLICAS}
    return usable | {f"model.{model}/{n}-wake" for n in REPLICAS if n not in names}


@contextmanager
def three_replicas(workdir: Path, path: str, per_replica=lambda name: {}, cfg: Path = CFG):
    """Three daemons (Replica's options from per_replica(name)) and HAProxy (`cfg`) in front of them."""
    replicas = [Replica(name, path, workdir, **per_replica(name)) for name in REPLICAS]
    proxy = None
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            r.wait_state("ready", "sleeping", timeout=120)
        proxy = HAProxy(replicas, workdir, cfg=cfg)
        yield replicas, proxy
    finally:
        if proxy is not None:
            proxy.stop()
        stop_all(replicas)


def stop_all(replicas: list[Replica]) -> None:
    """SIGTERM to every replica first, so their drain graces (2 s each, for the agent) run at once."""
    for r in replicas:
        if r.proc is not None and r.proc.poll() is None:
            r.proc.send_signal(signal.SIGTERM)  # a second SIGTERM, from stop(), is only logged
    for r in replicas:
        if r.stop(timeout=30) is None:
            r.kill()
        r.http.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, bundled_model):
    """Three daemons on the bundled model in real workers."""
    with three_replicas(tmp_path_factory.mktemp("haproxy"), bundled_model) as running:
        yield running


def all_asleep(replicas: list[Replica], proxy: HAProxy, model: str = DEFAULT) -> None:
    for r in replicas:
        r.wait_state("sleeping", timeout=60)
    proxy.wait_usable(asleep_everywhere(model), model)


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
    hits: Counter = field(default_factory=Counter)  # requests, by the model they named (None: none)
    answered: Counter = field(default_factory=Counter)  # agent answers, by Question (role, model)


async def named_model(request) -> str | None:
    """The model a request names, as the daemon reads it: the body's, else ?model=."""
    try:
        body = await request.json() if request.can_read_body else {}
    except ValueError:
        body = {}
    body = body if isinstance(body, dict) else {}
    return body.get("model") or body.get("name") or request.query.get("model")


@asynccontextmanager
async def stand_ins(tmp_path: Path, agent_answer, env: dict[str, str] | None = None, health=None,
                    cfg: Path = CFG, delay: float = 0.0):
    """Three stand-ins behind HAProxy; `agent_answer(stand_in)` is each one's
    asyncio connection handler for the agent port, `health(request)` the
    status of /health (200 when not given)."""
    from aiohttp import web

    servers = [StandIn(name) for name in REPLICAS]
    cleanups = []
    try:
        for s in servers:
            async def handle(request, s=s):
                if request.path == "/health":
                    return web.json_response({}, status=health(request) if health else 200)
                s.hits[await named_model(request)] += 1
                if request.path == "/busy":  # what a daemon answers when its queue is full
                    return web.json_response({"error": {"code": "queue_full"}}, status=503, headers={"Retry-After": "7"})
                if delay:  # requests held in flight: HAProxy's count of each server's load
                    await asyncio.sleep(delay)
                return web.json_response({"replica": s.name})
            app = web.Application(client_max_size=8 * 2**20)  # a daemon reads bodies of a few MB too
            app.router.add_route("*", "/{tail:.*}", handle)
            runner = web.AppRunner(app)
            await runner.setup()
            cleanups.append(runner.cleanup)
            await web.TCPSite(runner, "127.0.0.1", s.port).start()
            agent = await asyncio.start_server(agent_answer(s), "127.0.0.1", s.agent_port)
            cleanups.append(lambda agent=agent: _close(agent))
        proxy = await asyncio.to_thread(HAProxy, servers, tmp_path, env, cfg)
        cleanups.append(lambda: asyncio.to_thread(proxy.stop))
        yield servers, proxy
    finally:
        for cleanup in reversed(cleanups):
            await cleanup()


async def _close(server: asyncio.AbstractServer) -> None:
    server.close()


def every_question() -> list:
    """Every (role, model) that some line of the cfg asks each replica."""
    from daemon.http.agent import OVERFLOW, SERVE, WAKE, WARM, Question

    return [Question(role, model) for model in MODELS for role in (SERVE, WARM, WAKE, OVERFLOW)]


async def settle(servers: list[StandIn], hold: float | None = None) -> None:
    """Past the agent's make-before-break hold (a line of the tier a model
    left for a warmer one stays on that long; `hold`: a longer one, counted
    from the first question after the change, half a second at most), then
    until every line's agent has answered twice: the second answer was
    computed after any change made before this call, and HAProxy applied the
    first of those before the second was asked (agent-inter)."""
    from daemon.http.agent import TIER_HOLD_SECONDS

    await asyncio.sleep(TIER_HOLD_SECONDS if hold is None else hold + 0.5)
    questions = every_question()
    before = {s.name: Counter(s.answered) for s in servers}
    deadline = time.monotonic() + 15

    def done() -> bool:
        return all(s.answered[q] >= before[s.name][q] + 2 for s in servers for q in questions)

    while not done():
        assert time.monotonic() < deadline, f"agents not asked twice in 15 s: {[s.answered for s in servers]}"
        await asyncio.sleep(0.05)


class Quiet:
    def info(self, *a, **k):
        pass


def replica_of(**models):
    """A replica's snapshot from its models' snapshots; models not given are asleep."""
    from daemon.http.agent import ReplicaSnapshot

    return ReplicaSnapshot("asleep", 0, tuple((m, models.get(m, ReplicaSnapshot("asleep", 0))) for m in MODELS))


def daemon_agents(replicas: dict):
    """Stand-ins' agents: the daemon's own Agent, answering from replicas[name]."""
    from daemon.http.agent import Agent

    def agent_for(s: StandIn):
        agent = Agent(lambda: replicas[s.name], Quiet())
        agent.answered = s.answered  # counted where settle() looks
        return agent.answer
    return agent_for


def test_haproxy_tiers_with_stand_in_agents(tmp_path):
    """The routing the design rests on, on the real HAProxy with no daemon:
    stand-ins whose agents (daemon.http.agent.Agent) report the default
    model's states set here (the other models asleep)."""
    from daemon.http.agent import WOKEN_BUSY_HOLD_SECONDS, ReplicaSnapshot

    asleep, free, full = ReplicaSnapshot("asleep", 0), ReplicaSnapshot("ready", 2), ReplicaSnapshot("ready", 0)
    waking, stopping = ReplicaSnapshot("waking", 0), ReplicaSnapshot("stopping", 0)
    replicas: dict[str, ReplicaSnapshot] = {}
    results: dict[str, object] = {}

    def set_states(*snapshots: ReplicaSnapshot) -> None:
        replicas.update({name: stopping if snap is stopping else replica_of(**{DEFAULT: snap})
                         for name, snap in zip(REPLICAS, snapshots)})

    async def scenario() -> None:
        async with stand_ins(tmp_path, daemon_agents(replicas)) as (servers, proxy):
            async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
                async def phase(label: str, *snapshots: ReplicaSnapshot, hold: float | None = None) -> None:
                    set_states(*snapshots)
                    await settle(servers, hold)
                    seen = Counter()
                    for i in range(12):  # twelve conversations: affinity spreads them over the usable lines
                        response = await client.post("/x", json={"prompt_cache_key": f"conversation-{i}"})
                        seen[response.json()["replica"] if response.status_code == 200 else response.status_code] += 1
                    results[label] = dict(seen)

                await phase("all asleep", asleep, asleep, asleep)
                await phase("r2 awake", asleep, free, asleep)
                await phase("r2 and r3 awake", asleep, free, free)
                await phase("r2 saturated", asleep, full, asleep)
                await phase("r2 saturated, r3 waking", asleep, full, waking)
                await phase("r1 waking, r2 awake", waking, free, asleep)
                # r1's wake ended busy: its warm line stays on WOKEN_BUSY_HOLD_SECONDS (HAProxy's late
                # retries; tests/unit/test_agent.py), then the overflow backend takes them all.
                await phase("all saturated", full, full, full, hold=WOKEN_BUSY_HOLD_SECONDS)
                # A daemon's own 503 reaches the client with its Retry-After,
                # and is not retried (the request may have crashed a worker).
                set_states(free, asleep, asleep)
                await settle(servers)
                hits = sum(servers[0].hits.values())
                response = await client.post("/busy", json={})
                results["daemon 503"] = (response.status_code, response.headers.get("retry-after"),
                                         sum(servers[0].hits.values()) - hits)
                await phase("all stopping", stopping, stopping, stopping)
                response = await client.post("/x", json={})
                results["503"] = (response.headers.get("retry-after"), response.json()["error"]["code"])

    set_states(asleep, asleep, asleep)
    asyncio.run(scenario())
    figures("tiers (12 requests per phase)", **{k.replace(" ", "_").replace(",", ""): v for k, v in results.items()})
    assert results["all asleep"] == {"r1": 12}  # the first sleeping replica only: one wake
    assert results["r2 awake"] == {"r2": 12}  # the awake one, not the sleeping r1 listed before it
    # routing = "affinity": the awake replicas share the conversations by key (with "first", r2 took all)
    assert set(results["r2 and r3 awake"]) == {"r2", "r3"} and sum(results["r2 and r3 awake"].values()) == 12
    assert results["r2 saturated"] == {"r1": 12}  # one sleeper woken (the first), r3 stays asleep
    assert results["r2 saturated, r3 waking"] == {"r3": 12}  # wait for that wake rather than wake r1
    assert results["r1 waking, r2 awake"] == {"r2": 12}  # a free slot now beats a load under way
    all_full = results["all saturated"]
    assert set(all_full) == {"r1", "r2", "r3"} and sum(all_full.values()) == 12  # overflow: queues by key
    assert results["daemon 503"] == (503, "7", 1)
    assert results["all stopping"] == {503: 12}
    assert results["503"] == ("1", "no_replica")  # HAProxy's own 503 reads like the daemon's


def test_routing_by_model_with_stand_in_agents(tmp_path):
    """Requests go to the backend of the model they name, however they name
    it; a model down on one replica (failed there) is never sent there while
    the replica's other models are; a name no model has is HAProxy's own 404
    and a model no replica can serve its own 503, both without a replica."""
    from daemon.http.agent import ReplicaSnapshot

    free, failed = ReplicaSnapshot("ready", 2), ReplicaSnapshot("failed", 0)
    r1, r2, r3 = REPLICAS
    # The default model awake on r2 only; OTHER failed on r2 (the first replica
    # its lines try) and asleep elsewhere; UNSERVABLE failed on every replica.
    replicas = {r1: replica_of(**{UNSERVABLE: failed}),
                r2: replica_of(**{DEFAULT: free, OTHER: failed, UNSERVABLE: failed}),
                r3: replica_of(**{UNSERVABLE: failed})}
    alias = MODELS[OTHER].aliases[0]
    results: dict[str, object] = {}

    async def scenario() -> None:
        async with stand_ins(tmp_path, daemon_agents(replicas)) as (servers, proxy):
            async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
                await settle(servers)

                async def replies(label: str, method: str, path: str, **kwargs) -> None:
                    seen = Counter()
                    for _ in range(6):
                        response = await client.request(method, path, **kwargs)
                        body = response.json()
                        seen[body["replica"] if response.status_code == 200 else
                             (response.status_code, body["error"]["code"])] += 1
                    results[label] = dict(seen)

                await replies("default by id", "POST", "/v1/completions", json={"model": DEFAULT})
                await replies("no model", "POST", "/v1/completions", json={"prompt": "x"})
                await replies("not json", "POST", "/v1/completions", content=b"{", headers={"Content-Type": "text/plain"})
                await replies("other by id", "POST", "/v1/chat/completions", json={"model": OTHER})
                await replies("other by alias", "POST", "/v1/completions", json={"model": alias})
                await replies("other ?model=", "GET", f"/props?model={OTHER}")
                await replies("other, Anthropic", "POST", "/v1/messages", json={"model": OTHER, "max_tokens": 1})
                await replies("other, Ollama", "POST", "/api/chat", json={"model": OTHER, "messages": []})
                await replies("other, Ollama's name", "POST", "/api/show", json={"name": OTHER})
                hits_before = sum(sum(s.hits.values()) for s in servers)
                await replies("unknown", "POST", "/v1/completions", json={"model": "gpt-5"})
                unknown = (await client.post("/v1/completions", json={"model": 'no"such'})).json()
                await replies("failed everywhere", "POST", "/v1/embeddings", json={"model": UNSERVABLE})
                results["replicas asked"] = sum(sum(s.hits.values()) for s in servers) - hits_before
                results["unknown message"] = unknown["error"]["message"]
                # The failed model back on r2 (asleep): its lines there are usable again, first in its order.
                replicas[r2] = replica_of(**{DEFAULT: free, UNSERVABLE: failed})
                await settle(servers)
                await replies("other recovered on r2", "POST", "/v1/completions", json={"model": OTHER})
                results["hits"] = {s.name: dict(s.hits) for s in servers}

    asyncio.run(scenario())
    figures("routing by model (6 requests each)", **{k.replace(" ", "_"): v for k, v in results.items()})
    assert results["default by id"] == results["no model"] == results["not json"] == {r2: 6}
    # OTHER's lines try r2 first, but it failed there: r3's wake line (the next) takes it.
    for label in ("other by id", "other by alias", "other ?model=", "other, Anthropic", "other, Ollama",
                  "other, Ollama's name"):
        assert results[label] == {r3: 6}, label
    assert results["unknown"] == {(404, "model_not_found"): 6}
    # The name is JSON-escaped into HAProxy's body: it parses, and reads back as sent.
    assert results["unknown message"] == 'model "no"such" does not exist (GET /v1/models lists the models)'
    assert results["failed everywhere"] == {(503, "no_replica"): 6}
    assert results["replicas asked"] == 0  # both answered by HAProxy at once
    assert results["other recovered on r2"] == {r2: 6}  # "down" is not sticky: the next answer lifts it
    assert OTHER not in results["hits"][r2] or results["hits"][r2][OTHER] == 6  # only after it recovered


def test_bodies_past_16_kib_are_routed_by_model_with_stand_in_agents(tmp_path):
    """HAProxy reads a body's "model" only as far as tune.bufsize holds the body: 16 KiB by
    default, so a longer conversation went to the default model's backend. The file raises
    it (a 40 KiB body is routed by its model), and a body larger still is routed by the
    X-Dormouse-Model header (without it: the default model's backend, as documented)."""
    from daemon.http.agent import ReplicaSnapshot

    free, failed = ReplicaSnapshot("ready", 2), ReplicaSnapshot("failed", 0)
    r1, r2, r3 = REPLICAS
    # As in the routing test: the default model awake on r2, OTHER failed there (so r3 takes it).
    replicas = {r1: replica_of(**{UNSERVABLE: failed}),
                r2: replica_of(**{DEFAULT: free, OTHER: failed, UNSERVABLE: failed}),
                r3: replica_of(**{UNSERVABLE: failed})}
    results: dict[str, object] = {}
    big = 600 * 1024  # past the file's tune.bufsize too (and within the stand-ins' 1 MiB)

    async def scenario() -> None:
        async with stand_ins(tmp_path, daemon_agents(replicas)) as (servers, proxy):
            async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
                await settle(servers)

                async def replies(label: str, body: dict, headers=None) -> None:
                    seen = Counter()
                    for _ in range(4):
                        response = await client.post("/v1/chat/completions", json=body, headers=headers or {})
                        seen[response.json()["replica"] if response.status_code == 200 else response.status_code] += 1
                    results[label] = dict(seen)

                text = {"messages": [{"role": "user", "content": "x" * 40 * 1024}]}
                await replies("40 KiB, model first", {"model": OTHER, **text})
                await replies("40 KiB, model last", {**text, "model": OTHER})
                # The openai SDK writes "messages" before "model": the model lies past the buffer.
                huge = {"messages": [{"role": "user", "content": "x" * big}], "model": OTHER}
                await replies("600 KiB with the header", huge, {"X-Dormouse-Model": OTHER})
                await replies("600 KiB without it", huge)
                # Where "model" comes first, HAProxy finds it in what it holds of the body.
                await replies("600 KiB, model first", {"model": OTHER, "messages": huge["messages"]})
                await replies("header only", {"prompt": "x"}, {"X-Dormouse-Model": OTHER})
                await replies("body beats header", {"model": DEFAULT}, {"X-Dormouse-Model": OTHER})
                await replies("unknown header", {"prompt": "x"}, {"X-Dormouse-Model": "gpt-5"})

    asyncio.run(scenario())
    figures("bodies past 16 KiB (4 requests each)", **{k.replace(" ", "_"): v for k, v in results.items()})
    assert results["40 KiB, model first"] == results["40 KiB, model last"] == {r3: 4}
    assert results["600 KiB with the header"] == {r3: 4}
    assert results["600 KiB without it"] == {r2: 4}  # the documented limit: the default model's backend
    assert results["600 KiB, model first"] == {r3: 4}
    assert results["header only"] == {r3: 4}
    assert results["body beats header"] == {r2: 4}
    assert results["unknown header"] == {404: 4}


def test_agent_drain_outlives_the_process(tmp_path):
    """Why the agent says "up 0%" and never "drain": HAProxy keeps an agent's
    drain (an administrative state) after the agent answers "up 100%" again,
    so a restarted daemon would get no traffic unless every reply said
    "ready", which would also cancel an operator's maintenance."""
    from daemon.http.agent import parse_question

    r1, r2, r3 = REPLICAS
    # r1's agent says drain, then up 100%; r2's says up 0%, then up 100%.
    steps = [{r1: "drain\n", r2: "up 0%\n", r3: "up 100%\n"},
             {r1: "up 100%\n", r2: "up 100%\n", r3: "up 100%\n"}]
    reply = dict(steps[0])

    def agent_for(s: StandIn):
        async def answer(reader, writer):
            question = parse_question(await reader.read(256))  # agent-send comes first
            writer.write(reply[s.name].encode())
            await writer.drain()
            writer.close()
            s.answered[question] += 1
        return answer

    async def scenario() -> list:
        seen = []
        async with stand_ins(tmp_path, agent_for) as (servers, proxy):
            for step in steps:
                reply.update(step)
                await settle(servers)
                view = await asyncio.to_thread(proxy.servers)
                seen.append((view[f"model.{DEFAULT}/{r1}"], view[f"model.{DEFAULT}/{r2}"]))
        return seen

    (drained, zero), (after_drain, after_zero) = asyncio.run(scenario())
    figures("haproxy's (status, weight) after an agent's reply", drain=drained, drain_then_up_100=after_drain,
            up_0=zero, up_0_then_up_100=after_zero)
    assert drained[0].startswith("DRAIN") and after_drain[0].startswith("DRAIN")  # sticky
    assert zero == ("UP", 0)  # weight 0: no new requests (the tiers test shows it) ...
    # ... and the next answer replaces it (100% of the line's weight: 100 on affinity lines, else 1)
    assert after_zero == ("UP", 100 if FLEET.routing == "affinity" else 1)


def test_health_checks_send_the_host_and_metrics_key(tmp_path):
    """With allowed_hosts and metrics_key set on the daemons, /health answers
    403/401 to a check without them: the cfg sends DORMOUSE_CHECK_HOST and, when
    set, DORMOUSE_METRICS_KEY. Stand-ins that check both stay up; and a 503
    (the default model failed, or loading) keeps the replica up for its
    other models."""
    from daemon.http.agent import FULL

    seen = []
    health_status = {"ok": 200}

    def health(request) -> int:
        seen.append((request.host, request.headers.get("Authorization")))
        if request.host != "models.example":
            return 403
        return health_status["ok"] if request.headers.get("Authorization") == "Bearer s3cret" else 401

    def agent_for(s: StandIn):
        async def answer(reader, writer):
            writer.write(FULL.encode())
            await writer.drain()
            writer.close()
        return answer

    checked = {f"model.{m}/{r}" for m in MODELS for r in REPLICAS}  # the serve lines: the others track them

    async def scenario(env: dict[str, str], settled) -> set[str]:
        """The checked lines that are up once every one's health is `settled`."""
        async with stand_ins(tmp_path, agent_for, env=env, health=health) as (servers, proxy):
            def rows():
                return {name: row for name, row in proxy.rows().items() if name in checked}
            await asyncio.to_thread(until, lambda: all(settled(row) for row in rows().values()), 15,
                                    "health checks settling")
            return {name for name, row in rows().items() if row["status"].startswith("UP")}

    def passed(row) -> bool:  # a check has run and passed (servers start up before any check)
        return row["check_status"] == "L7OK"

    def down(row) -> bool:
        return row["status"].startswith("DOWN")

    keyed = {"DORMOUSE_CHECK_HOST": "models.example", "DORMOUSE_METRICS_KEY": "s3cret"}
    up = asyncio.run(scenario(keyed, passed))
    without_key = asyncio.run(scenario({"DORMOUSE_CHECK_HOST": "models.example"}, down))
    health_status["ok"] = 503
    up_on_503 = asyncio.run(scenario(keyed, passed))

    figures("health checks", up_with_host_and_key=sorted(up), up_without_key=sorted(without_key),
            up_while_health_is_503=sorted(up_on_503), first_check=seen[0])
    assert up == checked
    assert without_key == set()  # the check really is what decides
    assert up_on_503 == checked  # 503 is the daemon answering; the agent says what it means per model


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


def run_load(url: str, stop: threading.Event, results: list, workers: int,
             bodies: tuple[dict, ...] = (COMPLETION,)) -> list[threading.Thread]:
    """`workers` clients in a loop, each sending `bodies` in turn; results get (status, body, model asked)."""
    def loop():
        with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT) as client:
            for i in itertools.count():
                if stop.is_set():
                    return
                body = bodies[i % len(bodies)]
                results.append((*post(client, body), body.get("model", DEFAULT)))
    threads = [threading.Thread(target=loop, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    return threads


def tally(results: list) -> dict:
    statuses = Counter(s for s, *_ in results)
    clear_503 = sum(1 for s, b, *_ in results if s == 503 and isinstance(b, dict) and "error" in b)
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
    by_name = {r.name: r for r in replicas}
    wakes = {name: int(by_name[name].metric("dormouse_wakes_total") - b) for name, b in wakes_before.items()}
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
    """Three replicas restarted one after another under steady traffic for
    two models (each client alternates them): not one request lost."""
    replicas, proxy = cluster
    until(lambda: all(r.state() in ("ready", "sleeping") for r in replicas), 60, "all three up")
    stop, results = threading.Event(), []
    since = proxy.log_size()
    bodies = ({**COMPLETION, "model": DEFAULT}, {**COMPLETION, "model": OTHER})
    threads = run_load(proxy.url, stop, results, workers=2, bodies=bodies)
    restarts = []
    try:
        for r in replicas:
            time.sleep(1.0)  # steady load before each restart
            started = time.monotonic()
            code = r.stop(timeout=60)
            r.start()
            r.wait_state("ready", "sleeping", timeout=120)
            # Back in HAProxy's rotation (its health check passed) before the next one goes.
            until(lambda: all(proxy.servers()[f"model.{m}/{r.name}"][0].startswith("UP") for m in (DEFAULT, OTHER)), 20,
                  f"{r.name} up in haproxy")
            restarts.append((r.name, code, round(time.monotonic() - started, 1)))
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(CLIENT_TIMEOUT + 5)
    counts = tally(results)
    per_model = {model: tally([x for x in results if x[2] == model])["ok"] for model in (DEFAULT, OTHER)}
    answered_as_asked = all(b["model"] == m for s, b, m in results if s == 200)
    figures("rolling restart of three under steady load", **counts, ok_per_model=per_model, restarts=restarts,
            retried_by_haproxy=proxy.retried(since), haproxy_lines=proxy.lines_used(since))
    assert all(code == 0 for _, code, _ in restarts), restarts
    assert counts["hung"] == 0
    assert counts["lost"] == 0, [b for s, b, _ in results if s != 200][:5]
    assert all(per_model.values()) and answered_as_asked, per_model


# -- which replica a model's requests reach: three daemons on the fake worker --

FAKE_LOAD_SECONDS = "0.5"  # a wake long enough for a burst to arrive during it
SLOW_LOAD_SECONDS = "3"  # r3's: long enough to kill it while it wakes
FAKE_SLEEP_IDLE = 3


@pytest.fixture(scope="module")
def fake_cluster(tmp_path_factory, bundled_model):
    """Three daemons on the fake worker (the real daemon, HTTP and agent; the
    worker speaks the real protocol without llama.cpp). OTHER fails to load
    on r2, the first replica its lines try, and UNSERVABLE on every replica:
    their chat template cannot be read (not UTF-8), which the daemon finds
    at load, not at start. Both are pinned, so they load (and fail) at start.
    r3 (OTHER's next replica) takes SLOW_LOAD_SECONDS to load."""
    workdir = tmp_path_factory.mktemp("haproxy-fake")
    unreadable = workdir / "template.jinja"
    unreadable.write_bytes(b"\xff\xfe not UTF-8")
    failing = {"chat_template_file": str(unreadable), "pinned": True}

    def per_replica(name: str) -> dict:
        tables = {UNSERVABLE: failing} | ({OTHER: failing} if name == REPLICAS[1] else {})
        # r3 loads slowly: long enough to be killed while it wakes a model.
        load_seconds = SLOW_LOAD_SECONDS if name == REPLICAS[2] else FAKE_LOAD_SECONDS
        return {"tables": tables, "settings": {"sleep_idle_seconds": FAKE_SLEEP_IDLE, "spawn_ahead": False},
                "env": {"DORMOUSE_WORKER_MODULE": "tests.fakes.fake_worker", "FAKE_LOAD_SECONDS": load_seconds}}

    with three_replicas(workdir, bundled_model, per_replica) as (replicas, proxy):
        until(lambda: replicas[1].state(OTHER) == "failed", 30, f"{OTHER} failing on {REPLICAS[1]}")
        # HAProxy sees OTHER down on r2 only, and UNSERVABLE down everywhere.
        proxy.wait_usable(asleep_everywhere(OTHER, down=(REPLICAS[1],)), OTHER)
        proxy.wait_usable(set(), UNSERVABLE)
        yield replicas, proxy


def lines_of(proxy: HAProxy, model: str, since: int) -> Counter:
    """The replicas (r1, r2, ...) HAProxy sent this model's requests to, from its log."""
    found = Counter()
    for server, _, _ in proxy.logged(since):
        backend, line = server.split("/")
        if backend in (f"model.{model}", f"overflow.{model}"):
            found[line.removesuffix("-warm").removesuffix("-wake")] += 1
    return found


def test_a_model_failed_on_one_replica_is_never_routed_there(fake_cluster):
    replicas, proxy = fake_cluster
    r1, r2, r3 = replicas
    # The default model awake on r2 only (the others asleep), so that its
    # requests go to r2 as well: r2 serves one model and refuses the other.
    for r in replicas:
        r.wait_state("sleeping", timeout=30)
    assert r2.http.post("/models/load", json={"model": DEFAULT}).status_code == 200
    proxy.wait_usable(awake_set(r2.name), DEFAULT)
    proxy.wait_usable(asleep_everywhere(OTHER, down=(r2.name,)), OTHER)
    before = {r.name: {m: r.answered(model=m) for m in (DEFAULT, OTHER)} for r in replicas}
    since = proxy.log_size()
    answers = []
    with httpx.Client(base_url=proxy.url, timeout=CLIENT_TIMEOUT) as client:
        # DEFAULT's ten first, then OTHER's: OTHER's first request waits for r3's slow load
        # (SLOW_LOAD_SECONDS), as long as DEFAULT's idle sleep (FAKE_SLEEP_IDLE) on r2, and a
        # DEFAULT request after it raced that sleep (then woke r1, listed first).
        for i in range(20):
            model = DEFAULT if i < 10 else OTHER
            status, body = post(client, {"model": model, "prompt": "Hello there", "max_tokens": 2})
            answers.append((model, status, body.get("model") if isinstance(body, dict) else body))
        started = time.monotonic()
        unservable = client.post("/v1/completions", json={"model": UNSERVABLE, "prompt": "x", "max_tokens": 1})
        unservable_seconds = time.monotonic() - started
    answered = {r.name: {m: int(r.answered(model=m) - before[r.name][m]) for m in (DEFAULT, OTHER)} for r in replicas}
    routed = {m: dict(lines_of(proxy, m, since)) for m in (DEFAULT, OTHER, UNSERVABLE)}
    figures(f"{OTHER} failed on {r2.name}, {DEFAULT} awake there (10 requests each)", answered=answered,
            haproxy_routed=routed, unservable=(unservable.status_code, unservable.json()["error"]["code"]),
            unservable_answered_in_s=round(unservable_seconds, 4))
    assert [(status, named) for model, status, named in answers] == [(200, model) for model, _, _ in answers]
    assert r2.name not in routed[OTHER] and answered[r2.name][OTHER] == 0  # never sent there ...
    assert routed[DEFAULT] == {r2.name: 10} and answered[r2.name][DEFAULT] == 10  # ... while its other model is
    assert r2.state(OTHER) == "failed"  # still: it was not a moment between retries
    # A model no replica can serve: HAProxy's own 503, no replica asked.
    assert unservable.status_code == 503 and unservable.json()["error"]["code"] == "no_replica"
    assert UNSERVABLE in unservable.json()["error"]["message"] and routed[UNSERVABLE] == {}


def test_a_burst_for_one_model_wakes_it_on_one_replica_only(fake_cluster):
    replicas, proxy = fake_cluster
    r2 = replicas[1]
    for r in replicas:
        r.wait_state("sleeping", timeout=30)
        if r is not r2:
            r.wait_state("sleeping", model=OTHER, timeout=30)
    proxy.wait_usable(asleep_everywhere(DEFAULT), DEFAULT)
    proxy.wait_usable(asleep_everywhere(OTHER, down=(r2.name,)), OTHER)

    def wakes(model: str) -> dict[str, float]:
        return {r.name: r.metric("dormouse_wakes_total", model=model) for r in replicas}

    before = {m: wakes(m) for m in (DEFAULT, OTHER)}
    since = proxy.log_size()
    body = {"model": OTHER, "prompt": "Hello there", "max_tokens": 2}
    with httpx.Client(base_url=proxy.url, timeout=CLIENT_TIMEOUT) as client:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: post(client, body), range(8)))
    woke = {m: {name: int(n - before[m][name]) for name, n in wakes(m).items()} for m in (DEFAULT, OTHER)}
    figures(f"burst of 8 for {OTHER}, every model asleep", wakes=woke, haproxy_routed=dict(lines_of(proxy, OTHER, since)),
            statuses=dict(Counter(s for s, _ in answers)))
    assert [s for s, _ in answers] == [200] * 8, answers
    assert sum(woke[OTHER].values()) == 1  # one replica woke it, and served the whole burst
    assert sum(woke[DEFAULT].values()) == 0  # no other model was woken anywhere


def test_a_replica_killed_while_it_wakes_a_model_loses_nothing(fake_cluster):
    """The requests that woke a model are on that replica's backup lines (wake,
    then warm) when it dies: HAProxy marks those lines down at the first
    refused connection (each checks its own health, so `observe` applies to
    it) and retries them on the next replica in the model's order."""
    replicas, proxy = fake_cluster
    r1, r2, r3 = replicas
    for r in (r1, r3):
        r.wait_state("sleeping", model=OTHER, timeout=30)
    proxy.wait_usable(asleep_everywhere(OTHER, down=(r2.name,)), OTHER)
    since = proxy.log_size()
    body = {"model": OTHER, "prompt": "Hello there", "max_tokens": 2}
    with httpx.Client(base_url=proxy.url, timeout=CLIENT_TIMEOUT) as client:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(post, client, body) for _ in range(6)]
            r3.wait_state("waking", model=OTHER, timeout=30)  # its load takes SLOW_LOAD_SECONDS
            r3.kill()
            answers = [f.result() for f in futures]
    counts = tally(answers)
    routed = dict(lines_of(proxy, OTHER, since))
    figures(f"{r3.name} SIGKILLed while waking {OTHER} (6 concurrent requests)", **counts,
            retried_by_haproxy=proxy.retried(since), haproxy_routed=routed)
    r3.start()  # back, for any test after this one
    r3.wait_state("ready", "sleeping", timeout=60)
    assert counts["hung"] == 0 and counts["ok"] == counts["sent"] == 6, answers
    assert routed == {r1.name: 6}  # the next replica in its order; r2, where it failed, never
