"""llama-server's own request bodies (/tokenize, /detokenize, /apply-template,
/completion) and the embeddings body (/v1/embeddings, /embeddings), on the
same bounds as every other body (daemon/http/core/schemas.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from daemon.http.core.conversation import Conversation
from daemon.http.core.schemas import (INT32_MAX, MAX_EMBEDDING_INPUTS, MAX_PROMPT_TOKENS, MAX_TOP_LOGPROBS,
                                      RequestModel, SamplingFields, TokenId, _at_most, _prompt_limit)



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


MAX_COMPLETION_PROMPTS = 16  # prompts of one /completion: each a job, answered one after another
# Images of one object prompt, refused before any is decoded; the model's max_images_per_request applies after.
MAX_MULTIMODAL_DATA = 64


class MediaPrompt(RequestModel):
    """llama-server's object prompt with images: the text holds the media marker (<__media__>) where each
    image goes, in order, and multimodal_data the images (base64, or data: URLs), read by the projector."""

    prompt_string: str
    multimodal_data: Annotated[list[str], Field(min_length=1, max_length=MAX_MULTIMODAL_DATA)]



class NativeCompletionRequest(SamplingFields):
    """llama-server's /completion: its names for the same sampling fields."""

    prompt: (str | MediaPrompt | Annotated[list[TokenId | str], Field(min_length=1)]
             | Annotated[tuple[str | MediaPrompt | Annotated[list[TokenId | str], Field(min_length=1)], ...],
                         Field(min_length=2, max_length=MAX_COMPLETION_PROMPTS)]) = Field(
        description="a text, token ids (texts may sit between them: one prompt), {\"prompt_string\": text}, or "
                    "{\"prompt_string\": text with a <__media__> marker per image, \"multimodal_data\": [base64 "
                    "images]} (a model with a projector, mmproj); "
                    f"or a list of up to {MAX_COMPLETION_PROMPTS} of these, answered whole as a list")
    n_predict: int = Field(-1, ge=-1, le=1_000_000, description="-1: until the end of generation or of the slot's "
                                                                "context; left out: the server's n_predict")
    max_tokens: int | None = Field(None, ge=1, le=1_000_000, description="llama-server's alias of n_predict")
    cache_prompt: bool = Field(True, description="false: read the whole prompt, reuse nothing cached")
    id_slot: int = Field(-1, ge=-1, le=255, description="the slot to run in (0..parallel - 1; the request waits for "
                                                        "it), as /slots/{id_slot} saves and restores; -1: the best "
                                                        "cache match")
    n_probs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS, description="the most likely tokens at each position")
    post_sampling_probs: bool = Field(False, description="n_probs as probabilities (prob, top_probs) of the "
                                                         "distribution the sampler chain drew from")
    return_tokens: bool = Field(False, description="the generated token ids in `tokens`")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_size(cls, value: Any, info: ValidationInfo) -> Any:
        _prompt_limit(value, info, "prompt token ids (ctx_size)")  # the length before any walk over the items
        if not _several(value):
            return _prompt_limit(completion_prompt(value), info, "prompt token ids (ctx_size)")
        _at_most(value, MAX_COMPLETION_PROMPTS, "prompts in one /completion")
        prompts = []
        for i, item in enumerate(value):
            _at_most(item, (info.context or {}).get("max_prompt_tokens", MAX_PROMPT_TOKENS),
                     f"prompt token ids in prompt[{i}] (ctx_size)")
            if isinstance(item, list) and (not item or _several(item)):
                raise ValueError(f"prompt[{i}]: a prompt is a string, a non-empty list of token ids (texts may sit "
                                 'between them), or {"prompt_string": text}')
            prompts.append(completion_prompt(item))
        _texts_within_bound(prompts)
        return prompts[0] if len(prompts) == 1 else tuple(prompts)  # one prompt in a list: answered as one

    def prompts(self) -> list[str | list[int | str]]:
        return list(self.prompt) if isinstance(self.prompt, tuple) else [self.prompt]


def _texts_within_bound(prompts: list) -> None:
    """The texts between token ids over a request's prompts: each is a tokenize query to the worker."""
    texts = sum(sum(isinstance(v, str) for v in p) for p in prompts if isinstance(p, list))
    if texts > MAX_INPUT_PARTS:
        raise ValueError(f"at most {MAX_INPUT_PARTS} texts between token ids in one request, got {texts}")


def _several(value: Any) -> bool:
    """llama-server's rule: a list is one prompt when it holds token ids (texts may sit between them),
    and several prompts (texts, lists, objects) otherwise."""
    return isinstance(value, list) and bool(value) and not any(_token_id(v) for v in value) \
        and all(isinstance(v, (str, list, dict)) for v in value)


