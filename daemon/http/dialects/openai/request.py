"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions (and its
/input_tokens count), /v1/models.

A handler validates the body, routes it to the model it names (its `model`
field: an id or an alias; none, or any name where one model answers all
(Fleet.any_name): the default model; an unknown name: 404 model_not_found), hands a job to that model's controller and turns what
the worker sends back into an OpenAI response: one JSON body, or SSE chunks
ending with `data: [DONE]`. Headers are sent only once the first token is
there, so a rejected or timed-out request still gets a proper status code.
"""

from __future__ import annotations

from aiohttp import web

from daemon import protocol as p
from daemon.fleet.owner import FleetModel
from daemon.http.core.job import (chat_job, default_limit, generation_model, input_tokens_answer, parse_body,
                                  rendered_chat_prompt,
                                  structured_grammar, tool_mode)
from daemon.http.core.schemas import CompletionRequest
from daemon.http.dialects.openai.answer import run_job
from daemon.http.dialects.openai.body import ChatCompletionRequest
from daemon.http.dialects.openai.shapes import ChatShape, CompletionShape, system_fingerprint
from daemon.http.keys import FLEET, SETTINGS, model_for


async def completions(request: web.Request) -> web.StreamResponse:
    body = await parse_body(request, CompletionRequest)
    grammar = await structured_grammar(request, body)
    model = generation_model(request, body)
    settings = model.controller.settings
    limit = body.max_tokens if "max_tokens" in body.model_fields_set else default_limit(settings, body.max_tokens)
    params = body.sampling(limit, grammar, body.logprobs, defaults=settings)
    if body.suffix is not None:  # fill in the middle: the worker builds the prompt from the model's FIM tokens
        job = model.controller.new_job("completions", params, infill=p.Infill(body.prompt_value(), body.suffix),
                                       n=body.n, progress=body.wants_progress)
    else:
        job = model.controller.new_job("completions", params, prompt=body.prompt_value(), n=body.n,
                                       progress=body.wants_progress)
    shape = CompletionShape(f"cmpl-{job.id}", model.id, body.include_usage, logprobs=body.logprobs is not None,
                            fingerprint=system_fingerprint(model.controller.model_path))
    return await run_job(request, model, job, shape, body.stream, body.include_usage,
                         timings_per_token=body.timings_per_token)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await parse_body(request, ChatCompletionRequest)
    model, job = await chat_job(request, body, "chat.completions")
    shape = ChatShape(f"chatcmpl-{job.id}", model.id, body.include_usage, logprobs=body.logprobs,
                      fingerprint=system_fingerprint(model.controller.model_path))

    async def verbose() -> dict:  # llama-server's debug echo, rendered once the answer is read (the model is awake)
        return {"__verbose": {"prompt": await rendered_chat_prompt(request, body)}}

    wanted = not body.stream and (body.verbose or request.app[SETTINGS].verbose_answers)
    return await run_job(request, model, job, shape, body.stream, body.include_usage, tools=tool_mode(body),
                         reasoning=body.reasoning_format, extra=verbose if wanted else None,
                         timings_per_token=body.timings_per_token)


async def chat_input_tokens(request: web.Request) -> web.Response:
    """The prompt tokens a chat completions request with this body reads."""
    chat = await parse_body(request, ChatCompletionRequest)
    return await input_tokens_answer(request, "chat.input_tokens", chat, "messages")


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
    # Each beside its unversioned alias, as llama-server serves them; but /completions, which is
    # llama-server's native completion there (dialects/llama_server/request.py), not OpenAI's.
    app.router.add_post("/v1/completions", completions)
    for prefix in ("/v1", ""):
        app.router.add_post(f"{prefix}/chat/completions", chat_completions)
        app.router.add_post(f"{prefix}/chat/completions/input_tokens", chat_input_tokens)
        app.router.add_get(f"{prefix}/models", models)
    app.router.add_get("/v1/models/{model_id:.+}", retrieve_model)  # ids may hold '/' (hub-style names)
