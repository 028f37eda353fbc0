"""llama-server's stream telemetry on the real engine: return_progress (how far the prompt has been read,
chunk by chunk, before the first token) and timings_per_token (llama.cpp's timings block on every chunk),
on /completion, /v1/chat/completions and /v1/responses. The prompt is longer than a batch (32 tokens here),
so its read takes several chunks; each progress report must come before any text, never go backwards,
and end with the whole prompt read."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.e2e

PROMPT = "the quick brown fox jumps over the lazy dog " * 8  # about 80 tokens: three chunks of 32


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, bundled_model):
    from tests.conftest import DaemonProcess

    tmp = tmp_path_factory.mktemp("telemetry")
    d = DaemonProcess("--model", bundled_model, "--threads", "2", "--ctx-size", "1024", "--parallel", "1",
                      "--batch-size", "32", "--sleep-idle-seconds", "-1", log_path=tmp / "daemon.log")
    d.wait_state("ready", timeout=180)
    yield d
    d.stop()


def stream(d, path: str, body: dict) -> list[dict]:
    with d.http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def check_progress(reports: list[dict]) -> None:
    assert len(reports) >= 3, reports  # the read begins, then one report per chunk of 32
    first, last = reports[0], reports[-1]
    assert first["processed"] == first["cache"] and last["processed"] == last["total"] > 64
    for before, after in zip(reports, reports[1:]):
        assert after["processed"] > before["processed"] and after["total"] == before["total"]
        assert after["cache"] == before["cache"] and after["time_ms"] >= before["time_ms"]


def test_completion_reports_the_prompts_read_then_timings_on_every_token(daemon):
    chunks = stream(daemon, "/completion", {"prompt": PROMPT, "n_predict": 4, "stream": True, "cache_prompt": False,
                                            "return_progress": True, "timings_per_token": True})
    progress = [c for c in chunks if "prompt_progress" in c]
    check_progress([c["prompt_progress"] for c in progress])
    assert chunks[:len(progress)] == progress and all(c["content"] == "" for c in progress)  # all before any text
    first = progress[0]["timings"]
    assert (first["prompt_n"], first["prompt_ms"], first["predicted_n"], first["predicted_ms"]) == (0, 0.0, 0, 0.0)
    read = [c["timings"]["prompt_ms"] for c in progress]
    assert read == sorted(read) and read[-1] > 0
    texts = [c for c in chunks[len(progress):] if not c["stop"]]
    predicted = [c["timings"]["predicted_n"] for c in texts]
    assert predicted == sorted(predicted) and predicted[-1] <= 4 and all(c["timings"]["prompt_n"] > 64 for c in texts)
    assert chunks[-1]["stop"] and chunks[-1]["timings"]["predicted_n"] == 4


def test_without_the_fields_nothing_changes(daemon):
    chunks = stream(daemon, "/completion", {"prompt": PROMPT, "n_predict": 3, "stream": True})
    assert not any("prompt_progress" in c for c in chunks)
    assert [("timings" in c) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    whole = daemon.http.post("/completion", json={"prompt": PROMPT, "n_predict": 3, "return_progress": True})
    assert whole.status_code == 200 and "prompt_progress" not in whole.json()  # a whole answer has no progress


def test_chat_progress_rides_on_the_opening_chunk_and_a_cached_prompt_starts_there(daemon):
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "stream": True,
            "return_progress": True}
    stream(daemon, "/v1/chat/completions", body)  # the prompt is in the slot's cache now
    chunks = stream(daemon, "/v1/chat/completions", body)
    progress = [c for c in chunks if "prompt_progress" in c]
    reports = [c["prompt_progress"] for c in progress]
    assert reports[0]["cache"] > 64 and reports[-1]["processed"] == reports[-1]["total"]
    assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": None} for c in progress)
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert content and chunks.index(content[0]) > chunks.index(progress[-1])


def test_responses_stream_progress_and_timings(daemon):
    with daemon.http.stream("POST", "/v1/responses", json={
            "input": "Responses: " + PROMPT, "max_output_tokens": 4, "stream": True, "return_progress": True,
            "timings_per_token": True}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    progress = [e for e in events if "prompt_progress" in e]
    assert all(e["type"] == "response.in_progress" for e in progress)
    check_progress([e["prompt_progress"] for e in progress])
    # each names the response without echoing the request again (created had it whole)
    created = next(e for e in events if e["type"] == "response.created")["response"]
    assert all(e["response"] == {"id": created["id"], "object": "response", "created_at": created["created_at"],
                                 "status": "in_progress"} for e in progress)
    assert "instructions" in created and "tools" in created
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and all("predicted_per_second" in e["timings"] for e in deltas)
    completed = events[-1]
    assert completed["type"] in ("response.completed", "response.incomplete") and completed["timings"]["predicted_n"]


@pytest.mark.parametrize("field", ["return_progress", "timings_per_token"])
@pytest.mark.parametrize("value", ["yes", 2, [True], {"a": 1}])
def test_the_fields_take_booleans_only(daemon, field, value):
    r = daemon.http.post("/completion", json={"prompt": "x", "n_predict": 1, field: value})
    assert r.status_code == 400 and field in r.json()["error"]["message"]


def test_the_worker_counts_its_decodes_for_llama_servers_counters(daemon):
    from tests.metrics_text import value

    def scrape() -> str:
        return daemon.http.get("/metrics").text

    before = value(scrape(), "dormouse_decodes_total")
    answer = daemon.http.post("/completion", json={"prompt": PROMPT, "n_predict": 5, "cache_prompt": False,
                                                    "ignore_eos": True}).json()  # five tokens, always
    after = scrape()
    # one slot: a decode per prompt chunk of 32, then one per token after the first (its logits end the prompt)
    chunks = -(-answer["tokens_evaluated"] // 32)
    assert value(after, "dormouse_decodes_total") - before == chunks + answer["tokens_predicted"] - 1
    assert value(after, "dormouse_sequence_tokens_max") >= answer["tokens_evaluated"] + answer["tokens_predicted"] - 1
