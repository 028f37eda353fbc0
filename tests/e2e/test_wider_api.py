"""The API that real clients use, end to end on the bundled model: structured
output through the openai SDK's `chat.completions.parse`, tool calls (forced
and round trip, streamed and not), logprobs, embeddings from a second model of
the same daemon, and llama-server's /tokenize, /detokenize, /apply-template
and /completion."""

from __future__ import annotations

import base64
import functools
import json
import math
import struct
from enum import Enum
from typing import Optional

import openai
import pytest
from pydantic import BaseModel, Field

from tests.fixtures.fleet import write_toml

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, bundled_model):
    """One daemon, two models: `chat` generates, `embed` is the same file loaded for embeddings."""
    from tests.conftest import DaemonProcess

    tmp = tmp_path_factory.mktemp("wider")
    toml = write_toml(tmp / "fleet.toml", {"chat": {"path": bundled_model, "parallel": 4, "ctx_size": 4096},
                                           "embed": {"path": bundled_model, "embeddings": True, "parallel": 1,
                                                     "ctx_size": 1024}},
                      threads=2, sleep_idle_seconds=-1, state_dir=str(tmp / "state"), raw_grammar=True)
    d = DaemonProcess("--config", str(toml), log_path=tmp / "daemon.log")
    d.wait_state("ready")
    yield d
    d.stop()


@pytest.fixture
def client(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# -- structured output ----------------------------------------------------------------

class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    street: str = Field(max_length=40)
    city: str = Field(max_length=30)


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=120)  # an integer range: enforced by the grammar
    address: Address


class Palette(BaseModel):
    favourite: Color
    others: list[Color] = Field(max_length=3)


class Note(BaseModel):
    title: str = Field(max_length=40)
    done: bool
    due: Optional[str] = Field(default=None, max_length=20)


@pytest.mark.parametrize("schema, prompt", [
    (Person, "Describe a person who lives in Paris as JSON."),
    (Palette, "Pick colours as JSON."),
    (Note, "Write a short to-do note as JSON."),
])
def test_parse_returns_the_pydantic_object(client, schema, prompt):
    """The SDK sends a strict json_schema; the answer parses into the model."""
    completion = client.chat.completions.parse(model="chat", messages=ask(prompt), response_format=schema,
                                               temperature=0, max_tokens=300)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, schema), message.content
    schema.model_validate_json(message.content)  # the raw text is the JSON, nothing around it


def test_json_object_and_llama_server_json_schema(client, daemon):
    # A penalty: greedy, this 270M model would repeat keys until max_tokens (valid JSON so far, never closed).
    out = client.chat.completions.create(model="chat", messages=ask("Give me a JSON object about cats."),
                                         response_format={"type": "json_object"}, temperature=0, max_tokens=200,
                                         frequency_penalty=1.0)
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict), repr(out.choices[0].message.content)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    r = daemon.http.post("/v1/completions", json={"model": "chat", "prompt": "A number:", "json_schema": schema,
                                                  "temperature": 0, "max_tokens": 40})
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["choices"][0]["text"])["n"], int)


