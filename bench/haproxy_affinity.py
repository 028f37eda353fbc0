"""Affinity routing against today's routing for 3 and 6 replicas (issue 31):
real HAProxy 2.6 with deploy/haproxy/generate.py's file for a fleet of N
replicas, N real daemons (6 slots each, all awake, one shared_cache_dir),
4 x N conversations of 5 rounds at once. Per N it prints, for today's
routing (`first`) with a prompt_cache_key, affinity with the key and
affinity without one (the first message is the key): the share of the prompt
tokens of rounds 2-5 that the caches served, TTFT p50/p95, how many replicas
a conversation saw, the tokens restored from the shared tier and the
requests answered. Then (unless --no-drain) one more affinity run in which
the replica holding the most conversations is stopped with SIGTERM between
rounds 2 and 3: the share of their next turn's prompt served from the cache
on the replicas that took them (the shared tier's; the issue's goal is 80%),
and the requests lost (docs/SCALING.md, "Affinity" and "A shared tier").

    .venv/bin/python -m bench.haproxy_affinity                    # tiny model, 3 and 6
    .venv/bin/python -m bench.haproxy_affinity --model bundled 3  # Gemma 3 270M, 3 replicas

--model tiny: the tiny test model (random weights: routing, and a cache
figure whose answers are kept at 2 tokens in the drain run, as the random
tokens do not come back the same through their text); --model bundled: the
bundled Gemma 3 270M, with a system prompt of 120 words and answers of up to
8 tokens, which come back as the same tokens.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import tempfile
import threading
import time
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import table
from tests.fixtures.tiny_model import write_tiny_model
from tests.reliability import test_haproxy as th
from tests.reliability.test_haproxy_cache import ROUNDS, conversation, servers_by_conversation

generate = sys.modules["deploy_haproxy_generate"]  # deploy/haproxy/generate.py, loaded by test_haproxy
SETTINGS = {"parallel": 6, "ctx_size": 8192, "sleep_idle_seconds": 3600, "kv_cache_min_tokens": 16}
DRAIN_AFTER = 2  # rounds served before the drain
BARRIER_SECONDS = 600


@dataclass(frozen=True)
class Profile:
    """How a model's conversations are shaped (conversation()'s keywords)."""
    turns: dict = field(default_factory=dict)
    drain_turns: dict = field(default_factory=dict)


PROFILES = {
    "tiny": Profile({"system_words": 40, "answer_tokens": 48, "ignore_eos": True},
                    {"system_words": 120, "answer_tokens": 2, "ignore_eos": True}),
    # Moderate prompts (the rounds reach ~250 tokens) and short answers: 3 replicas of one
    # thread each share 2 CPU cores here, and a turn waits for the 5 others on its replica.
    "bundled": Profile({"system_words": 120, "answer_tokens": 8, "ignore_eos": False, "timeout": 600},
                       {"system_words": 120, "answer_tokens": 8, "ignore_eos": False, "timeout": 600}),
}


def model_path(name: str, directory: Path) -> str:
    if name == "bundled":
        from bench.common import bundled_model
        return bundled_model()
    return str(write_tiny_model(directory / "tiny-llama.gguf"))


def fleet_cfg(directory: Path, n: int, routing: str) -> Path:
    models = tomllib.loads(th.FLEET_TOML.read_text())["models"]
    fleet = generate.parse_fleet({"replicas": [f"r{i + 1}" for i in range(n)], "models": models,
                                  "default_model": th.DEFAULT, "routing": routing})
    cfg = directory / f"haproxy-{n}-{routing}.cfg"
    cfg.write_text(generate.render(fleet))
    return cfg


def start_proxy(replicas, workdir: Path, cfg: Path) -> th.HAProxy:
    env = {}
    for r in replicas:  # every replica's address (HAProxy() itself maps the first three)
        env[generate.env_name(r.name)] = f"127.0.0.1:{r.port}"
        env[generate.env_name(r.name) + "_AGENT"] = str(r.agent_port)
    proxy = th.HAProxy(replicas[:3], workdir, env=env, cfg=cfg)
    time.sleep(2)  # every line's agent answered
    return proxy


def shared_tokens(replicas) -> float:
    return sum(r.metric("dormouse_prompt_cache_disk_tokens_total", model=th.DEFAULT, origin="shared")
               for r in replicas)


def share(turns: list[dict]) -> float:
    return round(sum(t["cached"] for t in turns) / sum(t["prompt"] for t in turns), 3)


def answered(results: list[list[dict]]) -> str:
    statuses = Counter(t["status"] for conv in results for t in conv)
    return f"{statuses.get(200, 0)} of {sum(statuses.values())}"


def measure(replicas, workdir: Path, cfg: Path, label: str, conversations: int, with_key: bool,
            profile: Profile) -> list[object]:
    before = shared_tokens(replicas)
    proxy = start_proxy(replicas, workdir, cfg)
    try:
        since = proxy.log_size()
        with concurrent.futures.ThreadPoolExecutor(conversations) as pool:
            results = list(pool.map(lambda c: conversation(proxy.url, label, c, with_key, **profile.turns),
                                    range(conversations)))
        time.sleep(0.5)  # HAProxy logs a stream when it ends
        where = servers_by_conversation(proxy, since)
    finally:
        proxy.stop()
    ok = [[t for t in conv if t["status"] == 200] for conv in results]
    ttfts = sorted(t["ttft"] for conv in ok for t in conv)
    spread = sorted(len(w) for w in where.values())
    return [share([t for conv in ok for t in conv[1:]]),
            round(1000 * statistics.median(ttfts)), round(1000 * ttfts[int(0.95 * (len(ttfts) - 1))]),
            f"{statistics.mean(spread):.2f} (max {max(spread)})", int(shared_tokens(replicas) - before),
            answered(results)]


def drain(replicas, workdir: Path, cfg: Path, conversations: int, profile: Profile) -> list[object]:
    """Affinity with the key; between rounds 2 and 3 the replica with the most conversations
    gets SIGTERM (a rolling restart's or a scale-down's stop)."""
    between = threading.Barrier(conversations + 1)

    def before_round(r: int) -> None:
        if r == DRAIN_AFTER:  # twice: once all are between turns, once the drain is done
            between.wait(BARRIER_SECONDS)
            between.wait(BARRIER_SECONDS)

    proxy = start_proxy(replicas, workdir, cfg)
    try:
        since = proxy.log_size()
        with concurrent.futures.ThreadPoolExecutor(conversations) as pool:
            running = [pool.submit(conversation, proxy.url, "drain", c, True, before_round=before_round,
                                   **profile.drain_turns) for c in range(conversations)]
            between.wait(BARRIER_SECONDS)
            time.sleep(0.5)  # HAProxy's log lines of round 2
            homes = {c: w.most_common(1)[0][0] for c, w in servers_by_conversation(proxy, since).items()}
            load = Counter(homes.values())
            victim = next(r for r in replicas if r.name == max(load, key=load.get))
            moved = sorted(c for c, home in homes.items() if home == victim.name)
            survivors = [r for r in replicas if r is not victim]
            before = shared_tokens(survivors)
            started = time.monotonic()
            exit_code = victim.stop(timeout=60)
            stop_seconds = time.monotonic() - started
            proxy.wait_usable({f"{b}.{th.DEFAULT}/{r.name}" for r in survivors for b in ("model", "overflow")})
            between.wait(BARRIER_SECONDS)
            results = [f.result() for f in running]
    finally:
        proxy.stop()
    next_turns = [results[c][DRAIN_AFTER] for c in moved if results[c][DRAIN_AFTER]["status"] == 200]
    shares = [t["cached"] / t["prompt"] for t in next_turns]
    stayed = [results[c][DRAIN_AFTER] for c in range(conversations) if c not in moved]
    return [f"{victim.name}: {len(moved)} of {conversations}, exit {exit_code} in {stop_seconds:.1f} s",
            f"{min(shares):.3f} / {statistics.median(shares):.3f}" if shares else "-",
            share([t for t in stayed if t["status"] == 200]), int(shared_tokens(survivors) - before),
            answered(results)]


def run_size(n: int, model: str, with_drain: bool, rows: list, drain_rows: list) -> None:
    profile = PROFILES[model]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        (workdir / "shared").mkdir()
        settings = {**SETTINGS, "shared_cache_dir": str(workdir / "shared")}
        path = model_path(model, workdir)
        replicas = [th.Replica(f"r{i + 1}", path, workdir, settings=settings) for i in range(n)]
        try:
            for r in replicas:
                r.start()
            for r in replicas:
                r.wait_state("ready", "sleeping", timeout=180)
                r.http.post("/v1/completions", json={"prompt": "the", "max_tokens": 1}, timeout=120)
            for routing, with_key, name in (("first", True, "today (first), key"), ("affinity", True, "affinity, key"),
                                            ("affinity", False, "affinity, no key")):
                label = f"n{n}-{routing}-{'key' if with_key else 'nokey'}"
                rows.append([model, n, 4 * n, name, *measure(replicas, workdir, fleet_cfg(workdir, n, routing),
                                                             label, 4 * n, with_key, profile)])
                print(table(HEADERS, rows[-1:]), flush=True)
            if with_drain:
                drain_rows.append([model, n, 4 * n, *drain(replicas, workdir, fleet_cfg(workdir, n, "affinity"),
                                                          4 * n, profile)])
                print(table(DRAIN_HEADERS, drain_rows[-1:]), flush=True)
        finally:
            for r in replicas:
                if r.stop(timeout=30) is None:
                    r.kill()


HEADERS = ["model", "replicas", "conversations", "routing", f"cached share (rounds 2-{ROUNDS})", "TTFT p50 ms",
           "TTFT p95 ms", "replicas per conversation", "tokens from the shared tier", "answered"]
DRAIN_HEADERS = ["model", "replicas", "conversations", "drained (its conversations, stop)",
                 f"their round {DRAIN_AFTER + 1}: cached share min / median", "the others' round 3 share",
                 "tokens from the shared tier", "answered"]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.haproxy_affinity", description=__doc__.split("\n\n")[0])
    parser.add_argument("sizes", nargs="*", type=int, default=[3, 6], help="replica counts (default: 3 6)")
    parser.add_argument("--model", choices=sorted(PROFILES), default="tiny")
    parser.add_argument("--no-drain", action="store_true", help="skip the drain run")
    args = parser.parse_args(argv)
    rows: list = []
    drain_rows: list = []
    for n in args.sizes:
        run_size(n, args.model, not args.no_drain, rows, drain_rows)
    print()
    print(table(HEADERS, rows))
    if drain_rows:
        print()
        print(table(DRAIN_HEADERS, drain_rows))


if __name__ == "__main__":
    main(sys.argv[1:])
