"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models.

A handler validates the body, routes it to the model it names (its `model`
field: an id or an alias; none, or a fleet of one: the default model; an
unknown name: 404 model_not_found), hands a job to that model's controller and turns what
the worker sends back into an OpenAI response: one JSON body, or SSE chunks
ending with `data: [DONE]`. Headers are sent only once the first token is
there, so a rejected or timed-out request still gets a proper status code.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from daemon import protocol as p
from daemon.fleet.owner import FleetModel
from daemon.http.core.job import (ToolMode, chat_job, default_limit, generation_model, parse_body,
                                  structured_grammar, tool_mode)
from daemon.http.core.run import failure_error, first_item, is_failure, open_event_stream, tracked
from daemon.http.core.conversation import ChatCompletionRequest
from daemon.http.core.schemas import CompletionRequest
from daemon.http.dialects.openai.shapes import ChatShape, CompletionShape, _Shape, system_fingerprint
from daemon.http.keys import FLEET, model_for
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
