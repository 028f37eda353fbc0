"""What /v1/responses answers: one response object, or the event stream that
builds it, as the openai SDK reads them (openai/types/responses/).

The output is a message item (one output_text part) for the answer's text and
a function_call item per tool call, in that order. An answer cut by
max_output_tokens is status "incomplete" with incomplete_details.reason
"max_output_tokens". Streamed, each event is `event: <type>` and
`data: {"type", "sequence_number", ...}`: response.created, response.in_progress,
then per item output_item.added, its content (content_part.added,
output_text.delta..., output_text.done, content_part.done; or
function_call_arguments.delta..., function_call_arguments.done),
output_item.done, and last response.completed (or response.incomplete,
or response.failed when generation failed after the headers went out).
No `data: [DONE]`: Responses streams end with their last event.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from daemon import protocol as p
from daemon.fleet.owner import FleetModel
from daemon.http.core.conversation import ChatJobRequest
from daemon.http.core.events import (ChoiceReader, End, Event, Failure, Progress, TextDelta, ToolCallDelta, Whole,
                                     read_events, timings, token_logprobs, whole_or_error)
from daemon.http.core.job import ToolMode
from daemon.http.core.run import first_answer_item, open_event_stream, tracked
from daemon.model.jobs import Job
from daemon.tools.parse import new_call_id

_encode = msgspec.json.encode


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class ResponseShape:
    """The response object of one request: what it echoes of the request, and its output items."""

    def __init__(self, job_id: str, model: str, body, chat: ChatJobRequest, params: p.SamplingParams) -> None:
        self.id = "resp_" + job_id.split("-", 1)[-1]
        self.created_at = int(time.time())
        self.max_tool_calls = body.max_tool_calls
        self.wants_logprobs = body.wants_logprobs
        self.timings_per_token = bool(chat.timings_per_token)  # llama-server's telemetry on the stream's deltas
        fmt = body.format
        self.echo = {
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls, "metadata": body.metadata or {}, "model": model,
            "parallel_tool_calls": chat.parallel_tool_calls, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "service_tier": "default", "store": False,
            "temperature": params.temperature, "top_p": params.top_p, "top_logprobs": body.top_logprobs,  # as used
            "text": {"format": fmt.echo() if fmt is not None else {"type": "text"}, "verbosity": "medium"},
            "tool_choice": body.tool_choice or "auto", "tools": [tool.echo() for tool in body.tools or ()],
            "truncation": "disabled", "user": body.safety_identifier or chat.user,
        }

    def response(self, status: str, output: list[dict], done: p.Done | None = None, error: dict | None = None) -> dict:
        finished = status in ("completed", "incomplete", "failed")
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "completed_at": int(time.time()) if status == "completed" else None, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            **self.echo, "output": output, "usage": usage(done) if finished and done is not None else None,
        }

    def logprobs(self, entries: list[p.TokenLogprob]) -> list[dict]:
        """output_text's logprobs: [] unless include asked for them."""
        return token_logprobs(entries) if self.wants_logprobs else []

    def text_part(self, text: str, logprobs: list[p.TokenLogprob] = ()) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": self.logprobs(list(logprobs))}

    @staticmethod
    def message(item_id: str, status: str, parts: list[dict]) -> dict:
        return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": parts}

    @staticmethod
    def call(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
        return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
                "arguments": arguments}


