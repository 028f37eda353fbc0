"""Speculative decoding with a draft model, and memory accounting across
sleep/wake cycles. The draft is the bundled model itself (same vocabulary),
so output with and without it can be compared token for token: the target
verifies drafted tokens in batches, whose logits llama.cpp's CPU kernels
round a little otherwise than one token's, so the answers agree up to a
near-tie (greedy) or a draw within rounding of a boundary (seeded sampling),
as tests/answer_match.py compares them."""

import concurrent.futures

import psutil
import pytest

from tests.answer_match import match_sampled_until_fork, match_until_tie
from tests.e2e.test_walking_daemon import metric
from tests.soak import rounds

pytestmark = pytest.mark.e2e

PROMPTS = ["The sky is", "Once upon a time", "My favourite animal is", "1, 2, 3,", "I believe the meaning of life is"]
# As the prompt cache's property test (tests/e2e/test_cache_answers.py): the same rounding.
LOGPROB_TOLERANCE, TIE_MARGIN = 1.5, 1.0


def outputs(d, **extra):
    """Each prompt's answer: /completion's tokens with their 5 likeliest (the bits of the logits)."""
    def one(prompt):
        r = d.http.post("/completion", json={"prompt": prompt, "n_predict": 32, "temperature": 0, "n_probs": 5,
                                             "cache_prompt": False, **extra})
        assert r.status_code == 200, r.text
        return r.json()["completion_probabilities"]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, PROMPTS))


def test_output_with_a_draft_is_the_output_without_it_up_to_rounding(start_daemon, bundled_model):
    plain = start_daemon("--sleep-idle-seconds", "-1")
    plain.wait_state("ready")
    expected = outputs(plain)
    seeded = outputs(plain, temperature=0.2, top_k=5, seed=4242)
    plain.stop()

    drafted = start_daemon("--sleep-idle-seconds", "-1", "--model-draft", bundled_model, "--draft-max", "8",
                           "--draft-p-min", "0.5")
    drafted.wait_state("ready")
    for got, fresh in zip(outputs(drafted), expected):
        match_until_tie(got, fresh, TIE_MARGIN, LOGPROB_TOLERANCE)
    # Sampling consumes the random draws in the same order: a fork only where rounding can move a boundary.
    for got, fresh in zip(outputs(drafted, temperature=0.2, top_k=5, seed=4242), seeded):
        match_sampled_until_fork(got, fresh, LOGPROB_TOLERANCE)
    assert all(len(answer) == 32 for answer in expected + seeded)  # whole answers were compared
    drafted_tokens = metric(drafted, "dormouse_speculative_draft_tokens_total")
    accepted = metric(drafted, "dormouse_speculative_accepted_tokens_total")
    # A model mostly agrees with itself; not always, since the draft context decodes
    # the history in other batch shapes than the target (near-ties flip).
    assert drafted_tokens > 0 and drafted_tokens * 0.5 < accepted <= drafted_tokens
    phases = {ph["name"] for ph in drafted.props()["last_wake"]["phases"]}
    assert {"draft_model", "draft_context"} <= phases


def test_sleep_report_lists_six_steps_with_draft_and_projector(start_daemon, bundled_model, projector):
    d = start_daemon("--sleep-idle-seconds", "-1", "--model-draft", bundled_model, "--mmproj", projector)
    d.wait_state("ready")
    body = d.http.post("/sleep").json()
    steps = body["last_sleep"]["phases"]
    assert [s["name"] for s in steps] == ["kv_save", "draft_context", "draft_model", "context", "model", "mmproj",
                                          "backend"]
    by_name = {s["name"]: s for s in steps}
    assert by_name["kv_save"]["skipped"]  # nothing was cached: no prompt to save
    for name in ("draft_context", "draft_model", "context", "model", "mmproj"):
        assert not by_name[name]["skipped"] and by_name[name]["freed_bytes"] > 0 and by_name[name]["seconds"] >= 0
    assert not by_name["backend"]["skipped"]
    assert body["last_sleep"]["memory_returned"]["process_gone"] is True


CYCLES = rounds(8, 12)


def test_sleep_wake_cycles_with_draft_and_projector_keep_daemon_rss_and_fds_flat(start_daemon, bundled_model, projector):
    d = start_daemon("--sleep-idle-seconds", "-1", "--model-draft", bundled_model, "--mmproj", projector)
    d.wait_state("ready")
    daemon = psutil.Process(d.pid)
    samples = []
    # tests/reliability/test_wake_drift.py runs 100 cycles of the draft alone; these add the projector.
    for cycle in range(CYCLES):
        assert d.http.post("/sleep").status_code == 200
        r = d.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
        assert r.status_code == 200
        if cycle in (2, CYCLES - 1):
            samples.append((daemon.memory_info().rss, daemon.num_fds()))
    (rss_a, fds_a), (rss_b, fds_b) = samples
    print(f"\n[{CYCLES} cycles] daemon rss MiB {rss_a >> 20} -> {rss_b >> 20}, fds {fds_a} -> {fds_b}")
    assert rss_b <= rss_a * 1.05
    assert fds_b <= fds_a * 1.05


def test_device_memory_is_probed_through_ggml(start_daemon):
    d = start_daemon("--sleep-idle-seconds", "-1")
    d.wait_state("ready")
    devices = d.props()["model"]["devices"]
    assert devices and devices[0]["type"] == "cpu" and devices[0]["total"] >= devices[0]["free"] > 0
    sleep = d.http.post("/sleep").json()["last_sleep"]
    assert sleep["devices_before"] and sleep["devices_after_teardown"]
    assert sleep["devices_before"][0]["name"] == devices[0]["name"]
