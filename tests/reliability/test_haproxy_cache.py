"""Affinity against today's routing (issue 31), with real HAProxy 2.6 in front
of three real daemons (the tiny test model in real workers, every replica
awake): twelve conversations, five rounds each, all twelve at once. The
figure is the share of the prompt tokens that the replicas' prompt caches
served (usage.prompt_tokens_details.cached_tokens over prompt_tokens), and
the time to the first token.

- today's routing (routing = "first", generated from fleet.toml): the first
  replica with a free slot takes a request, so a conversation's next round
  lands wherever a slot is free when it arrives;
- affinity with prompt_cache_key (the committed haproxy.cfg);
- affinity without a key: the first message is the key (its first block).

Each replica has 6 slots, more than the conversations the ring gives any one
of them (at most 5 of these 12 keys), so under affinity with the key no
replica is out of the ring for want of a slot and every conversation stays
where it started; today's routing fills r1's 6 slots and spills the rest. Each run's
conversations open with words of their own, so one run's caches do not serve
the next."""

from __future__ import annotations

import concurrent.futures
import json
import statistics
import sys
import time
import tomllib
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import pytest

from tests.fixtures.tiny_model import WORDS, write_tiny_model
from tests.reliability.test_haproxy import (CFG, CLIENT_TIMEOUT, DEFAULT, FLEET_TOML, HAProxy, figures,
                                            three_replicas)

from tests.reliability.test_haproxy import pytestmark  # noqa: E402,F401 (reliability; skipped without haproxy)

CONVERSATIONS, ROUNDS = 12, 5
SETTINGS = {"parallel": 6, "ctx_size": 8192, "sleep_idle_seconds": 3600}
ANSWER_TOKENS = 48


def first_routing_cfg(directory: Path) -> Path:
    """fleet.toml's haproxy.cfg with routing = "first" (today's), generated as the committed one is."""
    generate = sys.modules["deploy_haproxy_generate"]  # deploy/haproxy/generate.py, loaded by test_haproxy
    fleet = generate.parse_fleet({**tomllib.loads(FLEET_TOML.read_text()), "routing": "first"})
    cfg = directory / "haproxy-first.cfg"
    cfg.write_text(generate.render(fleet))
    return cfg


@pytest.fixture(scope="module")
def tiny_cluster(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("haproxy-cache")
    tiny = write_tiny_model(workdir / "tiny-llama.gguf")
    with three_replicas(workdir, str(tiny), per_replica=lambda name: {"settings": SETTINGS}) as (replicas, proxy):
        proxy.stop()  # each run starts its own HAProxy
        for r in replicas:  # every replica awake: the comparison is about where requests go, not wakes
            assert r.http.post("/v1/completions", json={"prompt": "the", "max_tokens": 1}, timeout=60).status_code == 200
            r.wait_state("ready")
        yield replicas, workdir


def words(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3 + i * i) % len(WORDS)] for i in range(n))


