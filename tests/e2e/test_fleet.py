"""The fleet end to end: three real models behind one daemon, a memory budget
that fits any two of them (tests/fixtures/fleet.py computes it from what
`dormouse check-config` predicts), requests through the openai client.

What is checked is the planner's behaviour on real workers: which model
sleeps to make room (the least recently used idle one, and the test predicts
it), that a model serving a stream is never the one put to sleep, that a
model that can never fit is refused before anything is evicted for it, that
/v1/models answers without waking anything, and that loads happen one at a
time. Every test ends with `dormouse_fleet_loads_in_progress_max` == 1.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from tests.conftest import ROOT, DaemonProcess
from tests.fixtures.fleet import (
    fleet_config,
    footprints,
    metric,
    mib,
    props,
    statuses,
    three_models,
)
from tests.fixtures.tiny_model import write_tiny_model

pytestmark = pytest.mark.e2e

# Gemma 3's <eos> and <end_of_turn>: banned, a stream runs to max_tokens and so
# lasts as long as the test needs it to.
NO_END = {"1": -100, "106": -100}
HUGE = {"ctx_size": 32768, "parallel": 1}  # ~576 MiB of KV cache on top of the weights: over any budget here


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"))


@pytest.fixture
def fleet(tmp_path, bundled_model, tiny_model):
    """small (the default, loaded at start), big, tiny, and huge (never fits), within a budget fitting two."""
    models = {**three_models(bundled_model, tiny_model), "huge": {"path": bundled_model, **HUGE}}
    toml, budget, sizes = fleet_config(tmp_path, models)
    print(f"\n[fleet] budget={budget} ({mib(budget)}), predicted bytes={sizes}")
    d = DaemonProcess("--config", str(toml), log_path=tmp_path / "daemon.log")
    client = openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        d.wait_state("ready", timeout=120)
        yield SimpleNamespace(d=d, http=d.http, client=client, budget=budget, sizes=sizes, toml=toml)
        # Whatever the test did, loads never overlapped.
        assert metric(d.http, "dormouse_fleet_loads_in_progress_max") == 1
    finally:
        client.close()
        code = d.stop()
    assert code == 0, d.log()[-3000:]


def ask(f, model: str, chat: bool = False) -> None:
    """One short request, answered by the model it named."""
    if chat:
        response = f.client.chat.completions.create(model=model, max_tokens=4,
                                                    messages=[{"role": "user", "content": "Say hello"}])
        assert isinstance(response.choices[0].message.content, str)
    else:
        response = f.client.completions.create(model=model, prompt="The dormouse", max_tokens=4)
        assert isinstance(response.choices[0].text, str)
    assert response.model == model


def expected_statuses(loaded: set[str]) -> dict[str, str]:
    return {m: "loaded" if m in loaded else "sleeping" for m in ("small", "big", "tiny", "huge")}


def lru(trace: list[str], loaded_at_start: str = "small", capacity: int = 2) -> list[tuple[str, str | None, set[str]]]:
    """The test's own model of the planner, for models of which any two fit:
    (model asked, the model put to sleep for it or None, what is loaded after)."""
    resident = [loaded_at_start]  # least recently used first
    steps = []
    for model in trace:
        victim = None
        if model in resident:
            resident.remove(model)
        elif len(resident) == capacity:
            victim = resident.pop(0)
        resident.append(model)
        steps.append((model, victim, set(resident)))
    return steps


def test_the_tiny_model_is_served_by_the_real_worker(tmp_path, tiny_model):
    """The fixture model really loads in llama.cpp and generates, alone."""
    d = DaemonProcess("--model", tiny_model, "--threads", "2", "--ctx-size", "512", "--parallel", "2",
                      log_path=tmp_path / "daemon.log")
    try:
        d.wait_state("ready")
        with openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            text = client.completions.create(model="x", prompt="the dormouse", max_tokens=8, temperature=0)
            chat = client.chat.completions.create(model="x", max_tokens=8,
                                                  messages=[{"role": "user", "content": "hello"}])
        assert text.usage.completion_tokens >= 1 and chat.usage.prompt_tokens > 1
        info = d.props()["model"]
        assert info["architecture"] == "llama" and info["n_embd"] == 64 and info["n_vocab"] > 256
        footprint = footprints(d.http)[d.props()["id"]]
        print(f"\n[tiny model] predicted={footprint['predicted']} measured={footprint['measured']} bytes")
        assert footprint["measured"] > 0
    finally:
        assert d.stop() == 0


def test_requests_alternate_and_the_least_recently_used_model_sleeps(fleet):
    f = fleet
    # "tiny" after small, big, small: big is put to sleep (least recently used),
    # though small was loaded first: the rule is last use, not load order.
    trace = ["small", "big", "small", "tiny", "big", "tiny", "small", "big", "big", "tiny", "small"]
    evicted = {m: 0 for m in ("small", "big", "tiny")}
    woken = {m: 0 for m in ("small", "big", "tiny")}
    for i, (model, victim, loaded) in enumerate(lru(trace)):
        was_loaded = statuses(f.http)[model] == "loaded"
        ask(f, model, chat=i % 2 == 1)
        woken[model] += not was_loaded
        assert statuses(f.http) == expected_statuses(loaded), (i, model, victim)
        if victim is not None:
            evicted[victim] += 1
            assert props(f.http, victim)["last_sleep"]["reason"] == "evict", (i, model, victim)
        for m, n in evicted.items():
            assert metric(f.http, "dormouse_fleet_evictions_total", model=m) == n, (i, m)
    # Listing the models (done at every step above, and now) woke nothing: the
    # only wakes are the loads the trace asked for.
    for _ in range(5):
        assert statuses(f.http) == expected_statuses(lru(trace)[-1][2])
    for m, n in woken.items():
        assert metric(f.http, "dormouse_wakes_total", model=m, reason="request") == n, m
    assert metric(f.http, "dormouse_wakes_total", model="huge") == 0
    print(f"\n[fleet trace] {len(trace)} requests, wakes={woken}, evictions={evicted}")

    # The test's prediction assumed that the bytes the planner counts after a
    # load (measured) keep "any two fit, three do not" as the predictions did.
    measured = {m: footprints(f.http)[m]["measured"] for m in ("small", "big", "tiny")}
    print(f"[fleet trace] measured bytes={measured}, budget={f.budget}")
    assert sum(measured.values()) > f.budget
    assert all(sum(measured.values()) - measured[m] <= f.budget for m in measured)


def test_cold_requests_for_three_models_at_once_load_one_at_a_time(fleet):
    f = fleet
    assert f.http.post("/models/unload", json={"model": "small"}).status_code == 200
    assert statuses(f.http) == expected_statuses(set())
    seen_loading: list[float] = []
    stop = threading.Event()

    def watch() -> None:  # the gauge, as often as a scrape can read it, while the storm lasts
        with httpx.Client(base_url=f.d.url, timeout=30) as http:
            for _ in range(3000):
                if stop.is_set():
                    return
                seen_loading.append(metric(http, "dormouse_fleet_loads_in_progress"))
                time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda m: ask(f, m), ["small", "big", "tiny"] * 2))
    finally:
        stop.set()
        watcher.join(60)
    assert seen_loading and max(seen_loading) <= 1
    # All three were served with room for two: at least one had to sleep for another.
    assert sum(metric(f.http, "dormouse_fleet_evictions_total", model=m) for m in ("small", "big", "tiny")) >= 1
    assert sorted(statuses(f.http).values()).count("loaded") == 2
    print(f"\n[cold storm] 6 requests for 3 cold models, {len(seen_loading)} scrapes, "
          f"most loads seen at once={max(seen_loading):g}")


class Stream:
    """A streamed completion read on its own thread."""

    def __init__(self, f, model: str, max_tokens: int) -> None:
        self.first = threading.Event()
        self.done = threading.Event()
        self.finish_reason = None
        self.completion_tokens = None
        self.error: BaseException | None = None
        self._args = {"model": model, "prompt": "Count to a thousand: 1, 2, 3,", "max_tokens": max_tokens,
                      "temperature": 0, "logit_bias": NO_END, "stream": True,
                      "stream_options": {"include_usage": True}}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(f.client,))
        self._thread.start()
        assert self.first.wait(120), "the stream never started"

    def _run(self, client) -> None:
        try:
            with client.completions.create(**self._args) as stream:
                for chunk in stream:
                    self.first.set()
                    if self._stop.is_set():
                        return  # the client goes away: the daemon cancels the rest
                    if chunk.choices and chunk.choices[0].finish_reason:
                        self.finish_reason = chunk.choices[0].finish_reason
                    if chunk.usage:
                        self.completion_tokens = chunk.usage.completion_tokens
        except BaseException as exc:  # noqa: BLE001 - reported by join(), on the test's thread
            self.error = exc
        finally:
            self.first.set()
            self.done.set()

    def join(self) -> None:
        """Wait for the whole stream: every token asked for, cut by nothing."""
        self._thread.join(300)
        assert not self._thread.is_alive(), "the stream hung"
        assert self.error is None, self.error
        assert self.finish_reason == "length" and self.completion_tokens == self._args["max_tokens"]

    def leave(self) -> None:
        """Stop reading (the client goes away) once the stream has shown what it was for."""
        self._stop.set()
        self._thread.join(300)
        assert not self._thread.is_alive(), "the stream hung"
        assert self.error is None, self.error


class StatusWatch:
    """Polls /v1/models until stopped; `seen[model]` is every status it read."""

    def __init__(self, url: str) -> None:
        self.seen: dict[str, list[str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url,))
        self._thread.start()

    def _run(self, url: str) -> None:
        with httpx.Client(base_url=url, timeout=30) as http:
            for _ in range(6000):
                if self._stop.is_set():
                    return
                for model, status in statuses(http).items():
                    self.seen.setdefault(model, []).append(status)
                time.sleep(0.05)

    def stop(self) -> dict[str, list[str]]:
        self._stop.set()
        self._thread.join(60)
        return self.seen


def test_a_busy_model_is_never_evicted_while_its_stream_runs(fleet):
    f = fleet
    ask(f, "small")
    ask(f, "big")
    watch = StatusWatch(f.d.url)
    stream = Stream(f, "small", max_tokens=400)
    # tiny: big is the one idle model, it sleeps. Then big: small is now the least
    # recently used (its stream began before tiny's request) but it is busy, so
    # tiny sleeps instead.
    ask(f, "tiny")
    assert props(f.http, "big")["last_sleep"]["reason"] == "evict"
    ask(f, "big")
    still_streaming = not stream.done.is_set()
    stream.leave()  # both swaps happened under it: the rest of its tokens would prove nothing more
    seen = watch.stop()
    assert metric(f.http, "dormouse_fleet_evictions_total", model="small") == 0, "small was put to sleep"
    assert props(f.http, "small")["last_sleep"] is None
    assert set(seen["small"]) == {"loaded"}, seen["small"]
    assert still_streaming, "the stream ended before the other two were served: it proves nothing (make it longer)"
    assert props(f.http, "tiny")["last_sleep"]["reason"] == "evict"
    assert [metric(f.http, "dormouse_fleet_evictions_total", model=m) for m in ("big", "tiny")] == [1, 1]
    assert statuses(f.http) == expected_statuses({"small", "big"})
    print(f"\n[busy] small streamed while tiny and big swapped; {len(seen['small'])} listings saw small loaded")


def test_a_load_that_cannot_fit_waits_for_a_busy_model_to_finish(fleet):
    """Both loaded models serve streams: tiny waits (not a 503, not an eviction of a
    busy model) until big's short stream ends, then big sleeps; small keeps streaming."""
    f = fleet
    ask(f, "small")
    ask(f, "big")
    waits_before = metric(f.http, "dormouse_fleet_load_waits_total", model="tiny")
    long_stream = Stream(f, "small", max_tokens=400)
    short_stream = Stream(f, "big", max_tokens=40)
    ask(f, "tiny")
    still_streaming = not long_stream.done.is_set()
    short_stream.join()  # big served its whole stream: it was not put to sleep under it
    # small was still streaming when tiny was served; the rest of its 400 tokens would prove nothing
    # more (the eviction count below says it was never put to sleep) and cost tens of seconds.
    long_stream.leave()
    # big, not small: small still served its stream when big's ended.
    assert [metric(f.http, "dormouse_fleet_evictions_total", model=m) for m in ("small", "big")] == [0, 1]
    assert still_streaming, "small's stream ended before tiny was served: it proves nothing (make it longer)"
    assert metric(f.http, "dormouse_fleet_load_waits_total", model="tiny") == waits_before + 1
    assert statuses(f.http) == expected_statuses({"small", "tiny"})


