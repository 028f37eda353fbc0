"""What Ollama's clients read back from /api/chat, /api/generate and /api/embed.

A stream is NDJSON (application/x-ndjson): one JSON object per line, each
with `done: false` and a piece of the text, the last with `done: true`,
`done_reason` and the timings, in nanoseconds as Ollama gives them
(total_duration, load_duration, prompt_eval_duration, eval_duration). An error
after the headers went out is one more line, {"error": "..."}. Without
`stream`, the same last object carries the whole text.

Tool calls are read as chat completions read them (core/job.py's ToolMode,
openai/answer.py's StreamedChoice: text that may be a call is held back while it streams); Ollama
gives a call's arguments as an object, and sends the calls in one line before
the last.
"""

from __future__ import annotations

import json
import math
import time
from datetime import datetime, timezone
from typing import Any

import msgspec
from aiohttp import web

from daemon import protocol as p
from daemon.fleet.owner import FleetModel
from daemon.http.errors import ApiError
from daemon.http.core.job import ToolMode
from daemon.http.core.run import failure_error, first_item, is_failure, tracked
from daemon.http.dialects.openai.answer import StreamedChoice
from daemon.http.dialects.openai.shapes import piece_text
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


def logprobs_out(entries: list[p.TokenLogprob]) -> list[dict]:
    return [{"token": piece_text(e.piece), "logprob": e.logprob, "bytes": list(e.piece),
             "top_logprobs": [{"token": piece_text(t.piece), "logprob": t.logprob, "bytes": list(t.piece)}
                              for t in e.top]} for e in entries]


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
            out["logprobs"] = logprobs_out(list(logprobs))
        return out

    def end(self, reason: str, done: p.Done, job: Job, text: str = "", calls: list[ParsedCall] = (),
            logprobs: list[p.TokenLogprob] = ()) -> dict:
        out = {**self.head(), **self.text(text, calls), "done": True, "done_reason": reason,
               **durations(job, self.controller, done)}
        if self.logprobs:
            out["logprobs"] = logprobs_out(list(logprobs))
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
        item = await first_item(request, model, job)
        if is_failure(item):
            raise failure_error(item)
        if stream:
            return await _stream(request, job, lines, item, tools)
        parts, logprobs = [], []
        while isinstance(item, p.Tokens):
            parts.append(item.text)
            logprobs.extend(item.logprobs)
            item = await job.next(None)
        if is_failure(item):
            raise failure_error(item)
        text, calls, reason = "".join(parts), [], item.finish_reason
        if tools is not None:
            content, calls, reason = tools.calls(text, reason)
            text = content or ""
        return web.json_response(lines.end(_done_reason(reason), item, job, text, calls, logprobs))


async def _stream(request: web.Request, job: Job, lines: _Lines, item, tools: ToolMode | None) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache",
                                           "X-Request-Id": job.id})
    await response.prepare(request)

    async def send(body: dict) -> None:
        await response.write(_encode(body) + b"\n")

    choice = StreamedChoice(0, tools)
    while isinstance(item, p.Tokens):
        text, _ = choice.feed(item)  # with tools: the text that cannot be part of a call
        if text:
            await send(lines.piece(text, logprobs=choice.take_logprobs()))
        item = await job.next(None)
    if is_failure(item):
        await send(failure_error(item).body("ollama"))
    else:
        reason, calls, rest = item.finish_reason, [], ""
        if tools is not None:
            content, calls, reason = tools.calls("".join(choice.text), reason)
            held, _ = choice.calls.finish()
            rest = held if content is not None else ""  # None: what it held back was the calls
        if rest or calls:
            await send(lines.piece(rest, calls, choice.take_logprobs()))
        await send(lines.end(_done_reason(reason), item, job, logprobs=choice.take_logprobs()))
    await response.write_eof()
    return response


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