def usage(done: p.Done) -> dict[str, Any]:
    return {"input_tokens": done.prompt_tokens, "input_tokens_details": {"cached_tokens": done.cached_tokens},
            "output_tokens": done.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": done.prompt_tokens + done.completion_tokens}


def _status(reason: str) -> str:
    return "incomplete" if reason == "length" else "completed"


async def answer(request: web.Request, model: FleetModel, job: Job, shape: ResponseShape, tools: ToolMode | None,
                 stream: bool) -> web.StreamResponse:
    async with tracked(request, model, job, stream):
        item = await first_answer_item(request, model, job)
        if not stream:
            whole = await whole_or_error(job, item)
            return web.json_response(whole_body(whole, shape, tools))
        response = await open_event_stream(request, job)
        reader = ChoiceReader(0, tools, most_calls=shape.max_tool_calls)
        output = OutputStream(shape, _Events(response.write), tools, reader)
        await output.begin()
        async for event in read_events(job, item, [reader]):
            await output.on(event)
        await response.write_eof()
        return response


def whole_body(whole: Whole, shape: ResponseShape, tools: ToolMode | None) -> dict:
    """The response object: a message item for the text, a function_call item per call."""
    choice = whole.choices[0]
    content, calls, reason = choice.text, [], choice.reason
    if tools is not None:
        content, calls, reason = tools.calls(choice.text, reason)
    calls = calls[:shape.max_tool_calls]
    output = []
    if content is not None and (content or not calls):
        output.append(shape.message(_item_id("msg"), _status(reason), [shape.text_part(content, choice.logprobs)]))
    output += [shape.call(_item_id("fc"), new_call_id(), c.name, c.arguments, "completed") for c in calls]
    return shape.response(_status(reason), output, whole.done)


class _Events:
    """The SSE writer: each event numbered in order (sequence_number)."""

    def __init__(self, write: Callable[[bytes], Awaitable]) -> None:
        self._write = write
        self._numbers = itertools.count()

    async def send(self, kind: str, **fields: Any) -> None:
        body = {"type": kind, "sequence_number": next(self._numbers), **fields}
        await self._write(b"event: " + kind.encode() + b"\ndata: " + _encode(body) + b"\n\n")


class OutputStream:
    """The events as the Responses stream gives them: the message item opened
    at its first text, a forced call's item announced as its arguments begin
    (calls read from the whole answer are sent whole at the end), every item
    closed at the End, then response.completed or .incomplete (.failed on a Failure)."""

    def __init__(self, shape: ResponseShape, events: _Events, tools: ToolMode | None,
                 reader: ChoiceReader | None = None) -> None:
        self.shape = shape
        self.events = events
        self.tools = tools
        self.reader = reader  # its timings so far (llama-server's timings_per_token)
        self.items: list[dict] = []  # every item added, in output order (final forms once done)
        self.logprobs: list[p.TokenLogprob] = []  # of the message's text
        self.pending: list[p.TokenLogprob] = []  # not yet sent with a delta
        self.message: dict | None = None
        self.content: list[str] = []  # what the message's deltas said
        self.streamed: list[dict] = []  # forced calls announced: their items, arguments as streamed

    async def begin(self) -> None:
        started = self.shape.response("in_progress", [])
        await self.events.send("response.created", response=started)
        await self.events.send("response.in_progress", response=started)

    async def on(self, event: Event) -> None:
        if isinstance(event, (TextDelta, ToolCallDelta)):
            self.logprobs.extend(event.logprobs)
            self.pending.extend(event.logprobs)
        if isinstance(event, TextDelta):
            await self._say(event.text)
        elif isinstance(event, ToolCallDelta):
            for delta in event.deltas:
                await self._forced_delta(delta)
        elif isinstance(event, Progress):  # return_progress: llama-server says it with response.in_progress
            extra = {"timings": event.timings()} if self.shape.timings_per_token else {}
            # The response named, not echoed again (response.created had it whole): a long prompt sends one
            # of these per chunk read, and a request's tools or instructions could be megabytes.
            named = {"id": self.shape.id, "object": "response", "created_at": self.shape.created_at,
                     "status": "in_progress"}
            await self.events.send("response.in_progress", response=named,
                                   prompt_progress=event.prompt_progress(), **extra)
        elif isinstance(event, End):
            status = await self.finish(event)
            # llama.cpp's timings beside the response object, as llama-server ends its stream
            extra = {"timings": timings(event.done)} if event.done is not None else {}
            await self.events.send("response.completed" if status == "completed" else "response.incomplete",
                                   response=self.shape.response(status, self.items, event.done), **extra)
        elif isinstance(event, Failure):
            error = event.error
            await self.events.send("response.failed", response=self.shape.response(
                "failed", self.items, error={"code": error.code or "server_error", "message": error.message}))

    async def _say(self, text: str) -> None:
        if not text:
            return
        if self.message is None:
            await self._open_message()
        self.content.append(text)
        entries, self.pending = self.pending, []
        timed = self.reader.timings_so_far() if self.shape.timings_per_token and self.reader is not None else None
        await self.events.send("response.output_text.delta", item_id=self.message["id"], output_index=self._index,
                               content_index=0, delta=text, logprobs=self.shape.logprobs(entries),
                               **({"timings": timed} if timed is not None else {}))

    async def _open_message(self) -> None:
        self.message = self.shape.message(_item_id("msg"), "in_progress", [])
        self._index = len(self.items)
        self.items.append(self.message)
        await self.events.send("response.output_item.added", output_index=self._index, item=self.message)
        await self.events.send("response.content_part.added", item_id=self.message["id"], output_index=self._index,
                               content_index=0, part=self.shape.text_part(""))

    async def _forced_delta(self, delta: dict) -> None:
        if "id" in delta:  # a call's name is known and its arguments begin
            item = self.shape.call(_item_id("fc"), delta["id"], delta["function"]["name"], "", "in_progress")
            self.streamed.append(item)
            self.items.append(item)
            await self.events.send("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))
            return
        item = self.streamed[delta["index"]]
        item["arguments"] += delta["function"]["arguments"]
        await self.events.send("response.function_call_arguments.delta", item_id=item["id"],
                               output_index=self.items.index(item), delta=delta["function"]["arguments"])

    async def finish(self, end: End) -> str:
        """Close every item; the response's status."""
        await self._say(end.rest)
        calls = list(end.calls)[:self.shape.max_tool_calls]
        status = _status(end.reason)
        if self.message is None and not calls and not self.streamed:
            await self._open_message()  # an empty answer is an empty message, as unstreamed
        if self.message is not None:
            await self._close_message(status)
        for i, item in enumerate(self.streamed):  # forced calls: the grammar made each one's JSON whole, unless cut
            await self._close_call(item, "completed" if i < len(calls) else "incomplete")
        for call in calls[len(self.streamed):]:  # read from the whole answer: each sent whole
            item = self.shape.call(_item_id("fc"), new_call_id(), call.name, "", "in_progress")
            self.items.append(item)
            await self.events.send("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))
            item["arguments"] = call.arguments
            await self.events.send("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=len(self.items) - 1, delta=call.arguments)
            await self._close_call(item, "completed")
        return status

    async def _close_message(self, status: str) -> None:
        text, index, message = "".join(self.content), self._index, self.message
        part = self.shape.text_part(text, self.logprobs)
        await self.events.send("response.output_text.done", item_id=message["id"], output_index=index,
                               content_index=0, text=text, logprobs=part["logprobs"])
        await self.events.send("response.content_part.done", item_id=message["id"], output_index=index,
                               content_index=0, part=part)
        message.update(status=status, content=[part])
        await self.events.send("response.output_item.done", output_index=index, item=message)

    async def _close_call(self, item: dict, status: str) -> None:
        index = self.items.index(item)
        await self.events.send("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               name=item["name"], arguments=item["arguments"])
        item["status"] = status
        await self.events.send("response.output_item.done", output_index=index, item=item)
