"""Anthropic Messages (/v1/messages, /v1/messages/count_tokens) through the
real HTTP app on the fake worker, read by the anthropic SDK itself where it
parses something (messages.create, messages.stream's assembled message,
count_tokens), with the worker's side scripted token by token where tool
calls and thinking matter; keys sent as x-api-key; and hostile input for
every field: a 4xx in Anthropic's error shape naming the field, never a 500,
a hang, or a model woken for a request that is refused."""

from __future__ import annotations

import asyncio
import base64
import json

import anthropic
import pytest

from daemon import protocol as p
from daemon.model.jobs import Job
from statemachine import ServerState
from tests.integration.test_http_hardening import daemon
from tests.integration.scripted import scripted  # noqa: F401 (a fixture)
from tests.unit.test_images import png

pytestmark = pytest.mark.timeout(120)

ASK = [{"role": "user", "content": "hi"}]
BODY = {"model": "fake", "max_tokens": 3, "messages": ASK}
WEATHER = {"name": "get_weather", "description": "the weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def answer(job: Job, pieces: list[str], reason: str = "stop", cached: int = 1, stopping_word: str = "",
           reasoning_open: bool = False) -> None:
    for i, piece in enumerate(pieces):
        first = i == 0
        job.put(p.Tokens(job.id, piece, i + 1, n_prompt_tokens=5 if first else 0, n_cached_tokens=cached if first else 0,
                         reasoning_open=reasoning_open and first))
    job.put(p.Done(job.id, reason, prompt_tokens=5, completion_tokens=len(pieces), cached_tokens=cached,
                   stopping_word=stopping_word))


async def next_job(jobs: list[Job], count: int) -> Job:
    while len(jobs) < count:
        await asyncio.sleep(0.005)
    return jobs[count - 1]


def sdk(client, api_key: str = "unused") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=str(client.make_url("")), api_key=api_key, max_retries=0, timeout=30)


def events_of(text: str) -> list[dict]:
    """The SSE events: `event:` names and `data:` bodies, checked to agree."""
    out = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: "), block
        body = json.loads(data[6:])
        assert body["type"] == kind[7:], block
        out.append(body)
    return out


async def anthropic_error(response, status: int) -> dict:
    """The error of an answer in Anthropic's shape: {"type": "error", "error": {"type", "message"}}, nothing else."""
    assert response.status == status, await response.text()
    body = await response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and isinstance(body["error"]["message"], str), body
    return body["error"]


def b64png(width: int = 4, height: int = 4) -> str:
    return base64.b64encode(png(width, height)).decode()


# -- text ------------------------------------------------------------------------------------


async def test_a_text_answer_is_a_message_the_sdk_reads():
    async with daemon() as (controller, client):
        raw = await (await client.post("/v1/messages", json=BODY)).json()
        assert set(raw) == {"id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"}
        assert raw["id"].startswith("msg_") and len(raw["id"]) > 4
        assert set(raw["usage"]) == {"input_tokens", "output_tokens", "cache_creation_input_tokens",
                                     "cache_read_input_tokens"}

        m = await sdk(client).messages.create(model="fake", max_tokens=3, messages=ASK)
        assert m.type == "message" and m.role == "assistant" and m.model == "fake" and m.id.startswith("msg_")
        assert m.id != raw["id"]  # one per request
        (block,) = m.content
        assert block.type == "text" and block.text == "t0 t1 t2 "  # the fake runs to max_tokens
        assert m.stop_reason == "max_tokens" and m.stop_sequence is None
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == 3  # the fake's prompt is 3 tokens
        assert m.usage.output_tokens == 3 and m.usage.cache_creation_input_tokens == 0


async def test_a_stop_sequence_ends_the_answer_and_is_named():
    async with daemon() as (controller, client):
        m = await sdk(client).messages.create(model="fake", max_tokens=10, messages=ASK, stop_sequences=["zz", "t2"])
        assert m.content[0].text == "t0 t1 "  # the stop string itself is not part of the answer
        assert m.stop_reason == "stop_sequence" and m.stop_sequence == "t2"
        assert m.usage.output_tokens == 3

        # Streamed: message_delta carries the same.
        response = await client.post("/v1/messages", json={**BODY, "max_tokens": 10, "stop_sequences": ["2 "],
                                                           "stream": True})
        events = events_of(await response.text())
        delta = next(e for e in events if e["type"] == "message_delta")
        assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "2 "}
        assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == "t0 t1 t"

        # A stop sequence the answer never writes: max_tokens, no stop_sequence.
        m = await sdk(client).messages.create(model="fake", max_tokens=2, messages=ASK, stop_sequences=["never"])
        assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("max_tokens", None, "t0 t1 ")


