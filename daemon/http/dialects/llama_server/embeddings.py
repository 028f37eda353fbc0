"""OpenAI's /v1/embeddings (and llama-server's unversioned /embeddings), with llama-server's inputs.

A model with pooling none has a vector per token: /embeddings answers them as llama-server does
([{"index", "embedding": [[...], ...]}]); /v1/embeddings, which answers one vector per input, refuses it.

Besides OpenAI's strings and token ids, llama-server reads token ids with texts between them as one
prompt ([12, 34, "text", 56]) and objects ({"prompt_string": ...}, {"content": [text parts]}): the
schema (schemas.embedding_prompts) turns every form into texts and token lists; a mixed prompt's texts
are tokenized in place (mixed_prompt.py), so the worker embeds plain texts and token ids as before.
"""

from __future__ import annotations

import base64
import struct

import msgspec
from aiohttp import web

from daemon.http.core.job import parse_body
from daemon.http.core.run import run_query
from daemon.http.dialects.llama_server.mixed_prompt import is_mixed, mixed_tokens
from daemon.http.dialects.llama_server.schemas import EmbeddingsRequest
from daemon.http.errors import ApiError
from daemon.http.keys import check_one_vector_per_input, model_for

TOO_LARGE = "context_length_exceeded"


async def _resolved(request: web.Request, model, prompts: list[str | list[int | str]]) -> list[str | list[int]]:
    out: list[str | list[int]] = []
    for prompt in prompts:
        if is_mixed(prompt):
            out.append(await mixed_tokens(request, model, prompt))
        else:
            out.append(prompt)
    return out


async def embeddings(request: web.Request) -> web.Response:
    body = await parse_body(request, EmbeddingsRequest)
    model = model_for(request, body.model)
    if not model.controller.settings.embeddings:
        raise ApiError(400, f"model {model.id!r} has no embeddings: set embeddings = true in its [models.{model.id}] "
                            "table (or start with --embeddings), or name an embeddings model", "embeddings_not_enabled",
                       param="model")
    per_token = model.controller.settings.pooling == "none"
    if per_token and request.path != "/embeddings":
        check_one_vector_per_input(model, request.path)
    job = model.controller.new_query("embeddings", "embed", inputs=await _resolved(request, model, body.inputs()))
    try:
        answer = await run_query(request, model, job)
    except ApiError as exc:
        if exc.code != TOO_LARGE:
            raise
        # llama-server's words, which its clients match on ("input is too large to process").
        raise ApiError(exc.status, f"{exc.message}; the input is too large to process: give a larger batch_size "
                                   "(-b), within ctx_size / parallel", exc.code, exc.param) from None
    if per_token:  # llama-server's own answer: each input's every token, not pooled, not normalized
        # msgspec, not json: up to millions of numbers, encoded in C without holding up the event loop long
        return web.Response(body=msgspec.json.encode([{"index": i, "embedding": vectors}
                                                      for i, vectors in enumerate(answer.token_embeddings)]),
                            content_type="application/json")
    data = []
    for i, vector in enumerate(answer.embeddings):
        if body.encoding_format == "base64":  # as OpenAI's: little-endian float32
            encoded = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": encoded})
        else:
            data.append({"object": "embedding", "index": i, "embedding": vector})
    return web.json_response({"object": "list", "data": data, "model": model.id,
                              "usage": {"prompt_tokens": answer.prompt_tokens, "total_tokens": answer.prompt_tokens}})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/embeddings", embeddings)  # llama-server's unversioned alias
