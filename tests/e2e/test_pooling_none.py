"""pooling = "none" (llama-server's --pooling none) on the bundled model: llama-server's /embeddings
answers every token's vector, not normalized; the routes that answer one vector per input refuse the
model by name. The vectors are the model's own: their mean, normalized, is the mean-pooled embedding
of the same text (a daemon with pooling mean, the same model)."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.e2e

TEXT = "hello hello hello"


def norm(vector: list[float]) -> float:
    return math.sqrt(sum(x * x for x in vector))


def test_per_token_vectors_and_their_mean_is_the_pooled_embedding(tmp_path, bundled_model):
    from tests.conftest import DaemonProcess

    common = ("--model", bundled_model, "--threads", "2", "--ctx-size", "512", "--parallel", "1", "--embeddings",
              "--sleep-idle-seconds", "-1")
    none = DaemonProcess(*common, "--pooling", "none", log_path=tmp_path / "none.log")
    try:
        none.wait_state("ready", timeout=180)
        answer = none.http.post("/embeddings", json={"input": [TEXT, "hi"]})
        assert answer.status_code == 200, answer.text
        first, second = answer.json()
        assert (first["index"], second["index"]) == (0, 1)
        n_tokens = len(none.http.post("/tokenize", json={"content": TEXT, "add_special": True}).json()["tokens"])
        vectors = first["embedding"]
        assert len(vectors) == n_tokens and len(second["embedding"]) < n_tokens
        n_embd = len(vectors[0])
        assert n_embd > 64 and all(len(v) == n_embd for v in vectors)
        assert any(abs(norm(v) - 1) > 1e-3 for v in vectors)  # as computed, not normalized
        # One answer carries at most 4M numbers (a worker message): 20 inputs of ~400 tokens of 640 are more.
        huge = none.http.post("/embeddings", json={"input": ["word " * 400] * 20})
        assert huge.status_code == 400 and "numbers" in huge.json()["error"]["message"], huge.text[:300]
        assert none.http.post("/embeddings", json={"input": "hi"}).status_code == 200  # the worker lives on
        for path, body in (("/v1/embeddings", {"input": TEXT}), ("/api/embed", {"model": "x", "input": TEXT}),
                           ("/api/embeddings", {"model": "x", "prompt": TEXT})):
            refused = none.http.post(path, json=body)
            assert refused.status_code == 400 and "pooling" in refused.text, (path, refused.text)
    finally:
        none.stop()
    mean = DaemonProcess(*common, "--pooling", "mean", log_path=tmp_path / "mean.log")
    try:
        mean.wait_state("ready", timeout=180)
        pooled = mean.http.post("/v1/embeddings", json={"input": TEXT}).json()["data"][0]["embedding"]
    finally:
        mean.stop()
    average = [sum(column) / len(vectors) for column in zip(*vectors)]
    expected = [x / norm(average) for x in average]
    assert max(abs(a - b) for a, b in zip(expected, pooled)) < 1e-4
