"""What /v1/messages answers: one message object, or the event stream that
builds it, as the anthropic SDK reads them (anthropic/types/).

The content is, in order: a thinking block when the answer opened with one
(read out as llama-server's reasoning_format auto reads it), a text block, and
a tool_use block per tool call. stop_reason is end_turn, max_tokens,
stop_sequence (with stop_sequence, the string that matched) or tool_use.
usage counts input as Anthropic does: input_tokens are the tokens read, and
cache_read_input_tokens those the prompt cache already held (their sum is the
prompt; cache_creation_input_tokens is 0, as nothing is billed for writing).

Streamed, each event is `event: <type>` and `data: {"type", ...}`:
message_start, then per block content_block_start, its deltas (text_delta,
thinking_delta, input_json_delta) and content_block_stop, then message_delta
(stop_reason, stop_sequence, usage) and message_stop. A failure after the
headers went out is an `error` event in Anthropic's error shape.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from daemon import protocol as p
from daemon.fleet.owner import FleetModel
from daemon.http.core.events import (ChoiceReader, End, Event, Failure, ReasoningDelta, Start, TextDelta,
                                     ToolCallDelta, Whole, read_events, whole_or_error)
from daemon.http.core.job import ToolMode
from daemon.http.core.run import failure_error, first_answer_item, open_event_stream, tracked
from daemon.model.jobs import Job
from daemon.tools.parse import ParsedCall
from daemon.tools.reasoning import ReasoningMode

_encode = msgspec.json.encode


def tool_use_id() -> str:
    """An id in the shape Anthropic's look: "toolu_" and 24 url-safe characters."""
    return "toolu_" + secrets.token_urlsafe(18)


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as tool_use's input. The parsers hand over JSON objects
    only; anything else would be a bug, kept visible rather than dropped."""
    value = msgspec.json.decode(arguments)
    return value if isinstance(value, dict) else {"arguments": value}


class MessageShape:
    """The message object of one request."""

    def __init__(self, job_id: str, model: str, stops: list[str] | None) -> None:
        self.id = "msg_" + job_id.split("-", 1)[-1]
        self.model = model
        self.stops = list(stops or ())

    def message(self, content: list[dict], stop_reason: str | None, stop_sequence: str | None,
                usage: dict[str, int]) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    @staticmethod
    def usage(done: p.Done | None, prompt_tokens: int = 0, cached_tokens: int = 0) -> dict[str, int]:
        if done is not None:
            prompt_tokens, cached_tokens = done.prompt_tokens, done.cached_tokens
        return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": done.completion_tokens if done else 0,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}

    @staticmethod
    def stop(reason: str, done: p.Done, calls: list) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) from the worker's finish_reason."""
        if reason == "length":
            return "max_tokens", None
        if calls:
            return "tool_use", None
        if done.stopping_word:
            return "stop_sequence", done.stopping_word
        return "end_turn", None

    @staticmethod
    def tool_use(call: ParsedCall, call_id: str | None = None) -> dict:
        return {"type": "tool_use", "id": call_id or tool_use_id(), "name": call.name, "input": _input(call.arguments)}


async def answer(request: web.Request, model: FleetModel, job: Job, shape: MessageShape, tools: ToolMode | None,
                 stream: bool) -> web.StreamResponse:
    async with tracked(request, model, job, stream):
        item = await first_answer_item(request, model, job)
        if not stream:
            whole = await whole_or_error(job, item)
            return web.json_response(whole_body(whole, shape, tools))
        response = await open_event_stream(request, job)
        blocks = BlockStream(response.write, shape)
        # Thinking read apart as llama-server's reasoning_format auto reads it; streamed calls get tool_use ids.
        async for event in read_events(job, item, [ChoiceReader(0, tools, reasoning=True, call_id=tool_use_id)]):
            await blocks.on(event)
        await response.write_eof()
        return response


