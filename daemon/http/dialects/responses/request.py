"""OpenAI Responses: POST /v1/responses, and the token count of a request:
POST /v1/responses/input_tokens (chat completions' own count is the openai dialect's).

A Responses body is translated into the chat job it means
(core/conversation.py's ChatJobRequest: messages, tools, tool_choice, response_format,
max_completion_tokens and the sampling fields), which then takes chat's own
path: its validation, image checks, grammar, tool mode and one chat job
("responses"). answer.py writes what comes back in Responses' shapes.

Stateless, like llama-server: nothing is stored. `store` is accepted (the
answer says store: false), while `previous_response_id`, `conversation` and
`item_reference` items are a 400 that says to send the whole input.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from aiohttp import web
from pydantic import ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from daemon.http.errors import ApiError
from daemon.http.keys import FLEET
from daemon.http.core.job import chat_job, input_tokens_answer, parse_body, tool_mode
from daemon.http.core.conversation import (ChatJobRequest, ChatMessageIn, FunctionIn, ImagePart, ImageURL,
                                           TextPart, ToolIn)
from daemon.http.core.tagged import Refused, tagged, union_of
from daemon.http.core.schemas import (_at_most, CacheSalt, field_name, MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_TOOL_CALLS,
                                      MAX_TOOLS, MAX_TOP_LOGPROBS, RequestModel)

MAX_INCLUDE = 16
MAX_METADATA = 16  # OpenAI's: 16 pairs, keys of 64 characters, values of 512
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# What `include` may name: the logprobs are given; no reasoning item is ever produced, so none has content to add.
KNOWN_INCLUDES = frozenset({LOGPROBS_INCLUDE, "reasoning.encrypted_content"})
# llama.cpp's sampling fields beside Responses' own (llama-server passes them through): chat validates them, by these names.
SAMPLING_PASSTHROUGH = ("temperature", "top_p", "top_k", "min_p", "seed", "repeat_penalty", "repeat_last_n",
                        "presence_penalty", "frequency_penalty", "logit_bias", "stop", "ignore_eos", "user",
                        "chat_template_kwargs", "return_progress", "timings_per_token")
ShortText = Annotated[str, Field(max_length=512)]
CallId = Annotated[str, Field(min_length=1, max_length=256)]


def _null_only(why: str) -> dict[str, Any]:
    return {"type": "null", "description": why}


# -- content parts -------------------------------------------------------------------


class TextIn(RequestModel):
    type: Literal["input_text", "output_text"]
    text: str


class RefusalIn(RequestModel):
    type: Literal["refusal"]
    refusal: str


class ImageIn(RequestModel):
    model_config = ConfigDict(json_schema_extra={"required": ["type", "image_url"]})  # as _url below requires
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: ShortText | None = None
    detail: Annotated[str, Field(max_length=16)] | None = None

    @model_validator(mode="after")
    def _url(self) -> ImageIn:
        if self.image_url is None:
            raise ValueError("input_image needs image_url, a data: URL (Dormouse stores no files, so a file_id "
                             "names nothing)" if self.file_id else "input_image needs image_url, a data: URL")
        return self


class RefusedPart(Refused):
    REASONS: ClassVar[dict[str | None, str]] = {"input_file": "input_file parts are not supported: send the file's text as input_text",
               None: "content parts of type {kind!r} are not supported: send input_text, output_text, refusal or "
                     "input_image"}


Part = Annotated[union_of(TextIn, RefusalIn, ImageIn, RefusedPart),
                 tagged({"input_text": TextIn, "output_text": TextIn, "refusal": RefusalIn, "input_image": ImageIn},
                         RefusedPart)]
Parts = Annotated[list[Part], Field(max_length=MAX_CONTENT_PARTS)]


def _parts(value: Any) -> Any:
    """A string is one text part."""
    if isinstance(value, str):
        return [{"type": "input_text", "text": value}]
    return _at_most(value, MAX_CONTENT_PARTS, "content parts")


def _chat_content(parts: list) -> str | list:
    """Chat's content for these parts: a string when they are text only (what
    every template reads), else text and image_url parts in order."""
    if not any(isinstance(part, ImageIn) for part in parts):
        return "".join(part.text if isinstance(part, TextIn) else part.refusal for part in parts)
    return [ImagePart(type="image_url", image_url=ImageURL(url=part.image_url, detail=part.detail))
            if isinstance(part, ImageIn) else
            TextPart(type="text", text=part.text if isinstance(part, TextIn) else part.refusal) for part in parts]


# -- input items ---------------------------------------------------------------------


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Parts

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        return _parts(value)


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: CallId
    name: Annotated[str, Field(min_length=1, max_length=256)]
    arguments: Annotated[str, Field(max_length=1_000_000)]


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: CallId
    output: Parts

    @field_validator("output", mode="before")
    @classmethod
    def _output(cls, value: Any) -> Any:
        return _parts(value)


class RefusedItem(Refused):
    REASONS: ClassVar[dict[str | None, str]] = {
        "item_reference": "item_reference items name stored items, and Dormouse stores none (it is stateless, like "
                          "llama-server): send the items themselves",
        "reasoning": "reasoning items are not read back (no model here produces them): leave them out of input",
        None: "input items of type {kind!r} are not supported: send message, function_call and function_call_output "
              "items (Dormouse runs function tools only; the client runs them)",
    }


Item = Annotated[union_of(MessageItem, FunctionCallItem, FunctionCallOutputItem, RefusedItem),
                 tagged({"message": MessageItem, "function_call": FunctionCallItem,
                          "function_call_output": FunctionCallOutputItem}, RefusedItem, default="message")]


# -- tools, tool_choice, text, reasoning ------------------------------------------------


class FunctionToolIn(RequestModel):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: Annotated[str, Field(max_length=65536)] = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool = True  # Responses' default

    def to_chat(self) -> ToolIn:
        return ToolIn(type="function", function=FunctionIn(name=self.name, description=self.description,
                                                           parameters=self.parameters, strict=self.strict))

    def echo(self) -> dict:
        return {"type": "function", "name": self.name, "description": self.description or None,
                "parameters": self.parameters, "strict": self.strict}


class RefusedTool(Refused):
    REASONS: ClassVar[dict[str | None, str]] = {None: "tools of type {kind!r} are not supported: Dormouse offers function tools only (the client "
                     "runs them)"}


Tool = Annotated[union_of(FunctionToolIn, RefusedTool), tagged({"function": FunctionToolIn}, RefusedTool)]


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(max_length=64)] | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: Annotated[str, Field(max_length=65536)] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a json_schema format needs its schema")
        return self

    def response_format(self) -> dict | None:
        """Chat's response_format for this format; None for plain text."""
        if self.type == "json_schema":
            wrapper = {"name": self.name or "response", "schema": self.schema_, "strict": self.strict,
                       "description": self.description}
            return {"type": "json_schema", "json_schema": {k: v for k, v in wrapper.items() if v is not None}}
        return {"type": "json_object"} if self.type == "json_object" else None

    def echo(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "name": self.name or "response", "schema": self.schema_,
                "strict": self.strict, "description": self.description}


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(None, json_schema_extra={"enum": ["medium", None]})

    @field_validator("verbosity")
    @classmethod
    def _verbosity(cls, value: str | None) -> str | None:
        if value not in (None, "medium"):
            raise ValueError(f"{value!r} cannot be honoured: nothing tells a model here to write less or more; "
                             "send 'medium' or leave it out")
        return value


