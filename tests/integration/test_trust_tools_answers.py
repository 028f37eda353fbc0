"""Tools and fields as clients send them (issue 16, section 7), through the
real HTTP app with the worker's side scripted token by token: forced call
arguments stream as they are generated, call markup never reaches content
(streamed or not), parallel_tool_calls is false unless asked, null on an
optional field means unset, and an error names its field."""

from __future__ import annotations

import asyncio
import json

import pytest

from daemon import protocol as p
from daemon.http.core import schemas
from daemon.http.dialects.llama_server import schemas as native_schemas
from daemon.http.dialects.openai.body import ChatCompletionRequest
from daemon.model.jobs import Job
from tests.integration.test_http_hardening import daemon, error_of
from tests.integration.scripted import scripted  # noqa: F401 (a fixture)

ASK = [{"role": "user", "content": "weather?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def answer(job: Job, pieces: list[str], reason: str = "stop") -> None:
    for i, piece in enumerate(pieces):
        job.put(p.Tokens(job.id, piece, i + 1, n_prompt_tokens=3 if i == 0 else 0))
    job.put(p.Done(job.id, reason, prompt_tokens=3, completion_tokens=len(pieces)))


async def first_job(jobs: list[Job]) -> Job:
    for _ in range(2000):  # 10 s: a handler that fails before making its job fails the test, not the suite
        if jobs:
            return jobs[0]
        await asyncio.sleep(0.005)
    raise AssertionError("the handler made no job")


def chunks(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def assembled(events: list[dict]) -> tuple[str, dict[int, list[str]], str | None]:
    """(content, {index: [name, arguments]}, finish_reason) of a chat stream."""
    content, calls, reason = "", {}, None
    for event in events:
        for choice in event["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls", ()):
                if "id" in call:
                    calls[call["index"]] = [call["function"]["name"], call["function"]["arguments"]]
                else:
                    calls[call["index"]][1] += call["function"]["arguments"]
            reason = choice["finish_reason"] or reason
    return content, calls, reason


# -- forced calls stream their arguments ------------------------------------------------


async def test_forced_arguments_stream_as_they_are_generated(scripted):
    """Before: the first tool_calls chunk came at the very end of the stream (4.45 s, all of it)."""
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        body = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required", "stream": True}
        request = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
        job = await first_job(jobs)
        pieces = ['[{"name": "get_', 'weather", "arguments": {"ci', 'ty": "Pa', 'ris"}}]']
        job.put(p.Tokens(job.id, pieces[0], 1, n_prompt_tokens=3))
        response = await request
        seen: list[dict] = []

        async def until(predicate) -> None:
            while not predicate():
                line = (await asyncio.wait_for(response.content.readline(), 10)).decode()
                if line.startswith("data: {"):
                    seen.append(json.loads(line[6:]))

        def arguments_so_far() -> str:
            return assembled(seen)[1].get(0, ["", ""])[1]

        for i, piece in enumerate(pieces[1:3], start=2):
            job.put(p.Tokens(job.id, piece, i))
        # The call is announced and its arguments so far are out while the answer is still being generated.
        await until(lambda: arguments_so_far() == '{"city": "Pa')
        assert assembled(seen)[1][0][0] == "get_weather" and not job.finished
        job.put(p.Tokens(job.id, pieces[3], 4))
        job.put(p.Done(job.id, "stop", prompt_tokens=3, completion_tokens=4))
        rest = chunks((await response.read()).decode())
        content, calls, reason = assembled(seen + rest)
        assert content == "" and reason == "tool_calls"
        assert calls == {0: ["get_weather", '{"city": "Paris"}']}
        ids = [c["id"] for e in seen + rest for ch in e["choices"] for c in ch["delta"].get("tool_calls", ()) if "id" in c]
        assert len(ids) == 1 and ids[0].startswith("call_")


@pytest.mark.parametrize("size", [1, 3, 8, 1000])
async def test_streamed_forced_calls_assemble_to_the_calls_of_the_whole_answer(scripted, size):
    text = f'[{CALL}, {{"name": "get_time", "arguments": {{}}}}]'
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        for stream in (False, True):
            body = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required", "stream": stream,
                    "parallel_tool_calls": True}
            request = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
            while len(jobs) < 1 + stream:
                await asyncio.sleep(0.005)
            answer(jobs[-1], [text[i:i + size] for i in range(0, len(text), size)])
            response = await request
            if not stream:
                message = (await response.json())["choices"][0]["message"]
                whole = {i: [c["function"]["name"], json.loads(c["function"]["arguments"])]
                         for i, c in enumerate(message["tool_calls"])}
                continue
            content, calls, reason = assembled(chunks(await response.text()))
            assert content == "" and reason == "tool_calls"
            assert {i: [name, json.loads(arguments)] for i, (name, arguments) in calls.items()} == whole


# -- call markup is never content ------------------------------------------------------------


CUT = f'Let me check.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{{"name": "get_ti'


@pytest.mark.parametrize("stream", [False, True])
async def test_an_auto_answer_cut_inside_a_call_keeps_its_markup_out_of_content(scripted, stream):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        body = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "auto", "stream": stream,
                "parallel_tool_calls": True}
        request = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
        answer(await first_job(jobs), [CUT[i:i + 5] for i in range(0, len(CUT), 5)], "length")
        response = await request
        if stream:
            content, calls, reason = assembled(chunks(await response.text()))
            names = [name for name, _ in calls.values()]
        else:
            choice = (await response.json())["choices"][0]
            content, reason = choice["message"]["content"], choice["finish_reason"]
            names = [c["function"]["name"] for c in choice["message"]["tool_calls"]]
        assert content == "Let me check." and names == ["get_weather"] and reason == "length"


# -- parallel_tool_calls ----------------------------------------------------------------------


async def test_parallel_tool_calls_is_false_unless_asked(scripted):
    """llama-server's default: with it true by default the bundled model repeated a forced call until max_tokens."""
    two = f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL}\n</tool_call>"
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        for made, (asked, expected) in enumerate(((None, 1), (False, 1), (True, 2)), start=1):
            body = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "auto",
                    **({} if asked is None else {"parallel_tool_calls": asked})}
            request = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
            while len(jobs) < made:
                await asyncio.sleep(0.005)
            answer(jobs[-1], [two])
            assert len((await (await request).json())["choices"][0]["message"]["tool_calls"]) == expected
        forced = asyncio.ensure_future(client.post("/v1/chat/completions", json={
            "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required"}))
        while len(jobs) < 4:
            await asyncio.sleep(0.005)
        grammar = jobs[-1].submit.params.grammar
        assert '"minItems":1,"maxItems":1' in grammar  # exactly one call
        answer(jobs[-1], [f"[{CALL}]"])
        assert (await forced).status == 200


