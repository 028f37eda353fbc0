"""Prompt-cache checkpoints and scopes (issue 26), on the real model.

Gemma 3 keeps a 512-token window in 15 of its 18 layers, and a saved state
holds only that window: it can be extended, never cut back. So the worker
keeps checkpoints of the window where users come back (each prompt's end
before generation, each turn boundary, every N prompt tokens), in the slot,
the RAM tier and the disk tier; a regenerate or an edited last message after
a sleep, an eviction to RAM or a restart restores the best checkpoint at or
below the common prefix. An entry belongs to the cache scope that wrote it
(the named key and the request's cache_salt): nothing crosses scopes.
"""

from __future__ import annotations

import random

import pytest

from tests.e2e.test_cache_answers import words
from tests.metrics_text import value

pytestmark = pytest.mark.e2e


def chat(d, messages, max_tokens=8, salt=None):
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    r = d.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["message"]["content"], out["usage"]["prompt_tokens"], \
        out["usage"]["prompt_tokens_details"]["cached_tokens"]


def sleep(d) -> None:
    assert d.http.post("/sleep").status_code == 200


def test_the_rows_of_the_issue_after_a_sleep_keep_nearly_the_whole_prompt(start_daemon, tmp_path):
    """The issue's table (an ~840-token chat, default settings): the same
    prompt again after a sleep (a regenerate) was 0, the last user message
    edited after a sleep was 0; now each keeps all but what follows the
    checkpoint: the regenerate re-reads its last token, the edit what
    follows the turn boundary."""
    d = start_daemon("--parallel", "1", "--sleep-idle-seconds", "-1", "--state-dir", str(tmp_path / "state"))
    d.wait_state("ready")
    rng = random.Random(826)
    history = [{"role": "user", "content": words(rng, 760)}]
    answer, n1, _ = chat(d, history)
    assert 700 < n1 < 1000
    history += [{"role": "assistant", "content": answer}, {"role": "user", "content": words(rng, 6)}]
    _, n2, cached = chat(d, history)  # the next turn, awake
    assert cached >= n1 - 2

    sleep(d)  # the same prompt again: a regenerate, a retry
    _, n, cached = chat(d, history)
    assert n == n2 and cached == n2 - 1

    sleep(d)  # the last user message edited
    edited = history[:-1] + [{"role": "user", "content": words(rng, 6)}]
    _, n, cached = chat(d, edited)
    assert cached >= 0.9 * n, (cached, n)
    assert cached >= n1 - 2  # at least the turn boundary

    edited2 = history[:-1] + [{"role": "user", "content": words(rng, 7)}]
    _, n, cached = chat(d, edited2)  # edited again while awake: the live slot's checkpoint
    assert cached >= 0.9 * n, (cached, n)

    sleep(d)  # the next turn after a sleep, as before
    history += [{"role": "assistant", "content": "fine"}, {"role": "user", "content": words(rng, 6)}]
    _, n, cached = chat(d, history)
    assert cached >= n2 - 2
    metrics = d.http.get("/metrics").text
    assert value(metrics, "dormouse_prompt_cache_rejected_files_total", reason="corrupt") == 0


def test_after_an_eviction_to_ram_and_a_restart_a_regenerate_and_an_edit_come_back(start_daemon, tmp_path):
    state = str(tmp_path / "state")
    args = ("--parallel", "1", "--ctx-size", "2048", "--sleep-idle-seconds", "-1", "--state-dir", state)
    d = start_daemon(*args)
    d.wait_state("ready")
    rng = random.Random(27)
    history = [{"role": "user", "content": words(rng, 760)}]
    answer, n1, _ = chat(d, history)
    history += [{"role": "assistant", "content": answer}, {"role": "user", "content": words(rng, 6)}]
    _, n2, _ = chat(d, history)

    chat(d, [{"role": "user", "content": "Aside " + words(rng, 30)}])  # the only slot given to another prompt
    _, n, cached = chat(d, history)
    assert cached == n2 - 1  # from the RAM tier
    chat(d, [{"role": "user", "content": "Meanwhile " + words(rng, 30)}])
    _, n, cached = chat(d, history[:-1] + [{"role": "user", "content": words(rng, 6)}])
    assert cached >= 0.9 * n and cached >= n1 - 2
    assert value(d.http.get("/metrics").text, "dormouse_prompt_cache_hits_total", tier="ram") >= 2

    d.stop()
    d = start_daemon(*args)
    d.wait_state("ready")
    _, n, cached = chat(d, history)
    assert cached == n2 - 1  # from disk
    d.stop()
    d = start_daemon(*args)
    d.wait_state("ready")
    _, n, cached = chat(d, history[:-1] + [{"role": "user", "content": words(rng, 6)}])
    assert cached >= 0.9 * n and cached >= n1 - 2
    assert value(d.http.get("/metrics").text, "dormouse_prompt_cache_hits_total", tier="disk") >= 1


def test_a_restart_with_another_parallel_keeps_the_saved_prompts(start_daemon, tmp_path):
    """The files are keyed by what decides their validity (the model file, the
    context per slot, the cache types): another --parallel with the same
    context per slot restores them (they were deleted as corrupt before)."""
    state = str(tmp_path / "state")
    d = start_daemon("--parallel", "1", "--ctx-size", "2048", "--sleep-idle-seconds", "-1", "--state-dir", state)
    d.wait_state("ready")
    rng = random.Random(4)
    history = [{"role": "user", "content": words(rng, 500)}]
    answer, n1, _ = chat(d, history)
    d.stop()
    d = start_daemon("--parallel", "2", "--ctx-size", "4096", "--sleep-idle-seconds", "-1", "--state-dir", state)
    d.wait_state("ready")
    _, n, cached = chat(d, history)
    assert cached == n1 - 1
    metrics = d.http.get("/metrics").text
    assert value(metrics, "dormouse_prompt_cache_rejected_files_total", reason="corrupt") == 0


def test_two_scopes_never_share_a_cache_and_a_probe_learns_nothing(start_daemon, tmp_path):
    d = start_daemon("--parallel", "2", "--ctx-size", "4096", "--sleep-idle-seconds", "-1",
                     "--state-dir", str(tmp_path / "state"))
    d.wait_state("ready")
    rng = random.Random(2)
    prompt = [{"role": "user", "content": words(rng, 400)}]
    _, n, cached = chat(d, prompt, salt="alice")
    assert cached == 0
    _, _, cached = chat(d, prompt, salt="bob")  # the same prompt, another scope: read from 0
    assert cached == 0
    _, _, cached = chat(d, prompt, salt="alice")  # within one scope, as before
    assert cached == n - 1
    sleep(d)
    _, _, cached = chat(d, prompt, salt="carol")  # from disk neither (bob has his own entry now)
    assert cached == 0
    sleep(d)
    _, _, cached = chat(d, prompt, salt="alice")
    assert cached == n - 1

    # An oracle probe: a known header and a secret, guessed digit by digit from other scopes (a
    # scope per guess, as a prober with many keys or salts would), the secret's entry on disk too.
    header = words(rng, 300) + " The secret code is 4"
    chat(d, [{"role": "user", "content": header + "7"}], salt="alice")
    counts = {}
    for digit in "0123456789":
        if digit == "5":
            sleep(d)
        _, _, counts[digit] = chat(d, [{"role": "user", "content": header + digit}], salt="mallory" + digit)
    assert set(counts.values()) == {0}, counts  # the right guess (7) reads as much as every wrong one


# Random conversations with regenerates, edits, sleeps, RAM-tier evictions and restarts,
# compared with fresh reads: tests/e2e/test_cache_answers.py (its Trial has every one of these operations).
