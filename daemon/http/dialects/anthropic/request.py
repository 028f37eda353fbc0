"""Anthropic Messages: POST /v1/messages and POST /v1/messages/count_tokens.

A body is validated in Anthropic's names (errors name its fields, in its
error shape: the middleware renders any ApiError under /v1/messages so), then
translated into the chat completions request it means and run as the same
chat job: `system` becomes a system turn; an assistant's tool_use blocks its
tool_calls (input written as the arguments' JSON) and thinking blocks its
reasoning_content; each tool_result block a tool turn answering its call (by
tool_use_id, in the order the blocks came); image blocks (base64) image parts;
`tools` chat's function tools (input_schema as parameters); tool_choice auto,
any (chat's required), tool (a named function) and none; stop_sequences chat's
stop. What the worker answers is shaped by answer.py.

Refused by name, never ignored: server tools (web search, bash, code
execution: nothing here runs them), document and other server-side blocks,
image URLs and files (no remote fetching, no file store), mcp_servers,
container, context_management, output_config (structured output, effort).
cache_control is accepted on every block and needs nothing: the prompt cache
reuses any prefix it holds on its own.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, Union

import msgspec
from aiohttp import web
from pydantic import (Discriminator, Field, StrictBool, Tag, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from daemon.http.errors import ApiError
from daemon.http.keys import FLEET
from daemon.http.core.job import chat_inputs, chat_job, generation_model, parse_body, tool_mode
# Tagged unions (core/tagged.py): a block of an unknown type is refused by what it is.
from daemon.http.core.tagged import Refused, tagged, union_of
from daemon.http.core.conversation import ChatJobRequest, ChatMessageIn, ImagePart, ImageURL, TextPart
from daemon.http.core.schemas import (_at_most, _json_within, CacheSalt, field_name, INT32_MAX, MAX_CONTENT_PARTS,
                                      MAX_MESSAGES, MAX_STOP_CHARS, MAX_STOPS, MAX_TOOL_CALLS, MAX_TOOLS, RequestModel)

MAX_JSON_DEPTH = 64  # a tool_use's input and a tool's input_schema
MAX_INPUT_BYTES = 1_000_000  # a tool_use's input as JSON: chat's bound on a call's arguments
ToolName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]  # chat's function names
ToolUseId = Annotated[str, Field(min_length=1, max_length=256)]
CacheControl = dict[str, Any] | None  # accepted on any block: the prompt cache needs no marks


def _bounded_json(value: Any, what: str, budget: int = MAX_INPUT_BYTES) -> Any:
    try:
        over = _json_within(value, budget, MAX_JSON_DEPTH) < 0
    except ValueError:
        raise ValueError(f"{what} is nested more than {MAX_JSON_DEPTH} levels deep") from None
    if over:
        raise ValueError(f"{what} is larger than {budget} bytes of JSON")
    return value


def _text_or(blocks: Any, what: str) -> Any:
    """A string, or a list of blocks, told apart by the value's own type: an
    error in a block then names the block and why (a plain union reports the
    string member's "Input should be a valid string" first), and a value that
    is neither says what it should be."""
    def which(value: Any) -> str | None:
        return "str" if isinstance(value, str) else "list" if isinstance(value, list) else None

    return Annotated[Union[Annotated[str, Tag("str")], Annotated[blocks, Tag("list")]],  # noqa: UP007
                     Discriminator(which, custom_error_type="invalid_content",
                                   custom_error_message=f"must be a string or a list of {what}")]


# -- content blocks ----------------------------------------------------------------------


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None
    citations: list[Any] | None = None  # an earlier answer's: nothing here to cite again


class Base64Source(RequestModel):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class RefusedSource(Refused):
    REASONS: ClassVar[dict[str | None, str]] = {
        "url": "image sources of type 'url' are not fetched (no remote fetching): send the image as base64",
        "file": "image sources of type 'file' name stored files, and Dormouse stores none: send the image as base64",
        None: "image sources of type {kind!r} are not supported: send {{type: 'base64', media_type, data}}"}


ImageSource = Annotated[union_of(Base64Source, RefusedSource), tagged({"base64": Base64Source}, RefusedSource)]


class ImageBlock(RequestModel):
    type: Literal["image"]
    source: ImageSource
    cache_control: CacheControl = None

    def to_chat(self) -> ImagePart:
        url = f"data:{self.source.media_type};base64,{self.source.data}"
        return ImagePart(type="image_url", image_url=ImageURL(url=url))


class ToolUseBlock(RequestModel):
    type: Literal["tool_use"]
    id: ToolUseId
    name: ToolName
    input: dict[str, Any]
    cache_control: CacheControl = None

    @field_validator("input")
    @classmethod
    def _input_bounds(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _bounded_json(value, "input")


class RefusedResultPart(Refused):
    REASONS: ClassVar[dict[str | None, str]] = {
        None: "tool_result content blocks of type {kind!r} are not supported: send text and image blocks"}


ResultPart = Annotated[union_of(TextBlock, ImageBlock, RefusedResultPart),
                       tagged({"text": TextBlock, "image": ImageBlock}, RefusedResultPart)]


class ToolResultBlock(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: ToolUseId
    content: _text_or(Annotated[list[ResultPart], Field(max_length=MAX_CONTENT_PARTS)], "text and image blocks") = ""
    is_error: StrictBool = False
    cache_control: CacheControl = None

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, value: Any) -> Any:
        return _at_most(value, MAX_CONTENT_PARTS, "content blocks in a tool_result")

    def to_chat(self) -> str | list:
        """The tool turn's content: a string for text (what every template
        reads), else parts in order. An error says so first, where the model reads it."""
        prefix = "Error: " if self.is_error else ""
        if isinstance(self.content, str):
            return prefix + self.content
        if not any(isinstance(part, ImageBlock) for part in self.content):
            return prefix + "".join(part.text for part in self.content)
        parts = [part.to_chat() if isinstance(part, ImageBlock) else TextPart(type="text", text=part.text)
                 for part in self.content]
        return [TextPart(type="text", text=prefix), *parts] if prefix else parts


class ThinkingBlock(RequestModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # Anthropic's, for its own models; Dormouse's thinking carries an empty one


class RedactedThinkingBlock(RequestModel):
    """Thinking Anthropic encrypted: no model here can read it, so it is left out of the prompt."""

    type: Literal["redacted_thinking"]
    data: str = ""


class RefusedBlock(Refused):
    REASONS: ClassVar[dict[str | None, str]] = {
        "document": "document blocks are not supported: send the document's text as a text block",
        "search_result": "search_result blocks are not supported: send the results as text blocks",
        "container_upload": "container_upload blocks are not supported: no code execution container runs here",
        "server_tool_use": "server_tool_use blocks are not supported: no server tools run here (client tools only)",
        "web_search_tool_result": "web_search_tool_result blocks are not supported: no server tools run here",
        None: "content blocks of type {kind!r} are not supported: send text, image, tool_use, tool_result or "
              "thinking blocks"}


Block = Annotated[union_of(TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock,
                         RefusedBlock),
                  tagged({"text": TextBlock, "image": ImageBlock, "tool_use": ToolUseBlock,
                           "tool_result": ToolResultBlock, "thinking": ThinkingBlock,
                           "redacted_thinking": RedactedThinkingBlock}, RefusedBlock)]


class MessageIn(RequestModel):
    role: Literal["user", "assistant"]
    content: _text_or(Annotated[list[Block], Field(max_length=MAX_CONTENT_PARTS)], "content blocks")

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, value: Any) -> Any:
        return _at_most(value, MAX_CONTENT_PARTS, "content blocks in a message")

    @model_validator(mode="after")
    def _blocks_fit_role(self) -> MessageIn:
        blocks = self.content if isinstance(self.content, list) else ()
        if self.role == "user" and any(isinstance(b, (ToolUseBlock, ThinkingBlock, RedactedThinkingBlock)) for b in blocks):
            raise ValueError("tool_use and thinking blocks belong to assistant messages")
        if self.role == "assistant" and any(isinstance(b, ToolResultBlock) for b in blocks):
            raise ValueError("tool_result blocks belong to user messages (they answer the assistant's tool_use)")
        if sum(isinstance(b, ToolUseBlock) for b in blocks) > MAX_TOOL_CALLS:
            raise ValueError(f"at most {MAX_TOOL_CALLS} tool_use blocks in a message")
        return self


class RefusedSystemBlock(Refused):
    REASONS: ClassVar[dict[str | None, str]] = {None: "system blocks of type {kind!r} are not supported: send text blocks"}


SystemBlock = Annotated[union_of(TextBlock, RefusedSystemBlock), tagged({"text": TextBlock}, RefusedSystemBlock)]


# -- tools, tool_choice, thinking --------------------------------------------------------


class ToolDef(RequestModel):
    """A client tool: the model writes a call, the client runs it."""

    type: Literal["custom"] | None = None
    name: ToolName
    description: Annotated[str, Field(max_length=65536)] = ""
    input_schema: dict[str, Any]
    cache_control: CacheControl = None

    @field_validator("input_schema")
    @classmethod
    def _schema_bounds(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type", "object") != "object":
            raise ValueError("input_schema describes the input object: its type is 'object'")
        return _bounded_json(value, "input_schema")

    def to_chat(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.input_schema}}


class RefusedTool(Refused):
    REASONS: ClassVar[dict[str | None, str]] = {
        None: "tools of type {kind!r} are server tools, and none runs here: give client tools "
              "{{name, description, input_schema}} (the client runs them)"}


def _tool_tag(value: Any) -> str:
    """Client tools have no type, or 'custom'; every other type is a server tool."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return ToolDef.__name__ if kind in (None, "custom") else RefusedTool.__name__


