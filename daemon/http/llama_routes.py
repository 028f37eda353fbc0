"""llama-server's extras, in its request and response shapes: /tokenize,
/detokenize, /apply-template and the native /completion; and OpenAI's
/v1/embeddings.

Tokenizing, templates and embeddings need the loaded model, so each is a
query to the worker (protocol.Query): it wakes a sleeping model and waits its
turn like a generation. The native /completion is a generation with other
field names and another answer.
"""

from __future__ import annotations

import base64
import struct

import msgspec
from aiohttp import web

from daemon import protocol as p
from daemon.fleet.owner import FleetModel
from daemon.http.errors import ApiError
from daemon.http.keys import model_for
from daemon.http.openai_routes import (CLIENT_ERRORS, _failure_error, _first_item, _is_failure, generation_model,
                                       open_event_stream, parse_body, structured_grammar, tracked)
from daemon.http.schemas import (ApplyTemplateRequest, DetokenizeRequest, EmbeddingsRequest, ImageRefused,
                                 NativeCompletionRequest, TokenizeRequest)
from daemon.http.shapes import piece_text, timings
from daemon.model.jobs import Job, JobFailure


async def run_query(request: web.Request, model: FleetModel, job: Job) -> p.Answer:
    """The worker's Answer, or the ApiError that says why there is none."""
    async with tracked(request, model, job):
        item = await _first_item(request, model, job)
        if isinstance(item, JobFailure):
            raise _failure_error(item)
        if not isinstance(item, p.Answer):  # pragma: no cover - a query is answered by one Answer
            raise ApiError(500, "the worker answered a query with something else", "internal_error")
        if item.error is not None:
            raise ApiError(400 if item.error_code in CLIENT_ERRORS else 500, item.error, item.error_code)
        return item


def _piece(data: bytes) -> str | list[int]:
    """As llama-server: the text of a piece, or its bytes when it is not whole UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


async def tokenize(request: web.Request) -> web.Response:
    body = await parse_body(request, TokenizeRequest)
    model = model_for(request, body.model)
    job = model.controller.new_query("tokenize", "tokenize", text=body.content, add_special=body.add_special,
                                     with_pieces=body.with_pieces)
    answer = await run_query(request, model, job)
    if body.with_pieces:
        return web.json_response({"tokens": [{"id": t, "piece": _piece(b)} for t, b in zip(answer.tokens, answer.pieces)]})
    return web.json_response({"tokens": answer.tokens})


async def detokenize(request: web.Request) -> web.Response:
    body = await parse_body(request, DetokenizeRequest)
    model = model_for(request, body.model)
    answer = await run_query(request, model, model.controller.new_query("detokenize", "detokenize", tokens=body.tokens))
    return web.json_response({"content": answer.text})


async def apply_template(request: web.Request) -> web.Response:
    body = await parse_body(request, ApplyTemplateRequest)
    try:
        messages = [m.to_protocol(_no_images) for m in body.messages]
    except ImageRefused as exc:
        raise ApiError(400, str(exc), exc.code, param="messages") from None
    model = model_for(request, body.model)
    job = model.controller.new_query("apply-template", "apply_template", messages=messages,
                                     tools=[t.to_protocol() for t in body.tools or ()])
    answer = await run_query(request, model, job)
    return web.json_response({"prompt": answer.text})


def _no_images(part) -> bytes:
    raise ImageRefused("/apply-template renders text only: remove the images")


async def embeddings(request: web.Request) -> web.Response:
    body = await parse_body(request, EmbeddingsRequest)
    model = model_for(request, body.model)
    if not model.controller.settings.embeddings:
        raise ApiError(400, f"model {model.id!r} has no embeddings: set embeddings = true in its [models.{model.id}] "
                            "table (or start with --embeddings), or name an embeddings model", "embeddings_not_enabled",
                       param="model")
    job = model.controller.new_query("embeddings", "embed", inputs=body.inputs())
    answer = await run_query(request, model, job)
    data = []
    for i, vector in enumerate(answer.embeddings):
        if body.encoding_format == "base64":  # as OpenAI's: little-endian float32
            encoded = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": encoded})
        else:
            data.append({"object": "embedding", "index": i, "embedding": vector})
    return web.json_response({"object": "list", "data": data, "model": model.id,
                              "usage": {"prompt_tokens": answer.prompt_tokens, "total_tokens": answer.prompt_tokens}})


# -- the native /completion --------------------------------------------------------

_STOP_TYPES = {"stop": "eos", "length": "limit"}


async def completion(request: web.Request) -> web.StreamResponse:
    """llama-server's /completion: `content` and `stop` instead of choices, and timings."""
    body = await parse_body(request, NativeCompletionRequest)
    grammar = await structured_grammar(request, body)
    model = generation_model(request, body)
    settings = model.controller.settings
    if body.n > 1:
        raise ApiError(400, "n: /completion answers one completion (its answer has no choices); use /v1/completions",
                       "invalid_value", param="n")
    # -1: until the end of generation or of the slot's context (the worker stops there).
    n_predict = body.n_predict if body.n_predict >= 0 else settings.ctx_size
    if n_predict == 0:
        raise ApiError(400, "n_predict: 0 predicts nothing; use /tokenize to count a prompt's tokens", "invalid_value",
                       param="n_predict")
    params = body.sampling(n_predict, grammar, body.n_probs or None)
    job = model.controller.new_job("completion", params, prompt=body.prompt, cache_prompt=body.cache_prompt)
    async with tracked(request, model, job, body.stream):
        item = await _first_item(request, model, job)
        if _is_failure(item):
            raise _failure_error(item)
        if body.stream:
            return await _native_stream(request, job, model.id, item, body.n_probs)
        parts, probs = [], []
        while isinstance(item, p.Tokens):
            parts.append(item.text)
            probs.extend(item.logprobs)
            item = await job.next(None)
        if _is_failure(item):
            raise _failure_error(item)
        return web.json_response({"content": "".join(parts), **_native_end(item, model.id),
                                  **({"completion_probabilities": _native_probs(probs)} if body.n_probs else {})})


