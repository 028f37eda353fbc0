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
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import msgspec
import structlog
from aiohttp import web
from pydantic import BaseModel, ValidationError

from daemon import protocol as p
from daemon.http.errors import ApiError
from daemon.fleet.owner import FleetModel
from daemon.http.keys import CALLER, FLEET, JOB, LOG, LOGGED, SETTINGS, cache_scope, model_for, no_room
from daemon.model.jobs import Job, JobFailure, request_cache_scope
from daemon.http.core.schemas import (BodyError, ChatCompletionRequest, CompletionRequest, ImageRefused, SamplingFields,
                                  decode_body, field_name)
from daemon.http.dialects.openai.shapes import ChatShape, CompletionShape, _Shape, system_fingerprint
from daemon.tools.forced_stream import ForcedCallStream
from daemon.tools.parse import ToolCallStream, forced_calls, new_call_id, parse_tool_calls, stream_deltas
from daemon.tools.reasoning import ReasoningMode, ReasoningStream


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
        body = model.model_validate(data, context={"max_prompt_tokens": max_prompt_tokens})
    except ValidationError as exc:
        err = exc.errors()[0]
        name = field_name(err["loc"]) or "body"
        message = str(err["msg"]).removeprefix("Value error, ")
        raise ApiError(400, f"{name}: {message}", "invalid_value", param=name) from None
    salt = getattr(body, "cache_salt", None)
    if salt is not None:  # the key's scope (set by the access check) narrowed by the body's salt
        request_cache_scope.set(cache_scope(request.get(CALLER), salt))
    return body


# Worker error codes that are the request's fault.
CLIENT_ERRORS = ("context_length_exceeded", "invalid_request", "invalid_grammar", "embeddings_not_enabled")


def _failure_error(item: JobFailure | p.Done) -> ApiError:
    if isinstance(item, JobFailure):
        return ApiError(item.status, item.message, item.code, retry_after=item.retry_after)
    if item.finish_reason == "cancelled":
        return ApiError(503, "request cancelled: the server is shutting down", "cancelled", retry_after=1)
    status = 400 if item.error_code in CLIENT_ERRORS else 500
    return ApiError(status, item.error or "generation failed", item.error_code)


def _is_failure(item) -> bool:
    return isinstance(item, JobFailure) or (isinstance(item, p.Done) and item.finish_reason not in ("stop", "length"))


async def _first_item(request: web.Request, model: FleetModel, job: Job):
    settings = request.app[SETTINGS]
    max_wait = getattr(job, "max_wait", None) if job.cold else None  # X-Dormouse-Max-Wait: a wake's wait only
    try:
        return await job.next(settings.wake_timeout if max_wait is None else min(max_wait, settings.wake_timeout))
    except TimeoutError:
        refused = no_room(request, model, since=job.accepted_at)
        if refused is not None:  # the wake never started: the fleet had no room for it
            raise refused from None
        raise ApiError(503, f"the model did not become ready within {settings.wake_timeout:g}s (wake_timeout)",
                       "wake_timeout", retry_after=5) from None


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


@dataclass(frozen=True)
class ToolMode:
    """How an answer's tool calls are read. forced: a grammar made the whole
    answer the call array (tool_choice required or named), so it is never
    content, even cut short; else the model's own format is recognised."""

    names: tuple[str, ...]
    forced: bool
    parallel: bool

    def calls(self, text: str, worker_reason: str) -> tuple[str | None, list, str]:
        """(content, calls, finish_reason) of a whole answer."""
        if self.forced:
            content, calls = None, forced_calls(text, self.names)
        else:
            content, calls = parse_tool_calls(text, self.names)
        if not self.parallel:
            calls = calls[:1]
        # Cut short is "length" whatever it holds: the client must know the answer is incomplete.
        reason = "tool_calls" if calls and worker_reason != "length" else worker_reason
        return content, calls, reason


