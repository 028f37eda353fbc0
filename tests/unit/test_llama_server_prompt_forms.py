"""llama-server's prompt forms on /completion and /v1/embeddings (issue 29), read by the schemas:
token ids with texts between them are one prompt, objects give their text, a list of texts, lists
or objects is several prompts, and every other shape is refused with a message."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from daemon.http.dialects.llama_server.schemas import (MAX_COMPLETION_PROMPTS, MAX_INPUT_PARTS, EmbeddingsRequest,
                                                       MediaPrompt, NativeCompletionRequest, embedding_prompts)
from daemon.http.core.schemas import MAX_EMBEDDING_INPUTS


@pytest.mark.parametrize("value, prompts", [
    ("", [""]),
    ("text", ["text"]),
    ([12, 34, 56], [[12, 34, 56]]),
    ([12, 34, "text", 56], [[12, 34, "text", 56]]),  # ids and a text: one prompt
    (["a", "b"], ["a", "b"]),  # texts alone: several
    (["a", [1, 2]], ["a", [1, 2]]),
    ([[1, 2], [3, "x"]], [[1, 2], [3, "x"]]),
    ({"prompt_string": "p"}, ["p"]),
    ({"content": [{"type": "text", "text": "he"}, {"type": "text", "text": "llo"}]}, ["hello"]),
    (["a", {"prompt_string": "b"}, {"content": [{"type": "text", "text": "c"}]}], ["a", "b", "c"]),
])
def test_embedding_inputs_read_as_llama_server_reads_them(value, prompts):
    assert embedding_prompts(value) == prompts
    assert EmbeddingsRequest.model_validate({"input": value}).inputs() == prompts


@pytest.mark.parametrize("value, message", [
    ([], "no input"),
    ({"content": "text"}, "prompt_string"),
    ({"content": [{"type": "unknown"}]}, "text parts only"),
    ({"content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}, "text parts only"),
    ({"content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}, "text parts only"),
    ({"content": ["text"]}, "text parts only"),
    ({"content": [{"type": "text", "text": 5}]}, "text parts only"),
    ({"content": [{"type": "text", "text": "a"}] * (MAX_INPUT_PARTS + 1)}, "at most"),
    ({"prompt_string": ["x"]}, "must be a string"),
    ([[]], "a prompt is"),
    ([[1.5]], "token ids"),
    ([[True]], "token ids"),
    ([[-1]], "token ids"),
    ([[2**31]], "token ids"),
    ([None], "a prompt is"),
    (["x"] * (MAX_EMBEDDING_INPUTS + 1), "at most"),
    ([1] + ["x"] * (MAX_INPUT_PARTS + 1), "at most"),
    ([[1, "x", 2, "y"]] * (MAX_INPUT_PARTS // 2 + 1), "in one request"),  # texts counted over all inputs
    ({"prompt_string": "x", "multimodal_data": ["AAAA"]}, "text only"),  # never dropped in silence
    (3.5, "a prompt is"),
    (True, "a prompt is"),
])
def test_hostile_embedding_inputs_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        embedding_prompts(value)
    with pytest.raises(ValidationError):
        EmbeddingsRequest.model_validate({"input": value})


class Untouchable(list):
    """A huge input whose items must not be walked: its length is all a refusal may read."""

    def __iter__(self):
        raise AssertionError("the items were walked before the length was checked")

    def __getitem__(self, index):
        raise AssertionError("an item was read before the length was checked")


@pytest.mark.parametrize("head", ["a", 1, [1]])
def test_a_huge_input_is_refused_by_its_length_before_any_walk(head):
    huge = Untouchable([head] * 5_000)
    with pytest.raises(ValueError, match="at most 4096 input items"):
        embedding_prompts(huge, max_items=4096)
    context = {"max_prompt_tokens": 4096}
    with pytest.raises(ValidationError, match="at most 4096"):
        NativeCompletionRequest.model_validate({"prompt": huge}, context=context)


@pytest.mark.parametrize("value, prompt", [
    ("text", "text"),
    ([1, 2, 3], [1, 2, 3]),
    ([1, 2, "text", 3, "more"], [1, 2, "text", 3, "more"]),
    ({"prompt_string": "p"}, "p"),
])
def test_a_completion_prompt_is_one_prompt_in_any_of_its_forms(value, prompt):
    assert NativeCompletionRequest.model_validate({"prompt": value}).prompt == prompt


def test_an_object_prompt_with_images_stays_an_object_alone_and_in_a_list():
    media = {"prompt_string": "see <__media__>", "multimodal_data": ["AAAA"]}
    assert NativeCompletionRequest.model_validate({"prompt": media}).prompt == MediaPrompt(**media)
    several = NativeCompletionRequest.model_validate({"prompt": ["text", media]}).prompts()
    assert several == ["text", MediaPrompt(**media)]


@pytest.mark.parametrize("value, message", [
    ({"prompt_string": "p <__media__>", "multimodal_data": "iVBOR"}, "non-empty list of images"),
    ({"prompt_string": "p <__media__>", "multimodal_data": [b"x"]}, "each a base64 string"),
    ({"prompt_string": None, "multimodal_data": ["AAAA"]}, "prompt_string must be a string"),
    ({"prompt_string": "p", "multimodal_data": ["AAAA"] * 65}, "at most 64 images"),
    ({"prompt_string": 3}, "prompt_string"),
    ({}, "prompt_string"),
    ([], "at least 1"),
    ([-4], "greater than or equal"),
    ([1] + ["x"] * (MAX_INPUT_PARTS + 1), "at most"),
])
def test_other_completion_prompts_are_refused_with_a_reason(value, message):
    with pytest.raises(ValidationError, match=message):
        NativeCompletionRequest.model_validate({"prompt": value})


@pytest.mark.parametrize("value, prompts", [
    (["a", "b"], ["a", "b"]),  # texts alone: several
    ([[1, 2], [1, 2]], [[1, 2], [1, 2]]),
    ([[1, 2], "text"], [[1, 2], "text"]),
    ([[1, "x", 2], {"prompt_string": "p"}], [[1, "x", 2], "p"]),
    (["only"], ["only"]),  # one prompt in a list: answered as one
    (["x"] * MAX_COMPLETION_PROMPTS, ["x"] * MAX_COMPLETION_PROMPTS),
])
def test_several_completion_prompts_read_as_llama_server_reads_them(value, prompts):
    body = NativeCompletionRequest.model_validate({"prompt": value})
    assert body.prompts() == prompts
    assert isinstance(body.prompt, tuple) == (len(prompts) > 1)


@pytest.mark.parametrize("value, message", [
    (["x"] * (MAX_COMPLETION_PROMPTS + 1), "at most 16 prompts"),
    ([[]], "prompt\\[0\\]: a prompt is"),
    ([["a", "b"]], "prompt\\[0\\]: a prompt is"),  # a list of texts inside a list: no third level
    ([{}], "prompt_string"),
    (["a", {"prompt_string": "p", "multimodal_data": []}], "non-empty list of images"),
    ([[1, [2]]], "valid"),
    ([[1, "x"]] * (MAX_INPUT_PARTS + 1), "at most 16"),
    ([[1] + ["x"] * 20] * 13, "texts between token ids in one request"),  # 260 texts over the request
    ([[-1], [2]], "greater than or equal"),
])
def test_hostile_several_completion_prompts_are_refused(value, message):
    with pytest.raises(ValidationError, match=message):
        NativeCompletionRequest.model_validate({"prompt": value})


def test_each_of_several_prompts_is_bounded_by_the_context():
    context = {"max_prompt_tokens": 8}
    with pytest.raises(ValidationError, match="at most 8 prompt token ids in prompt\\[1\\]"):
        NativeCompletionRequest.model_validate({"prompt": [[1], list(range(9))]}, context=context)