def test_a_model_that_can_never_fit_is_refused_with_its_size_and_the_budget(fleet):
    f = fleet
    ask(f, "small")
    ask(f, "big")
    with pytest.raises(openai.APIStatusError) as refused:
        f.client.completions.create(model="huge", prompt="hi", max_tokens=2)
    error = refused.value.response.json()["error"]
    print(f"\n[never fits] {refused.value.status_code} {error}")
    assert refused.value.status_code == 503 and error["code"] == "model_too_large"
    assert mib(f.sizes["huge"]) in error["message"] and mib(f.budget) in error["message"]
    assert "Retry-After" not in refused.value.response.headers  # retrying cannot help
    load = f.http.post("/models/load", json={"model": "huge"})
    assert load.status_code == 503 and load.json()["error"]["code"] == "model_too_large"
    # Refused before anything was put to sleep for it.
    assert statuses(f.http) == expected_statuses({"small", "big"})
    assert sum(metric(f.http, "dormouse_fleet_evictions_total", model=m) for m in ("small", "big", "tiny")) == 0
    assert metric(f.http, "dormouse_fleet_load_refusals_total", model="huge", reason="never_fits") == 2
    # An unknown name is not a size problem.
    with pytest.raises(openai.NotFoundError) as missing:
        f.client.completions.create(model="gpt-5", prompt="hi", max_tokens=2)
    assert missing.value.response.json()["error"]["code"] == "model_not_found"
    # check-config said so before the daemon started.
    checked = subprocess.run([sys.executable, "-m", "daemon", "check-config", "--config", str(f.toml)], cwd=ROOT,
                             capture_output=True, text=True, timeout=120, check=False)
    assert checked.returncode == 2 and "model huge needs" in checked.stderr
