"""The conversation every chat-like dialect translates its turns into:
messages (text and image parts), the tools offered and the calls sent back,
and ChatJobRequest, the chat job's body: every dialect's chat turns map onto
it, and it is validated and bounded once, here (a dialect may subclass it to
refuse fields of its own). Each container is counted before its items are
validated (daemon/http/core/schemas.py)."""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any, Callable, Literal

from pydantic import ConfigDict, Field, StrictBool, ValidationInfo, field_validator

from daemon import protocol as p
from daemon.http.core.images import ImageHeaderError, read_header
from daemon.http.core.schemas import (MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_TEMPLATE_KWARG_BYTES, MAX_TEMPLATE_KWARG_DEPTH,
                                      MAX_TEMPLATE_KWARGS, MAX_TOOL_CALLS, MAX_TOOLS, MAX_TOP_LOGPROBS,
                                      TEMPLATE_VARIABLES, RequestModel, SamplingFields, _at_most, _json_within)


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ImageURL(RequestModel):
    url: str
    detail: str | None = None


class ImageRefused(ValueError):
    """An image the daemon will not hand to the worker; `code` is the error code."""

    def __init__(self, message: str, code: str = "invalid_image") -> None:
        super().__init__(message)
        self.code = code


class ImagePart(RequestModel):
    type: Literal["image_url"]
    image_url: ImageURL

    def image_bytes(self) -> bytes:
        url = self.image_url.url
        if not url.startswith("data:") or ";base64," not in url:
            raise ImageRefused("image_url must be a data: URL with base64 content (no remote fetching)")
        return base64_image(url.split(";base64,", 1)[1], "image_url data")


def base64_image(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageRefused(f"{what} is not valid base64") from None


def checked_image(data: bytes, number: int, max_pixels: int) -> bytes:
    """An image's header read (no pixel decoded): one too large (declared size), or not PNG/JPEG/GIF/BMP,
    is refused by its number in the request."""
    try:
        info = read_header(data)
    except ImageHeaderError as exc:
        raise ImageRefused(f"image {number} cannot be decoded: {exc}") from None
    if info.pixels > max_pixels:
        raise ImageRefused(f"image {number} is {info.width}x{info.height} = {info.pixels} pixels; at most "
                           f"{max_pixels} are accepted (max_image_pixels)", "image_too_large")
    return data


def image_checker(max_pixels: int) -> Callable[[ImagePart], bytes]:
    """Decodes each image of one request in order and checks it (checked_image), by its number in the
    request, before any pixel is decoded."""
    count = 0

    def check(part: ImagePart) -> bytes:
        nonlocal count
        count += 1
        return checked_image(part.image_bytes(), count, max_pixels)

    return check


class FunctionCallIn(RequestModel):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    arguments: Annotated[str, Field(max_length=1_000_000)] = "{}"


class ToolCallIn(RequestModel):
    """An assistant's earlier call, sent back in the conversation."""

    id: Annotated[str, Field(max_length=256)] = ""
    type: Literal["function"] = "function"
    function: FunctionCallIn


class FunctionIn(RequestModel):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: Annotated[str, Field(max_length=65536)] = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class ToolIn(RequestModel):
    type: Literal["function"]
    function: FunctionIn

    def to_protocol(self) -> p.Tool:
        f = self.function
        return p.Tool(f.name, f.description, f.parameters)


class ChatMessageIn(RequestModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[Annotated[TextPart | ImagePart, Field(discriminator="type")]],
                             Field(max_length=MAX_CONTENT_PARTS)] | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: Annotated[str, Field(max_length=256)] | None = None
    name: Annotated[str, Field(max_length=256)] | None = None
    reasoning_content: str | None = Field(None, description="an assistant's thinking, sent back: given to templates "
                                                            "that read it, or continued (continue_final_message)")

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _calls(cls, value: Any) -> Any:
        return _at_most(value, MAX_TOOL_CALLS, "tool calls in a message")

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, value: Any) -> Any:
        return _at_most(value, MAX_CONTENT_PARTS, "content parts in a message")

    def images(self) -> list[ImagePart]:
        if self.content is None or isinstance(self.content, str):
            return []  # not `for part in content`: a 6 MB string is 6 million iterations on the event loop
        return [part for part in self.content if isinstance(part, ImagePart)]

    def to_protocol(self, image: Callable[[ImagePart], bytes]) -> p.ChatMessage:
        role = "system" if self.role == "developer" else self.role
        calls = [p.ToolCall(c.id, c.function.name, c.function.arguments) for c in self.tool_calls or ()]
        extra = {"tool_calls": calls, "tool_call_id": self.tool_call_id, "name": self.name,
                 "reasoning_content": self.reasoning_content}
        if self.content is None or isinstance(self.content, str):
            return p.ChatMessage(role, self.content or "", **extra)
        parts = []
        for part in self.content:
            if isinstance(part, TextPart):
                parts.append(p.ChatPart("text", text=part.text))
            else:
                parts.append(p.ChatPart("image", image=image(part)))
        return p.ChatMessage(role, parts, **extra)


