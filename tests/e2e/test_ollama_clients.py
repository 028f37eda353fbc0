"""Issue 30's client and request items on a real daemon (the bundled model in
real workers), through the clients that send them:

- `curl -d` (a form Content-Type) and LiteLLM's async `ollama/` and
  `ollama_chat/` calls (application/octet-stream) get their answers from
  /api/chat and /api/generate; with an Origin the 415 stays;
- /api/embed cuts an input longer than the model reads at its end (Ollama's
  default truncate), and refuses it with truncate: false;
- /api/pull: a served model is success at once, a repository is fetched from
  the stand-in hub (tests/fixtures/fake_hub.py) with Ollama's progress lines;
- an unknown field (`max_token`) is answered as before and named in the log;
- a prompt longer than a slot is refused with what to change (ctx_size,
  parallel)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list: nothing is reachable

import litellm  # noqa: E402
import ollama  # noqa: E402
import pytest  # noqa: E402

from tests.fixtures.fake_hub import FakeHub  # noqa: E402
from tests.fixtures.fleet import write_toml  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

REPO = "test-org/tiny-GGUF"
# The embed model's context: one slot. llama.cpp pads it to 256 but decodes at most the 128 asked for at
# once, which is what one input may hold (an input of 129..256 tokens used to abort the worker).
EMBED_CTX = 128
CHAT_CTX, CHAT_PARALLEL = 512, 2  # 256 tokens a slot
SENTENCE = "The dormouse sleeps in the teapot while the hatter pours the tea. "


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    from tests.fixtures.tiny_model import write_tiny_model

    tiny = write_tiny_model(tmp_path_factory.mktemp("gguf") / "tiny.gguf").read_bytes()
    with FakeHub() as hub:
        hub.add(REPO, {"README.md": b"# tiny", "tiny-Q4_K_M.gguf": tiny, "tiny-Q8_0.gguf": tiny})
        yield hub


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, bundled_model, hub):
    from tests.conftest import DaemonProcess

    tmp = tmp_path_factory.mktemp("clients")
    toml = write_toml(tmp / "fleet.toml", {
        "chat": {"path": bundled_model, "parallel": CHAT_PARALLEL, "ctx_size": CHAT_CTX},
        "embed": {"path": bundled_model, "embeddings": True, "parallel": 1, "ctx_size": EMBED_CTX}},
        threads=2, sleep_idle_seconds=300, state_dir=str(tmp / "state"))
    d = DaemonProcess("--config", str(toml), log_path=tmp / "daemon.log",
                      env={"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp / "hf")})
    d.wait_state("ready", timeout=240)
    d.hf_home = tmp / "hf"
    yield d
    d.stop()


@pytest.fixture
def client(daemon):
    return ollama.Client(host=daemon.url, timeout=300)


def log_events(daemon, event: str) -> list[dict]:
    out = []
    for line in daemon.log().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("event") == event:
            out.append(entry)
    return out


ASK = [{"role": "user", "content": "Say hi."}]


# -- 1. the body types of Ollama's clients ---------------------------------------------------

def test_curl_d_as_ollamas_docs_show_it(daemon):
    for path, body in (("/api/chat", {"model": "chat", "messages": ASK, "stream": False,
                                      "options": {"num_predict": 4}}),
                       ("/api/generate", {"model": "chat", "prompt": "The dormouse", "stream": False,
                                          "options": {"num_predict": 4}})):
        out = subprocess.run(["curl", "-sS", "-w", "\n%{http_code}", "-d", json.dumps(body), daemon.url + path],
                             capture_output=True, text=True, timeout=300, check=True).stdout
        text, status = out.rsplit("\n", 1)
        assert status == "200", text
        answer = json.loads(text)
        assert answer["done"] is True and 1 <= answer["eval_count"] <= 4
    # curl's form type declared by a page (Origin): refused as before, before any model runs
    refused = daemon.http.post("/api/chat", content=json.dumps({"model": "chat", "messages": ASK}),
                               headers={"Content-Type": "application/x-www-form-urlencoded", "Origin": daemon.url})
    assert refused.status_code == 415 and "application/x-www-form-urlencoded" in refused.json()["error"]
    # curl -d with form fields, not JSON: a 400 that says so
    form = daemon.http.post("/api/generate", content=b"model=chat&prompt=hi",
                            headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert form.status_code == 400 and "not valid JSON" in form.json()["error"]


def test_litellm_async_ollama_providers(daemon):
    async def both():
        return await asyncio.gather(*(litellm.acompletion(model=f"{provider}/chat", api_base=daemon.url,
                                                          messages=ASK, max_tokens=4, temperature=0)
                                      for provider in ("ollama", "ollama_chat")))

    for answer in asyncio.run(both()):
        assert answer.choices[0].message.content and answer.usage.completion_tokens <= 4
    octet = daemon.http.post("/api/generate", content=json.dumps({"model": "chat", "prompt": "x"}),
                             headers={"Content-Type": "application/octet-stream", "Origin": daemon.url})
    assert octet.status_code == 415


# -- 2. /api/embed's truncate ----------------------------------------------------------------

def _cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))  # the vectors are normalized


def test_embed_cuts_a_long_input_at_its_end_unless_truncate_is_false(daemon):
    long = SENTENCE * 40  # ~600 tokens against 128
    inputs = [long + "Cats.", long + "Tax law and accounting.", "Tax law and accounting."]
    cut = daemon.http.post("/api/embed", json={"model": "embed", "input": inputs})  # Ollama's default: truncate
    assert cut.status_code == 200, cut.text
    head_cats, head_tax, short = cut.json()["embeddings"]
    # Cut at the end: the two long inputs differ only past the cut, so they are read as the same text.
    assert _cosine(head_cats, head_tax) > 0.9999 and _cosine(head_tax, short) < 0.99
    # Each long input read whole up to the model's context, no more; the short one whole.
    tokens_short = daemon.http.post("/api/embed", json={"model": "embed", "input": inputs[2]}).json()
    assert cut.json()["prompt_eval_count"] == 2 * EMBED_CTX + tokens_short["prompt_eval_count"]
    explicit = daemon.http.post("/api/embed", json={"model": "embed", "input": inputs[0], "truncate": True})
    assert _cosine(explicit.json()["embeddings"][0], head_cats) > 0.99999
    refused = daemon.http.post("/api/embed", json={"model": "embed", "input": inputs, "truncate": False})
    assert refused.status_code == 400
    assert refused.json()["error"].startswith("input 0: it has "), refused.json()
    assert f"reads at most {EMBED_CTX} per input" in refused.json()["error"]
    # Past the decode's size but within the padded slot: refused, the worker alive (it aborted before).
    between = daemon.http.post("/api/embed", json={"model": "embed", "input": SENTENCE * 15, "truncate": False})
    assert between.status_code == 400 and f"reads at most {EMBED_CTX} per input" in between.json()["error"]
    assert daemon.http.post("/api/embed", json={"model": "embed", "input": SENTENCE * 15}).json()[
        "prompt_eval_count"] == EMBED_CTX
    wrong = daemon.http.post("/api/embed", json={"model": "embed", "input": "x", "truncate": "yes"})
    assert wrong.status_code == 400 and wrong.json()["error"].startswith("truncate:")


def test_the_ollama_client_embeds_a_long_input(client):
    """The client sends no truncate unless told: Ollama's default (cut) applies."""
    out = client.embed(model="embed", input=SENTENCE * 40)
    assert len(out.embeddings[0]) == 640 and out.prompt_eval_count == EMBED_CTX
    with pytest.raises(ollama.ResponseError) as refused:
        client.embed(model="embed", input=SENTENCE * 40, truncate=False)
    assert refused.value.status_code == 400 and f"reads at most {EMBED_CTX} per input" in refused.value.error


