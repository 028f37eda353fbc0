"""llama-server's command line and inputs on a real daemon (issue 29): `--embedding -b N -ub N`
starts (the batch is the micro-batch), /v1/embeddings reads llama-server's input forms, and
`-rea off` renders every chat prompt with enable_thinking = false unless a request says otherwise."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.e2e

# Shows what the template was given, so the test reads the variables themselves.
PROBE_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                  "<thinking={{ enable_thinking }} tone={{ tone | default('none') }}>")


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    from tests.conftest import DaemonProcess

    tmp = tmp_path_factory.mktemp("ls-embed")
    # llama.cpp's own embedding tests start llama-server so: -ub with --embedding was refused before.
    d = DaemonProcess("--embedding", "--pooling", "last", "-c", "512", "-b", "300", "-ub", "128", "-np", "1",
                      "--threads", "2", log_path=tmp / "daemon.log")
    d.wait_state("ready", "sleeping", timeout=120)
    yield d
    d.stop()


def vectors(daemon, value) -> list[list[float]]:
    r = daemon.http.post("/v1/embeddings", json={"input": value})
    assert r.status_code == 200, r.text
    return [d["embedding"] for d in r.json()["data"]]


def test_the_forms_of_one_prompt_give_one_vector_each(embedder):
    text, = vectors(embedder, "hello world")
    assert math.isclose(sum(x * x for x in text), 1.0, rel_tol=1e-4)
    # The same text as an object, as text parts (read as one text), and as prompt_string.
    assert vectors(embedder, {"content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}) \
        == [text]
    assert vectors(embedder, {"prompt_string": "hello world"}) == [text]
    ids = embedder.http.post("/tokenize", json={"content": "hello world", "add_special": True}).json()["tokens"]
    assert vectors(embedder, ids) == [text]
    # Token ids with texts between them are one prompt: the texts tokenized in place, the specials only
    # for a text that opens it.
    mixed = embedder.http.post("/tokenize", json={"content": " world"}).json()["tokens"]
    assert vectors(embedder, [*ids[:-len(mixed)], " world"]) == [text]
    assert len(vectors(embedder, "")) == 1  # an empty text still has its specials to read


def test_a_list_of_prompts_gives_one_vector_per_prompt_in_order(embedder):
    out = vectors(embedder, ["a cat", {"prompt_string": "tax law"}, [2, 1000, 3], ["a", 17, "b"]])
    assert len(out) == 4 and out[0] != out[1]
    assert out[0] == vectors(embedder, "a cat")[0]


@pytest.mark.parametrize("value", [
    [], {}, {"content": "text"}, {"content": []}, {"content": [{"type": "unknown"}]},
    {"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
    {"prompt_string": 5}, [1.5], [-1, 2], [2**31], [True], [[]], [None], 7, None,
    ["x"] * 257, [{"content": [{"type": "text", "text": "a"}] * 257}],
])
def test_hostile_inputs_are_400_and_the_daemon_keeps_serving(embedder, value):
    r = embedder.http.post("/v1/embeddings", json={"input": value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]


def test_an_input_over_the_batch_says_it_is_too_large(embedder):
    r = embedder.http.post("/v1/embeddings", json={"input": "This is a test " * 512})
    assert r.status_code == 400 and "too large" in r.json()["error"]["message"], r.text
    assert len(vectors(embedder, "still serving")) == 1


@pytest.fixture(scope="module")
def chatter(tmp_path_factory):
    from tests.conftest import DaemonProcess

    tmp = tmp_path_factory.mktemp("ls-chat")
    template = tmp / "probe.jinja"
    template.write_text(PROBE_TEMPLATE)
    d = DaemonProcess("-rea", "off", "--chat-template-kwargs", '{"tone": "dry"}', "--chat-template-file",
                      str(template), "-c", "512", "-np", "1", "--threads", "2", log_path=tmp / "daemon.log")
    d.wait_state("ready", "sleeping", timeout=120)
    yield d
    d.stop()


def test_reasoning_off_is_the_default_a_request_may_override(chatter):
    messages = [{"role": "user", "content": "hi"}]
    prompt = chatter.http.post("/apply-template", json={"messages": messages}).json()["prompt"]
    assert prompt.endswith("<thinking=False tone=dry>"), prompt
    body = {"messages": messages, "chat_template_kwargs": {"enable_thinking": True}}
    prompt = chatter.http.post("/apply-template", json=body).json()["prompt"]
    assert prompt.endswith("<thinking=True tone=dry>"), prompt


def test_completion_reads_mixed_and_object_prompts_as_their_tokens(chatter):
    def complete(prompt):
        r = chatter.http.post("/completion", json={"prompt": prompt, "n_predict": 4, "temperature": 0,
                                                   "cache_prompt": False})
        assert r.status_code == 200, r.text
        return r.json()

    text = "I believe the meaning of life is"
    ids = chatter.http.post("/tokenize", json={"content": text, "add_special": True}).json()["tokens"]
    plain = complete(ids)
    assert complete({"prompt_string": text})["content"] == plain["content"]
    tail = chatter.http.post("/tokenize", json={"content": " is"}).json()["tokens"]
    mixed = complete([*ids[:-len(tail)], " is"])
    assert mixed["content"] == plain["content"] and mixed["tokens_evaluated"] == plain["tokens_evaluated"]
    several = chatter.http.post("/completion", json={"prompt": [ids, {"prompt_string": text}], "n_predict": 4,
                                                      "temperature": 0, "cache_prompt": False})
    assert several.status_code == 200, several.text  # several prompts: a list of answers, as llama-server
    assert [a["content"] for a in several.json()] == [plain["content"]] * 2
    for hostile in ([[]], {"prompt_string": "x", "multimodal_data": "AAAA"}, {"prompt_string": 1}, [1, None]):
        r = chatter.http.post("/completion", json={"prompt": hostile, "n_predict": 1})
        assert r.status_code == 400 and r.json()["error"]["message"], r.text


@pytest.fixture(scope="module")
def two_slots(tmp_path_factory):
    from tests.conftest import DaemonProcess

    tmp = tmp_path_factory.mktemp("ls-slots")
    d = DaemonProcess("-c", "1024", "-np", "2", "-cram", "0", "--threads", "2", log_path=tmp / "daemon.log")
    d.wait_state("ready", "sleeping", timeout=120)
    yield d
    d.stop()


def test_id_slot_runs_a_request_in_the_slot_it_names(two_slots):
    """llama-server's test_slot_save_restore, its cache figures only (the words are its own model's): a
    prompt read in slot 1 is cached there; the same prefix pinned to empty slot 0 is read whole, pinned
    to slot 1 only its new tail is read."""
    def prompt_n(prompt: str, id_slot: int) -> int:
        r = two_slots.http.post("/completion", json={"prompt": prompt, "id_slot": id_slot, "n_predict": 1,
                                                     "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["timings"]["prompt_n"]

    first = "The capital of France is a city of many bridges and of old streets. " * 3
    second = first + "What is the capital of Germany?"
    whole = prompt_n(first, 1)
    assert prompt_n(second, 0) > whole  # slot 0 held nothing: all of it read
    tail = prompt_n(second, 1)
    assert 0 < tail < whole / 2  # slot 1 held the first prompt: only what follows it
    assert prompt_n(second, 1) <= 1 and prompt_n(second, 0) <= 1  # each slot now holds the second prompt


@pytest.mark.parametrize("id_slot", [2, -2, 10 ** 9, "one", 1.5, [1]])
def test_a_hostile_id_slot_is_400_naming_it(two_slots, id_slot):
    r = two_slots.http.post("/completion", json={"prompt": "hi", "id_slot": id_slot, "n_predict": 1})
    assert r.status_code == 400, r.text
    assert "id_slot" in r.json()["error"]["message"]
    assert two_slots.http.post("/completion", json={"prompt": "hi", "n_predict": 1}).status_code == 200


def test_a_request_pinned_to_a_busy_slot_waits_for_it_and_stalls_no_other(two_slots):
    """Slot 1 streams; a request pinned to slot 1 waits for it though slot 0 is idle, and a request
    behind it that names no slot is not held up by it: it is answered while slot 1 still streams
    (counted in the stream's tokens read when each answer came, not in seconds)."""
    import threading
    import time

    import httpx

    seen = [0]  # the stream's tokens read so far
    at_answer = {}
    total = 200
    body = {"prompt": "Once upon a time", "id_slot": 1, "n_predict": total, "ignore_eos": True, "stream": True}

    def post(name, **fields):
        r = httpx.post(f"{two_slots.url}/completion", json={"prompt": "hi", "n_predict": 1, **fields}, timeout=60)
        at_answer[name] = (r.status_code, seen[0])

    with httpx.Client(base_url=two_slots.url, timeout=60) as client, client.stream("POST", "/completion",
                                                                                   json=body) as first:
        assert first.status_code == 200
        lines = (line for line in first.iter_lines() if line.startswith("data: "))
        next(lines)  # slot 1 is decoding
        seen[0] = 1
        pinned = threading.Thread(target=post, args=("pinned",), kwargs={"id_slot": 1})
        pinned.start()
        for _ in range(2000):  # until the pinned request is in the worker's queue (bounded by count)
            if two_slots.props()["requests_in_flight"] >= 2:
                break
            time.sleep(0.01)
        free = threading.Thread(target=post, args=("free",))
        free.start()
        for _ in lines:
            seen[0] += 1
        free.join(60)
        pinned.join(60)
    assert seen[0] >= total
    assert at_answer["free"][0] == 200 and at_answer["free"][1] < total * 3 // 4, at_answer  # beside the stream
    assert at_answer["pinned"][0] == 200 and at_answer["pinned"][1] > at_answer["free"][1], at_answer


def test_a_router_command_line_serves_a_models_dir_and_presets_within_models_max(tmp_path, bundled_model):
    """`llama-server --models-dir DIR --models-preset FILE --models-max 1 --no-models-autoload`,
    unchanged: each GGUF (and each folder of one) is a model, each preset section one more with its own
    options; a model not loaded is refused until POST /models/load; loading a second puts the first to
    sleep."""
    import os

    from tests.conftest import DaemonProcess

    models = tmp_path / "models"
    (models / "gemma-b").mkdir(parents=True)
    os.symlink(bundled_model, models / "gemma-a.gguf")
    os.symlink(bundled_model, models / "gemma-b" / "gemma-b.gguf")
    preset = tmp_path / "presets.ini"
    preset.write_text(f"version = 1\n[*]\nc = 512\n\n[gemma-c]\nmodel = {bundled_model}\nc = 256\nalias = tiny\n"
                      "tags = chat, small\n")
    d = DaemonProcess("--models-dir", str(models), "--models-preset", str(preset), "--models-max", "1", "--tags", "local",
                      "--no-models-autoload", "-np", "1", "--threads", "2", "--config", os.devnull,
                      log_path=tmp_path / "daemon.log")
    try:
        d.wait_state("ready", "sleeping", timeout=120)
        listed = {m["id"]: m["aliases"] for m in d.http.get("/v1/models").json()["data"]}
        assert listed == {"gemma-c": ["tiny"], "gemma-a": [], "gemma-b": []}
        tags = {m["id"]: m["tags"] for m in d.http.get("/models").json()["data"]}  # a section's over the line's
        assert tags == {"gemma-c": ["chat", "small"], "gemma-a": ["local"], "gemma-b": ["local"]}
        assert d.http.get("/props", params={"model": "tiny"}).json()["n_ctx"] == 256
        assert d.http.get("/props", params={"model": "gemma-b"}).json()["n_ctx"] == 512
        props = d.http.get("/props").json()
        assert (props["role"], props["max_instances"], props["models_autoload"]) == ("router", 1, False)

        def chat(model):
            return d.http.post("/v1/chat/completions", json={"model": model, "max_tokens": 2,
                                                             "messages": [{"role": "user", "content": "hi"}]})

        assert chat("gemma-c").status_code == 200  # the default model (the first table) loads at start
        refused = chat("gemma-b")
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "model_not_loaded"
        assert d.http.post("/models/load", json={"model": "gemma-b"}).json()["success"] is True
        assert chat("gemma-b").status_code == 200
        statuses = {m["id"]: m["status"] for m in d.http.get("/v1/models").json()["data"]}
        assert statuses == {"gemma-a": "sleeping", "gemma-b": "loaded", "gemma-c": "sleeping"}  # models_max 1
    finally:
        d.stop()


def test_several_host_addresses_are_each_served(tmp_path):
    """llama-server's test_server_multiple_addresses: `--host 127.0.0.1,::1` serves both; the command
    line's --host wins over LLAMA_ARG_HOST (here an address that cannot be bound)."""
    import socket

    import httpx

    from tests.conftest import DaemonProcess

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("IPv6 loopback is unavailable")
    d = DaemonProcess("--host", "127.0.0.1,::1", "-c", "512", "-np", "1", "--threads", "2",
                      env={"LLAMA_ARG_HOST": "192.0.2.1"}, log_path=tmp_path / "daemon.log")
    try:
        d.wait_state("ready", "sleeping", timeout=120)
        for base in (f"http://127.0.0.1:{d.port}", f"http://[::1]:{d.port}"):
            r = httpx.post(f"{base}/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 2}, timeout=60)
            assert r.status_code == 200, (base, r.text)
    finally:
        d.stop()