async def test_a_natural_end_is_end_turn_and_usage_counts_the_cache(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        request = asyncio.ensure_future(sdk(client).messages.create(model="fake", max_tokens=50, messages=ASK))
        answer(await next_job(jobs, 1), ["Hel", "lo."], cached=2)
        m = await request
        assert m.content[0].text == "Hello." and m.stop_reason == "end_turn" and m.stop_sequence is None
        # The worker read 5 prompt tokens, 2 of them from the prompt cache.
        assert (m.usage.input_tokens, m.usage.cache_read_input_tokens, m.usage.output_tokens) == (3, 2, 2)
        assert m.usage.cache_creation_input_tokens == 0


async def test_a_body_becomes_the_chat_conversation(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        body = {"model": "fake", "max_tokens": 7, "temperature": 0.25, "top_p": 0.5, "top_k": 5,
                "stop_sequences": ["END"], "metadata": {"user_id": "u1"},
                "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
                "tools": [WEATHER], "messages": [
                    {"role": "user", "content": "weather?"},
                    {"role": "assistant", "content": [
                        {"type": "thinking", "thinking": "they want weather", "signature": "sig"},
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                        {"type": "text", "text": "and this?"},
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64png()}}]}]}
        request = asyncio.ensure_future(client.post("/v1/messages", json=body,
                                                    headers={"anthropic-version": "2023-06-01"}))
        job = await next_job(jobs, 1)
        answer(job, ["Sunny."])
        assert (await request).status == 200
        assert job.endpoint == "messages"
        m = job.submit.messages
        assert [x.role for x in m] == ["system", "user", "assistant", "tool", "user"]
        assert m[0].content == "Be brief." and m[1].content == "weather?"
        assert m[2].content == "Checking." and m[2].reasoning_content == "they want weather"
        assert [(c.id, c.name, json.loads(c.arguments)) for c in m[2].tool_calls] == [
            ("toolu_1", "get_weather", {"city": "Paris"})]
        assert (m[3].content, m[3].tool_call_id, m[3].name) == ("sunny", "toolu_1", "get_weather")
        assert [part.type for part in m[4].content] == ["text", "image"] and m[4].content[1].image == png(4, 4)
        assert [t.name for t in job.submit.tools] == ["get_weather"]
        params = job.submit.params
        assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (7, 0.25, 0.5, 5)
        assert params.stop == ["END"] and params.grammar is None  # tool_choice auto: nothing forced