class ReasoningIn(RequestModel):
    effort: Annotated[str, Field(max_length=16)] | None = Field(None, json_schema_extra={"enum": ["none", None]})
    summary: Annotated[str, Field(max_length=16)] | None = Field(None, json_schema_extra=_null_only("refused"))
    generate_summary: Annotated[str, Field(max_length=16)] | None = Field(None,
                                                                           json_schema_extra=_null_only("refused"))

    @model_validator(mode="after")
    def _none(self) -> ReasoningIn:
        if self.effort not in (None, "none"):
            raise ValueError(f"effort {self.effort[:16]!r} cannot be honoured: the model does not reason here; send "
                             "'none' or leave reasoning out")
        if self.summary is not None or self.generate_summary is not None:
            raise ValueError("a reasoning summary cannot be given: the model does not reason here")
        return self


def _tool_choice(value: Any) -> Any:
    """'none', 'auto', 'required' or {type: function, name}; anything else refused by what it is."""
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        name = value.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= 64:
            raise ValueError("{type: 'function'} needs the name of one of the tools")
        return {"type": "function", "name": name}
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        raise ValueError(f"{{type: {value['type'][:64]!r}}} is not supported: give 'none', 'auto', 'required' or "
                         "{type: 'function', name}")
    raise ValueError("must be 'none', 'auto', 'required' or {type: 'function', name}")