Tool = Annotated[union_of(ToolDef, RefusedTool), Discriminator(_tool_tag)]


class ChoiceAuto(RequestModel):
    type: Literal["auto"]
    disable_parallel_tool_use: StrictBool = False


class ChoiceAny(RequestModel):
    type: Literal["any"]
    disable_parallel_tool_use: StrictBool = False


class ChoiceTool(RequestModel):
    type: Literal["tool"]
    name: ToolName
    disable_parallel_tool_use: StrictBool = False


class ChoiceNone(RequestModel):
    type: Literal["none"]


class RefusedChoice(Refused):
    REASONS: ClassVar[dict[str | None, str]] = {
        None: "tool_choice of type {kind!r} is not one of auto, any, tool (with name) or none"}


ToolChoice = Annotated[union_of(ChoiceAuto, ChoiceAny, ChoiceTool, ChoiceNone, RefusedChoice),
                       tagged({"auto": ChoiceAuto, "any": ChoiceAny, "tool": ChoiceTool, "none": ChoiceNone},
                               RefusedChoice)]


class ThinkingIn(RequestModel):
    """enabled: the chat template's enable_thinking is set (models that think
    then write their thinking as a thinking block); disabled: it is cleared.
    The thinking counts against max_tokens, which bounds budget_tokens."""

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=1, le=1_000_000, strict=True)