def tool_calls_out(calls) -> list[dict]:
    return [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


async def run_job(request: web.Request, model: FleetModel, job: Job, shape: _Shape, stream: bool,
                  include_usage: bool, tools: ToolMode | None = None, reasoning: str | None = None) -> web.StreamResponse:
    """tools: the output may hold tool calls (chat with tools). reasoning: a
    chat's reasoning_format (daemon/tools/reasoning.py); None: no thinking read out."""
    async with tracked(request, model, job, stream):
        item = await _first_item(request, model, job)
        if _is_failure(item):
            raise _failure_error(item)
        if stream:
            return await _stream(request, job, shape, item, include_usage, tools, reasoning)
        choices = [Choice() for _ in range(job.submit.n)]
        while isinstance(item, p.Tokens):
            choices[item.index].add(item)
            item = await job.next(None)
        if _is_failure(item):
            raise _failure_error(item)
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


@asynccontextmanager
async def tracked(request: web.Request, model: FleetModel, job: Job, stream: bool = False) -> AsyncIterator[None]:
    """While a job's request is answered: its id on every log line. However it
    ends, the job is let go (a no-op once finished; frees its slot if the
    client left) and the request gets its one log line and its metrics."""
    structlog.contextvars.bind_contextvars(request_id=job.id)
    if not request.app[SETTINGS].report_cached_tokens:
        _without_cache_counts(job)
    request[LOGGED] = True  # the line below, with the job's timings
    request[JOB] = job  # the cold-start headers (daemon/http/cold_start.py)
    status, code = 200, None
    try:
        yield
    except ApiError as exc:
        status, code = exc.status, exc.code
        raise
    finally:
        model.controller.abandon(job)
        metrics = model.controller.metrics
        request.app[LOG].info("request", endpoint=job.endpoint, model=model.id, status=status, code=code, stream=stream,
                              cold=job.cold, seconds=round(time.monotonic() - job.accepted_at, 4),
                              finished=job.finished)
        metrics.requests.labels(endpoint=job.endpoint, status=str(status)).inc()
        metrics.request_seconds.labels(endpoint=job.endpoint, outcome="ok" if status == 200 else "error").observe(
            time.monotonic() - job.accepted_at)
        structlog.contextvars.unbind_contextvars("request_id")


def _without_cache_counts(job: Job) -> None:
    """report_cached_tokens = false: every item this request's answer is written from says the
    prompt cache held nothing (cached_tokens, cache_n, tokens_cached, cache_read_input_tokens read 0),
    whatever dialect writes it; the worker's own accounting (metrics) is untouched."""
    if getattr(job, "_counts_hidden", False):
        return
    receive = job.next

    async def next_item(wake_limit: float | None):
        item = await receive(wake_limit)
        if isinstance(item, p.Done) and (item.cached_tokens or item.restored_tokens or item.cache_tier):
            return msgspec.structs.replace(item, cached_tokens=0, restored_tokens=0, cache_tier="")
        if isinstance(item, p.Tokens) and item.n_cached_tokens:
            return msgspec.structs.replace(item, n_cached_tokens=0)
        return item

    job.next = next_item  # type: ignore[method-assign]  # this job's alone (an instance attribute)
    job._counts_hidden = True  # type: ignore[attr-defined]


async def open_event_stream(request: web.Request, job: Job) -> web.StreamResponse:
    """The SSE response, its headers sent: only once the first item is there,
    so a refused or timed-out request still gets its status code."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": job.id})
    await response.prepare(request)
    return response


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
    if _is_failure(item):
        await send(_failure_error(item).body())
    else:
        for choice in choices:
            if not choice.finished:
                await finish(choice, choice.reason or item.finish_reason, item)
        if include_usage:
            await send(shape.usage_chunk(item))
        await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def structured_grammar(request: web.Request, body: SamplingFields,
                             chat: ChatCompletionRequest | None = None) -> str | None:
    """The GBNF that enforces the body's response_format, json_schema, grammar
    or forced tool call; None when nothing is constrained. A constraint that
    cannot be enforced is a 400 naming it, never ignored. Built on a thread
    with a time bound (daemon/grammar/off_loop.py): the event loop keeps
    serving every other request meanwhile."""
    from daemon.grammar import GrammarRefused
    from daemon.grammar.off_loop import GrammarBusy, build_grammar

    if body.grammar is not None and not request.app[SETTINGS].raw_grammar:
        raise ApiError(400, "grammar: raw GBNF grammars are off on this server (raw_grammar = true turns them on for "
                            "trusted clients: a GBNF grammar can stall every slot); json_schema and response_format "
                            "are always available", "invalid_value", param="grammar")

    tools = [t.model_dump(exclude_none=True) for t in chat.tools] if chat is not None and chat.tools else None
    if chat is not None and chat.tool_choice not in (None, "none") and not tools:
        raise ApiError(400, "tool_choice needs tools: no tools were given", "invalid_value", param="tool_choice")
    if body.response_format is None and body.json_schema is None and body.grammar is None and not tools:
        return None  # nothing to build: no thread for a plain request
    try:
        return await build_grammar(response_format=body.response_format, json_schema=body.json_schema,
                                   grammar=body.grammar, tools=tools,
                                   tool_choice=chat.tool_choice if chat is not None else None,
                                   parallel_tool_calls=chat.parallel_tool_calls if chat is not None else False)
    except GrammarRefused as exc:
        raise ApiError(400, str(exc), "invalid_value", param=exc.param) from None
    except GrammarBusy as exc:
        raise ApiError(503, f"the server is building too many grammars ({exc}); retry shortly", "server_busy",
                       retry_after=1) from None


def tool_mode(body: ChatCompletionRequest) -> ToolMode | None:
    """How to read this answer's tool calls; None: it is all content (no tools,
    tool_choice none, or a JSON response_format, whose answer is the JSON)."""
    json_answer = (body.response_format or {}).get("type") in ("json_object", "json_schema")
    if not body.calls_tools or (json_answer and not body.forces_tool_call):
        return None
    return ToolMode(tuple(body.tool_names), body.forces_tool_call, body.parallel_tool_calls)


def generation_model(request: web.Request, body: SamplingFields) -> FleetModel:
    model = model_for(request, body.model)
    if model.controller.settings.embeddings:
        raise ApiError(400, f"model {model.id!r} serves embeddings only (embeddings = true): use /v1/embeddings, or "
                            "name a model that generates text", "model_not_generative", param="model")
    slots = model.controller.settings.parallel
    if body.n > slots:
        raise ApiError(400, f"n: {body.n} choices need {body.n} slots at once; model {model.id!r} has {slots} "
                            "(parallel)", "invalid_value", param="n")
    return model


def default_limit(settings, fallback: int) -> int:
    """The tokens a request that names no limit generates: the server's
    n_predict (-1: until the end of generation or of the slot's context, where
    the worker stops), or without one the dialect's own default."""
    if settings.n_predict is None:
        return fallback
    return settings.ctx_size if settings.n_predict < 0 else settings.n_predict


