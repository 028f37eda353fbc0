"""OpenAI's answer to a job (chat and completions), from the core's events
(daemon/http/core/events.py): one JSON body (whole_body), or SSE chunks ending
with `data: [DONE]` (ChunkWriter); tool calls and thinking come read out of
the text by the core's reader, this file only shapes them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from daemon import protocol as p
from daemon.fleet.owner import FleetModel
from daemon.http.core.events import (ChoiceReader, End, Event, Failure, Progress, ReasoningDelta, TextDelta,
                                     ToolCallDelta, Whole, read_events, whole_or_error)
from daemon.http.core.job import ToolMode
from daemon.http.core.run import first_answer_item, open_event_stream, tracked
from daemon.http.dialects.openai.shapes import _Shape
from daemon.model.jobs import Job
from daemon.tools.parse import new_call_id, stream_deltas
from daemon.tools.reasoning import ReasoningMode


def tool_calls_out(calls) -> list[dict]:
    return [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


def streams_reasoning(reasoning: str | None) -> bool:
    """Thinking streamed apart (delta.reasoning_content) with these reasoning_formats."""
    return reasoning in ("auto", "deepseek")


async def run_job(request: web.Request, model: FleetModel, job: Job, shape: _Shape, stream: bool,
                  include_usage: bool, tools: ToolMode | None = None, reasoning: str | None = None,
                  extra: Callable[[], Awaitable[dict]] | None = None,
                  timings_per_token: bool = False) -> web.StreamResponse:
    """tools: the output may hold tool calls (chat with tools). reasoning: a
    chat's reasoning_format (daemon/tools/reasoning.py); None: no thinking read out.
    extra: keys added to a whole answer once it is read (llama-server's __verbose).
    timings_per_token: a stream's every chunk carries llama.cpp's timings so far."""
    async with tracked(request, model, job, stream):
        item = await first_answer_item(request, model, job)
        n = job.submit.n
        if not stream:
            whole = await whole_or_error(job, item, n)
            answer = whole_body(whole, shape, tools, reasoning)
            return web.json_response({**answer, **await extra()} if extra is not None else answer)
        response = await open_event_stream(request, job)
        readers = [ChoiceReader(i, tools, streams_reasoning(reasoning)) for i in range(n)]
        writer = ChunkWriter(response.write, shape, n, include_usage, tools, timed=readers if timings_per_token else None)
        await writer.begin()
        async for event in read_events(job, item, readers):
            await writer.on(event)
        await writer.close()
        await response.write_eof()
        return response


def whole_body(whole: Whole, shape: _Shape, tools: ToolMode | None, reasoning: str | None) -> dict:
    """chat.completion or text_completion: per choice, its thinking read first
    (tool calls are read from the rest), then its calls."""
    out = []
    for index, choice in enumerate(whole.choices):
        text, reason, thinking = choice.text, choice.reason, {}
        if reasoning is not None:
            thinking["reasoning"], text = ReasoningMode(reasoning, choice.reasoning_open).split(text)
        if tools is not None:
            content, calls, reason = tools.calls(text, reason)
            out.append(shape.choice(index, content, reason, choice.logprobs, tool_calls_out(calls) or None, **thinking))
        else:
            out.append(shape.choice(index, text, reason, choice.logprobs, **thinking))
    return shape.final(out, whole.done)


_encode = msgspec.json.encode


class ChunkWriter:
    """The events as OpenAI streams them. Per choice: thinking as
    delta.reasoning_content, text as delta.content, a forced call's deltas as
    they come, the calls read from the whole answer at its end, then its
    finish_reason; last the usage (include_usage) and `data: [DONE]`.
    Logprobs go out with the next text (with tools: only with text, as text
    may be held back while it may be a call)."""

    def __init__(self, write: Callable[[bytes], Awaitable], shape: _Shape, n: int, include_usage: bool,
                 tools: ToolMode | None, timed: list[ChoiceReader] | None = None) -> None:
        self.write = write
        self.timed = timed  # the choices' readers, whose timings so far go on each chunk (timings_per_token)
        self.shape = shape
        self.n = n
        self.include_usage = include_usage
        self.tools = tools
        self.pending: list[list[p.TokenLogprob]] = [[] for _ in range(n)]  # per choice: not yet sent
        self.done: p.Done | None = None
        self.failed = False

    async def send(self, body: dict) -> None:
        if self.timed is not None and body.get("choices") and "timings" not in body:
            timings = self.timed[body["choices"][0]["index"]].timings_so_far()
            if timings is not None:
                body["timings"] = timings
        await self.write(b"data: " + _encode(body) + b"\n\n")

    def take_logprobs(self, index: int) -> list[p.TokenLogprob]:
        taken, self.pending[index] = self.pending[index], []
        return taken

    async def begin(self) -> None:
        for index in range(self.n):
            first = self.shape.first_chunk(index=index)
            if first is not None:
                await self.send(first)

    async def on(self, event: Event) -> None:
        shape = self.shape
        if isinstance(event, Failure):
            self.failed = True
            await self.send(event.error.body())
            return
        index = event.index
        if isinstance(event, Progress):  # return_progress: the opening chunk again, with how far the read is
            chunk = self.shape.first_chunk(index=0) or self.shape.chunk("", index=0)
            chunk["prompt_progress"] = event.prompt_progress()
            if self.timed is not None:
                chunk["timings"] = event.timings()
            await self.send(chunk)
            return
        if isinstance(event, (ReasoningDelta, TextDelta, ToolCallDelta)):
            self.pending[index].extend(event.logprobs)
        if isinstance(event, ReasoningDelta):
            await self.send(shape.chunk(None, self.take_logprobs(index) if self.tools is None else (), index=index,
                                        reasoning=event.text))
        elif isinstance(event, TextDelta):
            if event.text or (self.pending[index] and self.tools is None):
                await self.send(shape.chunk(event.text, self.take_logprobs(index), index=index))
        elif isinstance(event, ToolCallDelta):
            await self.send(shape.chunk(None, tool_calls=event.deltas, index=index))
        elif isinstance(event, End):
            await self.end(event)

    async def end(self, end: End) -> None:
        """The text and logprobs still held, the calls not streamed yet (numbered
        after those that were), the finish_reason."""
        index = end.index
        if self.tools is not None:
            if end.rest or self.pending[index]:
                await self.send(self.shape.chunk(end.rest, self.take_logprobs(index), index=index))
            found = list(end.calls[end.announced:])
            for deltas in stream_deltas(found, [new_call_id() for _ in found], first_index=end.announced):
                await self.send(self.shape.chunk(None, tool_calls=deltas, index=index))
        if end.done is not None:
            self.done = end.done
        await self.send(self.shape.last_chunk(end.reason, end.done, index=index))

    async def close(self) -> None:
        if self.failed:
            return
        if self.include_usage:
            await self.send(self.shape.usage_chunk(self.done))
        await self.write(b"data: [DONE]\n\n")
