"""Affinity routing (issue 31) on the real HAProxy 2.6, with stand-ins:
deploy/haproxy/haproxy.cfg (routing = "affinity") sends a conversation to the
replica of its key on a consistent-hash ring, with the key read in a
documented order (prompt_cache_key, user, metadata.user_id, X-Session-Id;
with none, the prompt's first block), only a bounded prefix of it hashed,
and no replica past the balance factor of the average load.

The stand-ins (tests/reliability/test_haproxy.py's) answer their name and
run the daemon's own agent, every model awake with free slots, so HAProxy
sees what it sees in front of three idle daemons. The cache figures with real
daemons are in test_haproxy_cache.py."""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter

import httpx

from tests.reliability.test_haproxy import (DEFAULT, REPLICAS, daemon_agents, figures, replica_of, settle,
                                            stand_ins)

from tests.reliability.test_haproxy import pytestmark  # noqa: E402,F401 (reliability; skipped without haproxy)


def awake_everywhere():
    from daemon.http.agent import ReplicaSnapshot

    free = ReplicaSnapshot("ready", 64)
    return {name: replica_of(**{DEFAULT: free}) for name in REPLICAS}


async def replica(client: httpx.AsyncClient, body=None, headers=None, content=None) -> str | int:
    response = await client.post("/v1/completions", json=body, headers=headers, content=content)
    return response.json()["replica"] if response.status_code == 200 else response.status_code


def test_keys_stay_on_their_replica_in_the_documented_order(tmp_path):
    results: dict[str, object] = {}

    async def scenario() -> None:
        async with stand_ins(tmp_path, daemon_agents(awake_everywhere())) as (servers, proxy):
            await settle(servers)
            async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as client:
                # Twelve conversations, five rounds each: each always on one replica.
                seen = {k: Counter() for k in range(12)}
                for _ in range(5):
                    for k in seen:
                        seen[k][await replica(client, {"prompt_cache_key": f"conversation-{k}", "prompt": "hi"})] += 1
                results["replicas per conversation"] = sorted(len(c) for c in seen.values())
                results["conversations per replica"] = dict(Counter(c.most_common(1)[0][0] for c in seen.values()))

                # Two keys that the ring puts on different replicas, to tell the sources apart.
                where = {}
                for i in range(50):
                    where.setdefault(await replica(client, {"prompt_cache_key": f"probe-{i}"}), f"probe-{i}")
                    if len(where) >= 2:
                        break
                (ra, a), (rb, b) = list(where.items())[:2]
                order = {
                    "prompt_cache_key over user": await replica(client, {"prompt_cache_key": a, "user": b}),
                    "user alone": await replica(client, {"user": b}),
                    "user over metadata.user_id": await replica(client, {"user": a, "metadata": {"user_id": b}}),
                    "metadata.user_id": await replica(client, {"metadata": {"user_id": b}}),
                    "metadata.user_id over the header": await replica(
                        client, {"metadata": {"user_id": a}}, {"X-Session-Id": b}),
                    "the header alone": await replica(client, {"prompt": "x"}, {"X-Session-Id": b}),
                    "an empty key is no key": await replica(client, {"prompt_cache_key": "", "user": b}),
                }
                results["order"] = order
                results["expected"] = {"a": ra, "b": rb}

                # No key: the first block (1024 bytes). One system prompt, twelve users: one replica.
                system = "You are a helpful assistant. " * 40  # 1160 bytes
                shared = Counter()
                for k in range(12):
                    shared[await replica(client, {"messages": [{"role": "system", "content": system},
                                                              {"role": "user", "content": f"question {k}"}]})] += 1
                results["one system prompt"] = dict(shared)
                parts = Counter()
                for k in range(6):  # Anthropic's system blocks, and a completion's prompt
                    parts[await replica(client, {"system": [{"type": "text", "text": system}],
                                                 "messages": [{"role": "user", "content": f"q{k}"}]})] += 1
                    parts[await replica(client, {"prompt": system + f" question {k}"})] += 1
                results["system blocks and prompts"] = dict(parts)
    asyncio.run(scenario())
    figures("affinity keys (3 stand-ins awake)", **{k.replace(" ", "_"): v for k, v in results.items()})
    assert results["replicas per conversation"] == [1] * 12  # every conversation on one replica, 5 rounds
    assert len(results["conversations per replica"]) >= 2  # and the conversations are spread
    a, b = results["expected"]["a"], results["expected"]["b"]
    assert a != b
    assert results["order"] == {"prompt_cache_key over user": a, "user alone": b, "user over metadata.user_id": a,
                                "metadata.user_id": b, "metadata.user_id over the header": a,
                                "the header alone": b, "an empty key is no key": b}
    # A shared system prompt lands in one place; its first 1024 bytes are the key,
    # so Anthropic's system blocks and a completion's prompt that start with it land there too.
    (place,) = results["one system prompt"]
    assert results["system blocks and prompts"] == {place: 12}


