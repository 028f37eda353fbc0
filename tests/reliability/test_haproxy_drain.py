"""A replica drained mid-run behind HAProxy (issue 31): three real daemons
(the tiny test model in real workers) with their own state_dir and one
shared_cache_dir, twelve conversations with a prompt_cache_key, five rounds.
After round 2 (the conversations between turns), the replica that holds the
most conversations is stopped with SIGTERM, as a rolling restart or a
scale-down does: its agent drains, it finishes what it serves and saves its
prompt caches, to its own disk and to the shared directory. Its
conversations' next turns go to the next replicas of the ring, which
restore them from the shared tier; no request is lost.

The answers are 2 tokens: the tiny model's random tokens do not come back
the same when the next turn's template tokenizes their text, so a turn's
cached prefix ends where the previous answer starts (test_shared_cache.py)."""

from __future__ import annotations

import concurrent.futures
import statistics
import threading
import time

import httpx

from tests.fixtures.tiny_model import write_tiny_model
from tests.reliability.test_haproxy import CFG, CLIENT_TIMEOUT, DEFAULT, HAProxy, figures, three_replicas
from tests.reliability.test_haproxy_cache import servers_by_conversation, words

from tests.reliability.test_haproxy import pytestmark  # noqa: E402,F401 (reliability; skipped without haproxy)

CONVERSATIONS, ROUNDS, DRAIN_AFTER = 12, 5, 2


def turn(client: httpx.Client, c: int, messages: list[dict]) -> dict:
    r = client.post(f"/v1/chat/completions?conversation={c}", json={
        "model": DEFAULT, "messages": messages, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
        "prompt_cache_key": f"drain-conversation-{c}"})
    if r.status_code != 200:
        return {"status": r.status_code}
    body = r.json()
    return {"status": 200, "prompt": body["usage"]["prompt_tokens"],
            "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"],
            "message": body["choices"][0]["message"]}


def test_a_drained_replicas_conversations_restore_from_the_shared_tier(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    tiny = write_tiny_model(tmp_path / "tiny-llama.gguf")
    settings = {"parallel": 6, "ctx_size": 8192, "sleep_idle_seconds": 3600, "shared_cache_dir": str(shared),
                "kv_cache_min_tokens": 16}
    with three_replicas(tmp_path, str(tiny), per_replica=lambda name: {"settings": settings}) as (replicas, proxy):
        for r in replicas:  # all awake: the ring has the three
            assert r.http.post("/v1/completions", json={"prompt": "the", "max_tokens": 1}, timeout=60).status_code == 200
        proxy.stop()
        proxy = HAProxy(replicas, tmp_path, cfg=CFG)
        since = proxy.log_size()
        between = threading.Barrier(CONVERSATIONS + 1)
        drained: dict[str, object] = {}

        def conversation(c: int) -> list[dict]:
            messages = [{"role": "system", "content": f"drain {c} " + words(c, 120)}]
            done = []
            with httpx.Client(base_url=proxy.url, timeout=CLIENT_TIMEOUT) as client:
                for r in range(ROUNDS):
                    if r == DRAIN_AFTER:
                        between.wait(120)  # between turns: the drain happens here
                        between.wait(120)
                    messages.append({"role": "user", "content": words(c * 31 + r, 6)})
                    result = turn(client, c, messages)
                    done.append(result)
                    if result["status"] == 200:
                        messages.append(result["message"])
            return done

        try:
            with concurrent.futures.ThreadPoolExecutor(CONVERSATIONS) as pool:
                running = [pool.submit(conversation, c) for c in range(CONVERSATIONS)]
                between.wait(120)
                time.sleep(0.5)  # HAProxy's log lines of round 2
                before = servers_by_conversation(proxy, since)
                load = {}
                for c, where in before.items():
                    (home,) = where  # affinity: one replica each so far
                    load[home] = load.get(home, 0) + 1
                victim_name = max(load, key=load.get)
                victim = next(r for r in replicas if r.name == victim_name)
                moved = sorted(c for c, where in before.items() if victim_name in where)
                started = time.monotonic()
                drained.update(replica=victim_name, exit_code=victim.stop(timeout=60),
                               stop_seconds=round(time.monotonic() - started, 1))
                proxy.wait_usable({f"model.{DEFAULT}/{r.name}" for r in replicas if r is not victim}
                                  | {f"overflow.{DEFAULT}/{r.name}" for r in replicas if r is not victim})
                between.wait(120)
                results = [f.result() for f in running]
            time.sleep(0.5)
            after = servers_by_conversation(proxy, since)
            survivors = [r for r in replicas if r is not victim]
            shared_tokens = {r.name: r.metric("dormouse_prompt_cache_disk_tokens_total", model=DEFAULT, origin="shared")
                             for r in survivors}
        finally:
            proxy.stop()
    statuses = [t["status"] for conv in results for t in conv]
    first_after = [results[c][DRAIN_AFTER] for c in moved]
    shares = [t["cached"] / t["prompt"] for t in first_after if t["status"] == 200]
    stayed = [results[c][DRAIN_AFTER] for c in range(CONVERSATIONS) if c not in moved]
    figures("a replica drained between rounds 2 and 3", conversations_per_replica=load, **drained,
            moved=len(moved), moved_cached_share_median=round(statistics.median(shares), 3),
            moved_cached_share_min=round(min(shares), 3),
            stayed_cached_share_median=round(statistics.median(t["cached"] / t["prompt"] for t in stayed), 3),
            shared_tokens_restored=shared_tokens, requests={s: statuses.count(s) for s in set(statuses)},
            replicas_per_conversation=sorted(len(w) for w in after.values()))
    assert statuses == [200] * CONVERSATIONS * ROUNDS  # 0 requests lost
    assert drained["exit_code"] == 0
    # Each of them: its first rounds on the drained replica, none after, the rest elsewhere. Usually on
    # one other replica (its next on the ring); under a loaded machine the turns overlap longer, the
    # next replica's 6 slots fill (5 of its own + the moved ones) and a turn spills to the replica after
    # (the absolute bound, test_haproxy_affinity.py): seen once at load average 11, on both others.
    assert all(after[c][victim_name] == DRAIN_AFTER and len(after[c]) >= 2 for c in moved), after
    # Its conversations' next turns elsewhere came from the shared tier: the issue's goal, 80% of the prompt.
    assert moved and min(shares) >= 0.8, shares
    assert sum(shared_tokens.values()) >= sum(t["cached"] for t in first_after)