# Fields of other APIs that a client may send here by mistake: refused with where the setting went.
MOVED = {"response_format": "text.format", "messages": "input", "max_tokens": "max_output_tokens",
         "max_completion_tokens": "max_output_tokens", "functions": "tools"}
STATEFUL = {"previous_response_id": "responses are not stored", "conversation": "conversations are not stored",
            "prompt": "prompt templates are not stored"}


def _documented(schema: dict[str, Any]) -> None:
    """/openapi.json: what the validators below accept, not only the types (the
    passed-through sampling fields as chat documents them; refused fields null only)."""
    props = schema["properties"]
    chat = ChatJobRequest.model_json_schema(mode="validation")["properties"]
    for name in SAMPLING_PASSTHROUGH:
        props[name] = chat[name]
    for name, use in MOVED.items():
        props[name] = _null_only(f"not a Responses field: use {use}")
    for name, why in STATEFUL.items():
        props[name] = _null_only(f"{why} (Dormouse is stateless): send the whole conversation as input")
    # input: a string (one user message) or items; with neither input nor instructions there is nothing to answer.
    props["input"] = {"anyOf": [{"type": "string"}, {**props["input"], "minItems": 1}]}
    schema["anyOf"] = [{"required": ["input"]}, {"required": ["instructions"],
                                                 "properties": {"instructions": {"type": "string", "minLength": 1}}}]
    props["background"] = {"const": False, "default": False, "description": "responses are not stored"}
    props["include"] = {"anyOf": [{"type": "array", "items": {"enum": sorted(KNOWN_INCLUDES)}, "maxItems": MAX_INCLUDE},
                                  {"type": "null"}]}
    props["truncation"] = {"enum": ["disabled", None], "description": "'auto' would drop input items: refused"}
    props["service_tier"] = {"enum": ["auto", "default", None]}
    props["tool_choice"] = {"anyOf": [{"enum": ["none", "auto", "required", None]},
                                      {"type": "object", "required": ["type", "name"],
                                       "properties": {"type": {"const": "function"},
                                                      "name": {"type": "string", "minLength": 1, "maxLength": 64}}}]}


