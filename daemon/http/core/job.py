"""A request to the internal job, for every dialect: the body read and
validated (bounded once, on the event loop), the model it names, the grammar
that enforces its constraints, its limit, and the one chat job that every
chat-like dialect translates its body into. Knows no dialect: a dialect's own
words for a refusal come through `rename`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from aiohttp import web
from pydantic import BaseModel, ValidationError

from daemon import protocol as p
from daemon.fleet.owner import FleetModel
from daemon.http.core.conversation import ChatJobRequest, ImageRefused
from daemon.http.core.schemas import BodyError, decode_body, field_name, SamplingFields
from daemon.http.errors import ApiError
from daemon.http.keys import CALLER, FLEET, SETTINGS, cache_scope, model_for
from daemon.model.jobs import Job, request_cache_scope
from daemon.tools.parse import forced_calls, parse_tool_calls


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


async def structured_grammar(request: web.Request, body: SamplingFields,
                             chat: ChatJobRequest | None = None) -> str | None:
    """The GBNF that enforces the body's response_format, json_schema, grammar
    or forced tool call; None when nothing is constrained. A constraint that
    cannot be enforced is a 400 naming it, never ignored. Built on a thread
    with a time bound (daemon/grammar/off_loop.py): the event loop keeps
    serving every other request meanwhile."""
    from daemon.grammar import GrammarRefused
    from daemon.grammar.off_loop import GrammarBusy, build_grammar

    if body.grammar is not None and not request.app[SETTINGS].raw_grammar:
        raise ApiError(400, "grammar: raw GBNF grammars are off on this server (raw_grammar = false); json_schema "
                            "and response_format are always available", "invalid_value", param="grammar")

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


def tool_mode(body: ChatJobRequest) -> ToolMode | None:
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


def chat_inputs(request: web.Request, chat: ChatJobRequest, param: str = "messages") -> tuple[list, list]:
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


async def chat_job(request: web.Request, chat: ChatJobRequest, endpoint: str, param: str = "messages",
                   rename: Callable[[ApiError], ApiError] = _same) -> tuple[FleetModel, Job]:
    """The one chat job every chat-like dialect runs: its body translated to
    `chat`, refusals renamed into the dialect's words by `rename`."""
    messages, tools = chat_inputs(request, chat, param)
    try:
        grammar = await structured_grammar(request, chat, chat=chat)
    except ApiError as exc:
        raise rename(exc) from None
    model = generation_model(request, chat)
    settings = model.controller.settings  # the model's own defaults for what the body leaves out
    limit = chat.max_completion_tokens or chat.max_tokens or default_limit(settings, chat.token_limit)
    params = chat.sampling(limit, grammar, chat.wanted_logprobs, defaults=settings)
    if chat.forces_tool_call and params.stop:
        # A forced call (tool_choice required or named) is the whole answer: stop strings,
        # which clients send on every call, would cut its JSON, so they do not apply to it.
        params = msgspec.structs.replace(params, stop=[])
    job = model.controller.new_job(endpoint, params, messages=messages, tools=tools, n=chat.n,
                                   progress=chat.wants_progress, **chat.template_args())
    return model, job


async def _chat_query(request: web.Request, chat: ChatJobRequest, param: str, endpoint: str, kind: str) -> p.Answer:
    """A query about the prompt `chat` reads (its messages and tools through the model's chat template)."""
    from daemon.http.core.run import run_query

    messages, tools = chat_inputs(request, chat, param)
    model = generation_model(request, chat)
    job = model.controller.new_query(endpoint, kind, messages=messages, tools=tools, **chat.template_args())
    return await run_query(request, model, job)


async def rendered_chat_prompt(request: web.Request, chat: ChatJobRequest, param: str = "messages") -> str:
    """The prompt `chat` reads, as the model's chat template renders it (images as their markers)."""
    return (await _chat_query(request, chat, param, "render-chat", "render_chat")).text


async def input_tokens_answer(request: web.Request, endpoint: str, chat: ChatJobRequest, param: str) -> web.Response:
    """The prompt tokens `chat` reads (images included), as the input_tokens endpoints answer."""
    answer = await _chat_query(request, chat, param, endpoint, "count_chat")
    return web.json_response({"object": "response.input_tokens", "input_tokens": answer.prompt_tokens})
