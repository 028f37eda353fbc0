"""OpenAI request bodies, validated with pydantic, and their mapping onto the
worker protocol. Unknown fields are accepted and ignored (clients send
extras); OpenAI fields Dormouse cannot honour are refused by name."""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from daemon import protocol as p

Stop = str | Annotated[list[str], Field(max_length=16)] | None
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float = Field(0.8, ge=0.0, le=2.0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    top_k: int = Field(40, ge=0)
    min_p: float = Field(0.05, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repeat_penalty: float = Field(1.0, gt=0.0, le=10.0)
    repeat_last_n: int = Field(64, ge=-1)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=1, description="only 1 choice per request is supported")
    user: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit() or int(key) >= 2**31:
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias for {key} must be within [-100, 100]")
        return value

    def sampling(self, max_tokens: int) -> p.SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return p.SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            seed=self.seed,
            repeat_penalty=self.repeat_penalty,
            repeat_last_n=self.repeat_last_n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            stop=stop,
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | Annotated[list[TokenId], Field(min_length=1)] | Annotated[list[str], Field(min_length=1, max_length=1)]
    max_tokens: int = Field(256, ge=1, le=1_000_000)
    echo: Literal[False] = False
    logprobs: None = None
    best_of: Literal[1] | None = None
    suffix: None = None

    def prompt_value(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str
    detail: str | None = None


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL

    def image_bytes(self) -> bytes:
        url = self.image_url.url
        if not url.startswith("data:") or ";base64," not in url:
            raise ValueError("image_url must be a data: URL with base64 content (no remote fetching)")
        try:
            return base64.b64decode(url.split(";base64,", 1)[1], validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("image_url data is not valid base64") from None


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] | None = None

    def to_protocol(self) -> p.ChatMessage:
        role = "system" if self.role == "developer" else self.role
        if self.content is None or isinstance(self.content, str):
            return p.ChatMessage(role, self.content or "")
        parts = []
        for part in self.content:
            if isinstance(part, TextPart):
                parts.append(p.ChatPart("text", text=part.text))
            else:
                parts.append(p.ChatPart("image", image=part.image_bytes()))
        return p.ChatMessage(role, parts)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessageIn], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)
    tools: None = Field(None, description="tool calling is not supported")
    tool_choice: None = None
    logprobs: Literal[False] | None = None

    @property
    def token_limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 256


def field_name(loc: tuple[Any, ...]) -> str:
    """'messages.0.content' from pydantic's error location."""
    return ".".join(str(part) for part in loc if not str(part).startswith(("function-", "list[", "str", "int")))
