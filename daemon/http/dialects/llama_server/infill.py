"""llama-server's fill-in-the-middle endpoint, /infill, as editor plugins
(llama.vim, llama.vscode) call it: input_prefix, input_suffix, input_extra
(other files' chunks), prompt (what is already typed in the gap), n_predict,
stream, cache_prompt and /completion's sampling fields. The answer is
/completion's (its shapes and its stream are answer.py's), and
`response_fields` picks from it as llama-server does ("timings/prompt_n"
-> {"timings/prompt_n": ...}).

The worker builds the prompt from the model's FIM tokens (worker/fim.py); a
model without them answers 400. Fields llama-server takes and Dormouse does
not act on (samplers, n_indent, t_max_prompt_ms, t_max_predict_ms)
are accepted and ignored, as on /completion: the plugins always send them.
`lora` (an adapter llama.vscode sends when configured with one) is refused by
name: Dormouse loads no adapters, and the base model's answer would ignore it.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from aiohttp import web
from pydantic import Field, field_validator

from daemon import protocol as p
from daemon.http.errors import ApiError
from daemon.http.dialects.llama_server.answer import native_answer
from daemon.http.dialects.llama_server.request import _n_predict, check_slot
from daemon.http.core.job import generation_model, parse_body, structured_grammar
from daemon.http.core.schemas import _at_most, RequestModel
from daemon.http.dialects.llama_server.schemas import NativeCompletionRequest

MAX_EXTRA_CHUNKS = 1024  # llama.vim sends its ring of 16 (up to 64) chunks
MAX_FILENAME_CHARS = 4096  # a path
MAX_RESPONSE_FIELDS = 64
MAX_FIELD_PATH_CHARS = 256


class ExtraChunk(RequestModel):
    """One chunk of another file: its text and where it comes from (llama.vim also sends `time`, ignored)."""

    filename: Annotated[str, Field(max_length=MAX_FILENAME_CHARS)] = "tmp"
    text: str


class InfillRequest(NativeCompletionRequest):
    input_prefix: str = Field(description="the text before the gap")
    input_suffix: str = Field(description="the text after the gap (may be empty)")
    input_extra: Annotated[list[ExtraChunk], Field(max_length=MAX_EXTRA_CHUNKS)] = Field(
        default_factory=list, description="chunks of other files, read before the prefix as repository context")
    prompt: str = Field("", description="what is already typed in the gap: read after the prefix")
    response_fields: Annotated[list[Annotated[str, Field(max_length=MAX_FIELD_PATH_CHARS)]],
                               Field(max_length=MAX_RESPONSE_FIELDS)] | None = Field(
        None, description='the answer\'s fields to return, "a/b" for nested ones (llama-server\'s)')
    lora: list[Any] | None = Field(None, description="not supported: Dormouse loads no LoRA adapters (an empty "
                                                     "list, no adapter, is accepted)")

    @field_validator("lora", mode="before")
    @classmethod
    def _no_lora(cls, value: Any) -> Any:
        # llama.vscode sends lora when its user configured an adapter: answering with the base model would
        # ignore it silently, so it is refused by name (DESIGN: a field Dormouse does not support is a 400).
        if value is not None and value != []:
            raise ValueError("Dormouse loads no LoRA adapters: leave lora out, or send it empty")
        return value

    @field_validator("input_extra", mode="before")
    @classmethod
    def _chunk_count(cls, value: Any) -> Any:
        return _at_most(value, MAX_EXTRA_CHUNKS, "input_extra chunks")

    @field_validator("response_fields", mode="before")
    @classmethod
    def _field_count(cls, value: Any) -> Any:
        return _at_most(value, MAX_RESPONSE_FIELDS, "response_fields")

    def to_protocol(self) -> p.Infill:
        return p.Infill(self.input_prefix, self.input_suffix, [(c.filename, c.text) for c in self.input_extra],
                        self.prompt)


def pick_fields(answer: dict, paths: list[str]) -> dict:
    """llama-server's json_get_nested_values: each path that exists, under its own name."""
    picked = {}
    for path in paths:
        value: Any = answer
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            picked[path] = value
    return picked


async def infill(request: web.Request) -> web.StreamResponse:
    """/completion's flow (request.py's completion), with a FIM prompt the worker builds."""
    body = await parse_body(request, InfillRequest)
    grammar = await structured_grammar(request, body)
    model = generation_model(request, body)
    settings = model.controller.settings
    check_slot(body.id_slot, settings.parallel)
    if body.n > 1:
        raise ApiError(400, "n: /infill answers one completion (its answer has no choices)", "invalid_value", param="n")
    # 0: llama.vim's ring update and llama.vscode's extra context read the files into the cache
    n_predict = _n_predict(body, settings)
    logprobs = body.n_probs if body.n_probs else 0 if body.return_tokens else None
    post_sampling = body.post_sampling_probs and body.n_probs > 0
    # -1: until the end of generation or of the slot's context (the worker stops there).
    params = body.sampling(n_predict if n_predict >= 0 else settings.ctx_size, grammar, logprobs, defaults=settings)
    params = msgspec.structs.replace(params, post_sampling_probs=post_sampling)
    job = model.controller.new_job("infill", params, infill=body.to_protocol(), cache_prompt=body.cache_prompt,
                                   slot=body.id_slot)
    pick = (lambda answer: pick_fields(answer, body.response_fields)) if body.response_fields else None
    return await native_answer(request, model, job, body, params, n_predict, post_sampling, pick)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/infill", infill)
