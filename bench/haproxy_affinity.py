"""Affinity routing against today's routing for 3 and 6 replicas (issue 31):
real HAProxy 2.6 with deploy/haproxy/generate.py's file for a fleet of N
replicas, N real daemons (the tiny test model in real workers, 6 slots each,
all awake, one shared_cache_dir), 4 x N conversations of 5 rounds at once.
Prints per N and routing: the share of the prompt tokens of rounds 2-5 that
the caches served, TTFT p50/p95, how many replicas a conversation saw, and
the tokens restored from the shared tier, so the curve toward many replicas
is visible (docs/SCALING.md, "Affinity").

    .venv/bin/python -m bench.haproxy_affinity            # 3 and 6
    .venv/bin/python -m bench.haproxy_affinity 3 6 9
"""

from __future__ import annotations

import concurrent.futures
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from bench.common import table
from tests.fixtures.tiny_model import write_tiny_model
from tests.reliability import test_haproxy as th
from tests.reliability.test_haproxy_cache import ROUNDS, conversation, servers_by_conversation

generate = sys.modules["deploy_haproxy_generate"]  # deploy/haproxy/generate.py, loaded by test_haproxy
SETTINGS = {"parallel": 6, "ctx_size": 8192, "sleep_idle_seconds": 3600, "kv_cache_min_tokens": 16}


def fleet_cfg(directory: Path, n: int, routing: str) -> Path:
    models = tomllib.loads(th.FLEET_TOML.read_text())["models"]
    fleet = generate.parse_fleet({"replicas": [f"r{i + 1}" for i in range(n)], "models": models,
                                  "default_model": th.DEFAULT, "routing": routing})
    cfg = directory / f"haproxy-{n}-{routing}.cfg"
    cfg.write_text(generate.render(fleet))
    return cfg


def measure(replicas, workdir: Path, cfg: Path, label: str, conversations: int) -> list[object]:
    env = {}
    for r in replicas:  # every replica's address (HAProxy() itself maps the first three)
        env[generate.env_name(r.name)] = f"127.0.0.1:{r.port}"
        env[generate.env_name(r.name) + "_AGENT"] = str(r.agent_port)
    before = sum(r.metric("dormouse_prompt_cache_disk_tokens_total", model=th.DEFAULT, origin="shared")
                 for r in replicas)
    proxy = th.HAProxy(replicas[:3], workdir, env=env, cfg=cfg)
    try:
        time.sleep(2)  # every line's agent answered
        since = proxy.log_size()
        with concurrent.futures.ThreadPoolExecutor(conversations) as pool:
            results = list(pool.map(lambda c: conversation(proxy.url, label, c, True), range(conversations)))
        time.sleep(0.5)
        where = servers_by_conversation(proxy, since)
    finally:
        proxy.stop()
    later = [t for conv in results for t in conv[1:]]
    ttfts = sorted(t["ttft"] for conv in results for t in conv)
    shared = sum(r.metric("dormouse_prompt_cache_disk_tokens_total", model=th.DEFAULT, origin="shared")
                 for r in replicas) - before
    spread = sorted(len(w) for w in where.values())
    return [round(sum(t["cached"] for t in later) / sum(t["prompt"] for t in later), 3),
            round(1000 * statistics.median(ttfts)), round(1000 * ttfts[int(0.95 * (len(ttfts) - 1))]),
            f"{statistics.mean(spread):.2f} (max {max(spread)})", int(shared)]


def main(sizes: list[int]) -> None:
    rows = []
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            workdir = Path(tmp)
            (workdir / "shared").mkdir()
            tiny = write_tiny_model(workdir / "tiny-llama.gguf")
            settings = {**SETTINGS, "shared_cache_dir": str(workdir / "shared")}
            replicas = [th.Replica(f"r{i + 1}", str(tiny), workdir, settings=settings) for i in range(n)]
            try:
                for r in replicas:
                    r.start()
                for r in replicas:
                    r.wait_state("ready", "sleeping", timeout=180)
                    r.http.post("/v1/completions", json={"prompt": "the", "max_tokens": 1}, timeout=120)
                for routing in ("first", "affinity"):
                    label = f"n{n}-{routing}"
                    rows.append([n, 4 * n, routing,
                                 *measure(replicas, workdir, fleet_cfg(workdir, n, routing), label, 4 * n)])
                    print(table(HEADERS, rows[-1:]), flush=True)
            finally:
                for r in replicas:
                    if r.stop(timeout=30) is None:
                        r.kill()
    print()
    print(table(HEADERS, rows))


HEADERS = ["replicas", "conversations", "routing", f"cached share (rounds 2-{ROUNDS})", "TTFT p50 ms",
           "TTFT p95 ms", "replicas per conversation", "tokens from the shared tier"]

if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [3, 6])
