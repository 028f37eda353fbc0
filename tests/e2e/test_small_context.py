"""A context size that is not a multiple of llama.cpp's padding (256): the slot
llama.cpp gives is larger than the batch it takes, and a prompt between the two
once aborted the worker (GGML_ASSERT n_tokens_all <= n_batch: 503 worker_exited).
It is read in steps the context takes, and answered."""

import pytest

pytestmark = pytest.mark.e2e


def test_a_prompt_between_ctx_size_and_the_padded_slot_is_answered(start_daemon):
    d = start_daemon("--ctx-size", "128", "--parallel", "1", "--sleep-idle-seconds", "-1")
    d.wait_state("ready", timeout=180)
    prompt = "one two three four five six seven eight nine ten " * 18  # about 200 tokens
    answer = d.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert 128 < usage["prompt_tokens"] <= 252, usage  # past ctx_size, inside the padded slot
    pid = d.props()["last_wake"]["worker_pid"] if d.props().get("last_wake") else None
    again = d.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert again.status_code == 200, again.text  # the same worker, still alive
    if pid is not None:
        assert d.props()["last_wake"]["worker_pid"] == pid