# -- 3. /api/pull ------------------------------------------------------------------------------

def test_pull_of_a_served_model_is_success_at_once(client, hub):
    before = len(hub.requests)
    assert client.pull("chat").status == "success"
    assert [p.status for p in client.pull("chat:latest", stream=True)] == ["success"]
    assert len(hub.requests) == before  # the hub was not asked


def test_pull_fetches_a_repository_from_the_hub_with_ollamas_progress(client, daemon, hub):
    progress = list(client.pull(f"hf.co/{REPO}:Q8_0", stream=True))
    statuses = [p.status for p in progress]
    assert statuses[0] == "pulling manifest" and statuses[-3:] == ["verifying sha256 digest", "writing manifest",
                                                                   "success"]
    layer = [p for p in progress if p.digest]
    assert layer and layer[-1].completed == layer[-1].total > 0 and layer[-1].digest.startswith("sha256:")
    assert hub.downloads() == [f"/{REPO}/resolve/main/tiny-Q8_0.gguf"]
    snapshot = daemon.hf_home / "hub" / "models--test-org--tiny-GGUF" / "snapshots"
    assert [p.name for p in snapshot.glob("*/*.gguf")] == ["tiny-Q8_0.gguf"]
    # Again: from the cache, nothing downloaded; stream: false answers the last object.
    assert client.pull(f"{REPO}:Q8_0").status == "success"
    assert hub.downloads() == [f"/{REPO}/resolve/main/tiny-Q8_0.gguf"]
    assert [e["name"] for e in log_events(daemon, "pull.done")] == [f"hf.co/{REPO}:Q8_0", f"{REPO}:Q8_0"]


