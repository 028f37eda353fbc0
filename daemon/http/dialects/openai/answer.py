"""OpenAI's answer to a job (chat and completions): the worker's items gathered
into one JSON body, or streamed as SSE chunks ending with `data: [DONE]`;
tool calls and thinking read out of the text as they are generated
(StreamedChoice, which Ollama's stream reads its deltas with too)."""

from __future__ import annotations

import msgspec
from aiohttp import web

from daemon import protocol as p
from daemon.fleet.owner import FleetModel
from daemon.http.core.job import ToolMode
from daemon.http.core.run import failure_error, first_item, is_failure, open_event_stream, tracked
from daemon.http.dialects.openai.shapes import _Shape
from daemon.model.jobs import Job
from daemon.tools.forced_stream import ForcedCallStream
from daemon.tools.parse import ToolCallStream, new_call_id, stream_deltas
from daemon.tools.reasoning import ReasoningMode, ReasoningStream


class Choice:
    """What one choice produced, gathered for a JSON body."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.logprobs: list[p.TokenLogprob] = []
        self.finish_reason: str | None = None  # from its last Tokens (n > 1) or the Done
        self.reasoning_open = False  # the prompt left a thinking block open (its first Tokens says)

    def add(self, tokens: p.Tokens) -> None:
        self.reasoning_open = self.reasoning_open or tokens.reasoning_open
        self.parts.append(tokens.text)
        self.logprobs.extend(tokens.logprobs)
        if tokens.finish_reason is not None:
            self.finish_reason = tokens.finish_reason

    @property
    def text(self) -> str:
        return "".join(self.parts)


def tool_calls_out(calls) -> list[dict]:
    return [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


async def run_job(request: web.Request, model: FleetModel, job: Job, shape: _Shape, stream: bool,
                  include_usage: bool, tools: ToolMode | None = None, reasoning: str | None = None) -> web.StreamResponse:
    """tools: the output may hold tool calls (chat with tools). reasoning: a
    chat's reasoning_format (daemon/tools/reasoning.py); None: no thinking read out."""
    async with tracked(request, model, job, stream):
        item = await first_item(request, model, job)
        if is_failure(item):
            raise failure_error(item)
        if stream:
            return await _stream(request, job, shape, item, include_usage, tools, reasoning)
        choices = [Choice() for _ in range(job.submit.n)]
        while isinstance(item, p.Tokens):
            choices[item.index].add(item)
            item = await job.next(None)
        if is_failure(item):
            raise failure_error(item)
        out = []
        for index, choice in enumerate(choices):
            reason = choice.finish_reason or item.finish_reason
            text, thinking = choice.text, {}
            if reasoning is not None:  # the thinking first: tool calls are read from the rest
                thinking["reasoning"], text = ReasoningMode(reasoning, choice.reasoning_open).split(text)
            if tools is not None:
                content, calls, reason = tools.calls(text, reason)
                out.append(shape.choice(index, content, reason, choice.logprobs, tool_calls_out(calls) or None, **thinking))
            else:
                out.append(shape.choice(index, text, reason, choice.logprobs, **thinking))
        return web.json_response(shape.final(out, item))


_encode = msgspec.json.encode