def _native_end(done: p.Done, model: str) -> dict:
    return {"stop": True, "model": model, "stop_type": _STOP_TYPES.get(done.finish_reason, done.finish_reason),
            "tokens_predicted": done.completion_tokens, "tokens_evaluated": done.prompt_tokens,
            "tokens_cached": done.cached_tokens, "truncated": False, "timings": timings(done)}


def _native_probs(entries: list[p.TokenLogprob]) -> list[dict]:
    return [{"id": e.token, "token": piece_text(e.piece), "bytes": list(e.piece), "logprob": e.logprob,
             "top_logprobs": [{"id": t.token, "token": piece_text(t.piece), "bytes": list(t.piece), "logprob": t.logprob}
                              for t in e.top]} for e in entries]


async def _native_stream(request: web.Request, job: Job, model: str, item, n_probs: int) -> web.StreamResponse:
    """As llama-server streams /completion: `data: {...}` lines, the last with stop: true (no [DONE])."""
    response = await open_event_stream(request, job)
    encode = msgspec.json.encode
    while isinstance(item, p.Tokens):
        if item.text or item.logprobs:
            chunk = {"content": item.text, "stop": False}
            if n_probs:
                chunk["completion_probabilities"] = _native_probs(item.logprobs)
            await response.write(b"data: " + encode(chunk) + b"\n\n")
        item = await job.next(None)
    if _is_failure(item):
        await response.write(b"data: " + encode(_failure_error(item).body()) + b"\n\n")
    else:
        await response.write(b"data: " + encode({"content": "", **_native_end(item, model)}) + b"\n\n")
    await response.write_eof()
    return response


def add_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_post("/apply-template", apply_template)
    app.router.add_post("/completion", completion)
    app.router.add_post("/v1/embeddings", embeddings)
