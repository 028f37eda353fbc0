"""Issue 27 item 1: no step longer than one chunk, with a draft model.

A prompt that fills a slot's context arrives while a bystander streams. The draft
reads the slot's history one chunk (batch_size tokens) per engine step, in turn
with the target's prompt chunks (daemon/worker/speculative.py), and the slot
generates without drafts until its draft is within a chunk. So: no worker is
killed as hung, both answers complete, greedy answers are the ones a daemon
without a draft gives, the bystander keeps receiving tokens while the long prompt
is read, and the worker's log says how the draft caught up, in chunks (counted).
A restore of the saved prompt after a sleep makes the draft catch up the same way.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from tests.metrics_text import value

pytestmark = pytest.mark.e2e

BATCH = 64
# One thread: on a shared 2-core machine two llama.cpp threads spin on each other (a 64-token
# step measured 3 s median, 22 s at worst, against 0.7 s and 3.6 s with one).
COMMON = ("--sleep-idle-seconds", "-1", "--ctx-size", "2048", "--parallel", "2", "--batch-size", str(BATCH),
          "--threads", "1")
LONG = 960  # tokens: the slot holds 1024, the answer fills the rest
BYSTANDER = {"prompt": "Write a long story about a lighthouse keeper and her cat.", "max_tokens": 160,
             "temperature": 0, "ignore_eos": True}
CAUGHT_UP = re.compile(r"draft caught up on slot (\d+): (\d+) tokens in (\d+) chunks of at most (\d+)")


def long_prompt(d, n: int) -> list[int]:
    text = " ".join(f"Line {i}: the river passes the mill and the baker sells bread." for i in range(n // 12 + 10))
    tokens = d.http.post("/tokenize", json={"content": text}).json()["tokens"]
    assert len(tokens) >= n
    return tokens[:n]


def complete(d, body: dict) -> dict:
    r = d.http.post("/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, body: dict, first: threading.Event, out: dict) -> None:
    """Stream `body`; out: text, the arrival order of its chunks (perf_counter stamps), finish."""
    text, stamps = [], []
    with httpx.Client(base_url=url, timeout=600) as http, \
            http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["error"] = chunk["error"]
                break
            choice = chunk["choices"][0] if chunk["choices"] else {}
            if choice.get("text"):
                text.append(choice["text"])
                stamps.append(time.perf_counter())
                first.set()
            out["finish"] = choice.get("finish_reason") or out.get("finish")
    out.update(text="".join(text), stamps=stamps)
    first.set()


def catch_ups(d) -> list[tuple[int, int, int, int]]:
    return [tuple(int(x) for x in m.groups()) for m in CAUGHT_UP.finditer(d.log())]


def test_long_prompt_with_a_draft_is_read_in_chunks_beside_a_bystander(start_daemon, bundled_model, tmp_path):
    plain = start_daemon(*COMMON)
    plain.wait_state("ready")
    tokens = long_prompt(plain, LONG)
    long_body = {"prompt": tokens, "max_tokens": 16, "temperature": 0}
    expected_long = complete(plain, long_body)["choices"][0]["text"]
    expected_bystander = complete(plain, BYSTANDER)["choices"][0]["text"]
    plain.stop()

    state = tmp_path / "drafted-state"
    # A liveness bound shorter than the default: a step is at most one chunk (the chunk count
    # below is the proof), and the bound catches any step that is not.
    d = start_daemon(*COMMON, "--model-draft", bundled_model, "--state-dir", str(state),
                     env={"DORMOUSE_WORKER_LIVENESS_TIMEOUT": "30"})
    d.wait_state("ready")
    first, out = threading.Event(), {}
    bystander = threading.Thread(target=stream, args=(d.url, BYSTANDER, first, out))
    bystander.start()
    assert first.wait(300)
    sent = time.perf_counter()
    body = complete(d, long_body)
    answered = time.perf_counter()
    bystander.join(600)

    assert "error" not in out, out
    assert out["finish"] == "length" and out["text"] == expected_bystander  # greedy: as without a draft
    assert body["choices"][0]["text"] == expected_long
    assert body["usage"]["prompt_tokens"] == LONG
    # The bystander was served while the long prompt was read (counted, not timed).
    during = sum(sent < t < answered for t in out["stamps"])
    print(f"\nbystander chunks while the long prompt was read: {during} of {len(out['stamps'])}")
    assert during >= 1
    text = d.http.get("/metrics").text
    assert not value(text, "dormouse_worker_restarts_total")
    assert "worker.hung" not in d.log()

    lines = catch_ups(d)
    print(f"catch-ups: {lines}")
    long_lines = [line for line in lines if line[1] >= LONG - BATCH]
    assert len(long_lines) == 1, lines
    slot, n, chunks, size = long_lines[0]
    assert size == BATCH and n <= chunks * BATCH  # every chunk at most batch_size tokens
    assert chunks >= LONG // BATCH - 1  # ... so many chunks, one per step

    # A restore from disk after a sleep: the target reads only the rest, the draft catches up in chunks.
    assert d.http.post("/sleep").status_code == 200
    # Long enough an answer (ignore_eos) for the draft to catch up before it ends: meanwhile the
    # slot generates without drafts, one token a step, as the draft reads a chunk a step.
    again = complete(d, {**long_body, "prompt": tokens + tokens[-8:], "max_tokens": 40, "ignore_eos": True})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= LONG - BATCH
    lines = catch_ups(d)
    assert len([line for line in lines if line[1] >= LONG - BATCH]) == 2, lines
    assert not value(d.http.get("/metrics").text, "dormouse_worker_restarts_total")


def test_the_drafts_copy_of_a_slot_never_serves_another_scope(start_daemon, bundled_model):
    """The draft's KV of a slot is the scope's that wrote it: a prompt of another key on that
    slot makes the draft read it all again (its reuse would show in timings.prompt_ms), the
    same key's next turn does not. Counted from the worker's catch-up lines."""
    d = start_daemon("--sleep-idle-seconds", "-1", "--ctx-size", "1024", "--parallel", "1", "--batch-size",
                     str(BATCH), "--threads", "1", "--model-draft", bundled_model,
                     env={"DORMOUSE_API_KEYS": "alice:key-a,bob:key-b"})
    d.wait_state("ready")
    text = " ".join(f"Line {i}: the river passes the mill and the baker sells bread." for i in range(40))
    tokens = d.http.post("/tokenize", json={"content": text},
                         headers={"Authorization": "Bearer key-a"}).json()["tokens"][:320]
    assert len(tokens) == 320

    def run(key: str, prompt: list[int]) -> None:
        r = d.http.post("/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=600,
                        json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text

    run("key-a", tokens)
    run("key-a", tokens + tokens[:40])  # the same scope: the draft keeps what it read
    run("key-b", tokens + tokens[:40])  # another scope, the same tokens: the draft reads from 0
    deadline = time.monotonic() + 30
    while len(catch_ups(d)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    read = [n for _, n, _, _ in catch_ups(d)]
    assert read and read[0] >= 320 - BATCH  # alice's first prompt, read in chunks
    assert read[-1] >= 320 - BATCH, read  # bob's: all of it again, none of alice's copy kept
    assert not any(BATCH <= n < 320 - BATCH for n in read), read  # alice's next turn read only what was new