def turn(client: httpx.Client, conversation: int, messages: list[dict], key: str | None,
         answer_tokens: int = ANSWER_TOKENS, ignore_eos: bool = True) -> dict:
    """One streamed chat turn: its status, TTFT, the usage, the answer's text."""
    body = {"model": DEFAULT, "messages": messages, "max_tokens": answer_tokens, "temperature": 0,
            "ignore_eos": ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
    if key is not None:
        body["prompt_cache_key"] = key
    started, first, text, usage = time.perf_counter(), None, [], None
    # The conversation in the query: HAProxy's log line names it beside the server that served it.
    with client.stream("POST", f"/v1/chat/completions?conversation={conversation}", json=body) as response:
        if response.status_code != 200:  # counted by the caller (a lost request), not raised
            response.read()
            return {"status": response.status_code, "body": response.text}
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or []:
                if choice.get("delta", {}).get("content"):
                    first = first or time.perf_counter()
                    text.append(choice["delta"]["content"])
            usage = event.get("usage") or usage
    return {"status": 200, "ttft": (first or time.perf_counter()) - started, "prompt": usage["prompt_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"], "answer": "".join(text)}


def conversation(url: str, label: str, c: int, with_key: bool, system_words: int = 40,
                 answer_tokens: int = ANSWER_TOKENS, ignore_eos: bool = True, before_round=None,
                 timeout: float = CLIENT_TIMEOUT) -> list[dict]:
    """Five rounds of one conversation; before_round(r), when given, runs before round r's turn
    (bench.haproxy_affinity drains a replica there)."""
    # Every conversation opens with its own first message: the key when none is sent.
    messages = [{"role": "system", "content": f"{label} {c} " + words(c, system_words)}]
    key = f"{label}-conversation-{c}" if with_key else None
    done = []
    with httpx.Client(base_url=url, timeout=timeout) as client:
        for r in range(ROUNDS):
            if before_round is not None:
                before_round(r)
            messages.append({"role": "user", "content": words(c * 31 + r, 12)})
            result = turn(client, c, messages, key, answer_tokens, ignore_eos)
            if result["status"] == 200:
                messages.append({"role": "assistant", "content": result["answer"]})
            done.append(result)
    return done


def servers_by_conversation(proxy: HAProxy, since: int) -> dict[int, Counter]:
    found: dict[int, Counter] = defaultdict(Counter)
    for line in proxy.log_path.read_bytes()[since:].decode(errors="replace").splitlines():
        parts = line.split()
        if len(parts) > 10 and parts[2] == "dormouse" and "conversation=" in line:
            c = int(line.split("conversation=")[1].split()[0].split("&")[0])
            found[c][parts[3].split("/")[1].split("-")[0]] += 1  # the replica, whatever its tier line
    return found


def run(replicas, workdir: Path, cfg: Path, label: str, with_key: bool) -> dict:
    proxy = HAProxy(replicas, workdir, cfg=cfg)
    try:
        since = proxy.log_size()
        with concurrent.futures.ThreadPoolExecutor(CONVERSATIONS) as pool:
            results = list(pool.map(lambda c: conversation(proxy.url, label, c, with_key), range(CONVERSATIONS)))
        time.sleep(0.5)  # HAProxy logs a stream when it ends
        where = servers_by_conversation(proxy, since)
    finally:
        proxy.stop()
    statuses = Counter(t["status"] for conv in results for t in conv)
    results = [[t for t in conv if t["status"] == 200] for conv in results]
    later = [t for conv in results for t in conv[1:]]  # the rounds that have a cache to find
    ttfts = sorted(t["ttft"] for conv in results for t in conv)
    return {
        "statuses": dict(statuses),
        "cached_share": round(sum(t["cached"] for t in later) / sum(t["prompt"] for t in later), 3),
        "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
        "ttft_p95_ms": round(1000 * ttfts[int(0.95 * (len(ttfts) - 1))], 1),
        "replicas_per_conversation": sorted(len(w) for w in where.values()),
        "requests_per_replica": dict(sum(where.values(), Counter())),
        "requests_logged": sum(sum(w.values()) for w in where.values()),
    }


def test_affinity_serves_more_of_each_prompt_from_the_cache(tiny_cluster):
    replicas, workdir = tiny_cluster
    today = run(replicas, workdir, first_routing_cfg(workdir), "today", with_key=True)
    keyed = run(replicas, workdir, CFG, "keyed", with_key=True)
    keyless = run(replicas, workdir, CFG, "keyless", with_key=False)
    for name, figures_of in (("today's routing (first)", today), ("affinity, prompt_cache_key", keyed),
                             ("affinity, no key (first message)", keyless)):
        figures(f"{CONVERSATIONS} conversations x {ROUNDS} rounds, 3 replicas: {name}", **figures_of)
    for figures_of in (today, keyed, keyless):
        assert figures_of["statuses"] == {200: CONVERSATIONS * ROUNDS}
        assert figures_of["requests_logged"] == CONVERSATIONS * ROUNDS
    # Every conversation with a key stayed on one replica, and the replicas shared them.
    assert keyed["replicas_per_conversation"] == [1] * CONVERSATIONS
    assert len(keyed["requests_per_replica"]) >= 2
    # Today's routing moved conversations between replicas (what the comparison is about),
    # and affinity served a larger share of the prompts from the cache.
    assert max(today["replicas_per_conversation"]) >= 2
    assert keyed["cached_share"] > today["cached_share"]
    # Without a key the figures are printed, not asserted: the ring gave 8 of these 12 first
    # messages to one replica of 6 slots, so some conversations spill to the next replica of the
    # ring when it is full (the absolute bound), and the share depends on how many.
