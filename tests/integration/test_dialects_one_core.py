"""Every dialect driven through the same core (daemon/http/core/): the same
job, scripted item by item where the worker would answer (tests/integration/
scripted.py), read back through each dialect's answer, whole and streamed.

Each dialect's reader below brings its answer down to one common Read (the
text, the tool calls, the end, the token counts), so the same script must
read the same in every dialect; only the words for the end differ, and each
dialect's words are in its table. A new dialect is one more entry here."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from daemon import protocol as p
from daemon.model.jobs import Job
from tests.integration.scripted import scripted  # noqa: F401 (a fixture)
from tests.integration.test_http_hardening import daemon

pytestmark = pytest.mark.timeout(120)

ASK = [{"role": "user", "content": "hi"}]
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@dataclass(frozen=True)
class Read:
    """What an answer says, in no dialect's words."""

    text: str
    calls: tuple[tuple[str, dict], ...]  # (name, arguments)
    end: str  # the dialect's own word for it
    prompt_tokens: int | None  # None: the dialect does not say
    completion_tokens: int | None


@dataclass(frozen=True)
class Dialect:
    path: str
    body: Callable[[bool, bool], dict]  # (stream, with the tool) -> the request body
    whole: Callable[[dict], Read]
    streamed: Callable[[str], Read]
    ends: dict[str, str]  # the worker's finish_reason ("stop", "length", and "tool": a call made) -> the dialect's
    error: Callable[[dict], str]  # a whole answer's error body -> its message
    tools: bool = True  # the dialect takes tools


def sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def ndjson(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# -- OpenAI chat completions ----------------------------------------------------------------

def openai_body(stream: bool, tool: bool) -> dict:
    body = {"model": "fake", "messages": ASK, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if tool:
        body["tools"] = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}]
    return body


def openai_calls(calls: list[dict] | None) -> tuple[tuple[str, dict], ...]:
    return tuple((c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls or ())


def openai_whole(body: dict) -> Read:
    choice = body["choices"][0]
    return Read(choice["message"]["content"] or "", openai_calls(choice["message"].get("tool_calls")),
                choice["finish_reason"], body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"])


def openai_streamed(text: str) -> Read:
    chunks = sse(text)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls: dict[int, dict] = {}
    for delta in deltas:
        for part in delta.get("tool_calls") or ():
            call = calls.setdefault(part["index"], {"function": {"name": "", "arguments": ""}})
            call["function"]["name"] += part["function"].get("name") or ""
            call["function"]["arguments"] += part["function"].get("arguments") or ""
    ends = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    usage = chunks[-1]["usage"]
    return Read("".join(d.get("content") or "" for d in deltas), openai_calls(list(calls.values())), ends[-1],
                usage["prompt_tokens"], usage["completion_tokens"])


# -- OpenAI Responses -----------------------------------------------------------------------

def responses_body(stream: bool, tool: bool) -> dict:
    body = {"model": "fake", "input": "hi", "stream": stream}
    if tool:
        body["tools"] = [{"type": "function", "name": "get_weather", "parameters": PARAMETERS}]
    return body


def responses_whole(body: dict) -> Read:
    text = "".join(part["text"] for item in body["output"] if item["type"] == "message" for part in item["content"])
    calls = tuple((item["name"], json.loads(item["arguments"])) for item in body["output"]
                  if item["type"] == "function_call")
    end = body["status"] if body["status"] != "incomplete" else body["incomplete_details"]["reason"]
    if end == "completed" and calls:
        end = "completed+calls"
    return Read(text, calls, end, body["usage"]["input_tokens"], body["usage"]["output_tokens"])


def responses_streamed(text: str) -> Read:
    events = sse(text)
    final = responses_whole(events[-1]["response"])
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert streamed == final.text  # the deltas add up to the final response's text
    return final


# -- Anthropic Messages ---------------------------------------------------------------------

def anthropic_body(stream: bool, tool: bool) -> dict:
    body = {"model": "fake", "max_tokens": 100, "messages": ASK, "stream": stream}
    if tool:
        body["tools"] = [{"name": "get_weather", "input_schema": PARAMETERS}]
    return body


def anthropic_whole(body: dict) -> Read:
    text = "".join(b["text"] for b in body["content"] if b["type"] == "text")
    calls = tuple((b["name"], b["input"]) for b in body["content"] if b["type"] == "tool_use")
    usage = body["usage"]
    return Read(text, calls, body["stop_reason"], usage["input_tokens"] + usage.get("cache_read_input_tokens", 0),
                usage["output_tokens"])


def anthropic_streamed(text: str) -> Read:
    events = sse(text)
    blocks: dict[int, dict] = {}
    for e in events:
        if e["type"] == "content_block_start":
            blocks[e["index"]] = {**e["content_block"], "json": ""}
        elif e["type"] == "content_block_delta":
            delta = e["delta"]
            if delta["type"] == "text_delta":
                blocks[e["index"]]["text"] += delta["text"]
            elif delta["type"] == "input_json_delta":
                blocks[e["index"]]["json"] += delta["partial_json"]
    start = next(e for e in events if e["type"] == "message_start")["message"]["usage"]
    end = next(e for e in events if e["type"] == "message_delta")
    calls = tuple((b["name"], json.loads(b["json"])) for b in blocks.values() if b["type"] == "tool_use")
    usage = end["usage"]
    return Read("".join(b["text"] for b in blocks.values() if b["type"] == "text"), calls, end["delta"]["stop_reason"],
                usage.get("input_tokens", start["input_tokens"]) + usage.get("cache_read_input_tokens", 0),
                usage["output_tokens"])


# -- Ollama ---------------------------------------------------------------------------------

def ollama_body(stream: bool, tool: bool) -> dict:
    body = {"model": "fake", "messages": ASK, "stream": stream}
    if tool:
        body["tools"] = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}]
    return body


