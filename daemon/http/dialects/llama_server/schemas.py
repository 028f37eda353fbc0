"""llama-server's own request bodies (/tokenize, /detokenize, /apply-template,
/completion) and the embeddings body (/v1/embeddings, /embeddings), on the
same bounds as every other body (daemon/http/core/schemas.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from daemon.http.core.conversation import Conversation
from daemon.http.core.schemas import (MAX_EMBEDDING_INPUTS, MAX_TOP_LOGPROBS, RequestModel, SamplingFields, TokenId,
                                      _at_most, _prompt_limit)



class TokenizeRequest(RequestModel):
    model: str | None = None
    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]

    @field_validator("tokens", mode="before")
    @classmethod
    def _size(cls, value: Any, info: ValidationInfo) -> Any:
        return _prompt_limit(value, info, "token ids (ctx_size)")


class ApplyTemplateRequest(Conversation):
    model: str | None = None


class NativeCompletionRequest(SamplingFields):
    """llama-server's /completion: its names for the same sampling fields."""

    prompt: str | Annotated[list[TokenId], Field(min_length=1)]
    n_predict: int = Field(-1, ge=-1, le=1_000_000, description="-1: until the end of generation or of the slot's "
                                                                "context; left out: the server's n_predict")
    max_tokens: int | None = Field(None, ge=1, le=1_000_000, description="llama-server's alias of n_predict")
    cache_prompt: bool = Field(True, description="false: read the whole prompt, reuse nothing cached")
    n_probs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS, description="the most likely tokens at each position")
    post_sampling_probs: bool = Field(False, description="n_probs as probabilities (prob, top_probs) of the "
                                                         "distribution the sampler chain drew from")
    return_tokens: bool = Field(False, description="the generated token ids in `tokens`")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_size(cls, value: Any, info: ValidationInfo) -> Any:
        return _prompt_limit(value, info, "prompt token ids (ctx_size)")


EmbeddingInput = (Annotated[str, Field(min_length=1)]
                  | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
                  | Annotated[list[TokenId], Field(min_length=1)]
                  | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                              Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)])


class EmbeddingsRequest(RequestModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: None = Field(None, description="not supported: the model's own dimension is returned")
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _count(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            return _at_most(value, MAX_EMBEDDING_INPUTS, "inputs")
        return _prompt_limit(value, info, "token ids (ctx_size)")

    def inputs(self) -> list[str | list[int]]:
        if isinstance(self.input, str):
            return [self.input]
        if self.input and isinstance(self.input[0], int):
            return [list(self.input)]
        return list(self.input)
