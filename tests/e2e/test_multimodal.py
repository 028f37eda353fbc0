"""Images through the projector. The projector is tests/fixtures/projector.py:
random weights shaped for the bundled model, so these tests check the path
(decode, encode, generate, tear down), not what the model says about images."""

import base64
import math
import random

import pytest

from tests.fixtures.projector import png_bytes, write_projector
from tests.metrics_text import value

pytestmark = pytest.mark.e2e


def image_message(data: bytes) -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def test_image_runs_through_the_projector(start_daemon, projector):
    d = start_daemon("--sleep-idle-seconds", "-1", "--mmproj", projector)
    d.wait_state("ready")
    r = d.http.post("/v1/chat/completions", json={"messages": image_message(png_bytes()), "max_tokens": 4,
                                                  "temperature": 0})
    assert r.status_code == 200, r.text
    text_only = d.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "What is this?"}],
                                                          "max_tokens": 4, "temperature": 0}).json()
    # 32x32 in 8x8 patches: 16 image embeddings on top of the text prompt.
    assert r.json()["usage"]["prompt_tokens"] >= text_only["usage"]["prompt_tokens"] + 16
    assert r.json()["usage"]["completion_tokens"] >= 1

    bad = d.http.post("/v1/chat/completions", json={"messages": image_message(b"not an image"), "max_tokens": 4})
    assert bad.status_code == 400 and "cannot be decoded" in bad.json()["error"]["message"]
    not_data = d.http.post("/v1/chat/completions", json={"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.invalid/cat.png"}}]}]})
    assert not_data.status_code == 400 and "data: URL" in not_data.json()["error"]["message"]
    assert d.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_completion_reads_multimodal_data_at_its_markers(start_daemon, projector):
    # llama-server's /completion object prompt: the text's <__media__> markers take the images in order.
    d = start_daemon("--sleep-idle-seconds", "-1", "--mmproj", projector)
    d.wait_state("ready")
    image = base64.b64encode(png_bytes()).decode()
    text = "What is this: <__media__>\n"
    r = d.http.post("/completion", json={"prompt": {"prompt_string": text, "multimodal_data": [image]},
                                         "n_predict": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    plain = d.http.post("/completion", json={"prompt": text, "n_predict": 4, "temperature": 0}).json()
    # 32x32 in 8x8 patches: 16 image embeddings where the marker's own text tokens were.
    assert r.json()["tokens_evaluated"] >= plain["tokens_evaluated"] + 16 - len(tokens_of(d, "<__media__>"))
    as_url = d.http.post("/completion", json={"prompt": {"prompt_string": text, "multimodal_data": [
        "data:image/png;base64," + image]}, "n_predict": 4, "temperature": 0})
    assert as_url.json()["content"] == r.json()["content"]  # the same image, the same greedy answer
    # Two images for one marker: mtmd refuses the pair, named, and the model serves on.
    mismatch = d.http.post("/completion", json={"prompt": {"prompt_string": text, "multimodal_data": [image, image]},
                                                "n_predict": 2})
    assert mismatch.status_code == 400, mismatch.text
    assert "1 <__media__> markers and 2 images" in mismatch.json()["error"]["message"]
    # A prompt that ends with an image has no text token to read the answer on from (llama.cpp would abort
    # the worker): refused, named, and the same worker serves on.
    for ending in ("What is this: <__media__>", "<__media__>", "<__media__><__media__>"):
        images = [image] * ending.count("<__media__>")
        last = d.http.post("/completion", json={"prompt": {"prompt_string": ending, "multimodal_data": images},
                                                "n_predict": 2})
        assert last.status_code == 400 and "ends with an image" in last.json()["error"]["message"], last.text
    # The same through a chat: an assistant turn continued (continue_final_message) that ends with an image.
    continued = d.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
            {"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                                                  + image}}]}],
        "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 2})
    assert continued.status_code == 400 and "ends with an image" in continued.json()["error"]["message"]
    assert not value(d.http.get("/metrics").text, "dormouse_worker_restarts_total")
    broken = d.http.post("/completion", json={"prompt": {"prompt_string": text, "multimodal_data": ["AAAA"]}})
    assert broken.status_code == 400 and "image 1 cannot be decoded" in broken.json()["error"]["message"]
    assert d.http.post("/completion", json={"prompt": "Hi", "n_predict": 2}).status_code == 200
    # Over the slot's context: llama-server's error with the exact count, images' positions included.
    n_ctx = d.props()["default_generation_settings"]["n_ctx"]
    long_text = "word " * n_ctx + "<__media__> end"
    over = d.http.post("/completion", json={"prompt": {"prompt_string": long_text, "multimodal_data": [image]}})
    assert over.status_code == 400, over.text
    error = over.json()["error"]
    assert error["type"] == "exceed_context_size_error" and error["n_ctx"] == n_ctx
    assert error["n_prompt_tokens"] == len(tokens_of(d, "word " * n_ctx, add_special=True)) + 16 + len(
        tokens_of(d, " end")), error

    # The penalties count the text around the image, as llama-server's accept of the prompt does (the
    # image's positions are skipped): at temperature 1 with no truncation the chain's distribution is the
    # model's own shifted by count * frequency (+ presence), the count over the text's tokens in the window.
    rng = random.Random(5)
    words = ["one", "two", "red", "blue", "cat"]
    checked = 0
    for case in range(4):  # bounded by count
        before = " ".join(rng.choice(words) for _ in range(rng.randrange(4, 16))) + " "
        after = " " + " ".join(rng.choice(words) for _ in range(rng.randrange(4, 16)))
        seen = tokens_of(d, before, add_special=True) + tokens_of(d, after)
        window = rng.choice([-1, len(seen) // 2, 3])
        in_window = seen[-window:] if window > 0 else seen
        frequency, presence = round(rng.uniform(0.3, 2.0), 3), round(rng.uniform(-1.0, 1.0), 3)
        sampled = dict(prompt={"prompt_string": before + "<__media__>" + after, "multimodal_data": [image]},
                       n_predict=1, n_probs=20, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=case,
                       repeat_last_n=window)
        shifted = d.http.post("/completion", json={**sampled, "post_sampling_probs": True,
                                                   "frequency_penalty": frequency, "presence_penalty": presence})
        own = d.http.post("/completion", json=sampled)
        assert shifted.status_code == own.status_code == 200, (shifted.text, own.text)
        logprob = {t["id"]: t["logprob"] for t in own.json()["completion_probabilities"][0]["top_logprobs"]}
        shifts = {}
        for t in shifted.json()["completion_probabilities"][0]["top_probs"]:
            if t["id"] in logprob and t["prob"] > 0:
                count = in_window.count(t["id"])
                shifts[t["id"]] = math.log(t["prob"]) - logprob[t["id"]] + count * frequency + (presence if count else 0)
        assert len(shifts) >= 2
        assert max(shifts.values()) - min(shifts.values()) < 1e-3, (before, after, window, shifts)
        checked += any(in_window.count(i) for i in shifts) and any(not in_window.count(i) for i in shifts)
    assert checked >= 2  # cases where a penalized and an unpenalized token were compared


def tokens_of(d, text: str, add_special: bool = False) -> list[int]:
    return d.http.post("/tokenize", json={"content": text, "add_special": add_special}).json()["tokens"]


def test_image_without_projector_is_400(start_daemon):
    d = start_daemon("--sleep-idle-seconds", "-1")
    d.wait_state("ready")
    r = d.http.post("/v1/chat/completions", json={"messages": image_message(png_bytes()), "max_tokens": 4})
    assert r.status_code == 400
    assert "no multimodal projector" in r.json()["error"]["message"]


@pytest.mark.parametrize("drop", [("mm.2.weight", "mm.2.bias"), ("v.position_embd.weight",)])
def test_malformed_projector_fails_clearly_and_daemon_survives(start_daemon, tmp_path, drop):
    broken = write_projector(tmp_path / "broken.gguf", drop=drop)
    d = start_daemon("--mmproj", str(broken))
    health = d.wait_state("failed")
    # mtmd either refuses the file or crashes the worker: both end as a clear error here.
    assert "projector" in health["error"] or "SIG" in health["error"], health
    assert d.proc.poll() is None
    assert d.http.get("/health").status_code == 503


def test_projector_for_another_embedding_width_is_refused(start_daemon, tmp_path):
    wrong = write_projector(tmp_path / "wide.gguf", text_embd=1024)
    d = start_daemon("--mmproj", str(wrong))
    health = d.wait_state("failed")
    assert "projector" in health["error"] or "SIG" in health["error"]
