"""A shared KV pool (kv_unified, llama-server's -kvu), on the real model in a real worker: one slot may
take more than ctx_size / parallel; a full pool first moves idle slots' prompts to the prompt cache's RAM
tier (and they come back from it), then ends the request that started last, with a 503 context_full,
while the others finish; the slots' prompts survive a sleep in the shared pool as in their own streams."""

from __future__ import annotations

import json
import threading
import time

import httpx
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


def test_a_restore_that_finds_the_pool_held_by_busy_slots_is_a_miss_and_its_file_stays(start_daemon):
    d = start_daemon(*POOL, "--ctx-size", "256",
                     env={"DORMOUSE_KV_CACHE_MIN_TOKENS": "64", "DORMOUSE_PROMPT_CACHE_RAM_BYTES": "0"})
    d.wait_state("ready", timeout=180)
    mill, orchard = notes("the mill by the river", 4), notes("the orchard behind the school", 4)
    complete(d, mill, n_predict=1, id_slot=0)
    complete(d, orchard, n_predict=1, id_slot=0)  # the mill's prompt goes to disk (no RAM tier)
    held = threading.Event()

    def generate() -> None:  # slot 1 grows to 190 cells and more: the mill's 97 no longer fit beside it
        with d.http.stream("POST", "/completion", json={"prompt": "Once", "n_predict": 250, "ignore_eos": True,
                                                        "stream": True, "temperature": 0, "id_slot": 1},
                           timeout=300) as r:
            for n, line in enumerate(line for line in r.iter_lines() if line.startswith("data: ")):
                if n == 190:
                    held.set()

    generator = threading.Thread(target=generate)
    generator.start()
    assert held.wait(120)
    during = d.http.post("/completion", json={"prompt": mill, "n_predict": 1, "id_slot": 0}, timeout=120)
    generator.join(300)
    assert during.status_code == 503 and during.json()["error"]["code"] == "context_full", during.text
    metrics = d.http.get("/metrics").text
    assert value(metrics, "dormouse_prompt_cache_rejected_files_total", reason="corrupt") == 0
    after = complete(d, mill, n_predict=1, id_slot=0)  # the file was kept: it restores once there is room
    assert after["tokens_cached"] >= 64 and after["timings"]["cache_tier"] == "disk"


def test_a_draft_model_in_a_shared_pool_ends_one_request_and_the_worker_serves_on(start_daemon, bundled_model):
    d = start_daemon(*POOL, "--ctx-size", "256", "--model-draft", bundled_model)
    d.wait_state("ready", timeout=180)
    # The older request on slot 0, which the worker speculates for first in each step: when its verify
    # found the pool full, the newer request (slot 1) was ended, and the same step went on to speculate
    # for it, which took the worker down. Two answers of 200 cannot both fit in 256 cells.
    ended = 0
    for first, second in [("Once upon a time there", "The river"), ("Once upon a time", "The river flows")]:
        results: dict[str, httpx.Response] = {}

        def run(name: str, prompt: str, slot: int) -> None:
            results[name] = d.http.post("/completion", json={"prompt": prompt, "n_predict": 200, "ignore_eos": True,
                                                             "temperature": 0, "cache_prompt": False,
                                                             "id_slot": slot}, timeout=300)

        older = threading.Thread(target=run, args=("first", first, 0))
        older.start()
        for _ in range(400):  # the second once the first is generating
            if d.http.get("/slots").json()[0]["state"] == "generating":
                break
            time.sleep(0.02)
        run("second", second, 1)
        older.join(300)
        for r in results.values():
            assert r.status_code in (200, 503), r.text
            if r.status_code == 200:
                assert r.json()["tokens_predicted"] == 200
            else:
                assert r.json()["error"]["code"] == "context_full"
                ended += 1
        assert d.http.get("/health").json()["state"] == "ready"  # the worker lives on
    assert ended >= 1  # the pool did fill
    assert complete(d, "The river flows", n_predict=8)["tokens_predicted"] == 8


def test_one_requests_choices_that_fill_the_pool_end_with_length(start_daemon):
    d = start_daemon(*POOL, "--ctx-size", "256")
    d.wait_state("ready", timeout=180)
    r = d.http.post("/v1/completions", json={"prompt": "Once upon a time", "n": 2, "max_tokens": 200,
                                             "ignore_eos": True, "temperature": 1}, timeout=300)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["finish_reason"] for c in choices] == ["length", "length"]
    assert r.json()["usage"]["completion_tokens"] < 2 * 200  # the pool cut one of them short
    held = [s["n_cached"] for s in d.http.get("/slots").json()]
    assert sum(held) <= 256 and min(held) == 0  # the cut choice's cells were given back, and /slots says so
