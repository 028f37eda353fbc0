"""OpenAI Responses (/v1/responses) and the input_tokens endpoints, through
the real HTTP app on the fake worker, read by the openai SDK itself where it
parses something (responses.create, streamed events, responses.parse), with
the worker's side scripted token by token where tool calls matter; and
hostile input for every field: a 400 in OpenAI's error shape naming the
field, never a 500, a hang, or a model woken for a request that is refused."""

from __future__ import annotations

import asyncio
import base64
import json

import openai
import pydantic
import pytest

from daemon import protocol as p
from daemon.model.jobs import Job
from statemachine import ServerState
from tests.integration.test_http_hardening import daemon, error_of
from tests.integration.scripted import scripted  # noqa: F401 (a fixture)
from tests.unit.test_images import png

WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def answer(job: Job, pieces: list[str], reason: str = "stop") -> None:
    for i, piece in enumerate(pieces):
        job.put(p.Tokens(job.id, piece, i + 1, n_prompt_tokens=3 if i == 0 else 0))
    job.put(p.Done(job.id, reason, prompt_tokens=3, completion_tokens=len(pieces), cached_tokens=1))


async def next_job(jobs: list[Job], count: int) -> Job:
    while len(jobs) < count:
        await asyncio.sleep(0.005)
    return jobs[count - 1]


def sdk(client) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0, timeout=30)


def events_of(text: str) -> list[dict]:
    """The SSE events: `event:` names and `data:` bodies, checked to agree."""
    out = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: "), block
        body = json.loads(data[6:])
        assert body["type"] == kind[7:]
        out.append(body)
    return out


# -- text ----------------------------------------------------------------------------


async def test_text_answer_is_a_response_the_sdk_reads():
    async with daemon() as (controller, client):
        r = await sdk(client).responses.create(model="fake", input="hi", max_output_tokens=3, store=True,
                                               metadata={"who": "test"})
        assert r.object == "response" and r.id.startswith("resp_") and r.model == "fake"
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # the fake runs to it
        (message,) = r.output
        assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
        assert r.output_text == "t0 t1 t2 " == message.content[0].text
        assert r.usage.input_tokens == 3 and r.usage.output_tokens == 3 and r.usage.total_tokens == 6
        assert r.usage.input_tokens_details.cached_tokens == 0 and r.usage.output_tokens_details.reasoning_tokens == 0
        assert r.store is False and r.metadata == {"who": "test"}  # store is accepted; nothing is stored


async def test_instructions_and_items_become_the_chat_conversation(scripted):
    image = "data:image/png;base64," + base64.b64encode(png(4, 4)).decode()
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        body = {"instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0.2, "top_p": 0.5, "top_k": 5,
                "seed": 9, "input": [
                    {"role": "user", "content": "weather?"},
                    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
                    {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                     "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
                    {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
                     "arguments": '{"city": "Paris"}', "status": "completed"},
                    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                    {"role": "user", "content": [{"type": "input_text", "text": "and this?"},
                                                 {"type": "input_image", "image_url": image, "detail": "auto"}]}],
                "tools": [WEATHER]}
        request = asyncio.ensure_future(client.post("/v1/responses", json=body))
        job = await next_job(jobs, 1)
        answer(job, ["Sunny."])
        assert (await request).status == 200
        assert job.endpoint == "responses"
        m = job.submit.messages
        assert [x.role for x in m] == ["system", "user", "system", "assistant", "tool", "user"]
        assert m[0].content == "Be brief." and m[2].content == "Use tools."
        assert m[3].content == "Checking." and [(c.id, c.name, c.arguments) for c in m[3].tool_calls] == [
            ("call_1", "get_weather", '{"city": "Paris"}')]  # the call folded into the assistant turn before it
        assert (m[4].content, m[4].tool_call_id, m[4].name) == ("sunny", "call_1", "get_weather")
        assert [part.type for part in m[5].content] == ["text", "image"] and m[5].content[1].image == png(4, 4)
        assert [t.name for t in job.submit.tools] == ["get_weather"]
        params = job.submit.params
        assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed) == (7, 0.2, 0.5, 5, 9)


