"""Ollama's API (/api/*): chat, generate and embeddings, translated to the one internal job.

An Ollama body is validated in its own shape first (so a refusal names
Ollama's fields: `options.num_predict`, `messages.0.images.1`, `keep_alive`),
then rewritten as the core's body Dormouse already serves (ChatJobRequest
or CompletionRequest) and validated again with its bounds, so every number
that reaches llama.cpp is bounded once, in schemas.py. What the worker sends
back is written in Ollama's shapes by answer.py; tags, ps, show and
version are answered from the fleet by models.py.

Rules where Ollama and Dormouse differ (each a 400 naming the field, never
ignored):
- `options.num_ctx` is a load-time option in Ollama; here the context is
  configured (ctx_size / parallel per slot). A num_ctx the slot holds is
  accepted (the request runs in the configured slot, which is at least that
  large); a larger one is refused.
- Ollama's other load-time options (num_gpu, num_thread, ...) are settings of
  the model's table; mirostat, typical_p, tfs_z and num_keep have no sampler
  here, so only their "off" values are accepted.
- `keep_alive` is the model's sleep (controller.new_job keep_alive): 0 puts
  it to sleep when idle after this request, a duration keeps it awake at
  least that long once idle, a negative value keeps it awake.
- `/api/generate` with an empty prompt, or `/api/chat` with no messages,
  loads the model (done_reason "load"), or with keep_alive 0 unloads it
  ("unload"), as Ollama does.
- Loading and unloading are the operator's, as POST /sleep and /wake are:
  with `admin_key` set, a caller without it gets 403 (Ollama's error shape,
  naming admin_key) for an empty load or unload request and for a keep_alive
  that unloads (0), holds the model for ever (negative) or longer than
  MAX_UNPRIVILEGED_KEEP_ALIVE_SECONDS; a keep_alive up to that only delays
  the idle sleep (never past the fleet's eviction or POST /sleep) and is
  served. Without admin_key, whoever may call /sleep may do all of it.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator

from daemon.fleet.owner import FleetModel
from daemon.http.dialects.ollama import models as ollama_models
from daemon.http.dialects.ollama import pull as ollama_pull
from daemon.http.dialects.ollama.models import ollama_model, slot_context
from daemon.http.errors import ApiError
from daemon.http.keys import FLEET, check_one_vector_per_input, require_privilege
from daemon.http.core.run import run_query
from daemon.http.dialects.ollama.answer import ChatLines, GenerateLines, answer, check_dimensions, embed_body, load_answer
from daemon.http.core.job import chat_inputs, generation_model, parse_body, structured_grammar, tool_mode
from daemon.http.core.conversation import ChatJobRequest
from daemon.http.core.schemas import (_at_most, CompletionRequest, field_name, MAX_CONTENT_PARTS, MAX_EMBEDDING_INPUTS,
                                      MAX_MESSAGES, MAX_TOOL_CALLS, MAX_TOOLS, RequestModel)
from statemachine import ServerState

# -- keep_alive -------------------------------------------------------------------------

MAX_KEEP_ALIVE_SECONDS = 366 * 86400  # longer is "for ever", which a negative value says
# The longest keep_alive a caller without the admin key may send, when admin_key is set: enough for a
# conversation's pauses (Ollama's default is 5m), not a hold on the memory the operator's sleep gives back.
MAX_UNPRIVILEGED_KEEP_ALIVE_SECONDS = 3600.0
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")  # "ms" before "m" and "s"
_PLAIN_SECONDS = re.compile(r"\d+\.?\d*|\.\d+")


def parse_keep_alive(value: Any) -> float | None:
    """Seconds from Ollama's keep_alive: a number of seconds, or a Go duration
    ("5m", "1h30m", "0s", "-1"; a bare number is seconds). Negative: -1, never
    sleep on idle. None: not given (the model's sleep_idle_seconds)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError('a number of seconds or a duration such as "5m" or "1h30m"')
    seconds = float(value) if not isinstance(value, str) else _go_duration(value)
    if math.isnan(seconds):
        raise ValueError("not a number")
    if seconds < 0:
        return -1.0
    if seconds > MAX_KEEP_ALIVE_SECONDS:
        raise ValueError(f"at most {MAX_KEEP_ALIVE_SECONDS} seconds (366 days); a negative value keeps the model "
                         "awake for as long as the daemon runs")
    return seconds


def _go_duration(text: str) -> float:
    text = text.strip()
    if not text or len(text) > 64:
        raise ValueError('a duration such as "5m", "1h30m", "0" or "-1" (at most 64 characters)')
    sign, rest = (-1.0, text[1:]) if text[0] == "-" else (1.0, text.removeprefix("+"))
    if _PLAIN_SECONDS.fullmatch(rest):
        return sign * float(rest)
    total, pos = 0.0, 0
    while pos < len(rest):
        part = _GO_PART.match(rest, pos)
        if part is None:
            raise ValueError(f"{text!r} is not a duration (units: ns, us, ms, s, m, h; e.g. \"5m\", \"1h30m\")")
        total += float(part[1]) * _GO_UNITS[part[2]]
        pos = part.end()
    return sign * total


# -- options ------------------------------------------------------------------------------

# Ollama's option -> the field of Dormouse's sampling (schemas.SamplingFields), which bounds it.
SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "min_p", "seed", "stop", "repeat_penalty", "repeat_last_n",
                    "presence_penalty", "frequency_penalty")
