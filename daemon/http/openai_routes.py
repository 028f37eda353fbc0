"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models.

A handler validates the body, routes it to the model it names (its `model`
field: an id or an alias; none, or a fleet of one: the default model; an
unknown name: 404 model_not_found), hands a job to that model's controller and turns what
the worker sends back into an OpenAI response: one JSON body, or SSE chunks
ending with `data: [DONE]`. Headers are sent only once the first token is
there, so a rejected or timed-out request still gets a proper status code.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import structlog
from aiohttp import web
from pydantic import BaseModel, ValidationError

from daemon import protocol as p
from daemon.http.errors import ApiError
from daemon.fleet.owner import FleetModel
from daemon.http.keys import FLEET, LOG, LOGGED, SETTINGS, model_for, no_room
from daemon.model.jobs import Job, JobFailure
from daemon.http.schemas import BodyError, ChatCompletionRequest, CompletionRequest, ImageRefused, decode_body, field_name


async def parse_body(request: web.Request, model: type[BaseModel]) -> BaseModel:
    """The validated body. Runs on the event loop: unknown fields are skipped
    undecoded and containers are counted before their items are validated,
    so this stays cheap for any body under max_body_bytes."""
    raw = await request.read()
    max_prompt_tokens = request.app[FLEET].max_ctx_size  # no slot of any model holds more
    try:
        data = decode_body(raw, model, max_prompt_tokens)
    except msgspec.ValidationError:  # JSON, but not an object
        raise ApiError(400, "request body must be a JSON object", "invalid_json") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
    except RecursionError:
        raise ApiError(400, "request body is not valid JSON: nested too deeply", "invalid_json") from None
    except BodyError as exc:
        raise ApiError(400, str(exc), "invalid_value", param=exc.param) from None
    try:
        return model.model_validate(data, context={"max_prompt_tokens": max_prompt_tokens})
    except ValidationError as exc:
        err = exc.errors()[0]
        name = field_name(err["loc"]) or "body"
        message = str(err["msg"]).removeprefix("Value error, ")
        raise ApiError(400, f"{name}: {message}", "invalid_value", param=name) from None


_NO_USAGE: Any = object()  # the body has no "usage" key at all


class _Shape:
    """How one endpoint's responses look."""

    object_name: str
    chunk_name: str

    def __init__(self, request_id: str, model: str, include_usage: bool = False) -> None:
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        # As OpenAI's: with stream_options.include_usage every chunk carries
        # "usage": null, and the last one (no choices) carries the usage.
        self.chunk_usage = None if include_usage else _NO_USAGE

    def envelope(self, object_name: str, choices: list[dict], usage: dict | None = _NO_USAGE) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                                "choices": choices}
        if usage is not _NO_USAGE:
            body["usage"] = usage
        return body


class CompletionShape(_Shape):
    def final(self, text: str, reason: str, usage: dict) -> dict:
        return self.envelope("text_completion", [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}], usage)

    def chunk(self, text: str, reason: str | None = None) -> dict:
        return self.envelope("text_completion", [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}],
                             self.chunk_usage)

    def first_chunk(self) -> dict | None:
        return None

    def usage_chunk(self, usage: dict) -> dict:
        return self.envelope("text_completion", [], usage)


class ChatShape(_Shape):
    def final(self, text: str, reason: str, usage: dict) -> dict:
        message = {"role": "assistant", "content": text}
        return self.envelope("chat.completion", [{"index": 0, "message": message, "logprobs": None, "finish_reason": reason}], usage)

    def chunk(self, text: str | None, reason: str | None = None) -> dict:
        delta = {} if text is None else {"content": text}
        return self.envelope("chat.completion.chunk", [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}],
                             self.chunk_usage)

    def first_chunk(self) -> dict | None:
        return self.envelope("chat.completion.chunk", [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                         "logprobs": None, "finish_reason": None}], self.chunk_usage)

    def usage_chunk(self, usage: dict) -> dict:
        return self.envelope("chat.completion.chunk", [], usage)


def _usage(done: p.Done) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


def _failure_error(item: JobFailure | p.Done) -> ApiError:
    if isinstance(item, JobFailure):
        return ApiError(item.status, item.message, item.code, retry_after=item.retry_after)
    if item.finish_reason == "cancelled":
        return ApiError(503, "request cancelled: the server is shutting down", "cancelled", retry_after=1)
    status = 400 if item.error_code in ("context_length_exceeded", "invalid_request") else 500
    return ApiError(status, item.error or "generation failed", item.error_code)