async def test_streamed_text_is_the_real_event_sequence(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        stream = asyncio.ensure_future(sdk(client).responses.create(model="fake", input="hi", stream=True))
        answer(await next_job(jobs, 1), ["Hel", "lo", " there"])
        events = [event async for event in await stream]
        kinds = [e.type for e in events]
        assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"] + ["response.output_text.delta"] * 3 + [
            "response.output_text.done", "response.content_part.done", "response.output_item.done",
            "response.completed"]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[0].response.status == "in_progress" and events[0].response.output == []
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there"
        item_id = events[2].item.id
        assert {e.item_id for e in events if hasattr(e, "item_id")} == {item_id}
        final = events[-1].response
        assert final.status == "completed" and final.output_text == "Hello there" and final.output[0].id == item_id
        assert final.usage.input_tokens == 3 and final.usage.output_tokens == 3
        assert final.usage.input_tokens_details.cached_tokens == 1


async def test_the_sdks_stream_helper_assembles_the_same_response(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)

        async def run():
            async with sdk(client).responses.stream(model="fake", input="hi") as stream:
                deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
                return deltas, await stream.get_final_response()

        task = asyncio.ensure_future(run())
        answer(await next_job(jobs, 1), ["a", "b"])
        deltas, final = await task
        assert deltas == ["a", "b"] and final.output_text == "ab"


async def test_a_stream_cut_by_max_output_tokens_ends_incomplete():
    async with daemon() as (controller, client):
        response = await client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "stream": True})
        events = events_of(await response.text())
        assert events[-1]["type"] == "response.incomplete"
        final = events[-1]["response"]
        assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
        assert final["output"][0]["status"] == "incomplete" and final["output"][0]["content"][0]["text"] == "t0 t1 "