def test_hostile_keys_are_bounded_and_routed(tmp_path):
    """A key of 1 MB, keys alike in their first 256 bytes, keys of the wrong
    type, a body that is no JSON, 3,000 distinct keys: every request is
    answered, only a bounded prefix of a key decides its replica, and the
    ring holds no state per key (HAProxy keeps none: a million keys cost what
    three thousand do; the spread is the figure)."""
    results: dict[str, object] = {}

    async def scenario() -> None:
        async with stand_ins(tmp_path, daemon_agents(awake_everywhere())) as (servers, proxy):
            await settle(servers)
            async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as client:
                head = "k" * 256
                results["alike in 256 bytes"] = {await replica(client, {"prompt_cache_key": head + tail, "prompt": "x"})
                                                 for tail in ("", "a", "b" * 1000, "c" * 100_000)}
                huge = json.dumps({"prompt_cache_key": "k" * 2**20, "prompt": "x"})  # past tune.bufsize: not read
                results["1 MB key"] = await replica(client, content=huge.encode(),
                                                    headers={"Content-Type": "application/json"})
                results["1 MB key and a session header"] = (
                    await replica(client, content=huge.encode(),
                                  headers={"Content-Type": "application/json", "X-Session-Id": "s-1"}),
                    await replica(client, {"prompt_cache_key": "s-1"}))
                wrong = [{"prompt_cache_key": {"a": 1}}, {"prompt_cache_key": [1, 2]}, {"prompt_cache_key": None},
                         {"prompt_cache_key": True}, {"prompt_cache_key": -1}, {"prompt_cache_key": 1e308},
                         {"user": {"nested": "x"}}, {"metadata": "not an object"}, {"messages": "not a list"},
                         {"prompt": [1, 2, 3]}]
                results["wrong types"] = [await replica(client, body) for body in wrong]
                results["not JSON"] = await replica(client, content=b"\xff\xfe{not json",
                                                    headers={"Content-Type": "text/plain"})
                spread = Counter()
                for start in range(0, 3000, 100):
                    batch = await asyncio.gather(*(replica(client, {"prompt_cache_key": f"user-{k}"})
                                                   for k in range(start, start + 100)))
                    spread.update(batch)
                results["3000 keys"] = dict(spread)
    asyncio.run(scenario())
    figures("hostile keys", **{k.replace(" ", "_"): v for k, v in results.items()})
    assert len(results["alike in 256 bytes"]) == 1  # only the first 256 bytes are hashed
    assert results["1 MB key"] in REPLICAS  # answered; routed as a request with no key
    routed, by_key = results["1 MB key and a session header"]
    assert routed == by_key  # the header, read when the body is too large
    assert all(r in REPLICAS for r in results["wrong types"]), results["wrong types"]
    assert results["not JSON"] in REPLICAS
    spread = results["3000 keys"]
    assert sum(spread.values()) == 3000 and set(spread) == set(REPLICAS)
    # A ring of 3 servers of 1,600 points each (weight 100): each within 15% of its share (1000).
    assert all(850 <= n <= 1150 for n in spread.values()), spread


def test_a_hot_key_spills_to_the_next_replica_of_the_ring(tmp_path):
    """The two bounds of a key's replica. Its replica full (no free slot, its
    agent says "up 0%"): the key's requests go to one other replica, the next
    of the ring, and come back when it has a slot again. Every replica full:
    the overflow backend queues by the same ring, and one key's 30 requests at
    once (each held 0.5 s) spill past the balance factor (150% of the average
    in flight) instead of queueing on one replica."""
    from daemon.http.agent import ReplicaSnapshot

    free, full = ReplicaSnapshot("ready", 64), ReplicaSnapshot("ready", 0)
    replicas = awake_everywhere()
    results: dict[str, object] = {}

    def set_states(**states) -> None:
        replicas.update({name: replica_of(**{DEFAULT: states.get(name, free)}) for name in REPLICAS})

    async def scenario() -> None:
        async with stand_ins(tmp_path, daemon_agents(replicas), delay=0.5) as (servers, proxy):
            await settle(servers)
            async with httpx.AsyncClient(base_url=proxy.url, timeout=60,
                                         limits=httpx.Limits(max_connections=100)) as client:
                async def hot(n: int) -> Counter:
                    return Counter([await replica(client, {"prompt_cache_key": "hot"}) for _ in range(n)])

                results["alone"] = dict(await hot(3))
                (home,) = results["alone"]
                set_states(**{home: full})
                await settle(servers)
                results["its replica full"] = dict(await hot(4))
                set_states()
                await settle(servers)
                results["a free slot again"] = dict(await hot(3))
                set_states(**{name: full for name in REPLICAS})
                await settle(servers)
                results["all full, 30 at once"] = dict(Counter(await asyncio.gather(
                    *(replica(client, {"prompt_cache_key": "hot"}) for _ in range(30)))))
    asyncio.run(scenario())
    figures("one hot key", **{k.replace(" ", "_").replace(",", ""): v for k, v in results.items()})
    (home,) = results["alone"]
    (spill,) = results["its replica full"]  # one other replica, the same each time
    assert spill != home
    assert results["a free slot again"] == {home: 3}  # back where its cache is
    burst = results["all full, 30 at once"]
    assert sum(burst.values()) == 30 and len(burst) >= 2  # it spilled
    # HAProxy's bound: fewer than (in flight + 1) x 150% / 3 on the key's replica.
    assert burst.get(home, 0) <= math.ceil(31 * 1.5 / 3), burst
    assert burst.get(home, 0) == max(burst.values())  # and its own replica still took the most