def test_unenforceable_schema_and_broken_grammar_are_400_and_the_worker_lives(daemon):
    worker = daemon.http.get("/props", params={"model": "chat"}).json()["last_wake"]["worker_pid"]
    r = daemon.http.post("/v1/chat/completions", json={
        "model": "chat", "messages": ask("hi"),
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}})
    assert r.status_code == 400 and "not" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"].startswith("response_format")
    r = daemon.http.post("/v1/completions", json={"model": "chat", "prompt": "x", "grammar": "root ::= [a-z"})
    assert r.status_code == 400, r.text
    r = daemon.http.post("/v1/completions", json={"model": "chat", "prompt": "x", "grammar": "root ::= root \"a\""})
    assert r.status_code == 400, r.text  # matches nothing: llguidance stops before the first token
    # A grammar with no way on after its first token, on two choices decoded in one batch: the first
    # choice's dead end ends the request, and its sibling, ended with it, is not sampled (it was, once: a crash).
    r = daemon.http.post("/v1/completions", json={"model": "chat", "prompt": "Say a:", "n": 2, "max_tokens": 5,
                                                  "grammar": 'root ::= "a" x\nx ::= x "b"'})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_grammar", r.text
    assert daemon.http.get("/props", params={"model": "chat"}).json()["last_wake"]["worker_pid"] == worker
    r = daemon.http.post("/v1/completions", json={"model": "chat", "prompt": "x", "max_tokens": 3,
                                                  "grammar": 'root ::= "yes" | "no"', "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text


def test_a_grammar_on_one_slot_leaves_the_others_token_for_token(daemon):
    """Batch invariance: a greedy request gives the same text alone and beside grammar-constrained ones."""
    import concurrent.futures

    plain = {"model": "chat", "prompt": "The history of the lighthouse", "max_tokens": 48, "temperature": 0,
             "ignore_eos": True}
    # No wall-clock bound: on a loaded 2-core machine the three together took 60 s, the client's default.
    post = functools.partial(daemon.http.post, timeout=600)
    alone = post("/v1/completions", json=plain).json()["choices"][0]["text"]
    constrained = {"model": "chat", "messages": ask("List three fruits as JSON."), "max_tokens": 120, "temperature": 0,
                   "response_format": {"type": "json_object"}}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        others = [pool.submit(post, "/v1/chat/completions", json=constrained) for _ in range(2)]
        beside = pool.submit(post, "/v1/completions", json=plain)
        assert all(f.result().status_code == 200 for f in others)
        assert beside.result().json()["choices"][0]["text"] == alone


# -- tools --------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}}, "required": ["zone"]}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls(client, choice):
    out = client.chat.completions.create(model="chat", messages=ask("What is the weather in Oslo?"),
                                         tools=[WEATHER, TIME], tool_choice=choice, temperature=0, max_tokens=200)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    if isinstance(choice, dict):
        assert call.function.name == "get_time" and isinstance(arguments["zone"], str)
    else:
        assert call.function.name in ("get_weather", "get_time")
        if call.function.name == "get_weather":
            assert arguments["unit"] in ("celsius", "fahrenheit") and isinstance(arguments["city"], str)


def test_a_forced_call_cut_short_keeps_its_complete_calls(client):
    """Greedy, with parallel calls asked for, this model repeats the call until max_tokens cuts the
    array: the complete calls come back as tool_calls with finish_reason "length", and the JSON never
    as content; streamed alike (where the cut call was already announced as it was generated)."""
    kwargs = dict(model="chat", messages=ask("What is the weather in Oslo?"), tools=[WEATHER],
                  tool_choice="required", parallel_tool_calls=True, temperature=0, max_tokens=70)
    c = client.chat.completions.create(**kwargs).choices[0]
    assert c.finish_reason == "length" and c.message.content is None, c.message
    assert c.message.tool_calls and all(t.function.name == "get_weather" for t in c.message.tool_calls)
    streamed_content, names, reasons = "", [], []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed_content += choice.delta.content or ""
            names += [t.function.name for t in choice.delta.tool_calls or () if t.function and t.function.name]
            reasons.append(choice.finish_reason)
    assert streamed_content == "" and reasons[-1] == "length"
    assert len(names) in (len(c.message.tool_calls), len(c.message.tool_calls) + 1)  # + the cut one, begun


def test_a_required_call_is_made_once_unless_parallel_calls_are_asked(client):
    """parallel_tool_calls defaults to false, as llama-server's (issue 16: the bundled model repeated
    the same call until max_tokens and answered finish_reason "length" with duplicates)."""
    c = client.chat.completions.create(model="chat", messages=ask("What is the weather in Oslo?"), tools=[WEATHER],
                                       tool_choice="required", temperature=0, max_tokens=200).choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c


def test_a_forced_call_wins_over_response_format_and_stop(client):
    """Issue 30: instructor, LangChain and pydantic-ai send response_format and stop with tool_choice on every
    call; as in OpenAI's API the forced call is the answer, and the stop strings do not cut its JSON."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "answer": {"type": "string"}}, "required": ["answer"], "additionalProperties": False}, "strict": True}}
    c = client.chat.completions.create(model="chat", messages=ask("What is the weather in Oslo?"), tools=[WEATHER],
                                       tool_choice="required", response_format=fmt, stop=['"', "}", ","],
                                       temperature=0, max_tokens=200).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    (call,) = c.message.tool_calls
    arguments = json.loads(call.function.arguments)  # whole, though '"', '}' and ',' are stop strings
    assert call.function.name == "get_weather" and set(arguments) == {"city", "unit"}, arguments


def test_forced_arguments_stream_token_by_token(client):
    """Before, the arguments came whole at the end, cut into 32-character pieces; now each token's
    part of them is a chunk of its own, sent as it is generated."""
    kwargs = dict(model="chat", messages=ask("What is the time in Oslo?"), tools=[TIME],
                  tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=0, max_tokens=60)
    pieces = []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            pieces += [t.function.arguments for t in choice.delta.tool_calls or () if t.function.arguments]
    arguments = "".join(pieces)
    assert isinstance(json.loads(arguments)["zone"], str)
    assert len(pieces) > len(arguments) // 32 + 1, pieces


def test_streamed_tool_calls_assemble_to_the_same_call(client):
    # One call: greedy, this small model would fill all 8 places the grammar gives parallel calls.
    kwargs = dict(model="chat", messages=ask("What is the weather in Oslo?"), tools=[WEATHER],
                  tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=200)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    name, arguments, ids, reasons = "", "", set(), []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or ():
            assert call.index == 0
            if call.id:
                ids.add(call.id)
            name += call.function.name or ""
            arguments += call.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert name == whole.function.name and json.loads(arguments) == json.loads(whole.function.arguments)
    assert len(ids) == 1 and reasons[-1] == "tool_calls"


def test_tool_round_trip(client):
    messages = ask("What is the weather in Oslo?")
    call = client.chat.completions.create(model="chat", messages=messages, tools=[WEATHER], tool_choice="required",
                                          parallel_tool_calls=False, temperature=0, max_tokens=200).choices[0].message
    messages.append(call.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.tool_calls[0].id,
                     "content": json.dumps({"temperature": 21, "sky": "clear"})})
    final = client.chat.completions.create(model="chat", messages=messages, tools=[WEATHER], temperature=0,
                                           max_tokens=40)
    assert final.choices[0].message.content  # an answer, after the tool's result went through the template
    prompt = client.post("/../apply-template", cast_to=object, body={"model": "chat", "messages": messages,
                                                                     "tools": [WEATHER]})
    assert "get_weather" in prompt["prompt"] and "clear" in prompt["prompt"]


def test_tool_choice_without_tools_and_unknown_function_are_400(daemon):
    r = daemon.http.post("/v1/chat/completions", json={"model": "chat", "messages": ask("hi"), "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = daemon.http.post("/v1/chat/completions", json={"model": "chat", "messages": ask("hi"), "tools": [WEATHER],
                                                       "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"]


# -- logprobs -----------------------------------------------------------------------

def test_completion_logprobs(client):
    out = client.completions.create(model="chat", prompt="The capital of France is", max_tokens=6, temperature=0,
                                    logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) == 3
        assert math.isclose(chosen, max(top.values()), abs_tol=1e-5)  # greedy: the model's most likely token
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_streamed_and_not(client):
    kwargs = dict(model="chat", messages=ask("Say hello."), max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kwargs).choices[0]
    entries = whole.logprobs.content
    assert len(entries) == 8 or whole.finish_reason == "stop"
    assert "".join(e.token for e in entries) == whole.message.content
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 and bytes(e.bytes).decode() == e.token for e in entries)
    streamed = [e for chunk in client.chat.completions.create(**kwargs, stream=True) if chunk.choices
                and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]
    # Not bit for bit: the second request finds its prompt cached and decodes only the last prompt
    # token, and llama.cpp's kernels for one token round differently from those for the whole prompt.
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=0.15) for a, b in zip(streamed, entries))


# -- embeddings ---------------------------------------------------------------------

def test_embeddings_from_the_second_model(client, daemon):
    out = client.embeddings.create(model="embed", input=["a cat sat on the mat", "a cat sat on the mat", "tax law"])
    vectors = [d.embedding for d in out.data]
    assert [d.index for d in out.data] == [0, 1, 2] and out.usage.prompt_tokens > 0
    assert all(math.isclose(sum(x * x for x in v), 1.0, rel_tol=1e-4) for v in vectors)
    assert vectors[0] == vectors[1]  # the same input, the same vector: inputs never see each other
    assert vectors[0] != vectors[2]
    encoded = client.embeddings.create(model="embed", input="a cat sat on the mat", encoding_format="base64")
    raw = base64.b64decode(encoded.data[0].embedding)  # little-endian float32, as OpenAI's
    assert [round(x, 5) for x in struct.unpack(f"<{len(raw) // 4}f", raw)] == [round(x, 5) for x in vectors[0]]
    r = daemon.http.post("/v1/embeddings", json={"model": "chat", "input": "x"})
    assert r.status_code == 400 and "embeddings = true" in r.json()["error"]["message"]
    # The planner's prediction counts an embeddings context's room for a batch of outputs (a vocabulary-wide
    # row each: ~0.5 GiB of compute buffer at load, as much again of output buffer once an input of
    # batch_size tokens is read), never less than what the load holds.
    footprint = {m["id"]: m["footprint_bytes"] for m in daemon.http.get("/v1/models").json()["data"]}["embed"]
    assert footprint["measured"] and footprint["measured"] <= footprint["predicted"] <= 2 * footprint["measured"]
    # Many inputs are read one per worker step (pings are answered between them): all come back, in order.
    worker = daemon.http.get("/props", params={"model": "embed"}).json()["last_wake"]["worker_pid"]
    many = client.embeddings.create(model="embed", input=[f"word {i}" for i in range(64)])
    assert [d.index for d in many.data] == list(range(64)) and many.data[5].embedding != many.data[6].embedding
    r = daemon.http.post("/v1/embeddings", json={"model": "embed", "input": ["fine", "x " * 2000]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("input 1:"), r.text
    assert daemon.http.get("/props", params={"model": "embed"}).json()["last_wake"]["worker_pid"] == worker
    r = daemon.http.post("/v1/chat/completions", json={"model": "embed", "messages": ask("hi")})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_generative"


# -- llama-server's extras ------------------------------------------------------------

def test_tokenize_detokenize_round_trip(daemon):
    r = daemon.http.post("/tokenize", json={"model": "chat", "content": "Hello world", "with_pieces": True}).json()
    assert "".join(t["piece"] for t in r["tokens"]) == "Hello world"
    ids = daemon.http.post("/tokenize", json={"model": "chat", "content": "Hello world", "add_special": True}).json()
    assert ids["tokens"][1:] == [t["id"] for t in r["tokens"]]  # BOS first
    back = daemon.http.post("/detokenize", json={"model": "chat", "tokens": [t["id"] for t in r["tokens"]]}).json()
    assert back["content"] == "Hello world"
    bad = daemon.http.post("/detokenize", json={"model": "chat", "tokens": [2**31 - 1]})
    assert bad.status_code == 400


def test_native_completion_and_timings(daemon):
    r = daemon.http.post("/completion", json={"model": "chat", "prompt": "Once upon a time", "n_predict": 8,
                                              "temperature": 0, "n_probs": 2}).json()
    assert r["stop"] is True and r["tokens_predicted"] == 8 and r["stop_type"] == "limit"
    t = r["timings"]
    assert t["predicted_n"] == 8 and t["prompt_n"] + t["cache_n"] == r["tokens_evaluated"] and t["predicted_per_second"] > 0
    assert len(r["completion_probabilities"]) == 8
    chunks = []
    with daemon.http.stream("POST", "/completion", json={"model": "chat", "prompt": "Once upon a time", "n_predict": 8,
                                                         "temperature": 0, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    assert "".join(c["content"] for c in chunks) == r["content"] and chunks[-1]["stop"] is True
    openai_answer = daemon.http.post("/v1/completions", json={"model": "chat", "prompt": "Hi", "max_tokens": 3}).json()
    assert openai_answer["timings"]["predicted_n"] == 3


# -- LangChain ------------------------------------------------------------------------

def test_langchain_structured_output_and_bound_tools(daemon):
    from langchain_openai import ChatOpenAI  # in the test extras: a missing install fails, never skips

    llm = ChatOpenAI(base_url=daemon.url + "/v1", api_key="unused", model="chat", temperature=0,
                                      max_tokens=300, max_retries=0, timeout=300)
    note = llm.with_structured_output(Note).invoke("Write a short to-do note.")
    assert isinstance(note, Note)
    reply = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("What is the weather in Oslo?")
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and call["args"]["unit"] in ("celsius", "fahrenheit")


# -- n choices -------------------------------------------------------------------------

def test_n_choices_share_one_prompt(client, daemon):
    """Greedy, every choice is the single answer token for token (each choice's KV is a copy of
    the one prompt decode, and generating slots decode side by side without changing logits);
    sampled with a seed, the choices differ from each other."""
    prompt = "The old lighthouse keeper looked at the sea and"
    single = client.completions.create(model="chat", prompt=prompt, max_tokens=24, temperature=0)
    greedy = client.completions.create(model="chat", prompt=prompt, max_tokens=24, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert {c.text for c in greedy.choices} == {single.choices[0].text}
    assert greedy.usage.completion_tokens == 3 * single.usage.completion_tokens
    assert greedy.usage.prompt_tokens == single.usage.prompt_tokens  # one prompt, counted once
    sampled = client.chat.completions.create(model="chat", messages=ask("Name a colour."), max_tokens=12,
                                             temperature=1.0, seed=7, n=4)
    texts = [c.message.content for c in sampled.choices]
    assert len(texts) == 4 and len(set(texts)) > 1, texts  # a seed per choice (seed + index): not 4 copies
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model="chat", prompt=prompt, max_tokens=24, temperature=0, n=2, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {0: single.choices[0].text, 1: single.choices[0].text}
    r = daemon.http.post("/v1/completions", json={"model": "chat", "prompt": "x", "n": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"  # 4 slots
    # The other choices' grammar is a clone of the first's, taken before it accepted anything.
    structured = client.chat.completions.create(model="chat", messages=ask("Give me a JSON object about cats."),
                                                response_format={"type": "json_object"}, temperature=0.7, seed=3,
                                                max_tokens=200, frequency_penalty=1.0, n=3)
    assert all(c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict)
               for c in structured.choices), [c.message.content for c in structured.choices]