def completion_prompt(value: Any) -> Any:
    """One of /completion's prompts as llama-server reads it: an object gives its prompt_string, or stays
    an object (a MediaPrompt) when it has multimodal_data."""
    if isinstance(value, dict):
        if "multimodal_data" in value:
            return _media_prompt(value)
        text = value.get("prompt_string")
        if not isinstance(text, str):
            raise ValueError('an object prompt is {"prompt_string": text}')
        return text
    if isinstance(value, list) and sum(isinstance(v, str) for v in value) > MAX_INPUT_PARTS:
        raise ValueError(f"at most {MAX_INPUT_PARTS} texts between token ids")
    return value


def _media_prompt(value: dict) -> MediaPrompt:
    """Checked here, each field named, rather than by the prompt's union (whose error would name a member)."""
    text, images = value.get("prompt_string"), value["multimodal_data"]
    if not isinstance(text, str):
        raise ValueError("prompt_string must be a string (the text, with a <__media__> marker per image)")
    if not isinstance(images, list) or not images or not all(isinstance(image, str) for image in images):
        raise ValueError("multimodal_data is a non-empty list of images, each a base64 string")
    _at_most(images, MAX_MULTIMODAL_DATA, "images in multimodal_data")
    return MediaPrompt(prompt_string=text, multimodal_data=images)


MAX_INPUT_PARTS = 256  # text parts of one {"content": [...]} input, pieces of one mixed prompt


def _token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= INT32_MAX


def _object_prompt(value: dict, where: str) -> str:
    """llama-server's object input: {"prompt_string": text} or {"content": [text parts]}. Embeddings read
    text only: an image, audio or video part is refused (no embeddings model here reads media)."""
    if "multimodal_data" in value:  # never dropped in silence: no embeddings model here reads media
        raise ValueError(f"{where}.multimodal_data: embeddings read text only")
    if "prompt_string" in value:
        text = value["prompt_string"]
        if not isinstance(text, str):
            raise ValueError(f"{where}.prompt_string must be a string")
        return text
    parts = value.get("content")
    if not isinstance(parts, list) or not parts:
        raise ValueError(f"{where}: an object input has prompt_string (a string) or content (a list of "
                         '{"type": "text", "text": ...} parts)')
    _at_most(parts, MAX_INPUT_PARTS, f"content parts in {where}")
    texts = []
    for i, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            shown = kind if isinstance(kind, str) else type(part).__name__
            raise ValueError(f"{where}.content[{i}]: embeddings read text parts only, got {str(shown)[:40]!r}")
        texts.append(part["text"])
    return "".join(texts)  # as llama-server: the parts read as one text


def _one_prompt(value: Any, where: str) -> str | list[int | str]:
    """A text, token ids, token ids mixed with texts (one prompt, as llama-server reads it), or an object."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return _object_prompt(value, where)
    if isinstance(value, list) and value:
        if not all(_token_id(v) or isinstance(v, str) for v in value):
            raise ValueError(f"{where}: a prompt of token ids holds integers from 0 to {INT32_MAX} (and texts)")
        if sum(isinstance(v, str) for v in value) > MAX_INPUT_PARTS:
            raise ValueError(f"{where}: at most {MAX_INPUT_PARTS} texts between token ids")
        return list(value)
    raise ValueError(f"{where}: a prompt is a string, a non-empty list of token ids, or an object")


def embedding_prompts(value: Any, max_items: int = MAX_PROMPT_TOKENS) -> list[str | list[int | str]]:
    """`input` as llama-server reads it: one prompt (a string, token ids, token ids and strings mixed, an
    object) or a list of them. A list of strings alone is several prompts; a list with both token ids and
    strings is one. Lengths are checked before any walk over the items (a list of millions is refused in
    one step), and the texts to tokenize are counted over the whole request (each is a worker query)."""
    _at_most(value, max_items, "input items (ctx_size)")
    if isinstance(value, list):
        if not value:
            raise ValueError("no input: give a string, token ids, or a list of them")
        ids = any(_token_id(v) for v in value)
        if ids and all(_token_id(v) or isinstance(v, str) for v in value):
            return [_one_prompt(value, "input")]
        _at_most(value, MAX_EMBEDDING_INPUTS, "inputs")
        for i, item in enumerate(value):
            _at_most(item, max_items, f"items in input[{i}] (ctx_size)")
        prompts = [_one_prompt(item, f"input[{i}]") for i, item in enumerate(value)]
        _texts_within_bound(prompts)
        return prompts
    return [_one_prompt(value, "input")]


class EmbeddingsRequest(RequestModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: list[str | list[TokenId | str]] = Field(
        description="a string, token ids (texts may sit between them), an object ({\"prompt_string\": ...} or "
                    "{\"content\": [text parts]}), or a list of these: one embedding each")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: None = Field(None, description="not supported: the model's own dimension is returned")
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _prompts(cls, value: Any, info: ValidationInfo) -> Any:
        prompts = embedding_prompts(value, (info.context or {}).get("max_prompt_tokens", MAX_PROMPT_TOKENS))
        for prompt in prompts:
            if isinstance(prompt, list):
                _prompt_limit(prompt, info, "token ids (ctx_size)")
        return prompts

    def inputs(self) -> list[str | list[int | str]]:
        return list(self.input)