async def test_an_error_tool_result_says_so_to_the_model(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        body = {**BODY, "tools": [WEATHER], "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                          "content": [{"type": "text", "text": "no such city"}]}]}]}
        request = asyncio.ensure_future(client.post("/v1/messages", json=body))
        job = await next_job(jobs, 1)
        answer(job, ["Sorry."])
        assert (await request).status == 200
        tool = job.submit.messages[-1]
        assert tool.role == "tool" and tool.content == "Error: no such city"
        assert not job.submit.messages[1].content  # an assistant turn of calls only has no text


# -- streaming ----------------------------------------------------------------------------------


async def test_a_streamed_answer_is_the_real_event_sequence(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        request = asyncio.ensure_future(client.post("/v1/messages", json={**BODY, "stream": True}))
        answer(await next_job(jobs, 1), ["Hel", "lo", " there"], cached=1)
        response = await request
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
        events = events_of(await response.text())
        assert [e["type"] for e in events] == ["message_start", "content_block_start"] + ["content_block_delta"] * 3 + [
            "content_block_stop", "message_delta", "message_stop"]
        start = events[0]["message"]
        assert start["id"].startswith("msg_") and start["role"] == "assistant" and start["content"] == []
        assert start["stop_reason"] is None and start["usage"]["input_tokens"] == 4
        assert start["usage"]["cache_read_input_tokens"] == 1
        assert events[1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
        assert [e["delta"] for e in events[2:5]] == [{"type": "text_delta", "text": t} for t in ("Hel", "lo", " there")]
        assert {e["index"] for e in events[1:6]} == {0}
        assert events[6]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
        assert events[6]["usage"]["output_tokens"] == 3
        assert events[6]["usage"]["input_tokens"] + events[6]["usage"]["cache_read_input_tokens"] == 5


async def test_the_sdks_stream_helper_assembles_the_message(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)

        async def run():
            async with sdk(client).messages.stream(model="fake", max_tokens=50, messages=ASK) as stream:
                texts = [text async for text in stream.text_stream]
                return texts, await stream.get_final_message()

        task = asyncio.ensure_future(run())
        answer(await next_job(jobs, 1), ["a", "b", "c"])
        texts, final = await task
        assert texts == ["a", "b", "c"]
        assert [b.type for b in final.content] == ["text"] and final.content[0].text == "abc"
        assert final.stop_reason == "end_turn" and final.usage.output_tokens == 3
        assert final.usage.input_tokens + final.usage.cache_read_input_tokens == 5


async def test_the_sdk_assembles_a_stream_from_the_fake_worker():
    async with daemon() as (controller, client):
        async with sdk(client).messages.stream(model="fake", max_tokens=4, messages=ASK) as stream:
            final = await stream.get_final_message()
        whole = await sdk(client).messages.create(model="fake", max_tokens=4, messages=ASK)
        assert final.content[0].text == whole.content[0].text == "t0 t1 t2 t3 "
        assert final.stop_reason == whole.stop_reason == "max_tokens"
        assert final.usage.output_tokens == whole.usage.output_tokens == 4


async def test_thinking_is_a_thinking_block_whole_and_streamed(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        pieces = ["<think>", "let me ", "see</think>", "The answer."]
        request = asyncio.ensure_future(sdk(client).messages.create(model="fake", max_tokens=50, messages=ASK))
        answer(await next_job(jobs, 1), pieces)
        m = await request
        assert [b.type for b in m.content] == ["thinking", "text"]
        assert m.content[0].thinking == "let me see" and m.content[1].text == "The answer."

        request = asyncio.ensure_future(client.post("/v1/messages", json={**BODY, "stream": True}))
        answer(await next_job(jobs, 2), pieces)
        events = events_of(await (await request).text())
        starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
        assert starts == ["thinking", "text"]
        thinking = "".join(e["delta"]["thinking"] for e in events
                           if e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta")
        text = "".join(e["delta"]["text"] for e in events
                       if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta")
        assert thinking == "let me see" and text == "The answer."
        # Each block is closed before the next opens, and its deltas carry its index.
        order = [(e["type"], e.get("index")) for e in events if e["type"].startswith("content_block")]
        assert order[0] == ("content_block_start", 0) and ("content_block_stop", 0) in order
        assert order.index(("content_block_stop", 0)) < order.index(("content_block_start", 1))
        assert order[-1] == ("content_block_stop", 1)

        # A prompt that ended inside a thinking block (the template opened it): the answer's start is thinking.
        for made, stream in ((3, False), (4, True)):
            request = asyncio.ensure_future(client.post("/v1/messages", json={**BODY, "stream": stream}))
            answer(await next_job(jobs, made), ["hmm", "</think>", "Done."], reasoning_open=True)
            response = await request
            if stream:
                events = events_of(await response.text())
                blocks = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
                deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
                assert blocks == ["thinking", "text"]
                assert deltas == [{"type": "thinking_delta", "thinking": "hmm"}, {"type": "text_delta", "text": "Done."}]
            else:
                assert (await response.json())["content"] == [{"type": "thinking", "thinking": "hmm", "signature": ""},
                                                              {"type": "text", "text": "Done."}]


async def test_a_failure_after_the_headers_is_an_error_event(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        request = asyncio.ensure_future(client.post("/v1/messages", json={**BODY, "stream": True}))
        job = await next_job(jobs, 1)
        job.put(p.Tokens(job.id, "par", 1, n_prompt_tokens=3))
        job.put(p.Done(job.id, "error", error="the worker died", error_code="worker_crashed"))
        events = events_of(await (await request).text())
        assert [e["type"] for e in events][-2:] == ["content_block_stop", "error"]
        assert events[-1] == {"type": "error", "error": {"type": "api_error", "message": "the worker died"}}
        assert not any(e["type"] == "message_stop" for e in events)

        # The SDK raises it.
        async def run():
            async with sdk(client).messages.stream(model="fake", max_tokens=50, messages=ASK) as stream:
                return await stream.get_final_message()

        task = asyncio.ensure_future(run())
        job = await next_job(jobs, 2)
        job.put(p.Tokens(job.id, "par", 1, n_prompt_tokens=3))
        job.put(p.Done(job.id, "error", error="the worker died", error_code="worker_crashed"))
        with pytest.raises(anthropic.APIError, match="the worker died"):
            await task


async def test_a_failure_before_the_headers_is_a_status_in_anthropics_shape(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        for stream in (False, True):
            request = asyncio.ensure_future(client.post("/v1/messages", json={**BODY, "stream": stream}))
            job = await next_job(jobs, 1 + stream)
            job.put(p.Done(job.id, "error", error="prompt too long", error_code="context_length_exceeded"))
            error = await anthropic_error(await request, 400)
            assert error == {"type": "invalid_request_error", "message": "prompt too long"}


# -- tools ---------------------------------------------------------------------------------


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
async def test_a_forced_call_is_a_tool_use_block(scripted, choice):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        request = asyncio.ensure_future(sdk(client).messages.create(
            model="fake", max_tokens=50, messages=ASK, tools=[WEATHER], tool_choice=choice))
        job = await next_job(jobs, 1)
        assert job.submit.params.grammar is not None and "get_weather" in job.submit.params.grammar  # forced
        answer(job, ['[{"name": "get_weather", ', '"arguments": {"city": "Paris"}}]'])
        m = await request
        (block,) = m.content
        assert block.type == "tool_use" and block.name == "get_weather" and block.input == {"city": "Paris"}
        assert block.id.startswith("toolu_") and len(block.id) > 10
        assert m.stop_reason == "tool_use" and m.stop_sequence is None


async def test_a_forced_call_wins_over_stop_sequences(scripted):
    # As the API does (issue 30): the pair is answered, and no stop string can cut the call's JSON.
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        request = asyncio.ensure_future(sdk(client).messages.create(
            model="fake", max_tokens=50, messages=ASK, tools=[WEATHER], tool_choice={"type": "any"},
            stop_sequences=["Paris"]))
        job = await next_job(jobs, 1)
        assert job.submit.params.grammar is not None and job.submit.params.stop == []
        answer(job, ['[{"name": "get_weather", ', '"arguments": {"city": "Paris"}}]'])
        m = await request
        (block,) = m.content
        assert block.type == "tool_use" and block.input == {"city": "Paris"} and m.stop_reason == "tool_use"


async def test_a_forced_call_streams_its_input_as_it_is_generated(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        body = {**BODY, "max_tokens": 50, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"},
                "stream": True}
        request = asyncio.ensure_future(client.post("/v1/messages", json=body))
        job = await next_job(jobs, 1)
        job.put(p.Tokens(job.id, '[{"name": "get_weather", "arguments": {"ci', 1, n_prompt_tokens=3))
        response = await request
        seen: list[dict] = []
        while not any(e["type"] == "content_block_delta" for e in seen):
            block = b""
            while not block.endswith(b"\n\n"):
                block += await asyncio.wait_for(response.content.readline(), 10)
            seen += events_of(block.decode())
        assert not job.finished  # the tool_use block opened while the answer is still being generated
        start = next(e for e in seen if e["type"] == "content_block_start")["content_block"]
        assert start["type"] == "tool_use" and start["name"] == "get_weather" and start["input"] == {}
        assert start["id"].startswith("toolu_")
        job.put(p.Tokens(job.id, 'ty": "Paris"}}]', 2))
        job.put(p.Done(job.id, "stop", prompt_tokens=3, completion_tokens=2))
        events = seen + events_of((await response.read()).decode())
        deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
        assert {d["type"] for d in deltas} == {"input_json_delta"}
        partial = "".join(d["partial_json"] for d in deltas)
        assert len(deltas) >= 2 and json.loads(partial) == {"city": "Paris"}
        assert [e["type"] for e in events if e["type"].startswith("content_block_s")] == [
            "content_block_start", "content_block_stop"]
        delta = next(e for e in events if e["type"] == "message_delta")["delta"]
        assert delta == {"stop_reason": "tool_use", "stop_sequence": None}
        assert events[-1] == {"type": "message_stop"}


async def test_the_sdk_assembles_a_streamed_tool_use(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)

        async def run():
            async with sdk(client).messages.stream(model="fake", max_tokens=50, messages=ASK, tools=[WEATHER],
                                                   tool_choice={"type": "any"}) as stream:
                return await stream.get_final_message()

        task = asyncio.ensure_future(run())
        text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
        answer(await next_job(jobs, 1), [text[i:i + 5] for i in range(0, len(text), 5)])
        final = await task
        (block,) = final.content
        assert block.type == "tool_use" and block.name == "get_weather" and block.input == {"city": "Paris"}
        assert final.stop_reason == "tool_use"


@pytest.mark.parametrize("stream", [False, True])
async def test_an_auto_call_is_text_then_tool_use(scripted, stream):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        body = {**BODY, "max_tokens": 50, "tools": [WEATHER], "stream": stream}
        request = asyncio.ensure_future(client.post("/v1/messages", json=body))
        job = await next_job(jobs, 1)
        assert job.submit.params.grammar is None  # auto: the model's own call format is read
        text = f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>"
        answer(job, [text[i:i + 4] for i in range(0, len(text), 4)])
        response = await request
        if stream:
            events = events_of(await response.text())
            streamed = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
            assert streamed == "Let me check."  # the call's markup never streams as text
            starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
            assert [s["type"] for s in starts] == ["text", "tool_use"] and starts[1]["name"] == "get_weather"
            partial = "".join(e["delta"]["partial_json"] for e in events
                              if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta")
            assert json.loads(partial) == {"city": "Paris"}
            assert next(e for e in events if e["type"] == "message_delta")["delta"]["stop_reason"] == "tool_use"
        else:
            m = await response.json()
            assert [b["type"] for b in m["content"]] == ["text", "tool_use"]
            assert m["content"][0]["text"] == "Let me check." and m["content"][1]["input"] == {"city": "Paris"}
            assert m["stop_reason"] == "tool_use"


async def test_disable_parallel_tool_use_keeps_one_call(scripted):
    two = f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL}\n</tool_call>"
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        for made, (choice, expected) in enumerate((({"type": "auto"}, 2),
                                                    ({"type": "auto", "disable_parallel_tool_use": True}, 1)), start=1):
            request = asyncio.ensure_future(client.post("/v1/messages", json={
                **BODY, "tools": [WEATHER], "tool_choice": choice}))
            answer(await next_job(jobs, made), [two])
            content = (await (await request).json())["content"]
            assert [b["type"] for b in content] == ["tool_use"] * expected
            assert len({b["id"] for b in content}) == expected  # each call its own id


async def test_tool_choice_none_offers_no_tools(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        request = asyncio.ensure_future(client.post("/v1/messages", json={
            **BODY, "tools": [WEATHER], "tool_choice": {"type": "none"}}))
        job = await next_job(jobs, 1)
        answer(job, [f"<tool_call>\n{CALL}\n</tool_call>"])
        m = await (await request).json()
        assert job.submit.tools == [] and job.submit.params.grammar is None
        assert [b["type"] for b in m["content"]] == ["text"] and m["stop_reason"] == "end_turn"


# -- count_tokens --------------------------------------------------------------------------------


async def test_count_tokens_counts_system_messages_and_images():
    async with daemon() as (controller, client):
        # The fake counts a token per word (and one per image).
        counted = await sdk(client).messages.count_tokens(
            model="fake", system="four five", messages=[{"role": "user", "content": "one two three"}])
        assert counted.input_tokens == 5
        r = await client.post("/v1/messages/count_tokens", json={"model": "fake", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "one two"},
                                         {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": b64png()}}]}]})
        assert r.status == 200 and await r.json() == {"input_tokens": 3}
        error = await anthropic_error(await client.post("/v1/messages/count_tokens", json={"model": "fake"}), 400)
        assert error["message"].startswith("messages")


async def test_count_tokens_never_generates(scripted):
    async with daemon() as (controller, client):
        jobs = scripted(controller)
        r = await client.post("/v1/messages/count_tokens", json={"model": "fake", "messages": ASK})
        assert r.status == 200 and (await r.json())["input_tokens"] == 1
        assert jobs == []  # a count is a query, never a generation


# -- keys and headers -------------------------------------------------------------------------------


async def test_x_api_key_opens_the_messages_routes():
    async with daemon(api_key="sekret") as (controller, client):
        for path, body in (("/v1/messages", BODY), ("/v1/messages/count_tokens", {"model": "fake", "messages": ASK})):
            error = await anthropic_error(await client.post(path, json=body), 401)
            assert error["type"] == "authentication_error" and "key" in error["message"]
            error = await anthropic_error(await client.post(path, json=body, headers={"x-api-key": "wrong"}), 401)
            assert error["type"] == "authentication_error"
            for headers in ({"x-api-key": "sekret", "anthropic-version": "2023-06-01"},
                            {"Authorization": "Bearer sekret"},
                            {"x-api-key": "sekret", "anthropic-version": "2099-01-01",
                             "anthropic-beta": "something-2025-01-01"}):
                r = await client.post(path, json=body, headers=headers)
                assert r.status == 200, (path, headers, await r.text())

        # The SDK sends x-api-key and anthropic-version.
        m = await sdk(client, api_key="sekret").messages.create(model="fake", max_tokens=2, messages=ASK)
        assert m.content[0].text == "t0 t1 "
        with pytest.raises(anthropic.AuthenticationError) as refused:
            await sdk(client, api_key="nope").messages.create(model="fake", max_tokens=2, messages=ASK)
        assert refused.value.status_code == 401 and refused.value.body["error"]["type"] == "authentication_error"


# -- hostile input ------------------------------------------------------------------------------------

BIG = 10**12


def _nested_schema(levels: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _with(**fields) -> dict:
    return {**BODY, **fields}


def _user(*blocks) -> list[dict]:
    return [{"role": "user", "content": list(blocks)}]


IMAGE_URL = {"type": "image", "source": {"type": "url", "url": "http://169.254.169.254/latest/meta-data"}}
IMAGE_FILE = {"type": "image", "source": {"type": "file", "file_id": "file_1"}}
HUGE_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                                for i in range(10_000)}}
HOSTILE = [
    # (body, the field the error names)
    ({"model": "fake", "messages": ASK}, "max_tokens"),
    (_with(max_tokens=0), "max_tokens"),
    (_with(max_tokens=-5), "max_tokens"),
    (_with(max_tokens=BIG), "max_tokens"),
    (_with(max_tokens="16"), "max_tokens"),
    (_with(max_tokens=16.5), "max_tokens"),
    (_with(max_tokens=True), "max_tokens"),
    (_with(max_tokens=None), "max_tokens"),
    (_with(model=5), "model"),
    (_with(model=""), "model"),
    (_with(messages=[]), "messages"),
    (_with(messages="hi"), "messages"),
    (_with(messages=ASK * 5000), "messages"),
    (_with(messages=[{"role": "system", "content": "x"}]), "messages.0.role"),
    (_with(messages=[{"role": "tool", "content": "x"}]), "messages.0.role"),
    (_with(messages=[{"content": "x"}]), "messages.0.role"),
    (_with(messages=[{"role": "user"}]), "messages.0.content"),
    (_with(messages=[{"role": "user", "content": 5}]), "messages.0.content"),
    (_with(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}] * 2000}]), "messages.0.content"),
    (_with(messages=_user({"type": "wizard", "text": "x"})), "messages.0.content.0"),
    (_with(messages=_user({"text": "no type"})), "messages.0.content.0"),
    (_with(messages=_user("a bare string")), "messages.0.content.0"),
    (_with(messages=_user({"type": "text"})), "messages.0.content.0.text"),
    (_with(messages=_user({"type": "document", "source": {"type": "text", "data": "x"}})), "messages.0.content.0"),
    (_with(messages=_user({"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}})),
     "messages.0.content.0"),
    (_with(messages=_user(IMAGE_URL)), "messages.0.content.0.source"),
    (_with(messages=_user(IMAGE_FILE)), "messages.0.content.0.source"),
    (_with(messages=_user({"type": "image", "source": {"type": "s3", "key": "x"}})), "messages.0.content.0.source"),
    (_with(messages=_user({"type": "image", "source": {"type": "base64", "media_type": "image/tiff", "data": "x"}})),
     "messages.0.content.0.source.media_type"),
    (_with(messages=_user({"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"})),
     "messages.0.content.0.tool_use_id"),
    (_with(messages=_user({"type": "tool_result", "tool_use_id": "", "content": "x"})),
     "messages.0.content.0.tool_use_id"),
    (_with(messages=_user({"type": "tool_result", "tool_use_id": "t", "content": 5})), "messages.0.content.0.content"),
    (_with(messages=_user({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "document"}]})),
     "messages.0.content.0.content.0"),
    (_with(messages=_user({"type": "tool_use", "id": "t", "name": "f", "input": {}})), "messages.0"),
    (_with(messages=_user({"type": "redacted_thinking", "data": "x"})), "messages.0"),  # was a 500 (schemathesis)
    (_with(messages=_user({"type": "thinking", "thinking": "x", "signature": "s"})), "messages.0"),
    (_with(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]),
     "messages.0.content.0.input"),
    (_with(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "a b", "input": {}}]}]),
     "messages.0.content.0.name"),
    (_with(messages=[{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": _nested_schema(200)}]}]), "messages.0.content.0.input"),
    (_with(messages=[{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]),
     "messages.0"),
    (_with(system=5), "system"),
    (_with(system=[{"type": "image", "source": {}}]), "system.0"),
    (_with(tools="x"), "tools"),
    (_with(tools=[WEATHER] * 1000), "tools"),
    (_with(tools=[{**WEATHER, "name": "a b"}]), "tools.0.name"),
    (_with(tools=[{**WEATHER, "name": ""}]), "tools.0.name"),
    (_with(tools=[{**WEATHER, "name": "n" * 65}]), "tools.0.name"),
    (_with(tools=[{"name": "f"}]), "tools.0.input_schema"),
    (_with(tools=[{**WEATHER, "input_schema": 5}]), "tools.0.input_schema"),
    (_with(tools=[{**WEATHER, "input_schema": {"type": "string"}}]), "tools.0.input_schema"),
    (_with(tools=[{**WEATHER, "input_schema": _nested_schema(200)}]), "tools.0.input_schema"),
    (_with(tools=[{**WEATHER, "input_schema": HUGE_SCHEMA}]), "tools.0.input_schema"),
    (_with(tools=[{**WEATHER, "description": "x" * 100_000}]), "tools.0.description"),
    (_with(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools.0"),
    (_with(tools=[{"type": "bash_20250124", "name": "bash"}]), "tools.0"),
    (_with(tools=[WEATHER], tool_choice={"type": "maybe"}), "tool_choice"),
    (_with(tools=[WEATHER], tool_choice="any"), "tool_choice"),
    (_with(tools=[WEATHER], tool_choice={"type": "tool"}), "tool_choice.name"),
    (_with(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}), "tool_choice.name"),
    (_with(tool_choice={"type": "any"}), "tool_choice"),
    (_with(tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": "yes"}),
     "tool_choice.disable_parallel_tool_use"),
    (_with(stop_sequences=["s"] * 100), "stop_sequences"),
    (_with(stop_sequences=["s" * 10_000]), "stop_sequences"),
    (_with(stop_sequences="END"), "stop_sequences"),
    (_with(stop_sequences=[""]), "stop_sequences.0"),
    (_with(temperature=1.5), "temperature"),
    (_with(temperature=-0.1), "temperature"),
    (_with(temperature="hot"), "temperature"),
    (_with(top_p=-0.1), "top_p"),
    (_with(top_p=2), "top_p"),
    (_with(top_k=-1), "top_k"),
    (_with(top_k=BIG), "top_k"),
    (_with(top_k=2.5), "top_k"),
    (_with(stream="yes"), "stream"),
    (_with(metadata={"user_id": 5}), "metadata.user_id"),
    (_with(metadata=[1]), "metadata"),
    (_with(service_tier="priority"), "service_tier"),
    (_with(thinking={"type": "adaptive"}), "thinking.type"),
    (_with(thinking={"type": "enabled", "budget_tokens": -1}), "thinking.budget_tokens"),
    (_with(thinking={"type": "enabled", "budget_tokens": 10}), "thinking.budget_tokens"),  # not under max_tokens 3
    (_with(thinking={"type": "enabled"}, chat_template_kwargs={"enable_thinking": False}), "thinking"),
    (_with(mcp_servers=[{"type": "url", "url": "https://mcp.example.com", "name": "m"}]), "mcp_servers"),
    (_with(container="container_1"), "container"),
    (_with(context_management={"edits": []}), "context_management"),
    (_with(output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}}), "output_config"),
]
# What a count reads: the input (a count builds no grammar, samples nothing, stops nowhere).
COUNTED = ("model", "messages", "system", "tools", "tool_choice", "thinking.type", "mcp_servers", "container",
           "context_management", "output_config")


def _counted(param: str) -> bool:
    return param.split(".")[0] in COUNTED and not param.startswith("tool_choice.disable") and param != "thinking"


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
async def test_hostile_fields_are_400s_in_anthropics_shape_that_name_them(path):
    async with daemon() as (controller, client):
        checked = 0
        for body, param in HOSTILE:
            if path.endswith("count_tokens"):
                if not _counted(param):
                    continue
                body = {k: v for k, v in body.items() if k not in ("max_tokens", "stop_sequences", "temperature")}
            response = await client.post(path, json=body)
            assert response.status == 400, (param, await response.text())
            error = await anthropic_error(response, 400)
            assert error["type"] == "invalid_request_error", (body, error)
            assert error["message"].startswith(param), (param, error)
            checked += 1
        assert checked > (60 if path == "/v1/messages" else 30)
        assert controller.state is ServerState.READY
        # The daemon still answers a normal request.
        r = await client.post("/v1/messages", json=BODY)
        assert r.status == 200 and (await r.json())["content"][0]["text"] == "t0 t1 t2 "


async def test_bodies_that_are_not_a_json_object():
    async with daemon() as (controller, client):
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            for data in (b"{", b"not json", b"[1, 2]", b'"a string"', b"null", b"", b"\xff\xfe"):
                error = await anthropic_error(await client.post(path, data=data,
                                                                headers={"Content-Type": "application/json"}), 400)
                assert error["type"] == "invalid_request_error" and "body" in error["message"], (data, error)
            deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
            error = await anthropic_error(await client.post(path, data=deep,
                                                            headers={"Content-Type": "application/json"}), 400)
            assert "nested" in error["message"] or "JSON" in error["message"]
            for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
                headers = {"Content-Type": content_type} if content_type else {}
                error = await anthropic_error(await client.post(path, data=json.dumps(BODY).encode(), headers=headers),
                                              415)
                assert error["type"] == "invalid_request_error" and "Content-Type" in error["message"]
            error = await anthropic_error(await client.get(path), 405)
            assert error["type"] == "invalid_request_error"
        too_big = json.dumps(_with(system="x" * (9 * 1024 * 1024)))
        error = await anthropic_error(await client.post("/v1/messages", data=too_big,
                                                        headers={"Content-Type": "application/json"}), 413)
        assert error["type"] == "request_too_large"
        assert controller.state is ServerState.READY
        assert (await client.post("/v1/messages", json=BODY)).status == 200


async def test_images_get_chats_checks():
    def image(data: bytes) -> dict:
        return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(data).decode()}}

    async with daemon(max_images_per_request=2) as (controller, client):
        for blocks, words in (([image(png(4, 4))] * 3, "images"), ([image(png(4, 4)[:20])], "image"),
                              ([image(png(5000, 5000, pixels=False))], "pixels")):
            for path in ("/v1/messages", "/v1/messages/count_tokens"):
                error = await anthropic_error(await client.post(path, json=_with(messages=_user(*blocks))), 400)
                assert error["message"].startswith("messages") and words in error["message"], (path, error)
        not_base64 = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "!!not base64!!"}}
        error = await anthropic_error(await client.post("/v1/messages", json=_with(messages=_user(not_base64))), 400)
        assert error["message"].startswith("messages")


async def test_refused_requests_never_wake_a_sleeping_model():
    async with daemon() as (controller, client):
        assert (await client.post("/sleep")).status == 200
        assert controller.state is ServerState.SLEEPING
        for body, _ in HOSTILE:
            assert (await client.post("/v1/messages", json=body)).status == 400, body
        assert controller.state is ServerState.SLEEPING
        # A good one wakes it and is answered.
        m = await sdk(client).messages.create(model="fake", max_tokens=2, messages=ASK)
        assert m.content[0].text == "t0 t1 " and controller.state is ServerState.READY


async def test_a_message_beside_a_sleep():
    async with daemon(sleep_idle_seconds=-1) as (controller, client):
        # A streamed answer in flight: /sleep is refused (the model serves), the answer is whole.
        response = await client.post("/v1/messages", json={**BODY, "max_tokens": 30, "stream": True})
        assert response.status == 200
        first = await asyncio.wait_for(response.content.readline(), 10)
        assert first == b"event: message_start\n"
        refused = await client.post("/sleep")
        assert refused.status == 409, await refused.text()
        events = events_of(first.decode() + (await response.read()).decode())
        text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
        assert text == "".join(f"t{i} " for i in range(30)) and events[-1] == {"type": "message_stop"}

        # Asleep, a message request wakes it (streamed and not), and /sleep then works again.
        for stream in (False, True):
            assert (await client.post("/sleep")).status == 200
            assert controller.state is ServerState.SLEEPING
            r = await client.post("/v1/messages", json={**BODY, "stream": stream})
            assert r.status == 200, await r.text()
            if stream:
                events = events_of(await r.text())
                assert events[-1] == {"type": "message_stop"}
            else:
                assert (await r.json())["content"][0]["text"] == "t0 t1 t2 "
            assert controller.state is ServerState.READY
        # A count wakes it too (the template is the model's).
        assert (await client.post("/sleep")).status == 200
        r = await client.post("/v1/messages/count_tokens", json={"model": "fake", "messages": ASK})
        assert r.status == 200 and (await r.json())["input_tokens"] == 1


async def test_a_request_that_names_no_model_gets_the_default_one():
    """Anthropic's API requires `model`; llama-server and Dormouse's other dialects serve the default model
    (llama-server's test_server_sleep_token_counting_wake counts tokens with no model named)."""
    async with daemon() as (_, client):
        counted = await client.post("/v1/messages/count_tokens", json={"messages": ASK})
        assert counted.status == 200 and (await counted.json())["input_tokens"] > 0
        answered = await client.post("/v1/messages", json={"max_tokens": 3, "messages": ASK})
        assert answered.status == 200 and (await answered.json())["model"] == "fake"

