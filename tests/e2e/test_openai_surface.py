"""The OpenAI surface with the official client against the real daemon:
completions and chat, streaming and not, stops, seeds, concurrency, slots."""

import concurrent.futures
import threading
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, bundled_model):
    from tests.conftest import DaemonProcess

    d = DaemonProcess("--model", bundled_model, "--threads", "2", "--parallel", "4", "--ctx-size", "2048",
                      "--sleep-idle-seconds", "-1", log_path=tmp_path_factory.mktemp("d") / "daemon.log")
    d.wait_state("ready")
    yield d
    d.stop()


@pytest.fixture
def client(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_bundled_model(client):
    (model,) = client.models.list().data
    assert model.id == "gemma-3-270m-q4_k_m"


def test_completion_and_usage(client):
    r = client.completions.create(model="x", prompt="The capital of France is", max_tokens=10, temperature=0)
    assert r.choices[0].text.strip()
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 10 and r.usage.prompt_tokens > 3


def test_streamed_completion_equals_unstreamed(client):
    kwargs = dict(model="x", prompt="Once upon a time", max_tokens=16, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_streaming_and_not(client):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model="x", messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    text = whole.choices[0].message.content
    streamed = client.chat.completions.create(model="x", messages=messages, max_tokens=12, temperature=0,
                                              stream=True, stream_options={"include_usage": True})
    parts, usage = [], None
    for chunk in streamed:
        if chunk.usage:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    assert "".join(parts) == text
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_stop_strings_cut_and_are_never_streamed(client):
    base = client.completions.create(model="x", prompt="1, 2, 3, 4,", max_tokens=20, temperature=0).choices[0].text
    assert " 6" in base, base
    stop = base[base.index(" 6"):base.index(" 6") + 3]  # spans more than one token in most vocabularies
    r = client.completions.create(model="x", prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[:base.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="x", prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[stop], stream=True) if c.choices)
    assert streamed == r.choices[0].text


def test_same_seed_same_text_other_seed_other_text(client):
    kwargs = dict(model="x", prompt="My favourite animal is", max_tokens=24, temperature=1.0, top_p=1.0)
    a = client.completions.create(seed=1234, **kwargs).choices[0].text
    b = client.completions.create(seed=1234, **kwargs).choices[0].text
    others = {client.completions.create(seed=s, **kwargs).choices[0].text for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1


def test_four_concurrent_streams_match_their_solo_runs(client):
    prompts = ["The sky is", "Water boils at", "My name is", "In 1969, the"]
    solo = [client.completions.create(model="x", prompt=p, max_tokens=20, temperature=0).choices[0].text for p in prompts]

    def stream(p):
        return "".join(c.choices[0].text for c in client.completions.create(
            model="x", prompt=p, max_tokens=20, temperature=0, stream=True) if c.choices)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(stream, prompts))
    assert together == solo  # greedy output of a slot is the same alone or beside 3 others


def test_slots_show_generating_while_busy(daemon, client):
    seen = set()
    done = threading.Event()

    def watch():
        while not done.is_set():
            seen.update(s["state"] for s in daemon.http.get("/slots").json())
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    client.completions.create(model="x", prompt="Tell me a story", max_tokens=40, temperature=0)
    done.set()
    watcher.join()
    assert "generating" in seen
    assert [s["state"] for s in daemon.http.get("/slots").json()] == ["idle"] * 4


def test_prompt_cache_reuses_the_common_prefix(client):
    history = "The following is a long conversation about the history of the Roman empire. " * 8
    first = client.completions.create(model="x", prompt=history + "Question one:", max_tokens=4, temperature=0)
    second = client.completions.create(model="x", prompt=history + "Question two:", max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details is None or first.usage.prompt_tokens_details.cached_tokens < 10
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 5


def test_prompt_longer_than_context_is_400(client, daemon):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="x", prompt="word " * 3000, max_tokens=4)
    assert info.value.code == "context_length_exceeded"


def test_disconnect_frees_the_slot(daemon):
    with httpx.stream("POST", daemon.url + "/v1/completions", timeout=60,
                      json={"prompt": "Write a very long essay", "max_tokens": 500, "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break  # leave mid-stream
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if all(s["state"] == "idle" for s in daemon.http.get("/slots").json()):
            break
        time.sleep(0.02)
    assert all(s["state"] == "idle" for s in daemon.http.get("/slots").json())
    assert daemon.props()["requests_in_flight"] == 0


def test_logit_bias_forces_a_token_and_penalties_change_repetition(client):
    one = client.completions.create(model="x", prompt="Hello", max_tokens=1, temperature=0,
                                    logit_bias={"1000": 100}).choices[0].text
    four = client.completions.create(model="x", prompt="Hello", max_tokens=4, temperature=0,
                                     logit_bias={"1000": 100}).choices[0].text
    assert one and four == one * 4
    prompt = "yes yes yes yes yes yes yes yes"
    plain = client.completions.create(model="x", prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    penalised = client.completions.create(model="x", prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"repeat_penalty": 1.8}, frequency_penalty=1.5).choices[0].text
    assert plain.count("yes") > penalised.count("yes")


def test_non_streamed_disconnect_frees_the_slot(daemon):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(daemon.url + "/v1/completions", timeout=httpx.Timeout(60, read=0.5),
                   json={"prompt": "Write a very long essay", "max_tokens": 400, "ignore_eos": True})
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and daemon.props()["requests_in_flight"]:
        time.sleep(0.02)
    assert daemon.props()["requests_in_flight"] == 0
    assert all(s["state"] == "idle" for s in daemon.http.get("/slots").json())