class StreamedChoice:
    """One choice while it streams: text held back while it may be a tool
    call (auto), or a forced call's deltas as its arguments are generated,
    and the logprobs of that text."""

    def __init__(self, index: int, tools: ToolMode | None, reasoning: str | None = None) -> None:
        self.index = index
        self.tools = tools
        # Thinking streamed apart (delta.reasoning_content) with these formats; made at the first Tokens.
        self.reads_reasoning = reasoning in ("auto", "deepseek")
        self.reasoning: ReasoningStream | None = None
        self.thinking: list[str] = []  # thinking not yet sent
        forced = tools is not None and tools.forced
        self.calls = ToolCallStream(tools.names) if tools is not None and not forced else None
        self.forced = ForcedCallStream(tools.names, new_call_id, most=None if tools.parallel else 1) if forced else None
        self.text: list[str] = []  # all of it, read whole at the end
        self.pending: list[p.TokenLogprob] = []
        self.finished = False
        self.reason: str | None = None  # from its last Tokens (n > 1)

    def feed(self, tokens: p.Tokens) -> tuple[str, list[list[dict]]]:
        """(content safe to stream now, `delta.tool_calls` lists to stream now);
        thinking, if read apart, waits in take_thinking()."""
        self.pending.extend(tokens.logprobs)
        text = tokens.text
        if self.reads_reasoning:
            if self.reasoning is None:
                self.reasoning = ReasoningStream(tokens.reasoning_open)
            thinking, text = self.reasoning.feed(text)
            self.thinking.append(thinking)
        return self._content(text)

    def _content(self, text: str) -> tuple[str, list[list[dict]]]:
        if self.tools is None:
            return text, []
        self.text.append(text)
        if self.forced is not None:
            return "", self.forced.feed(text)
        return self.calls.feed(text), []

    def end_reasoning(self) -> tuple[str, list[list[dict]]]:
        """At the end: what the thinking held back (its tail waits in take_thinking()), as feed."""
        if self.reasoning is None:
            return "", []
        thinking, text = self.reasoning.finish()
        self.thinking.append(thinking)
        return self._content(text) if text else ("", [])

    def take_thinking(self) -> str:
        taken, self.thinking = "".join(self.thinking), []
        return taken

    def take_logprobs(self) -> list[p.TokenLogprob]:
        taken, self.pending = self.pending, []
        return taken


async def _stream(request: web.Request, job: Job, shape: _Shape, item, include_usage: bool,
                  tools: ToolMode | None, reasoning: str | None = None) -> web.StreamResponse:
    response = await open_event_stream(request, job)

    async def send(body: dict) -> None:
        await response.write(b"data: " + _encode(body) + b"\n\n")

    async def finish(choice: StreamedChoice, reason: str, done: p.Done | None) -> None:
        """The choice's held-back text, its tool calls as OpenAI streams them, its finish_reason."""
        choice.finished = True
        await send_pieces(choice, *choice.end_reasoning())
        if choice.tools is not None:
            rest_content, found, reason = choice.tools.calls("".join(choice.text), reason)
            if choice.forced is not None:  # never content; its calls went out as they were generated
                rest, first = "", choice.forced.announced
                found = found[first:]  # any the scan could not stream (not the grammar's shape), whole
            else:
                rest, _ = choice.calls.finish()  # what it held back; the calls are read from the whole text
                rest, first = ("" if rest_content is None else rest), 0
            if rest or choice.pending:
                await send(shape.chunk(rest, choice.take_logprobs(), index=choice.index))
            for deltas in stream_deltas(found, [new_call_id() for _ in found], first_index=first):
                await send(shape.chunk(None, tool_calls=deltas, index=choice.index))
        await send(shape.last_chunk(reason, done, index=choice.index))

    async def send_pieces(choice: StreamedChoice, text: str, call_deltas: list[list[dict]]) -> None:
        """What feed let out: thinking first, then content (with the logprobs so far), then call deltas."""
        thinking = choice.take_thinking()
        if thinking:
            await send(shape.chunk(None, choice.take_logprobs() if choice.tools is None else (), index=choice.index,
                                   reasoning=thinking))
        if text or (choice.pending and choice.tools is None):
            await send(shape.chunk(text, choice.take_logprobs(), index=choice.index))
        for deltas in call_deltas:  # a forced call's arguments, as they are generated
            await send(shape.chunk(None, tool_calls=deltas, index=choice.index))

    choices = [StreamedChoice(i, tools, reasoning) for i in range(job.submit.n)]
    for choice in choices:
        first = shape.first_chunk(index=choice.index)
        if first is not None:
            await send(first)
    while isinstance(item, p.Tokens):
        choice = choices[item.index]
        await send_pieces(choice, *choice.feed(item))
        if item.finish_reason is not None:  # with n > 1, each choice ends on its own ...
            choice.reason = item.finish_reason
            if sum(not c.finished for c in choices) > 1:
                await finish(choice, item.finish_reason, None)  # ... the last one with the Done's timings, below
        item = await job.next(None)
    if is_failure(item):
        await send(failure_error(item).body())
    else:
        for choice in choices:
            if not choice.finished:
                await finish(choice, choice.reason or item.finish_reason, item)
        if include_usage:
            await send(shape.usage_chunk(item))
        await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