async def completions(request: web.Request) -> web.StreamResponse:
    body = await parse_body(request, CompletionRequest)
    grammar = await structured_grammar(request, body)
    model = generation_model(request, body)
    settings = model.controller.settings
    limit = body.max_tokens if "max_tokens" in body.model_fields_set else default_limit(settings, body.max_tokens)
    params = body.sampling(limit, grammar, body.logprobs, defaults=settings)
    if body.suffix is not None:  # fill in the middle: the worker builds the prompt from the model's FIM tokens
        job = model.controller.new_job("completions", params, infill=p.Infill(body.prompt_value(), body.suffix),
                                       n=body.n)
    else:
        job = model.controller.new_job("completions", params, prompt=body.prompt_value(), n=body.n)
    shape = CompletionShape(f"cmpl-{job.id}", model.id, body.include_usage, logprobs=body.logprobs is not None,
                            fingerprint=system_fingerprint(model.controller.model_path))
    return await run_job(request, model, job, shape, body.stream, body.include_usage)


def chat_inputs(request: web.Request, chat: ChatCompletionRequest, param: str = "messages") -> tuple[list, list]:
    """(messages, tools) for the worker, for every dialect's chat job. Images are
    counted and their headers read here, so the worker never sees one that is
    refused (a 400 naming `param`, the dialect's name for the turns); tools
    go only where tool_choice is not none."""
    settings = request.app[SETTINGS]
    try:
        messages = chat.protocol_messages(settings.max_images_per_request, settings.max_image_pixels)
    except ImageRefused as exc:
        raise ApiError(400, f"{param}: {exc}", exc.code, param=param) from None
    tools = [t.to_protocol() for t in chat.tools or ()] if chat.tool_choice != "none" else []
    return messages, tools