async def test_a_failure_after_the_headers_is_response_failed(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        request = asyncio.ensure_future(client.post("/v1/responses", json={"input": "hi", "stream": True}))
        job = await next_job(jobs, 1)
        job.put(p.Tokens(job.id, "par", 1, n_prompt_tokens=3))
        job.put(p.Done(job.id, "error", error="the worker died", error_code="worker_crashed"))
        events = events_of(await (await request).text())
        assert events[-1]["type"] == "response.failed"
        assert events[-1]["response"]["error"] == {"code": "worker_crashed", "message": "the worker died"}


async def test_logprobs_come_when_included(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        request = asyncio.ensure_future(client.post("/v1/responses", json={
            "input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 2}))
        job = await next_job(jobs, 1)
        assert job.submit.params.logprobs == 2
        job.put(p.Tokens(job.id, "a", 1, logprobs=[p.TokenLogprob(5, b"a", -0.5, [p.TopLogprob(5, b"a", -0.5)])]))
        job.put(p.Done(job.id, "stop", prompt_tokens=3, completion_tokens=1))
        (entry,) = (await (await request).json())["output"][0]["content"][0]["logprobs"]
        assert entry["token"] == "a" and entry["logprob"] == -0.5 and entry["top_logprobs"][0]["token"] == "a"


# -- tools -----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_an_auto_call_is_a_function_call_item(scripted, stream):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        request = asyncio.ensure_future(sdk(client).responses.create(
            model="fake", input="weather in Paris?", tools=[WEATHER], stream=stream))
        text = f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>"
        answer(await next_job(jobs, 1), [text[i:i + 4] for i in range(0, len(text), 4)])
        result = await request
        if stream:
            events = [e async for e in result]
            streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert streamed == "Let me check."  # the call's markup never streams as text
            added = [e.item for e in events if e.type == "response.output_item.added"]
            assert [i.type for i in added] == ["message", "function_call"]
            arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
            assert json.loads(arguments) == {"city": "Paris"}
            result = events[-1].response
        message, call = result.output
        assert message.content[0].text == "Let me check." and result.status == "completed"
        assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        assert json.loads(call.arguments) == {"city": "Paris"}


async def test_a_forced_call_streams_its_arguments_as_they_are_generated(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        body = {"input": "weather?", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
                "stream": True}
        request = asyncio.ensure_future(client.post("/v1/responses", json=body))
        job = await next_job(jobs, 1)
        assert job.submit.params.grammar is not None  # the call is forced by a grammar
        job.put(p.Tokens(job.id, '[{"name": "get_weather", "arguments": {"ci', 1, n_prompt_tokens=3))
        response = await request
        seen: list[dict] = []
        while not any(e["type"] == "response.function_call_arguments.delta" for e in seen):
            block = b""
            while not block.endswith(b"\n\n"):
                block += await asyncio.wait_for(response.content.readline(), 10)
            seen += events_of(block.decode())
        assert not job.finished  # announced while the answer is still being generated
        job.put(p.Tokens(job.id, 'ty": "Paris"}}]', 2))
        job.put(p.Done(job.id, "stop", prompt_tokens=3, completion_tokens=2))
        events = seen + events_of((await response.read()).decode())
        assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"] == ["function_call"]
        arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
        assert arguments == '{"city": "Paris"}'
        done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
        assert done["arguments"] == arguments and done["name"] == "get_weather"
        final = events[-1]
        assert final["type"] == "response.completed" and final["response"]["output"][0]["arguments"] == arguments
        assert final["response"]["tool_choice"] == {"type": "function", "name": "get_weather"}


async def test_max_tool_calls_bounds_the_calls(scripted):
    two = f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL}\n</tool_call>"
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        for made, (limit, expected) in enumerate(((None, 2), (1, 1)), start=1):
            body = {"input": "x", "tools": [WEATHER], "parallel_tool_calls": True,
                    **({"max_tool_calls": limit} if limit else {})}
            request = asyncio.ensure_future(client.post("/v1/responses", json=body))
            answer(await next_job(jobs, made), [two])
            output = (await (await request).json())["output"]
            assert [item["type"] for item in output] == ["function_call"] * expected


# -- structured output ----------------------------------------------------------------


class City(pydantic.BaseModel):
    name: str
    population: int


async def test_responses_parse_with_a_pydantic_model(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        request = asyncio.ensure_future(sdk(client).responses.parse(model="fake", input="a city", text_format=City))
        job = await next_job(jobs, 1)
        assert '"population"' in job.submit.params.grammar  # the schema is enforced on the sampler
        answer(job, ['{"name": "Paris", ', '"population": 2100000}'])
        parsed = (await request).output_parsed
        assert parsed == City(name="Paris", population=2100000)


async def test_json_object_format_is_enforced_and_echoed(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        request = asyncio.ensure_future(client.post("/v1/responses", json={
            "input": "json please", "text": {"format": {"type": "json_object"}}}))
        job = await next_job(jobs, 1)
        assert job.submit.params.grammar is not None
        answer(job, ['{"a": 1}'])
        body = await (await request).json()
        assert body["text"]["format"] == {"type": "json_object"} and body["output"][0]["content"][0]["text"] == '{"a": 1}'


# -- token counts ------------------------------------------------------------------------


async def test_input_tokens_of_a_responses_body_and_of_a_chat_body():
    async with daemon() as (controller, client):
        r = await client.post("/v1/responses/input_tokens", json={"input": "one two three", "instructions": "four"})
        assert r.status == 200 and await r.json() == {"object": "response.input_tokens", "input_tokens": 4}
        r = await client.post("/v1/chat/completions/input_tokens", json={
            "messages": [{"role": "user", "content": "one two"}]})
        assert r.status == 200 and await r.json() == {"object": "response.input_tokens", "input_tokens": 2}
        error = await error_of(await client.post("/v1/chat/completions/input_tokens", json={"messages": 5}), 400)
        assert error["param"] == "messages"


# -- hostile input -----------------------------------------------------------------------

BIG = 10**12
HOSTILE = [
    # (body, the field the error names)
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": [5]}, "input.0"),
    ({"input": [{"role": "user", "content": "x"}] * 5000}, "input"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": 5}]}, "input.0.content"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}] * 2000}]}, "input.0.content"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input.0.content.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input.0.content.0.text"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input.0"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]},
     "input.0.arguments"),
    ({"input": [{"type": "function_call", "call_id": "", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input.0.call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input.0.output"),
    ({"input": "x", "instructions": 5}, "instructions"),
    ({"input": "x", "tools": "x"}, "tools"),
    ({"input": "x", "tools": [WEATHER] * 200}, "tools"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": "x", "tools": [{**WEATHER, "name": "a b"}]}, "tools.0.name"),
    ({"input": "x", "tools": [{**WEATHER, "parameters": 5}]}, "tools.0.parameters"),
    ({"input": "x", "tools": [{**WEATHER, "parameters": {"type": "string"}}], "tool_choice": "required"},
     "tools.0.parameters"),
    ({"input": "x", "tool_choice": 5}, "tool_choice"),
    ({"input": "x", "tool_choice": "maybe"}, "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"input": "x", "max_tool_calls": 0}, "max_tool_calls"),
    ({"input": "x", "max_tool_calls": BIG}, "max_tool_calls"),
    ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": BIG}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": "16"}, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x", "top_p": 7}, "top_p"),
    ({"input": "x", "top_k": -5}, "top_k"),
    ({"input": "x", "seed": -2}, "seed"),
    ({"input": "x", "stop": ["s"] * 100}, "stop"),
    ({"input": "x", "top_logprobs": 5}, "top_logprobs"),
    ({"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 99}, "top_logprobs"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include"),
    ({"input": "x", "include": "message.output_text.logprobs"}, "include"),
    ({"input": "x", "include": ["reasoning.encrypted_content"] * 100}, "include"),
    ({"input": "x", "text": "json"}, "text"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": 5}}}, "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {"$ref": "#/nope"}}}},
     "text.format.schema"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "reasoning": 5}, "reasoning"),
    ({"input": "x", "stream": "yes"}, "stream"),
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "service_tier": "priority"}, "service_tier"),
    ({"input": "x", "metadata": [1]}, "metadata"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "metadata": {"k": "v" * 600}}, "metadata.k"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "x", "response_format": {"type": "json_object"}}, "response_format"),
    ({"input": "x", "max_tokens": 5}, "max_tokens"),
    ({"input": "x", "model": 5}, "model"),
    ({"input": "x", "logit_bias": {"1": 1000}}, "logit_bias"),
    ({"input": "x", "chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs"),
]


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/responses/input_tokens"])
async def test_hostile_fields_are_400s_that_name_them(path):
    async with daemon() as (controller, client):
        for body, param in HOSTILE:
            if path.endswith("input_tokens") and param in ("tools.0.parameters", "text.format.schema",
                                                           "tool_choice", "stop", "top_k", "seed"):
                continue  # a count builds no grammar and samples nothing
            response = await client.post(path, json=body)
            assert response.status == 400, (body, await response.text())
            error = (await response.json())["error"]
            assert error["param"] == param, (body, error)
            assert error["type"] == "invalid_request_error" and error["message"].startswith(param), (body, error)
        assert controller.state is ServerState.READY


async def test_stateless_refusals_say_to_send_the_whole_input():
    async with daemon() as (controller, client):
        error = await error_of(await client.post("/v1/responses", json={"input": "x", "previous_response_id": "r"}), 400)
        assert "stateless" in error["message"] and "whole conversation" in error["message"]


async def test_images_get_chats_checks():
    def image(data: bytes) -> dict:
        return {"type": "input_image", "image_url": "data:image/png;base64," + base64.b64encode(data).decode()}

    async with daemon(max_images_per_request=2) as (controller, client):
        for content, code in (([image(png(4, 4))] * 3, "too_many_images"), ([image(png(4, 4)[:20])], "invalid_image"),
                              ([image(png(5000, 5000, pixels=False))], "image_too_large"),
                              ([{"type": "input_image", "image_url": "https://example.com/a.png"}], "invalid_image")):
            body = {"input": [{"role": "user", "content": content}]}
            for path in ("/v1/responses", "/v1/responses/input_tokens"):
                error = await error_of(await client.post(path, json=body), 400)
                assert error["code"] == code and error["param"] == "input", (path, error)


async def test_deep_nesting_and_wrong_content_type():
    async with daemon() as (controller, client):
        for path in ("/v1/responses", "/v1/responses/input_tokens", "/v1/chat/completions/input_tokens"):
            deep = '{"input": ' + "[" * 100_000 + "]" * 100_000 + "}"
            error = await error_of(await client.post(path, data=deep, headers={"Content-Type": "application/json"}), 400)
            assert error["code"] == "invalid_json"
            error = await error_of(await client.post(path, data='{"input": "x"}', headers={"Content-Type": "text/plain"}),
                                   415)
            assert error["code"] == "unsupported_media_type"
        schema: dict = {"type": "object"}
        for _ in range(200):
            schema = {"type": "object", "properties": {"a": schema}}
        body = {"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": schema}}}
        error = await error_of(await client.post("/v1/responses", json=body), 400)
        assert error["param"] == "text.format.schema" and "nested" in error["message"]


async def test_refused_requests_never_wake_a_sleeping_model():
    async with daemon() as (controller, client):
        assert (await client.post("/sleep")).status == 200
        assert controller.state is ServerState.SLEEPING
        for body, _ in HOSTILE:
            assert (await client.post("/v1/responses", json=body)).status == 400
        assert controller.state is ServerState.SLEEPING
        # A good one wakes it and is answered.
        r = await client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2})
        assert r.status == 200 and (await r.json())["output"][0]["content"][0]["text"] == "t0 t1 "


async def test_a_huge_input_is_refused_at_the_cost_of_a_count():
    async with daemon() as (controller, client):
        body = json.dumps({"input": [{"role": "user", "content": "x"}] * 200_000})
        error = await error_of(await client.post("/v1/responses", data=body,
                                                 headers={"Content-Type": "application/json"}), 400)
        assert error["param"] == "input" and "at most" in error["message"]