def _is_failure(item) -> bool:
    return isinstance(item, JobFailure) or (isinstance(item, p.Done) and item.finish_reason not in ("stop", "length"))


async def _first_item(request: web.Request, model: FleetModel, job: Job):
    settings = request.app[SETTINGS]
    try:
        return await job.next(settings.wake_timeout)
    except TimeoutError:
        refused = no_room(request, model, since=job.accepted_at)
        if refused is not None:  # the wake never started: the fleet had no room for it
            raise refused from None
        raise ApiError(503, f"the model did not become ready within {settings.wake_timeout:g}s (wake_timeout)",
                       "wake_timeout", retry_after=5) from None


async def run_job(request: web.Request, model: FleetModel, job: Job, shape: _Shape, stream: bool,
                  include_usage: bool) -> web.StreamResponse:
    controller = model.controller
    metrics = controller.metrics
    structlog.contextvars.bind_contextvars(request_id=job.id)
    request[LOGGED] = True  # the line below, with the job's timings
    status, code = 200, None
    try:
        item = await _first_item(request, model, job)
        if _is_failure(item):
            raise _failure_error(item)
        if stream:
            return await _stream(request, job, shape, item, include_usage)
        parts: list[str] = []
        while isinstance(item, p.Tokens):
            parts.append(item.text)
            item = await job.next(None)
        if _is_failure(item):
            raise _failure_error(item)
        return web.json_response(shape.final("".join(parts), item.finish_reason, _usage(item)))
    except ApiError as exc:
        status, code = exc.status, exc.code
        raise
    finally:
        controller.abandon(job)  # no-op once finished; frees the slot if the client left
        request.app[LOG].info("request", endpoint=job.endpoint, model=model.id, status=status, code=code, stream=stream,
                              cold=job.cold,
                              seconds=round(time.monotonic() - job.accepted_at, 4), finished=job.finished)
        metrics.requests.labels(endpoint=job.endpoint, status=str(status)).inc()
        metrics.request_seconds.labels(endpoint=job.endpoint, outcome="ok" if status == 200 else "error").observe(
            time.monotonic() - job.accepted_at)
        structlog.contextvars.unbind_contextvars("request_id")


_encode = msgspec.json.encode


async def _stream(request: web.Request, job: Job, shape: _Shape, item, include_usage: bool) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": job.id})
    await response.prepare(request)

    async def send(body: dict) -> None:
        await response.write(b"data: " + _encode(body) + b"\n\n")

    first = shape.first_chunk()
    if first is not None:
        await send(first)
    while isinstance(item, p.Tokens):
        if item.text:
            await send(shape.chunk(item.text))
        item = await job.next(None)
    if _is_failure(item):
        await send(_failure_error(item).body())
    else:
        await send(shape.chunk(None if isinstance(shape, ChatShape) else "", item.finish_reason))
        if include_usage:
            await send(shape.usage_chunk(_usage(item)))
        await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    body = await parse_body(request, CompletionRequest)
    model = model_for(request, body.model)
    job = model.controller.new_job("completions", body.sampling(body.max_tokens), prompt=body.prompt_value())
    shape = CompletionShape(f"cmpl-{job.id}", model.id, body.include_usage)
    return await run_job(request, model, job, shape, body.stream, body.include_usage)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await parse_body(request, ChatCompletionRequest)
    settings = request.app[SETTINGS]
    try:  # images are counted and their headers read here: the worker never sees one that is refused
        messages = body.protocol_messages(settings.max_images_per_request, settings.max_image_pixels)
    except ImageRefused as exc:
        raise ApiError(400, str(exc), exc.code, param="messages") from None
    model = model_for(request, body.model)
    job = model.controller.new_job("chat.completions", body.sampling(body.token_limit), messages=messages)
    shape = ChatShape(f"chatcmpl-{job.id}", model.id, body.include_usage)
    return await run_job(request, model, job, shape, body.stream, body.include_usage)


async def models(request: web.Request) -> web.Response:
    """Every configured model with its status (loaded, loading, sleeping,
    unloading, failed), answered from the daemon: it wakes nothing."""
    fleet = request.app[FLEET]
    return web.json_response({"object": "list", "data": [{
        "id": model.id, "object": "model", "created": int(model.controller.state_since), "owned_by": "dormouse",
        **fleet.describe(model), "meta": model.controller.model_info or None,
    } for model in fleet.models.values()]})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