# -- fields as clients send them -----------------------------------------------------------


def optional_fields(model) -> dict:
    return {name: None for name, field in model.model_fields.items() if not field.is_required()}


@pytest.mark.parametrize("path, model, required", [
    ("/v1/chat/completions", ChatCompletionRequest, {"messages": ASK}),
    ("/v1/completions", schemas.CompletionRequest, {"prompt": "x"}),
    ("/completion", native_schemas.NativeCompletionRequest, {"prompt": "x"}),
])
async def test_null_on_every_optional_field_means_unset(path, model, required):
    """OpenAI's semantics; 11 fields (temperature, stream, n, ...) refused null before."""
    async with daemon() as (controller, client):
        body = {**optional_fields(model), **required, "max_tokens": 2, "n_predict": 2}
        body = {k: v for k, v in body.items() if k in model.model_fields}
        response = await client.post(path, json=body)
        assert response.status == 200, await response.text()


def test_null_is_unset_in_every_request_object():
    """Nested objects too: messages, tools, tool calls, stream options, and llama-server's and embeddings' bodies."""
    message = {"role": "assistant", "content": None, "name": None, "tool_call_id": None,
               "tool_calls": [{"id": None, "type": None, "function": {"name": "f", "arguments": None}}]}
    tool = {"type": "function", "function": {"name": "f", "description": None, "parameters": None, "strict": None}}
    chat = ChatCompletionRequest.model_validate({"messages": [message], "tools": [tool],
                                                 "stream_options": {"include_usage": None}})
    assert chat.messages[0].tool_calls[0].function.arguments == "{}" and chat.tools[0].function.description == ""
    assert chat.temperature == 0.8 and chat.stream is False and chat.parallel_tool_calls is False
    for model, required in ((native_schemas.TokenizeRequest, {"content": "x"}), (native_schemas.DetokenizeRequest, {"tokens": [1]}),
                            (native_schemas.EmbeddingsRequest, {"input": "x"}), (native_schemas.ApplyTemplateRequest,
                                                                          {"messages": ASK})):
        model.model_validate({**optional_fields(model), **required})


@pytest.mark.parametrize("field, value", [("stream", 5), ("stream_options", {"include_usage": 5}), ("strict", "x"),
                                          ("stop", 5), ("messages", None), ("tool_choice", 5)])
async def test_an_error_names_its_field(field, value):
    """`stream`, `stream_options` and `strict` begin like pydantic's label "str": they were named "body"."""
    expected = {"stream_options": "stream_options.include_usage", "strict": "tools.0.function.strict"}.get(field, field)
    body = {"messages": ASK, "tools": [{"type": "function", "function": {"name": "f"}}]}
    if field == "strict":
        body["tools"][0]["function"]["strict"] = value
    else:
        body[field] = value
    async with daemon() as (controller, client):
        error = await error_of(await client.post("/v1/chat/completions", json=body), 400)
        assert error["param"] == expected, error