class Conversation(RequestModel):
    """Messages and the tools offered with them, counted before their items are
    validated: chat completions and /apply-template take the same."""

    messages: Annotated[list[ChatMessageIn], Field(min_length=1, max_length=MAX_MESSAGES)]
    tools: Annotated[list[ToolIn], Field(max_length=MAX_TOOLS)] | None = None
    # The chat template's options (daemon/worker/chat.py renders them).
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description=f"variables for the chat template (e.g. enable_thinking): at most {MAX_TEMPLATE_KWARGS}, "
                          f"each value at most {MAX_TEMPLATE_KWARG_BYTES} bytes of JSON")
    add_generation_prompt: StrictBool | None = Field(None, description="end the prompt with the assistant's turn opened "
                                                                 "(default true, false when continuing)")
    continue_final_message: StrictBool | None = Field(
        None, validate_default=True, description="continue the last (assistant) message rather than close it; "
                                                 "default: true when the conversation ends with one (assistant prefill)")

    @field_validator("messages", mode="before")
    @classmethod
    def _message_count(cls, value: Any) -> Any:
        return _at_most(value, MAX_MESSAGES, "messages")

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _kwargs_bounds(cls, value: Any) -> Any:
        _at_most(value, MAX_TEMPLATE_KWARGS, "chat_template_kwargs entries")
        for key, item in value.items() if isinstance(value, dict) else ():
            if not 0 < len(key) <= 128 or key in TEMPLATE_VARIABLES:
                raise ValueError(f"{key[:32]!r} is not a template variable a request may set (1 to 128 characters; "
                                 f"not one of {', '.join(sorted(TEMPLATE_VARIABLES))})")
            if key == "enable_thinking" and not isinstance(item, bool):
                raise ValueError(f"enable_thinking must be true or false, got {type(item).__name__}")
            try:
                over = _json_within(item, MAX_TEMPLATE_KWARG_BYTES, MAX_TEMPLATE_KWARG_DEPTH) < 0
            except ValueError:
                raise ValueError(f"{key}: nested more than {MAX_TEMPLATE_KWARG_DEPTH} levels deep") from None
            if over:
                raise ValueError(f"{key}: at most {MAX_TEMPLATE_KWARG_BYTES} bytes of JSON")
        return value

    @field_validator("continue_final_message")
    @classmethod
    def _continuation(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        """An assistant message at the end is continued (assistant prefill)
        unless asked otherwise; conflicting asks are refused."""
        messages, opened = info.data.get("messages"), info.data.get("add_generation_prompt")
        if not messages:
            return value
        last = messages[-1]
        if value is None:  # assistant prefill, unless a new turn was asked for
            if last.role != "assistant" or last.tool_calls or opened:
                return False
            if len(messages) > 1 and messages[-2].role == "assistant":
                raise ValueError("2 or more assistant messages end the conversation; the last one would be continued")
            return True
        if value and opened:
            raise ValueError("cannot both continue the final message and add a generation prompt")
        if value and last.role != "assistant":
            raise ValueError(f"the last message must be the assistant's to be continued, not {last.role!r}")
        if value and last.tool_calls:
            raise ValueError("an assistant message with tool calls cannot be continued")
        return value

    def template_args(self) -> dict[str, Any]:
        """The template options as p.Submit / p.Query fields."""
        return {"chat_template_kwargs": self.chat_template_kwargs or {},
                "continue_final": bool(self.continue_final_message),
                "add_generation_prompt": not self.continue_final_message and self.add_generation_prompt is not False}

    @field_validator("tools", mode="before")
    @classmethod
    def _tool_count(cls, value: Any) -> Any:
        return _at_most(value, MAX_TOOLS, "tools")


class ChatJobRequest(SamplingFields, Conversation):
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = Field(False, description="several calls in one answer; false unless asked: "
                                                         "a forced call is then made once")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    reasoning_format: Literal["none", "auto", "deepseek", "deepseek-legacy"] = Field(
        "auto", description="where an answer's thinking goes (message.reasoning_content, or none: "
                            "left in the content)")

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")  # never silently ignored
        return value

    @property
    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def tool_names(self) -> list[str]:
        return [t.function.name for t in self.tools or ()]

    @property
    def calls_tools(self) -> bool:
        """The output may hold tool calls to recognise."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forces_tool_call(self) -> bool:
        """A grammar makes the whole answer the call array."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, dict))

    @property
    def token_limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 256

    def protocol_messages(self, max_images: int, max_image_pixels: int) -> list[p.ChatMessage]:
        """The messages for the worker; raises ImageRefused for too many images
        (counted before any is decoded) or for one that is refused."""
        n_images = sum(len(m.images()) for m in self.messages)
        if n_images > max_images:
            raise ImageRefused(f"{n_images} images in one request; at most {max_images} are accepted "
                               "(max_images_per_request)", "too_many_images")
        check = image_checker(max_image_pixels)
        return [m.to_protocol(check) for m in self.messages]
