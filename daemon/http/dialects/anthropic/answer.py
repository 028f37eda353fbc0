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
from typing import Any

import msgspec
from aiohttp import web

from daemon import protocol as p
from daemon.fleet.owner import FleetModel
from daemon.http.core.job import ToolMode
from daemon.http.core.run import failure_error, first_item, is_failure, open_event_stream, tracked
from daemon.model.jobs import Job
from daemon.tools.forced_stream import ForcedCallStream
from daemon.tools.parse import ParsedCall, ToolCallStream
from daemon.tools.reasoning import ReasoningMode, ReasoningStream

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
        item = await first_item(request, model, job)
        if is_failure(item):
            raise failure_error(item)
        if stream:
            return await _stream(request, job, shape, item, tools)
        parts, reasoning_open = [], item.reasoning_open if isinstance(item, p.Tokens) else False
        while isinstance(item, p.Tokens):
            parts.append(item.text)
            item = await job.next(None)
        if is_failure(item):
            raise failure_error(item)
        thinking, text = ReasoningMode("auto", reasoning_open).split("".join(parts))
        reason, content, calls = item.finish_reason, text, []
        if tools is not None:
            content, calls, reason = tools.calls(text, reason)
        blocks: list[dict] = []
        if thinking:
            blocks.append({"type": "thinking", "thinking": thinking, "signature": ""})
        if content:
            blocks.append({"type": "text", "text": content})
        blocks += [shape.tool_use(call) for call in calls]
        stop_reason, stop_sequence = shape.stop(reason, item, calls)
        return web.json_response(shape.message(blocks, stop_reason, stop_sequence, shape.usage(item)))


class _Blocks:
    """The content blocks while they stream: one open at a time, numbered in
    order. Thinking goes out as thinking_delta, the answer as text_delta (held
    back while it may be a tool call), a forced call's arguments as
    input_json_delta as they are generated; calls read from the whole answer
    go out whole at the end."""

    def __init__(self, response: web.StreamResponse, shape: MessageShape, tools: ToolMode | None) -> None:
        self.response = response
        self.shape = shape
        self.tools = tools
        self.count = 0  # blocks started
        self.open: str | None = None  # the type of the block being written
        self.text: list[str] = []  # the answer after its thinking, read whole at the end for its calls
        self.reasoning: ReasoningStream | None = None  # made at the first Tokens
        forced = tools is not None and tools.forced
        self.scan = ToolCallStream(tools.names) if tools is not None and not forced else None
        self.forced = ForcedCallStream(tools.names, tool_use_id, most=None if tools.parallel else 1) if forced else None

    async def send(self, kind: str, **fields: Any) -> None:
        body = {"type": kind, **fields}
        await self.response.write(b"event: " + kind.encode() + b"\ndata: " + _encode(body) + b"\n\n")

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

    async def feed(self, tokens: p.Tokens) -> None:
        if self.reasoning is None:
            self.reasoning = ReasoningStream(tokens.reasoning_open)
        thinking, text = self.reasoning.feed(tokens.text)
        await self.thinking(thinking)
        await self._answer(text)

    async def _answer(self, text: str) -> None:
        if not text:
            return
        self.text.append(text)
        if self.forced is not None:
            for deltas in self.forced.feed(text):
                for delta in deltas:
                    await self._forced_delta(delta)
            return
        await self.say(self.scan.feed(text) if self.scan is not None else text)

    async def _forced_delta(self, delta: dict) -> None:
        if "id" in delta:  # a call's name is known and its arguments begin
            await self._start({"type": "tool_use", "id": delta["id"], "name": delta["function"]["name"], "input": {}})
            return
        await self.send("content_block_delta", index=self.count - 1,
                        delta={"type": "input_json_delta", "partial_json": delta["function"]["arguments"]})

    async def finish(self, reason: str, done: p.Done) -> tuple[str, str | None]:
        """Close every block; (stop_reason, stop_sequence)."""
        if self.reasoning is not None:
            thinking, text = self.reasoning.finish()
            await self.thinking(thinking)
            await self._answer(text)
        calls: list[ParsedCall] = []
        if self.tools is not None:
            content, calls, reason = self.tools.calls("".join(self.text), reason)
            if self.scan is not None:
                rest, _ = self.scan.finish()  # what it held back; the calls are read from the whole text
                await self.say(rest if content is not None else "")
        streamed = self.forced.announced if self.forced is not None else 0
        for call in calls[streamed:]:  # read from the whole answer: each sent whole
            await self._start({"type": "tool_use", "id": tool_use_id(), "name": call.name, "input": {}})
            await self.send("content_block_delta", index=self.count - 1,
                            delta={"type": "input_json_delta", "partial_json": call.arguments})
        await self.close()
        return self.shape.stop(reason, done, calls)


async def _stream(request: web.Request, job: Job, shape: MessageShape, item, tools: ToolMode | None
                  ) -> web.StreamResponse:
    response = await open_event_stream(request, job)
    blocks = _Blocks(response, shape, tools)
    first = item if isinstance(item, p.Tokens) else None
    usage = shape.usage(None, first.n_prompt_tokens if first else 0, first.n_cached_tokens if first else 0)
    await blocks.send("message_start", message=shape.message([], None, None, usage))
    while isinstance(item, p.Tokens):
        await blocks.feed(item)
        item = await job.next(None)
    if is_failure(item):
        await blocks.close()
        await blocks.send("error", error=failure_error(item).body("anthropic")["error"])
    else:
        stop_reason, stop_sequence = await blocks.finish(item.finish_reason, item)
        await blocks.send("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                          usage=shape.usage(item))
        await blocks.send("message_stop")
    await response.write_eof()
    return response