def ollama_whole(body: dict) -> Read:
    message = body["message"]
    calls = tuple((c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or ())
    return Read(message["content"], calls, body["done_reason"], body["prompt_eval_count"], body["eval_count"])


def ollama_streamed(text: str) -> Read:
    lines = ndjson(text)
    assert [line["done"] for line in lines] == [False] * (len(lines) - 1) + [True]
    calls = tuple((c["function"]["name"], c["function"]["arguments"]) for line in lines
                  for c in line["message"].get("tool_calls") or ())
    last = lines[-1]
    return Read("".join(line["message"]["content"] for line in lines), calls, last["done_reason"],
                last["prompt_eval_count"], last["eval_count"])


# -- llama-server's /completion -------------------------------------------------------------

def native_body(stream: bool, tool: bool) -> dict:
    return {"model": "fake", "prompt": "hi", "stream": stream}


def native_whole(body: dict) -> Read:
    return Read(body["content"], (), body["stop_type"], body["tokens_evaluated"], body["tokens_predicted"])


def native_streamed(text: str) -> Read:
    events = sse(text)
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    last = events[-1]
    return Read("".join(e["content"] for e in events), (), last["stop_type"], last["tokens_evaluated"],
                last["tokens_predicted"])


DIALECTS = {
    "openai": Dialect("/v1/chat/completions", openai_body, openai_whole, openai_streamed,
                      {"stop": "stop", "length": "length", "tool": "tool_calls"}, lambda b: b["error"]["message"]),
    "responses": Dialect("/v1/responses", responses_body, responses_whole, responses_streamed,
                         {"stop": "completed", "length": "max_output_tokens", "tool": "completed+calls"},
                         lambda b: b["error"]["message"]),
    "anthropic": Dialect("/v1/messages", anthropic_body, anthropic_whole, anthropic_streamed,
                         {"stop": "end_turn", "length": "max_tokens", "tool": "tool_use"},
                         lambda b: b["error"]["message"]),
    "ollama": Dialect("/api/chat", ollama_body, ollama_whole, ollama_streamed,
                      {"stop": "stop", "length": "length", "tool": "stop"}, lambda b: b["error"]),
    "llama_server": Dialect("/completion", native_body, native_whole, native_streamed,
                            {"stop": "eos", "length": "limit"}, lambda b: b["error"]["message"], tools=False),
}


def script(job: Job, pieces: list[str], reason: str) -> None:
    """The worker's side: one Tokens per piece, then the Done (5 prompt tokens, one per piece)."""
    for i, piece in enumerate(pieces):
        job.put(p.Tokens(job.id, piece, i + 1, n_prompt_tokens=5 if i == 0 else 0))
    job.put(p.Done(job.id, reason, prompt_tokens=5, completion_tokens=len(pieces)))


async def through_core(client, jobs: list[Job], dialect: Dialect, stream: bool, tool: bool,
                       fill: Callable[[Job], None]):
    """The dialect's answer to one request whose job `fill` scripts: (status, body text)."""
    request = asyncio.ensure_future(client.post(dialect.path, json=dialect.body(stream, tool)))
    while not jobs:
        await asyncio.sleep(0.005)
    fill(jobs[-1])
    response = await request
    return response.status, await response.text()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name", list(DIALECTS))
@pytest.mark.parametrize("reason", ["stop", "length"])
async def test_the_same_text_reads_the_same_in_every_dialect(scripted, name, stream, reason):
    dialect = DIALECTS[name]
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        status, text = await through_core(client, jobs, dialect, stream, False,
                                          lambda job: script(job, ["Hel", "lo", " there"], reason))
        assert status == 200, text
        read = (dialect.streamed if stream else dialect.whole)(text if stream else json.loads(text))
        assert read == Read("Hello there", (), dialect.ends[reason], 5, 3)
        assert jobs[0].submit.n == 1 and len(jobs) == 1  # one job, from the one request


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name", [n for n, d in DIALECTS.items() if d.tools])
async def test_the_same_tool_call_reads_the_same_in_every_dialect(scripted, name, stream):
    dialect = DIALECTS[name]
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        status, text = await through_core(client, jobs, dialect, stream, True,
                                          lambda job: script(job, [CALL[:20], CALL[20:]], "stop"))
        assert status == 200, text
        read = (dialect.streamed if stream else dialect.whole)(text if stream else json.loads(text))
        assert read.calls == (("get_weather", {"city": "Paris"}),)
        assert read.text == "" and read.end == dialect.ends["tool"]
        assert [t.name for t in jobs[0].submit.tools] == ["get_weather"]  # the core handed the tool on


@pytest.mark.parametrize("name", list(DIALECTS))
async def test_a_failed_job_is_each_dialects_error_with_the_workers_message(scripted, name):
    dialect = DIALECTS[name]
    async with daemon() as (controller, client):
        jobs = scripted(controller)

        def fail(job: Job) -> None:
            job.put(p.Done(job.id, "error", error="the worker fell over", error_code="internal_error"))

        status, text = await through_core(client, jobs, dialect, False, False, fail)
        assert status == 500, text
        assert dialect.error(json.loads(text)) == "the worker fell over"


@pytest.mark.parametrize("name", list(DIALECTS))
async def test_a_stream_that_fails_midway_ends_with_the_error_after_the_text(scripted, name):
    dialect = DIALECTS[name]
    async with daemon() as (controller, client):
        jobs = scripted(controller)

        def fail_midway(job: Job) -> None:
            job.put(p.Tokens(job.id, "Hel", 1, n_prompt_tokens=5))
            job.put(p.Done(job.id, "error", error="the worker fell over", error_code="internal_error"))

        status, text = await through_core(client, jobs, dialect, True, False, fail_midway)
        assert status == 200  # the headers went out with the first text
        assert "Hel" in text and "the worker fell over" in text
        assert text.index("Hel") < text.index("the worker fell over")
