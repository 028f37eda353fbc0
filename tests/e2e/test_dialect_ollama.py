"""Ollama's API end to end on the bundled model, through the clients people
use: the `ollama` Python client (chat streamed and not, a format schema, tools,
generate, embed, list, ps, show) and LiteLLM's `ollama_chat/` provider; and
keep_alive driving the real sleep (/api/ps and /props read the same timer)."""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list: nothing is reachable

import litellm  # noqa: E402
import ollama  # noqa: E402
import pytest  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from tests.fixtures.fleet import write_toml  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SHORT = {"num_predict": 8, "temperature": 0}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, bundled_model):
    """One daemon, two models: `chat` generates (300 s idle before it sleeps), `embed` is the same file
    loaded for embeddings."""
    from tests.conftest import DaemonProcess

    tmp = tmp_path_factory.mktemp("ollama")
    toml = write_toml(tmp / "fleet.toml", {"chat": {"path": bundled_model, "parallel": 2, "ctx_size": 2048},
                                           "embed": {"path": bundled_model, "embeddings": True, "parallel": 1,
                                                     "ctx_size": 512}},
                      threads=2, sleep_idle_seconds=300, state_dir=str(tmp / "state"))
    d = DaemonProcess("--config", str(toml), log_path=tmp / "daemon.log")
    d.wait_state("ready", timeout=180)
    yield d
    d.stop()


@pytest.fixture
def client(daemon):
    return ollama.Client(host=daemon.url, timeout=300)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def props(daemon, model: str = "chat") -> dict:
    return daemon.http.get("/props", params={"model": model}).json()


def ps_entry(client, name: str = "chat"):
    return next((m for m in client.ps().models if m.model == name), None)


# -- chat and generate -------------------------------------------------------------------

def test_chat_whole_and_streamed(client):
    whole = client.chat(model="chat", messages=ask("Name three colours."), options=SHORT)
    assert whole.message.role == "assistant" and whole.message.content
    assert whole.done and whole.done_reason in ("stop", "length") and 0 < whole.eval_count <= 8
    assert whole.prompt_eval_count > 0 and whole.total_duration >= whole.eval_duration > 0
    parts = list(client.chat(model="chat:latest", messages=ask("Name three colours."), options=SHORT, stream=True))
    assert [p.done for p in parts[:-1]] == [False] * (len(parts) - 1) and parts[-1].done
    assert "".join(p.message.content for p in parts).strip() and parts[-1].eval_count <= 8


class Pet(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=30)


def test_chat_with_a_format_schema_answers_that_schema(client):
    answer = client.chat(model="chat", messages=ask("Describe a pet as JSON."), format=Pet.model_json_schema(),
                         options={"num_predict": 60, "temperature": 0})
    pet = Pet.model_validate_json(answer.message.content)  # the grammar made it valid, within its bounds
    assert 0 <= pet.age <= 30
    json_answer = client.chat(model="chat", messages=ask("Give a JSON object."), format="json",
                              options={"num_predict": 30, "temperature": 0})
    assert json_answer.message.content.lstrip().startswith("{")


def _asked_for_paris() -> list[dict]:
    """Two earlier calls in the history: the model then answers with a call of its own (greedy)."""
    def call(city: str) -> dict:
        return {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": city}}}]}

    return [*ask("Weather in Rome?"), call("Rome"), *ask("Weather in Oslo?"), call("Oslo"), *ask("Weather in Paris?")]


def test_tool_calls_whole_and_streamed_with_their_arguments_as_objects(client):
    options = {"num_predict": 30, "temperature": 0}
    whole = client.chat(model="chat", messages=_asked_for_paris(), tools=[WEATHER], options=options)
    [called] = whole.message.tool_calls
    assert called.function.name == "get_weather" and called.function.arguments == {"city": "Paris"}
    parts = list(client.chat(model="chat", messages=_asked_for_paris(), tools=[WEATHER], options=options, stream=True))
    calls = [c for p in parts for c in (p.message.tool_calls or ())]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert parts[-1].done
    # The round trip: the tool's answer goes back with tool_name, and the model answers in words.
    history = [*_asked_for_paris(), whole.message.model_dump(exclude_none=True),
               {"role": "tool", "content": "sunny, 25 C", "tool_name": "get_weather"}]
    after = client.chat(model="chat", messages=history, tools=[WEATHER], options=SHORT)
    assert after.done


def test_generate_templated_raw_and_load(client):
    templated = client.generate(model="chat", prompt="Say hello.", system="Be brief.", options=SHORT)
    assert templated.response and templated.done and templated.eval_count <= 8
    raw = list(client.generate(model="chat", prompt="The capital of France is", raw=True, options=SHORT, stream=True))
    assert "".join(r.response for r in raw).strip() and raw[-1].done
    loaded = client.generate(model="chat")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_refusals_reach_the_client_as_response_errors(client):
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model="chat", messages=ask("x"), options={"num_ctx": 1_000_000})
    assert refused.value.status_code == 400 and "options.num_ctx" in refused.value.error
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="no-such-model", messages=ask("x"))
    assert missing.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as pulled:
        client.pull("gemma3")
    assert pulled.value.status_code == 400 and "owner/name" in pulled.value.error  # a library name: not the hub's