def test_pull_of_a_missing_repository_fails_in_ollamas_shapes(client, daemon):
    with pytest.raises(ollama.ResponseError) as whole:
        client.pull("test-org/no-such-GGUF")
    assert whole.value.status_code == 502 and "no-such-GGUF" in whole.value.error
    streamed = daemon.http.post("/api/pull", json={"model": "test-org/no-such-GGUF"})
    lines = [json.loads(line) for line in streamed.text.splitlines()]
    assert streamed.status_code == 200 and lines[0] == {"status": "pulling manifest"}
    assert set(lines[-1]) == {"error"} and "no-such-GGUF" in lines[-1]["error"]
    with pytest.raises(ollama.ResponseError):  # the client raises on the error line too
        list(client.pull("test-org/no-such-GGUF", stream=True))
    huge = daemon.http.post("/api/pull", json={"model": "x/" + "y" * 1_000_000})
    assert huge.status_code == 400 and huge.json()["error"].startswith("model:")


# -- 4. unknown fields are named in the log ------------------------------------------------------

def test_an_unknown_field_is_answered_and_named_in_the_log(daemon):
    answer = daemon.http.post("/v1/chat/completions", json={"model": "chat", "messages": ASK, "max_token": 5,
                                                            "max_tokens": 3, "temperature": 0})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] <= 3
    named = [e for e in log_events(daemon, "request.ignored_fields") if e["fields"] == ["max_token"]]
    assert named and named[-1]["level"] == "warning" and named[-1]["body"] == "ChatCompletionRequest"

    many = {**{f"unknown_{i}": i for i in range(10_000)}, "model": "chat", "messages": ASK, "max_tokens": 2}
    answer = daemon.http.post("/v1/chat/completions", json=many)
    assert answer.status_code == 200
    line = next(e for e in log_events(daemon, "request.ignored_fields") if e["fields"][0] == "unknown_0")
    assert line["fields"] == [f"unknown_{i}" for i in range(10)] and line["more"] is True
    assert max(len(raw) for raw in daemon.log().splitlines() if "unknown_0" in raw) < 1000


# -- 5. an oversize prompt says what to change -----------------------------------------------------

@pytest.mark.parametrize("words", [300, 5000])  # the whole prompt counted, or the count stopped at the slot
def test_a_prompt_longer_than_a_slot_says_to_raise_ctx_size_or_lower_parallel(daemon, words):
    prompt = " ".join(["dormouse"] * words)
    for path, body in (("/v1/completions", {"model": "chat", "prompt": prompt, "max_tokens": 2}),
                       ("/api/chat", {"model": "chat", "messages": [{"role": "user", "content": prompt}],
                                      "stream": False})):
        refused = daemon.http.post(path, json=body)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        message = error if isinstance(error, str) else error["message"]
        assert f"the context of a slot holds {CHAT_CTX // CHAT_PARALLEL}" in message, message
        assert f"raise ctx_size (the --ctx-size flag or the ctx_size setting, now {CHAT_CTX})" in message
        assert f"lower parallel (now {CHAT_PARALLEL})" in message and "ctx_size / parallel" in message