def whole_body(whole: Whole, shape: MessageShape, tools: ToolMode | None) -> dict:
    """The message: a thinking block when the answer opened with one, its text, a tool_use block per call."""
    choice = whole.choices[0]
    thinking, text = ReasoningMode("auto", choice.reasoning_open).split(choice.text)
    reason, content, calls = choice.reason, text, []
    if tools is not None:
        content, calls, reason = tools.calls(text, reason)
    blocks: list[dict] = []
    if thinking:
        blocks.append({"type": "thinking", "thinking": thinking, "signature": ""})
    if content:
        blocks.append({"type": "text", "text": content})
    blocks += [shape.tool_use(call) for call in calls]
    stop_reason, stop_sequence = shape.stop(reason, whole.done, calls)
    return shape.message(blocks, stop_reason, stop_sequence, shape.usage(whole.done))


class BlockStream:
    """The events as Anthropic streams them: message_start (its usage from the
    first step), then content blocks, one open at a time, numbered in order:
    thinking as thinking_delta, the answer as text_delta, a forced call's
    arguments as input_json_delta as they are generated, calls read from the
    whole answer whole at the end; then message_delta and message_stop, or an
    `error` event on a Failure."""

    def __init__(self, write: Callable[[bytes], Awaitable], shape: MessageShape) -> None:
        self.write = write
        self.shape = shape
        self.started = False  # message_start sent
        self.count = 0  # blocks started
        self.open: str | None = None  # the type of the block being written

    async def send(self, kind: str, **fields: Any) -> None:
        body = {"type": kind, **fields}
        await self.write(b"event: " + kind.encode() + b"\ndata: " + _encode(body) + b"\n\n")

    async def on(self, event: Event) -> None:
        if not self.started:
            self.started = True
            first = event if isinstance(event, Start) else Start(0)
            usage = self.shape.usage(None, first.prompt_tokens, first.cached_tokens)
            await self.send("message_start", message=self.shape.message([], None, None, usage))
        if isinstance(event, ReasoningDelta):
            await self.thinking(event.text)
        elif isinstance(event, TextDelta):
            await self.say(event.text)
        elif isinstance(event, ToolCallDelta):
            for delta in event.deltas:
                await self._forced_delta(delta)
        elif isinstance(event, End):
            stop_reason, stop_sequence = await self.finish(event)
            await self.send("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                            usage=self.shape.usage(event.done))
            await self.send("message_stop")
        elif isinstance(event, Failure):
            await self.close()
            await self.send("error", error=failure_error(event.item).body("anthropic")["error"])

    async def _start(self, block: dict) -> None:
        await self.close()
        self.open = block["type"]
        await self.send("content_block_start", index=self.count, content_block=block)
        self.count += 1

    async def close(self) -> None:
        if self.open is not None:
            self.open = None
            await self.send("content_block_stop", index=self.count - 1)

    async def _delta(self, kind: str, block: dict, delta: dict) -> None:
        if self.open != kind:
            await self._start(block)
        await self.send("content_block_delta", index=self.count - 1, delta=delta)

    async def thinking(self, text: str) -> None:
        if text:
            await self._delta("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                              {"type": "thinking_delta", "thinking": text})

    async def say(self, text: str) -> None:
        if text:
            await self._delta("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": text})

    async def _forced_delta(self, delta: dict) -> None:
        if "id" in delta:  # a call's name is known and its arguments begin
            await self._start({"type": "tool_use", "id": delta["id"], "name": delta["function"]["name"], "input": {}})
            return
        await self.send("content_block_delta", index=self.count - 1,
                        delta={"type": "input_json_delta", "partial_json": delta["function"]["arguments"]})

    async def finish(self, end: End) -> tuple[str, str | None]:
        """Close every block; (stop_reason, stop_sequence)."""
        await self.say(end.rest)
        for call in end.calls[end.announced:]:  # read from the whole answer: each sent whole
            await self._start({"type": "tool_use", "id": tool_use_id(), "name": call.name, "input": {}})
            await self.send("content_block_delta", index=self.count - 1,
                            delta={"type": "input_json_delta", "partial_json": call.arguments})
        await self.close()
        return self.shape.stop(end.reason, end.done, list(end.calls))