# -- embeddings ---------------------------------------------------------------------------

def _cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))  # the vectors are normalized


def test_embed_and_the_older_embeddings(client):
    out = client.embed(model="embed", input=["a cat sat on the mat", "a cat sat on the mat", "tax law"])
    same, _, other = out.embeddings
    assert len(same) == 640 and _cosine(same, out.embeddings[1]) > 0.999 > _cosine(same, other)
    cut = client.embed(model="embed", input="a cat", dimensions=64).embeddings[0]
    assert len(cut) == 64 and abs(_cosine(cut, cut) - 1) < 1e-6
    legacy = client.embeddings(model="embed", prompt="a cat sat on the mat").embedding
    assert _cosine(legacy, same) > 0.999


# -- list, ps, show ------------------------------------------------------------------------

def test_list_ps_and_show_read_the_fleet_and_the_file(client, daemon):
    listed = {m.model: m for m in client.list().models}
    assert set(listed) == {"chat", "embed"}
    details = listed["chat"].details
    assert (details.format, details.family, details.quantization_level) == ("gguf", "gemma3", "Q4_K_M")
    assert details.parameter_size == "268.10M" and listed["chat"].size > 200_000_000
    client.generate(model="chat")  # loaded
    running = ps_entry(client)
    assert running is not None and running.context_length == 1024 and running.size > 0  # 2048 / 2 slots
    shown = client.show("chat")
    assert shown.modelinfo["general.architecture"] == "gemma3" and shown.modelinfo["gemma3.context_length"] == 32768
    assert shown.capabilities == ["completion", "tools"] and client.show("embed").capabilities == ["embedding"]


# -- LiteLLM ----------------------------------------------------------------------------------

def test_litellm_ollama_chat_provider(daemon):
    answer = litellm.completion(model="ollama_chat/chat", api_base=daemon.url, messages=ask("Say hi."), max_tokens=8,
                                temperature=0)
    assert answer.choices[0].message.content and answer.usage.completion_tokens <= 8
    streamed = litellm.completion(model="ollama_chat/chat", api_base=daemon.url, messages=ask("Say hi."),
                                  max_tokens=8, temperature=0, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed).strip()
    openai_history = [  # the same history as OpenAI's shape, which LiteLLM takes and translates
        {**m, "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {
            "name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
            for c in m["tool_calls"]]} if "tool_calls" in m else m for i, m in enumerate(_asked_for_paris())]
    called = litellm.completion(model="ollama_chat/chat", api_base=daemon.url, messages=openai_history,
                                tools=[WEATHER], max_tokens=30, temperature=0)
    [call] = called.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and "Paris" in call.function.arguments
    assert called.choices[0].finish_reason == "tool_calls"


# -- keep_alive drives the real sleep ----------------------------------------------------

def _seconds_until(moment: datetime) -> float:
    return moment.timestamp() - datetime.now(timezone.utc).timestamp()


def test_keep_alive_moves_the_real_sleep_deadline(client, daemon):
    client.chat(model="chat", messages=ask("Hi."), options={"num_predict": 2}, keep_alive=0)
    answered = time.time()
    deadline = time.monotonic() + 60
    while not props(daemon)["is_sleeping"]:
        assert time.monotonic() < deadline, props(daemon)
        time.sleep(0.05)
    slept = props(daemon)["last_sleep"]
    assert slept["reason"] == "idle"
    began = slept["at"] - slept["seconds"]  # the teardown's start, on the daemon's clock (this machine's)
    assert began - answered < 1.0, (began, answered)  # the configured idle time is 300 s
    assert ps_entry(client) is None

    client.chat(model="chat", messages=ask("Hi."), options={"num_predict": 2}, keep_alive="1h")
    now = props(daemon)
    assert now["keep_alive"] == 3600 and now["idle_seconds"] == 3600 and now["is_sleeping"] is False
    remaining = _seconds_until(ps_entry(client).expires_at)
    assert 3500 < remaining <= 3600 and abs(remaining - now["idle_timer_remaining"]) < 5

    client.generate(model="chat", keep_alive=-1)  # Ollama's load form: awake until told otherwise
    assert props(daemon)["idle_seconds"] == -1 and props(daemon)["idle_timer_remaining"] is None
    assert ps_entry(client).expires_at.year > 2300

    client.generate(model="chat", keep_alive=30)  # at least 30 s: the model's own 300 s is longer
    assert props(daemon)["idle_seconds"] == 300
    assert 200 < _seconds_until(ps_entry(client).expires_at) <= 300
