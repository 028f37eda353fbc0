"""Images through the projector. The projector is tests/fixtures/projector.py:
random weights shaped for the bundled model, so these tests check the path
(decode, encode, generate, tear down), not what the model says about images."""

import base64

import pytest

from tests.fixtures.projector import png_bytes, write_projector

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