class Metadata(RequestModel):
    user_id: Annotated[str, Field(max_length=256)] | None = None


# Fields of Anthropic's API that need something Dormouse does not run: refused with why.
NOT_RUN = {"mcp_servers": "MCP servers are not connected from here: run them in the client",
           "container": "no code execution container runs here",
           "context_management": "context management (clearing earlier tool results) is not done here: send the "
                                 "conversation as it should be read",
           # messages.parse() sends output_config.format: an answer not held to it would fail the client's parse.
           "output_config": "output_config (structured output format, effort) is not applied here: for JSON held to "
                            "a schema, use /v1/chat/completions' response_format, or a tool with tool_choice "
                            "{type: 'tool', name}"}


SYSTEM_BLOCK_SEPARATOR = "\n"


class CountTokensRequest(RequestModel):
    """What /v1/messages/count_tokens reads; /v1/messages adds generation's fields."""

    # Anthropic's API requires it; here, as llama-server and the other dialects read it, none is the default model.
    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    messages: Annotated[list[MessageIn], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: _text_or(Annotated[list[SystemBlock], Field(max_length=MAX_CONTENT_PARTS)], "text blocks") | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingIn | None = None
    # llama-server's: variables for the chat template, as on chat completions.
    chat_template_kwargs: dict[str, Any] | None = None
    mcp_servers: Any = None
    container: Any = None
    context_management: Any = None
    output_config: Any = None

    @field_validator("messages", mode="before")
    @classmethod
    def _message_count(cls, value: Any) -> Any:
        return _at_most(value, MAX_MESSAGES, "messages")

    @field_validator("tools", mode="before")
    @classmethod
    def _tool_count(cls, value: Any) -> Any:
        return _at_most(value, MAX_TOOLS, "tools")

    @field_validator("system", mode="before")
    @classmethod
    def _system_blocks(cls, value: Any) -> Any:
        return _at_most(value, MAX_CONTENT_PARTS, "system blocks")

    @field_validator("mcp_servers", "container", "context_management", "output_config")
    @classmethod
    def _not_run(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(f"not supported: {NOT_RUN[info.field_name]}")
        return value

    # -- the chat request this body means ------------------------------------------------

    def chat_messages(self) -> list[ChatMessageIn]:
        out = []
        if self.system is not None:
            # Blocks are separate paragraphs of one system prompt: joined with a newline, as llama.cpp's
            # chat layer joins an OpenAI system message's text parts ("You are a pirate." + "Answer in
            # French." must not read "You are a pirate.Answer in French.").
            text = self.system if isinstance(self.system, str) else \
                SYSTEM_BLOCK_SEPARATOR.join(b.text for b in self.system if b.text)
            if text:
                out.append(ChatMessageIn(role="system", content=text))
        names: dict[str, str] = {}  # tool_use id -> its tool's name, for the tool turns that answer it
        for index, message in enumerate(self.messages):
            if isinstance(message.content, str):
                out.append(ChatMessageIn(role=message.role, content=message.content))
            elif message.role == "assistant":
                out.append(_assistant_turn(message.content, names))
            else:
                out += _user_turns(message.content, names, f"messages.{index}.content")
        return out

    def _tool_choice(self) -> tuple[str | dict | None, bool]:
        """(chat's tool_choice, parallel_tool_calls): Anthropic lets a model make
        several calls unless disable_parallel_tool_use says otherwise."""
        choice = self.tool_choice
        parallel = not getattr(choice, "disable_parallel_tool_use", False)
        if choice is None:
            return None, parallel
        if isinstance(choice, ChoiceTool):
            return {"type": "function", "function": {"name": choice.name}}, False
        return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel

    def _template_kwargs(self) -> dict[str, Any] | None:
        kwargs = dict(self.chat_template_kwargs or {})
        if self.thinking is not None:
            wanted = self.thinking.type == "enabled"
            if kwargs.get("enable_thinking", wanted) != wanted:
                raise ApiError(400, f"thinking: {self.thinking.type!r} and chat_template_kwargs.enable_thinking "
                                    f"{kwargs['enable_thinking']} disagree; give one", "invalid_value",
                               param="thinking")
            kwargs["enable_thinking"] = wanted
        return kwargs or None

    def _choice_fits_tools(self) -> None:
        """tool_choice any or tool needs tools, and tool names one of them: checked
        here, so a count refuses what a generation would (it builds no grammar)."""
        choice = self.tool_choice
        if isinstance(choice, (ChoiceAny, ChoiceTool)) and not self.tools:
            raise ApiError(400, f"tool_choice: {{type: {choice.type!r}}} needs tools, and no tools were given",
                           "invalid_value", param="tool_choice")
        if isinstance(choice, ChoiceTool) and choice.name not in {tool.name for tool in self.tools}:
            raise ApiError(400, f"tool_choice.name: {choice.name!r} is not among the tools", "invalid_value",
                           param="tool_choice.name")

    def chat_fields(self) -> dict[str, Any]:
        self._choice_fits_tools()
        choice, parallel = self._tool_choice()
        data: dict[str, Any] = {"model": self.model, "messages": self.chat_messages(), "parallel_tool_calls": parallel}
        if self.tools:
            data["tools"] = [tool.to_chat() for tool in self.tools]
        if choice is not None:
            data["tool_choice"] = choice
        kwargs = self._template_kwargs()
        if kwargs is not None:
            data["chat_template_kwargs"] = kwargs
        return data

    def chat_request(self, max_prompt_tokens: int) -> ChatJobRequest:
        """The chat job this body means, validated as every chat job is."""
        try:
            return ChatJobRequest.model_validate(self.chat_fields(),
                                                 context={"max_prompt_tokens": max_prompt_tokens})
        except ValidationError as exc:
            err = exc.errors()[0]
            name = anthropic_name(field_name(err["loc"]) or "body")
            raise ApiError(400, f"{name}: {anthropic_name(str(err['msg']).removeprefix('Value error, '))}",
                           "invalid_value", param=name) from None


def _assistant_turn(blocks: list, names: dict[str, str]) -> ChatMessageIn:
    texts, calls, thinking = [], [], []
    for block in blocks:
        if isinstance(block, TextBlock):
            texts.append(TextPart(type="text", text=block.text))
        elif isinstance(block, ImageBlock):
            texts.append(block.to_chat())
        elif isinstance(block, ToolUseBlock):
            names[block.id] = block.name
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": msgspec.json.encode(block.input).decode()}})
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
    return ChatMessageIn(role="assistant", content=_content(texts) if texts or not calls else None,
                         tool_calls=calls or None, reasoning_content="".join(thinking) or None)


def _user_turns(blocks: list, names: dict[str, str], where: str) -> list[ChatMessageIn]:
    """A user message's blocks in order: each tool_result a tool turn, the
    text and images between them user turns."""
    out, pending = [], []
    for index, block in enumerate(blocks):
        if not isinstance(block, ToolResultBlock):
            pending.append(block.to_chat() if isinstance(block, ImageBlock) else TextPart(type="text", text=block.text))
            continue
        if pending:
            out.append(ChatMessageIn(role="user", content=_content(pending)))
            pending = []
        if block.tool_use_id not in names:
            raise ApiError(400, f"{where}.{index}.tool_use_id: no tool_use block with id {block.tool_use_id[:64]!r} "
                                "comes before this tool_result", "invalid_value", param=f"{where}.{index}.tool_use_id")
        out.append(ChatMessageIn(role="tool", content=block.to_chat(), tool_call_id=block.tool_use_id,
                                 name=names[block.tool_use_id]))
    if pending or not out:
        out.append(ChatMessageIn(role="user", content=_content(pending)))
    return out


def _content(parts: list) -> str | list:
    """One text block is a string (what every template reads); else the parts."""
    if len(parts) == 1 and isinstance(parts[0], TextPart):
        return parts[0].text
    return parts or ""


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=1_000_000, strict=True, description="required, as Anthropic's")
    cache_salt: CacheSalt | None = None  # vLLM's field: the prompt-cache scope within the key's (core/job.py's parse_body)
    stop_sequences: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
                              Field(max_length=MAX_STOPS)] | None = None
    stream: StrictBool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0, strict=True, description="Anthropic's range; left out: "
                                                                                    "the server's default")
    top_p: float | None = Field(None, ge=0.0, le=1.0, strict=True)  # 0..1, as Anthropic's API
    top_k: int | None = Field(None, ge=0, le=INT32_MAX, strict=True)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here

    @field_validator("stop_sequences", mode="before")
    @classmethod
    def _stop_bounds(cls, value: Any) -> Any:
        _at_most(value, MAX_STOPS, "stop sequences")
        for stop in value if isinstance(value, list) else ():
            if isinstance(stop, str) and len(stop) > MAX_STOP_CHARS:
                raise ValueError(f"a stop sequence has at most {MAX_STOP_CHARS} characters, got {len(stop)}")
        return value

    def _budget_within_max_tokens(self) -> None:
        """Checked here, not in a model validator: its error would name no field."""
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if budget is not None and budget >= self.max_tokens:
            raise ApiError(400, f"thinking.budget_tokens: {budget} must be less than max_tokens ({self.max_tokens}), "
                                "as Anthropic's: the thinking counts against max_tokens", "invalid_value",
                           param="thinking.budget_tokens")

    def chat_fields(self) -> dict[str, Any]:
        self._budget_within_max_tokens()
        data = super().chat_fields()
        data.update(max_tokens=self.max_tokens, stream=self.stream)
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                data[name] = getattr(self, name)
        if self.stop_sequences:
            data["stop"] = self.stop_sequences
        if self.metadata is not None and self.metadata.user_id is not None:
            data["user"] = self.metadata.user_id
        return data