class ResponsesRequest(RequestModel):
    model_config = ConfigDict(json_schema_extra=_documented)
    model: str | None = None
    input: Annotated[list[Item], Field(max_length=MAX_MESSAGES)] = Field(default_factory=list)
    instructions: str | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = Field(False, strict=True, description="several calls in one answer; false unless "
                                      "asked, as chat's")
    max_tool_calls: int | None = Field(None, ge=1, le=MAX_TOOL_CALLS, strict=True)
    text: TextConfig | None = None
    reasoning: ReasoningIn | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=1_000_000, strict=True)
    include: Annotated[list[str], Field(max_length=MAX_INCLUDE)] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, strict=True, description="needs include: "
                                     "['message.output_text.logprobs'], which gives the chosen tokens' logprobs")
    stream: bool = Field(False, strict=True)
    store: bool = Field(False, strict=True, description="accepted and ignored: nothing is stored")
    background: bool = Field(False, strict=True)
    truncation: Literal["auto", "disabled"] | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], ShortText], Field(max_length=MAX_METADATA)] | None \
        = None
    service_tier: Literal["auto", "default", "flex", "priority", "scale"] | None = None
    safety_identifier: ShortText | None = None
    prompt_cache_key: ShortText | None = None
    cache_salt: CacheSalt | None = None
    previous_response_id: Any = None
    conversation: Any = None
    prompt: Any = None
    response_format: Any = None
    messages: Any = None
    max_tokens: Any = None
    max_completion_tokens: Any = None
    functions: Any = None
    # llama.cpp's sampling fields, validated by chat under the same names.
    top_k: Any = None
    min_p: Any = None
    seed: Any = None
    repeat_penalty: Any = None
    repeat_last_n: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    stop: Any = None
    ignore_eos: Any = None
    temperature: Any = None
    top_p: Any = None
    user: Any = None
    chat_template_kwargs: Any = None
    return_progress: Any = None
    timings_per_token: Any = None

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, value: Any) -> Any:
        if isinstance(value, str):  # one user message
            return [{"type": "message", "role": "user", "content": value}]
        return _at_most(value, MAX_MESSAGES, "input items")

    @field_validator("tools", mode="before")
    @classmethod
    def _tools(cls, value: Any) -> Any:
        return _at_most(value, MAX_TOOLS, "tools")

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice(cls, value: Any) -> Any:
        return _tool_choice(value)

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata(cls, value: Any) -> Any:
        return _at_most(value, MAX_METADATA, "metadata pairs")

    @field_validator("include", mode="before")
    @classmethod
    def _include(cls, value: Any) -> Any:
        _at_most(value, MAX_INCLUDE, "include values")
        for name in value if isinstance(value, list) else ():
            if isinstance(name, str) and name not in KNOWN_INCLUDES:
                raise ValueError(f"{name[:64]!r} cannot be included: it belongs to a tool Dormouse does not run "
                                 f"(it includes {', '.join(sorted(KNOWN_INCLUDES))})")
        return value

    @field_validator(*STATEFUL)
    @classmethod
    def _stateful(cls, value: Any, info: ValidationInfo) -> Any:
        raise ValueError(f"{STATEFUL[info.field_name]} (Dormouse is stateless, like llama-server): send the whole "
                         "conversation as input")

    @field_validator(*MOVED)
    @classmethod
    def _moved(cls, value: Any, info: ValidationInfo) -> Any:
        raise ValueError(f"not a Responses field: use {MOVED[info.field_name]}")

    @field_validator("background")
    @classmethod
    def _background(cls, value: bool) -> bool:
        if value:
            raise ValueError("responses are not stored, so none can run in the background; leave it out or false")
        return value

    @field_validator("truncation")
    @classmethod
    def _truncation(cls, value: str | None) -> str | None:
        if value == "auto":
            raise ValueError("'auto' would drop input items; Dormouse never drops any (a request longer than the "
                             "context is a 400): send 'disabled' or leave it out")
        return value

    @field_validator("service_tier")
    @classmethod
    def _tier(cls, value: str | None) -> str | None:
        if value in ("flex", "priority", "scale"):
            raise ValueError(f"{value!r} is not offered; send 'auto' or 'default'")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _needs_include(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and LOGPROBS_INCLUDE not in (info.data.get("include") or ()):
            raise ValueError(f"top_logprobs needs include: ['{LOGPROBS_INCLUDE}']")  # as chat's: never ignored
        return value

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    @property
    def format(self) -> TextFormat | None:
        return self.text.format if self.text is not None else None

    def chat_messages(self) -> list[ChatMessageIn]:
        """The conversation as chat messages: instructions first (a system
        turn), consecutive function_call items folded into the assistant turn
        before them, each output a tool turn naming its call's function."""
        out = [ChatMessageIn(role="system", content=self.instructions)] if self.instructions else []
        if not self.input and not out:
            raise ApiError(400, "input: give at least one input item (or instructions)", "invalid_value", param="input")
        names: dict[str, str] = {}  # call_id -> function name, for the tool turns that answer them
        for index, item in enumerate(self.input):
            if isinstance(item, MessageItem):
                out.append(ChatMessageIn(role=item.role, content=_chat_content(item.content)))
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                names[item.call_id] = item.name
                last = out[-1] if out else None
                if last is not None and last.role == "assistant" and len(last.tool_calls or ()) < MAX_TOOL_CALLS:
                    out[-1] = ChatMessageIn(role="assistant", content=last.content,
                                            tool_calls=[*(last.tool_calls or ()), call])
                else:
                    out.append(ChatMessageIn(role="assistant", content=None, tool_calls=[call]))
            else:
                if item.call_id not in names:
                    raise ApiError(400, f"input.{index}.call_id: no function_call item with call_id "
                                        f"{item.call_id[:64]!r} comes before this output", "invalid_value",
                                   param=f"input.{index}.call_id")
                out.append(ChatMessageIn(role="tool", content=_chat_content(item.output), tool_call_id=item.call_id,
                                         name=names[item.call_id]))
        return out

    def chat_request(self, max_prompt_tokens: int) -> ChatJobRequest:
        """The chat job this body means, validated as every chat job is."""
        data: dict[str, Any] = {name: getattr(self, name) for name in SAMPLING_PASSTHROUGH
                                if getattr(self, name) is not None}
        data.update(model=self.model, messages=self.chat_messages(), stream=self.stream,
                    parallel_tool_calls=self.parallel_tool_calls)
        if self.tools:
            data["tools"] = [tool.to_chat() for tool in self.tools]
        if isinstance(self.tool_choice, dict):
            data["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice["name"]}}
        elif self.tool_choice is not None:
            data["tool_choice"] = self.tool_choice
        if self.max_output_tokens is not None:
            data["max_completion_tokens"] = self.max_output_tokens
        if self.format is not None:
            data["response_format"] = self.format.response_format()
        if self.wants_logprobs:
            data.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        try:
            return ChatJobRequest.model_validate(data, context={"max_prompt_tokens": max_prompt_tokens})
        except ValidationError as exc:
            err = exc.errors()[0]
            name = responses_name(field_name(err["loc"]) or "body")
            raise ApiError(400, f"{name}: {str(err['msg']).removeprefix('Value error, ')}", "invalid_value",
                           param=name) from None


_CHAT_NAMES = ((re.compile(r"\bmessages(\.\d+)?(\.[\w.]+)?"), "input"),
               (re.compile(r"\bresponse_format\.json_schema\b"), "text.format"),
               (re.compile(r"\bresponse_format\b"), "text.format"),
               (re.compile(r"\btools(?:\.(\d+)|\[(\d+)\])\.function\b"), r"tools.\1\2"),
               (re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"))


def responses_name(text: str) -> str:
    """A chat field's name, or a message naming it, in Responses' names. Chat's
    message indexes are not input's (instructions, folded calls), so those name `input`."""
    for pattern, name in _CHAT_NAMES:
        text = pattern.sub(name, text)
    return text


def _renamed(exc: ApiError) -> ApiError:
    return ApiError(exc.status, responses_name(exc.message), exc.code,
                    param=responses_name(exc.param) if exc.param else None, retry_after=exc.retry_after)


async def responses(request: web.Request) -> web.StreamResponse:
    from daemon.http.dialects.responses.answer import ResponseShape, answer

    body = await parse_body(request, ResponsesRequest)
    chat = body.chat_request(request.app[FLEET].max_ctx_size)
    model, job = await chat_job(request, chat, "responses", param="input", rename=_renamed)
    shape = ResponseShape(job.id, model.id, body, chat, job.submit.params)
    return await answer(request, model, job, shape, tool_mode(chat), body.stream)


async def responses_input_tokens(request: web.Request) -> web.Response:
    """The input tokens a Responses request with this body reads (its messages
    and tools through the model's chat template, images included)."""
    body = await parse_body(request, ResponsesRequest)
    chat = body.chat_request(request.app[FLEET].max_ctx_size)
    return await input_tokens_answer(request, "responses.input_tokens", chat, "input")


def add_routes(app: web.Application) -> None:
    for prefix in ("/v1", ""):  # llama-server serves each of these unversioned too
        app.router.add_post(f"{prefix}/responses", responses)
        app.router.add_post(f"{prefix}/responses/input_tokens", responses_input_tokens)