# Load-time options: set in the model's table of the configuration, never per request.
CONFIGURED_OPTIONS = {"num_gpu": "n_gpu_layers", "num_thread": "threads", "num_batch": "batch_size",
                      "main_gpu": "the devices the model is given", "low_vram": "n_gpu_layers",
                      "f16_kv": "the cache types", "use_mmap": "the loader", "use_mlock": "the loader",
                      "numa": "the loader", "vocab_only": "the loader", "logits_all": "the loader",
                      "embedding_only": "embeddings = true"}
# Samplers Dormouse does not have: only the value that turns them off is accepted.
OFF_VALUES = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0}
MAX_NUM_PREDICT = 1_000_000  # as max_tokens


class OllamaOptions(RequestModel):
    model_config = ConfigDict(extra="allow")

    num_predict: StrictInt | None = Field(None, ge=-2, le=MAX_NUM_PREDICT,
                                    description="-1 (the default) or -2: until the end of generation or of the slot")
    num_ctx: StrictInt | None = Field(None, ge=1, le=2**31 - 1,
                                      description="at most the slot's context (ctx_size / parallel)")

    @field_validator("num_predict")
    @classmethod
    def _predicts_something(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("0 predicts nothing (-1: until the end of generation)")
        return value

    @classmethod
    def check_names(cls, options: dict[str, Any], sampling: bool) -> None:
        """Refuse, by name, an option that would be ignored here."""
        for name, value in options.items():
            if name in cls.model_fields or value is None:
                continue
            where = f"options.{name[:64]}"
            if name in SAMPLING_OPTIONS and sampling:
                continue
            if name in SAMPLING_OPTIONS or (name in OFF_VALUES and not sampling):
                raise ApiError(400, f"{where}: embeddings have no sampling options", "invalid_value", param=where)
            if name in CONFIGURED_OPTIONS:
                raise ApiError(400, f"{where}: a load-time option; Dormouse's models are configured, not loaded per "
                                    f"request ({CONFIGURED_OPTIONS[name]} in the model's [models.ID] table)",
                               "invalid_value", param=where)
            if name in OFF_VALUES:
                if isinstance(value, bool) or value != OFF_VALUES[name]:
                    raise ApiError(400, f"{where}: this sampler is not available here; only {OFF_VALUES[name]} (off) "
                                        "is accepted", "invalid_value", param=where)
                continue
            if name == "num_keep":
                raise ApiError(400, f"{where}: the context is never shifted here (a prompt longer than the slot is "
                                    "refused), so there is nothing to keep", "invalid_value", param=where)
            raise ApiError(400, f"{where}: not an option Dormouse knows (sampling: {', '.join(SAMPLING_OPTIONS)}, "
                                "num_predict, num_ctx)", "invalid_value", param=where)


# -- request bodies --------------------------------------------------------------------

_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
MAX_IMAGES_PER_MESSAGE = MAX_CONTENT_PARTS - 1  # with the text, the parts of one message
Name = Annotated[str, Field(max_length=256)]


class OllamaFunctionCall(RequestModel):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    arguments: dict[str, Any] | Annotated[str, Field(max_length=1_000_000)] = Field(default_factory=dict)


class OllamaToolCall(RequestModel):
    id: Name | None = None
    type: Literal["function"] = "function"
    function: OllamaFunctionCall


class OllamaMessage(RequestModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: Annotated[list[str], Field(max_length=MAX_IMAGES_PER_MESSAGE)] | None = None
    tool_calls: Annotated[list[OllamaToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None
    tool_name: Name | None = None
    tool_call_id: Name | None = None
    thinking: str | None = Field(None, description="an earlier answer's thinking: not given to the template")

    @field_validator("images", mode="before")
    @classmethod
    def _image_count(cls, value: Any) -> Any:
        return _at_most(value, MAX_IMAGES_PER_MESSAGE, "images in a message")

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _call_count(cls, value: Any) -> Any:
        return _at_most(value, MAX_TOOL_CALLS, "tool calls in a message")

    @field_validator("images")
    @classmethod
    def _base64(cls, value: list[str] | None) -> list[str] | None:
        for i, image in enumerate(value or ()):
            if image.startswith("data:"):
                raise ValueError(f"image {i}: the base64 of the image file, without a data: URL prefix")
            if len(image) % 4 or not _BASE64.fullmatch(image):
                raise ValueError(f"image {i} is not valid base64")
        return value

    def openai(self) -> dict[str, Any]:
        """The same message as chat completions take it."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.images:
            out["content"] = [{"type": "text", "text": self.content}, *(
                {"type": "image_url", "image_url": {"url": "data:image;base64," + image}} for image in self.images)]
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id or "", "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments if isinstance(c.function.arguments, str)
                else json.dumps(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_name is not None:
            out["name"] = self.tool_name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class OllamaFields(RequestModel):
    """What every Ollama body that reaches a model has."""

    model: str | None = None
    options: dict[str, Any] | None = None
    keep_alive: float | None = Field(None, description='seconds, or a duration such as "5m"; negative: never sleep')

    @field_validator("keep_alive", mode="before")
    @classmethod
    def _keep_alive(cls, value: Any) -> float | None:
        return parse_keep_alive(value)

    @field_validator("options", mode="before")
    @classmethod
    def _option_count(cls, value: Any) -> Any:
        return _at_most(value, 64, "options")


class OllamaGenerationFields(OllamaFields):
    """What /api/chat and /api/generate share."""

    stream: StrictBool = True  # Ollama's default
    format: Literal["", "json"] | dict[str, Any] | None = Field(None, description='"json" or a JSON schema')
    think: StrictBool | Literal["low", "medium", "high"] | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None


class OllamaChatRequest(OllamaGenerationFields):
    messages: Annotated[list[OllamaMessage], Field(max_length=MAX_MESSAGES)] = Field(default_factory=list)
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _message_count(cls, value: Any) -> Any:
        return _at_most(value, MAX_MESSAGES, "messages")

    @field_validator("tools", mode="before")
    @classmethod
    def _tool_count(cls, value: Any) -> Any:
        return _at_most(value, MAX_TOOLS, "tools")


class OllamaGenerateRequest(OllamaGenerationFields):
    prompt: str = ""
    system: str | None = None
    raw: StrictBool = False
    images: Annotated[list[str], Field(max_length=MAX_IMAGES_PER_MESSAGE)] | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[Any] | None = None

    @field_validator("images", mode="before")
    @classmethod
    def _image_count(cls, value: Any) -> Any:
        return _at_most(value, MAX_IMAGES_PER_MESSAGE, "images")

    @field_validator("images")
    @classmethod
    def _base64(cls, value: list[str] | None) -> list[str] | None:
        return OllamaMessage._base64(value)

    @field_validator("suffix", "template", "context")
    @classmethod
    def _refused(cls, value: Any, info) -> Any:
        if value:  # an empty one asks for nothing
            raise ValueError(_REFUSED_GENERATE_FIELDS[info.field_name])
        return value


_REFUSED_GENERATE_FIELDS = {
    "suffix": "fill-in-the-middle is not served by /api/generate here; llama-server's /infill serves it",
    "template": "Go templates are not run here: the model's own chat template renders the prompt (raw: true sends "
                "the prompt as it is)",
    "context": "token contexts of earlier answers are not kept here (none is returned); send the conversation to "
               "/api/chat",
}


class OllamaEmbedRequest(OllamaFields):
    input: str | Annotated[list[str], Field(max_length=MAX_EMBEDDING_INPUTS)] | None = None
    truncate: StrictBool = Field(True, description="Ollama's: an input longer than the model reads at once is cut "
                                                   "at its end; false: refused")
    dimensions: StrictInt | None = Field(None, ge=1, le=1 << 20)

    @field_validator("input", mode="before")
    @classmethod
    def _input_count(cls, value: Any) -> Any:
        return _at_most(value, MAX_EMBEDDING_INPUTS, "inputs")


class OllamaLegacyEmbeddingsRequest(OllamaFields):
    prompt: str = ""


# -- translation --------------------------------------------------------------------

# The OpenAI body's field -> Ollama's name for it, in error messages.
_OLLAMA_NAMES = {**{name: f"options.{name}" for name in SAMPLING_OPTIONS}, "max_tokens": "options.num_predict",
                 "response_format": "format", "json_schema": "format"}


def _renamed(name: str) -> str:
    head, dot, rest = name.partition(".")
    return _OLLAMA_NAMES.get(head, head) + (dot + rest if head not in ("response_format", "json_schema") else "")


def _validate_as(model: type[BaseModel], data: dict[str, Any], request: web.Request) -> Any:
    """The translated body, validated with Dormouse's bounds; a refusal names Ollama's field."""
    try:
        return model.model_validate(data, context={"max_prompt_tokens": request.app[FLEET].max_ctx_size})
    except ValidationError as exc:
        err = exc.errors()[0]
        name = _renamed(field_name(err["loc"]) or "body")
        message = str(err["msg"]).removeprefix("Value error, ")
        raise ApiError(400, f"{name}: {message}", "invalid_value", param=name) from None


def _sampling_fields(body: OllamaGenerationFields, model: FleetModel) -> dict[str, Any]:
    """Ollama's options and format as the OpenAI body's fields."""
    options = body.options or {}
    OllamaOptions.check_names(options, sampling=True)
    try:
        known = OllamaOptions.model_validate(options)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = "options." + (field_name(err["loc"]) or "")
        raise ApiError(400, f"{name}: {str(err['msg']).removeprefix('Value error, ')}", "invalid_value",
                       param=name) from None
    check_num_ctx(known.num_ctx, model)
    fields = {name: options[name] for name in SAMPLING_OPTIONS if options.get(name) is not None}
    settings = model.controller.settings
    predict = known.num_predict if known.num_predict is not None and known.num_predict > 0 else settings.ctx_size
    fields["max_tokens"] = min(predict, MAX_NUM_PREDICT)  # -1, -2: the worker stops at the end of the slot
    if body.format == "json":
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(body.format, dict):
        fields["json_schema"] = body.format  # llama-server's field: the output matches this schema
    if body.think not in (None, False):
        raise ApiError(400, f"think: model {model.id!r} does not think (no thinking is parsed from its answers); "
                            "send think: false or leave it out", "invalid_value", param="think")
    return {"model": model.id, **fields}


def check_num_ctx(num_ctx: int | None, model: FleetModel) -> None:
    holds = slot_context(model)
    if num_ctx is not None and num_ctx > holds:
        raise ApiError(400, f"options.num_ctx: {num_ctx} is more than a slot of model {model.id!r} holds ({holds} "
                            "tokens: ctx_size / parallel in its configuration); send at most that, or leave it out",
                       "invalid_value", param="options.num_ctx")


async def _grammar(request: web.Request, body, chat=None) -> str | None:
    try:
        return await structured_grammar(request, body, chat=chat)
    except ApiError as exc:
        if exc.param is None or exc.param.partition(".")[0] not in ("response_format", "json_schema"):
            raise
        message = exc.message.replace(exc.param, "format", 1)
        raise ApiError(exc.status, message if message.startswith("format") else f"format: {message}", exc.code,
                       param="format", retry_after=exc.retry_after) from None


def _generative(request: web.Request, model: FleetModel, body) -> None:
    if model.controller.settings.embeddings:
        raise ApiError(400, f"model {model.id!r} serves embeddings only (embeddings = true): use /api/embed, or name "
                            "a model that generates text", "model_not_generative", param="model")
    generation_model(request, body)


# -- handlers -----------------------------------------------------------------------

def check_keep_alive(request: web.Request, keep_alive: float | None) -> None:
    """A keep_alive that unloads or holds the model needs what POST /sleep needs (the admin key, when
    one is set); one that only keeps the model awake a while longer is anyone's."""
    if keep_alive is None or 0 < keep_alive <= MAX_UNPRIVILEGED_KEEP_ALIVE_SECONDS:
        return
    if keep_alive == 0:
        what = "keep_alive 0 (unload the model)"
    elif keep_alive < 0:
        what = "a negative keep_alive (keep the model loaded for ever)"
    else:
        what = f"keep_alive over {MAX_UNPRIVILEGED_KEEP_ALIVE_SECONDS:g} seconds (1h)"
    require_privilege(request, what)


def _asleep_or_gone(model: FleetModel) -> bool:
    """Nothing to unload: no worker holds the model, or it is already going to sleep."""
    return model.controller.state not in (ServerState.READY, ServerState.WAKING, ServerState.LOADING)


async def _load_or_unload(request: web.Request, model: FleetModel, endpoint: str, keep_alive: float | None,
                          lines) -> web.Response:
    """Ollama's load (an empty request) and unload (the same with keep_alive 0): a
    request that reads nothing, so the model wakes, or falls asleep once idle,
    through the one path every request takes."""
    require_privilege(request, "unloading a model (keep_alive 0)" if keep_alive == 0 else
                      "loading a model with an empty request")
    if keep_alive == 0 and _asleep_or_gone(model):
        return web.json_response(load_answer(lines, "unload"))
    job = model.controller.new_query(endpoint, "tokenize", text="", keep_alive=keep_alive)
    await run_query(request, model, job)
    return web.json_response(load_answer(lines, "unload" if keep_alive == 0 else "load"))


async def chat(request: web.Request) -> web.StreamResponse:
    body = await parse_body(request, OllamaChatRequest)
    model = ollama_model(request, body.model)
    check_keep_alive(request, body.keep_alive)
    lines = ChatLines(body.model or model.id, model.controller, logprobs=body.logprobs)
    if not body.messages:
        return await _load_or_unload(request, model, "ollama.chat", body.keep_alive, lines)
    data = {**_sampling_fields(body, model), "messages": [m.openai() for m in body.messages],
            "parallel_tool_calls": True, "logprobs": body.logprobs, "top_logprobs": body.top_logprobs}
    if body.tools:
        data["tools"] = body.tools  # Ollama's tools are OpenAI's; without tool_choice: the model decides
    openai_body = _validate_as(ChatJobRequest, data, request)
    messages = chat_inputs(request, openai_body, "images")[0]
    grammar = await _grammar(request, openai_body, chat=openai_body)
    _generative(request, model, openai_body)
    params = openai_body.sampling(openai_body.token_limit, grammar, openai_body.wanted_logprobs,
                                  defaults=model.controller.settings)
    job = model.controller.new_job("ollama.chat", params, messages=messages, keep_alive=body.keep_alive,
                                   tools=[t.to_protocol() for t in openai_body.tools or ()])
    return await answer(request, model, job, lines, body.stream, tool_mode(openai_body))


async def generate(request: web.Request) -> web.StreamResponse:
    body = await parse_body(request, OllamaGenerateRequest)
    model = ollama_model(request, body.model)
    check_keep_alive(request, body.keep_alive)
    lines = GenerateLines(body.model or model.id, model.controller, logprobs=body.logprobs)
    if not body.prompt and not body.system and not body.images:
        return await _load_or_unload(request, model, "ollama.generate", body.keep_alive, lines)
    fields = {**_sampling_fields(body, model), "logprobs": body.logprobs, "top_logprobs": body.top_logprobs}
    if body.raw:  # the prompt as it is, no template: a completion
        if body.images:
            raise ApiError(400, "images: raw: true sends the prompt as it is, and an image needs the chat template "
                                "to be placed; send raw: false", "invalid_value", param="images")
        if body.system:
            raise ApiError(400, "system: raw: true sends the prompt as it is, with no template to place a system "
                                "prompt in", "invalid_value", param="system")
        top = fields.pop("top_logprobs")
        fields["logprobs"] = (top or 0) if fields["logprobs"] else None
        openai_body = _validate_as(CompletionRequest, {**fields, "prompt": body.prompt}, request)
        grammar = await _grammar(request, openai_body)
        _generative(request, model, openai_body)
        params = openai_body.sampling(openai_body.max_tokens, grammar, openai_body.logprobs,
                                      defaults=model.controller.settings)
        job = model.controller.new_job("ollama.generate", params, prompt=body.prompt, keep_alive=body.keep_alive)
        return await answer(request, model, job, lines, body.stream, None)
    messages = [OllamaMessage(role="system", content=body.system)] if body.system else []
    messages.append(OllamaMessage(role="user", content=body.prompt, images=body.images))
    openai_body = _validate_as(ChatJobRequest, {**fields, "messages": [m.openai() for m in messages]}, request)
    protocol = chat_inputs(request, openai_body, "images")[0]
    grammar = await _grammar(request, openai_body, chat=openai_body)
    _generative(request, model, openai_body)
    params = openai_body.sampling(openai_body.token_limit, grammar, openai_body.wanted_logprobs,
                                  defaults=model.controller.settings)
    job = model.controller.new_job("ollama.generate", params, messages=protocol, keep_alive=body.keep_alive)
    return await answer(request, model, job, lines, body.stream, None)


def _embeddings_model(request: web.Request, name: str | None, options: dict[str, Any] | None) -> FleetModel:
    model = ollama_model(request, name)
    if not model.controller.settings.embeddings:
        raise ApiError(400, f"model {model.id!r} has no embeddings: set embeddings = true in its [models.{model.id}] "
                            "table (or start with --embeddings), or name an embeddings model", "embeddings_not_enabled",
                       param="model")
    check_one_vector_per_input(model, request.path)
    OllamaOptions.check_names(options or {}, sampling=False)
    for option, value in (options or {}).items():
        if value is not None and option != "num_ctx":  # num_predict: nothing is predicted
            raise ApiError(400, f"options.{option}: embeddings take only num_ctx", "invalid_value",
                           param=f"options.{option}")
    num_ctx = (options or {}).get("num_ctx")
    if num_ctx is not None:
        if isinstance(num_ctx, bool) or not isinstance(num_ctx, int) or num_ctx < 1:
            raise ApiError(400, "options.num_ctx: a positive integer", "invalid_value", param="options.num_ctx")
        check_num_ctx(num_ctx, model)
    return model


async def embed(request: web.Request) -> web.Response:
    body = await parse_body(request, OllamaEmbedRequest)
    model = _embeddings_model(request, body.model, body.options)
    check_keep_alive(request, body.keep_alive)
    inputs = [body.input] if isinstance(body.input, str) else list(body.input or ())
    if not inputs:  # Ollama's load: no input, no embeddings
        require_privilege(request, "loading a model with an empty request")
        job = model.controller.new_query("ollama.embed", "tokenize", text="", keep_alive=body.keep_alive)
        await run_query(request, model, job)
        return web.json_response({"model": body.model or model.id, "embeddings": []})
    if any(not text for text in inputs):
        raise ApiError(400, "input: an empty string has no embedding", "invalid_value", param="input")
    check_dimensions(body.dimensions, await ollama_models.embedding_length(model))
    job = model.controller.new_query("ollama.embed", "embed", inputs=inputs, truncate=body.truncate,
                                     keep_alive=body.keep_alive)
    result = await run_query(request, model, job)
    return web.json_response(embed_body(body.model or model.id, job, model.controller, result, body.dimensions))


async def embeddings(request: web.Request) -> web.Response:
    """Ollama's older endpoint: one prompt, one `embedding`."""
    body = await parse_body(request, OllamaLegacyEmbeddingsRequest)
    model = _embeddings_model(request, body.model, body.options)
    check_keep_alive(request, body.keep_alive)
    if not body.prompt:  # Ollama's load
        require_privilege(request, "loading a model with an empty request")
    kind, fields = ("embed", {"inputs": [body.prompt]}) if body.prompt else ("tokenize", {"text": ""})
    job = model.controller.new_query("ollama.embeddings", kind, keep_alive=body.keep_alive, **fields)
    result = await run_query(request, model, job)
    return web.json_response({"embedding": result.embeddings[0] if body.prompt else []})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/api/chat", chat)
    app.router.add_post("/api/generate", generate)
    app.router.add_post("/api/embed", embed)
    app.router.add_post("/api/embeddings", embeddings)
    ollama_models.add_routes(app)
    ollama_pull.add_routes(app)
