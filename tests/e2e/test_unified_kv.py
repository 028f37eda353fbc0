"""A shared KV pool (kv_unified, llama-server's -kvu), on the real model in a real worker: one slot may
take more than ctx_size / parallel; a full pool first moves idle slots' prompts to the prompt cache's RAM
tier (and they come back from it), then ends the request that started last, with a 503 context_full,
while the others finish; the slots' prompts survive a sleep in the shared pool as in their own streams."""

from __future__ import annotations

import json
import threading

import pytest

from tests.metrics_text import value

pytestmark = pytest.mark.e2e

POOL = ("-kvu", "--parallel", "2", "--sleep-idle-seconds", "-1")


def notes(topic: str, lines: int) -> str:
    return " ".join(f"Line {i}: a short note about {topic}, its keeper and the weather on day {i}." for i in range(lines))


def complete(d, prompt: str, **body) -> dict:
    r = d.http.post("/completion", json={"prompt": prompt, "n_predict": 4, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_one_slot_takes_more_than_its_share_and_an_idle_slot_makes_room_through_the_ram_tier(start_daemon):
    d = start_daemon(*POOL, "--ctx-size", "1024", env={"DORMOUSE_KV_CACHE_MIN_TOKENS": "64"})
    d.wait_state("ready", timeout=180)
    assert d.props()["default_generation_settings"]["n_ctx"] == 1024  # each slot may grow to the whole pool
    mill, orchard = notes("the mill by the river", 36), notes("the orchard behind the school", 36)

    first = complete(d, mill)
    assert first["tokens_evaluated"] > 1024 // 2  # more than a slot's share of a split context
    # The other slot reads another prompt as long: the pool cannot hold both, so the idle slot's
    # prompt goes to the RAM tier and leaves the pool; this request is served, not refused.
    other = complete(d, orchard)
    assert other["tokens_evaluated"] > 1024 // 2 and other["tokens_cached"] == 0
    slots = {s["id"]: s for s in d.http.get("/slots").json()}
    assert sorted(s["n_ctx"] for s in slots.values()) == [1024, 1024]

    again = complete(d, mill)  # the first conversation comes back from RAM, not read again
    assert again["tokens_cached"] >= first["tokens_evaluated"] - 1
    assert again["timings"]["cache_tier"] == "ram"
    metrics = d.http.get("/metrics").text
    assert value(metrics, "dormouse_prompt_cache_hits_total", tier="ram") >= 1


def test_a_full_pool_ends_the_request_that_started_last_and_the_first_finishes(start_daemon):
    d = start_daemon(*POOL, "--ctx-size", "256")
    d.wait_state("ready", timeout=180)
    # Two prompts of 97 tokens with answers of 100 cannot both fit in 256 cells (unless the second began
    # 140 tokens after the first). The first is streamed, and the second sent once the first is
    # generating, so which one started last is known.
    mill, orchard = notes("the mill by the river", 4), notes("the orchard behind the school", 4)
    first_tokens: list[int] = []
    generating = threading.Event()

    def first() -> None:
        with d.http.stream("POST", "/completion", json={"prompt": mill, "n_predict": 100, "ignore_eos": True,
                                                        "stream": True, "temperature": 0}, timeout=300) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if chunk.get("stop"):
                        first_tokens.append(chunk["tokens_predicted"])
                    generating.set()

    streamer = threading.Thread(target=first)
    streamer.start()
    assert generating.wait(120)
    second = d.http.post("/completion", json={"prompt": orchard, "n_predict": 100, "ignore_eos": True,
                                              "temperature": 0}, timeout=300)
    streamer.join(300)
    assert second.status_code == 503, second.text
    error = second.json()["error"]
    assert error["code"] == "context_full" and "context size has been exceeded" in error["message"]
    assert second.headers["Retry-After"] == "1"
    assert first_tokens == [100]  # the first request got every token it asked for
    # The first slot, idle, holds 196 cells: a short prompt on the other slot fits beside it, and its
    # answer does not; as it grows, the idle slot's prompt leaves the pool, and the answer is whole.
    held = {s["id"]: s["n_cached"] for s in d.http.get("/slots").json()}
    (empty,) = [i for i, n in held.items() if n == 0]
    assert max(held.values()) == 97 + 100 - 1  # the last token was drawn, never decoded
    r = d.http.post("/completion", json={"prompt": "Once", "n_predict": 100, "ignore_eos": True, "temperature": 0,
                                         "id_slot": empty}, timeout=300)
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 100, r.text
    held = {s["id"]: s["n_cached"] for s in d.http.get("/slots").json()}
    assert held[empty] >= 100 and held[1 - empty] == 0


def test_the_slots_prompts_survive_a_sleep_in_a_shared_pool(start_daemon):
    d = start_daemon(*POOL, "--ctx-size", "1024", env={"DORMOUSE_KV_CACHE_MIN_TOKENS": "64"})
    d.wait_state("ready", timeout=180)
    mill, orchard = notes("the mill by the river", 14), notes("the orchard behind the school", 14)
    before = [complete(d, mill), complete(d, orchard)]  # one slot each, both in the pool
    assert d.http.post("/sleep").status_code == 200
    d.wait_state("sleeping")
    after = [complete(d, mill), complete(d, orchard)]
    for old, new in zip(before, after):
        assert new["tokens_cached"] >= old["tokens_evaluated"] - 1  # restored into the pool at the wake


def test_an_image_prompt_makes_room_in_a_shared_pool(start_daemon, projector):
    from tests.e2e.test_multimodal import image_message, png_bytes

    d = start_daemon(*POOL, "--ctx-size", "256", "--mmproj", projector)
    d.wait_state("ready", timeout=180)
    long = complete(d, notes("the mill by the river", 10), id_slot=0)  # nearly all of the pool, kept idle
    assert long["tokens_evaluated"] > 256 - 32
    r = d.http.post("/v1/chat/completions", json={"messages": image_message(png_bytes()), "max_tokens": 4,
                                                  "temperature": 0, "id_slot": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] >= 16  # the image's 16 embeddings: more than the pool had free
    held = {s["id"]: s["n_cached"] for s in d.http.get("/slots").json()}
    assert held[0] == 0 and held[1] >= 16  # the idle prompt left the pool for them
