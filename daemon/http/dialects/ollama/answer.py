"""What Ollama's clients read back from /api/chat, /api/generate and /api/embed.

A stream is NDJSON (application/x-ndjson): one JSON object per line, each
with `done: false` and a piece of the text, the last with `done: true`,
`done_reason` and the timings, in nanoseconds as Ollama gives them
(total_duration, load_duration, prompt_eval_duration, eval_duration). An error
after the headers went out is one more line, {"error": "..."}. Without
`stream`, the same last object carries the whole text.

Tool calls come read out of the text by the core's reader (core/events.py:
text that may be a call is held back while it streams); Ollama gives a
call's arguments as an object, and sends the calls in one line before the
last.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

import msgspec
from aiohttp import web

from daemon import protocol as p
from daemon.fleet.owner import FleetModel
from daemon.http.errors import ApiError
from daemon.http.core.events import (ChoiceReader, End, Event, Failure, TextDelta, Whole, read_events, token_logprobs,
                                     whole_or_error)
from daemon.http.core.job import ToolMode
from daemon.http.core.run import first_answer_item, tracked
from daemon.model.controller import Controller
from daemon.model.jobs import Job
from daemon.tools.parse import ParsedCall, new_call_id

_encode = msgspec.json.encode


def created_at(at: float | None = None) -> str:
    """RFC 3339 in UTC, as Ollama writes its times."""
    moment = datetime.fromtimestamp(time.time() if at is None else at, timezone.utc)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def durations(job: Job, controller: Controller, done: p.Done | None = None, prompt_tokens: int | None = None) -> dict:
    """Ollama's timings. load_duration is the wake this request waited for (0 when the model was awake)."""
    wake = controller.last_wake or {}
    out = {"total_duration": ns(time.monotonic() - job.accepted_at),
           "load_duration": ns(wake.get("seconds", 0.0)) if job.cold else 0}
    if done is not None:
        out.update(prompt_eval_count=done.prompt_tokens, prompt_eval_duration=ns(done.prompt_seconds),
                   eval_count=done.completion_tokens, eval_duration=ns(done.generation_seconds))
    elif prompt_tokens is not None:
        out["prompt_eval_count"] = prompt_tokens
    return out


def tool_calls_out(calls: list[ParsedCall]) -> list[dict]:
    """Ollama's tool_calls: the arguments as an object (ParsedCall holds them as JSON text of one)."""
    return [{"id": new_call_id(), "function": {"index": i, "name": c.name, "arguments": json.loads(c.arguments)}}
            for i, c in enumerate(calls)]


class _Lines:
    """The objects of one endpoint's answer."""

    def __init__(self, model_name: str, controller: Controller, logprobs: bool = False) -> None:
        self.name = model_name  # the name the client used, as Ollama echoes it
        self.controller = controller
        self.logprobs = logprobs

    def text(self, text: str, calls: list[ParsedCall] = ()) -> dict:
        raise NotImplementedError

    def head(self) -> dict:
        return {"model": self.name, "created_at": created_at()}

    def piece(self, text: str, calls: list[ParsedCall] = (), logprobs: list[p.TokenLogprob] = ()) -> dict:
        out = {**self.head(), **self.text(text, calls), "done": False}
        if self.logprobs:
            out["logprobs"] = token_logprobs(logprobs)
        return out

    def end(self, reason: str, done: p.Done, job: Job, text: str = "", calls: list[ParsedCall] = (),
            logprobs: list[p.TokenLogprob] = ()) -> dict:
        out = {**self.head(), **self.text(text, calls), "done": True, "done_reason": reason,
               **durations(job, self.controller, done)}
        if self.logprobs:
            out["logprobs"] = token_logprobs(logprobs)
        return out


class ChatLines(_Lines):
    def text(self, text: str, calls: list[ParsedCall] = ()) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = tool_calls_out(list(calls))
        return {"message": message}


class GenerateLines(_Lines):
    def text(self, text: str, calls: list[ParsedCall] = ()) -> dict:
        return {"response": text}


def load_answer(lines: _Lines, reason: str) -> dict:
    """The answer to Ollama's load or unload request (no text, no timings)."""
    return {**lines.head(), **lines.text(""), "done": True, "done_reason": reason}


def _done_reason(reason: str) -> str:
    # Ollama ends an answer that holds tool calls with "stop"; clients look for the calls.
    return "stop" if reason == "tool_calls" else reason


async def answer(request: web.Request, model: FleetModel, job: Job, lines: _Lines, stream: bool,
                 tools: ToolMode | None) -> web.StreamResponse:
    async with tracked(request, model, job, stream):
        item = await first_answer_item(request, model, job)
        if not stream:
            whole = await whole_or_error(job, item)
            return web.json_response(whole_body(whole, lines, job, tools))
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache",
                                               "X-Request-Id": job.id})
        await response.prepare(request)
        writer = LineWriter(response.write, lines, job)
        async for event in read_events(job, item, [ChoiceReader(0, tools)]):
            await writer.on(event)
        await response.write_eof()
        return response


def whole_body(whole: Whole, lines: _Lines, job: Job, tools: ToolMode | None) -> dict:
    choice = whole.choices[0]
    text, calls, reason = choice.text, [], choice.reason
    if tools is not None:
        content, calls, reason = tools.calls(text, reason)
        text = content or ""
    return lines.end(_done_reason(reason), whole.done, job, text, calls, choice.logprobs)


class LineWriter:
    """The events as Ollama streams them: a line per piece of text (with the
    logprobs so far), the text held back and the calls in one line, the last
    line with done_reason and the timings; a failure is an {"error"} line."""

    def __init__(self, write: Callable[[bytes], Awaitable], lines: _Lines, job: Job) -> None:
        self.write = write
        self.lines = lines
        self.job = job
        self.pending: list[p.TokenLogprob] = []  # not yet sent

    async def send(self, body: dict) -> None:
        await self.write(_encode(body) + b"\n")

    def take_logprobs(self) -> list[p.TokenLogprob]:
        taken, self.pending = self.pending, []
        return taken

    async def on(self, event: Event) -> None:
        if isinstance(event, Failure):
            await self.send(event.error.body("ollama"))
            return
        self.pending.extend(getattr(event, "logprobs", ()))
        if isinstance(event, TextDelta) and event.text:
            await self.send(self.lines.piece(event.text, logprobs=self.take_logprobs()))
        elif isinstance(event, End):
            if event.rest or event.calls:
                await self.send(self.lines.piece(event.rest, event.calls, self.take_logprobs()))
            await self.send(self.lines.end(_done_reason(event.reason), event.done, self.job,
                                           logprobs=self.take_logprobs()))


def embed_body(name: str, job: Job, controller: Controller, result: p.Answer, dimensions: int | None) -> dict:
    vectors = result.embeddings
    if dimensions is not None:
        check_dimensions(dimensions, len(vectors[0]) if vectors else None)  # the header did not say
        # As Ollama: the first `dimensions` values, normalized again.
        vectors = [_normalized(v[:dimensions]) for v in vectors]
    return {"model": name, "embeddings": vectors, **durations(job, controller, prompt_tokens=result.prompt_tokens)}


def _normalized(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else vector


def check_dimensions(dimensions: int | None, n_embd: int | None) -> None:
    if dimensions is not None and n_embd and dimensions > n_embd:
        raise ApiError(400, f"dimensions: at most {n_embd}, the model's embedding size", "invalid_value",
                       param="dimensions")