# Chat's names in its errors (from the grammar builder, the template options), in Anthropic's.
_CHAT_NAMES = ((re.compile(r"\btools(?:\.(\d+)|\[(\d+)\])\.function\.parameters\b"), r"tools.\1\2.input_schema"),
               (re.compile(r"\btools(?:\.(\d+)|\[(\d+)\])\.function\b"), r"tools.\1\2"),
               (re.compile(r"\bmessages\.\d+(\.[\w.]+)?"), "messages"),  # chat's turns are not Anthropic's messages
               (re.compile(r"\bresponse_format\b|\bjson_schema\b"), "tools"),
               (re.compile(r"\bstop\b"), "stop_sequences"),
               (re.compile(r"\brequired\b"), "any"),
               (re.compile(r"\bmax_completion_tokens\b"), "max_tokens"))


def anthropic_name(text: str) -> str:
    for pattern, name in _CHAT_NAMES:
        text = pattern.sub(name, text)
    return text


def _renamed(exc: ApiError) -> ApiError:
    return ApiError(exc.status, anthropic_name(exc.message), exc.code,
                    param=anthropic_name(exc.param) if exc.param else None, retry_after=exc.retry_after)


async def messages(request: web.Request) -> web.StreamResponse:
    from daemon.http.dialects.anthropic.answer import MessageShape, answer

    body = await parse_body(request, MessagesRequest)
    chat = body.chat_request(request.app[FLEET].max_ctx_size)
    model, job = await chat_job(request, chat, "messages", rename=_renamed)
    shape = MessageShape(job.id, model.id, chat.stop)
    return await answer(request, model, job, shape, tool_mode(chat), body.stream)


async def count_tokens(request: web.Request) -> web.Response:
    """The input tokens a /v1/messages request with this body reads: its
    system, messages and tools through the model's chat template, images included."""
    from daemon.http.core.run import run_query

    body = await parse_body(request, CountTokensRequest)
    chat = body.chat_request(request.app[FLEET].max_ctx_size)
    messages_in, tools = chat_inputs(request, chat)
    model = generation_model(request, chat)
    job = model.controller.new_query("messages.count_tokens", "count_chat", messages=messages_in, tools=tools,
                                     **chat.template_args())
    answer = await run_query(request, model, job)
    return web.json_response({"input_tokens": answer.prompt_tokens})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