def _same(exc: ApiError) -> ApiError:
    return exc


async def chat_job(request: web.Request, chat: ChatCompletionRequest, endpoint: str, param: str = "messages",
                   rename: Callable[[ApiError], ApiError] = _same) -> tuple[FleetModel, Job]:
    """The one chat job that chat completions, Responses and Anthropic Messages
    run: their body translated to `chat`, refusals renamed into the dialect's
    words by `rename`."""
    messages, tools = chat_inputs(request, chat, param)
    try:
        if chat.forces_tool_call and chat.stop:
            raise ApiError(400, "stop: a forced tool call (tool_choice required or named) is the whole answer; "
                                "cutting it at a string would break its JSON", "invalid_value", param="stop")
        grammar = await structured_grammar(request, chat, chat=chat)
    except ApiError as exc:
        raise rename(exc) from None
    model = generation_model(request, chat)
    settings = model.controller.settings  # the model's own defaults for what the body leaves out
    limit = chat.max_completion_tokens or chat.max_tokens or default_limit(settings, chat.token_limit)
    params = chat.sampling(limit, grammar, chat.wanted_logprobs, defaults=settings)
    job = model.controller.new_job(endpoint, params, messages=messages, tools=tools, n=chat.n, **chat.template_args())
    return model, job


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await parse_body(request, ChatCompletionRequest)
    model, job = await chat_job(request, body, "chat.completions")
    shape = ChatShape(f"chatcmpl-{job.id}", model.id, body.include_usage, logprobs=body.logprobs,
                      fingerprint=system_fingerprint(model.controller.model_path))
    return await run_job(request, model, job, shape, body.stream, body.include_usage, tools=tool_mode(body),
                         reasoning=body.reasoning_format)


def _model_entry(fleet, model: FleetModel) -> dict:
    return {"id": model.id, "object": "model", "created": int(model.controller.state_since), "owned_by": "dormouse",
            **fleet.describe(model), "meta": model.controller.model_info or None}


async def models(request: web.Request) -> web.Response:
    """Every configured model with its status (loaded, loading, sleeping,
    unloading, failed), answered from the daemon: it wakes nothing."""
    fleet = request.app[FLEET]
    return web.json_response({"object": "list", "data": [_model_entry(fleet, m) for m in fleet.models.values()]})


async def retrieve_model(request: web.Request) -> web.Response:
    """OpenAI's GET /v1/models/{id}: one model (by id or alias), as /v1/models lists it; 404 model_not_found."""
    name = request.match_info["model_id"]
    return web.json_response(_model_entry(request.app[FLEET], model_for(request, name)))


def add_routes(app: web.Application) -> None:
    # Each beside its unversioned alias, as llama-server serves them.
    for prefix in ("/v1", ""):
        app.router.add_post(f"{prefix}/completions", completions)
        app.router.add_post(f"{prefix}/chat/completions", chat_completions)
        app.router.add_get(f"{prefix}/models", models)
    app.router.add_get("/v1/models/{model_id:.+}", retrieve_model)  # ids may hold '/' (hub-style names)
