"""Anthropic Messages on the real daemon and the bundled model, driven by the
official anthropic SDK: messages.create, messages.stream (the same greedy
answer, assembled by the SDK), a stop sequence, a tool_use / tool_result
round trip, an image through the test projector, and messages.count_tokens
equal to what the generation read. One daemon for the module (with the
projector); answers are kept short."""

from __future__ import annotations

import base64

import anthropic
import pytest

from tests.fixtures.projector import png_bytes

pytestmark = pytest.mark.e2e

MODEL = "gemma-3-270m-q4_k_m"
WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# This SDK's messages.create has no sampling arguments; the API's temperature goes in the body as it is.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, bundled_model, projector):
    from tests.conftest import DaemonProcess

    # --n-predict bounds any answer; every request here also names a small max_tokens.
    d = DaemonProcess("--model", bundled_model, "--mmproj", projector, "--threads", "2", "--parallel", "2",
                      "--ctx-size", "2048", "--sleep-idle-seconds", "-1", "--n-predict", "48", "--api-key", "e2e-key",
                      log_path=tmp_path_factory.mktemp("d") / "daemon.log")
    d.http.headers["x-api-key"] = "e2e-key"
    d.wait_state("ready", timeout=180)
    yield d
    d.stop()


@pytest.fixture
def client(daemon) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=daemon.url, api_key="e2e-key", max_retries=0, timeout=180)


def read(usage) -> int:
    """The prompt the generation read: the tokens decoded and those the prompt cache held."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_create_and_stream_give_the_same_greedy_answer(client):
    kwargs = dict(model=MODEL, max_tokens=16, extra_body=GREEDY, system="Answer in a few words.",
                  messages=[{"role": "user", "content": "Name a colour."}])
    whole = client.messages.create(**kwargs)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert text_of(whole).strip() and [b.type for b in whole.content] == ["text"]
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.stop_sequence is None
    assert 1 <= whole.usage.output_tokens <= 16 and read(whole.usage) > 5
    assert whole.usage.cache_creation_input_tokens == 0

    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(final) == text_of(whole)  # greedy: the same answer
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert read(final.usage) == read(whole.usage)  # the same prompt, whatever the cache held of it

    counted = client.messages.count_tokens(model=MODEL, system=kwargs["system"], messages=kwargs["messages"])
    assert counted.input_tokens == read(whole.usage)


def test_a_stop_sequence_cuts_the_greedy_answer(client):
    kwargs = dict(model=MODEL, max_tokens=24, extra_body=GREEDY,
                  messages=[{"role": "user", "content": "Write one sentence about the sea."}])
    whole = text_of(client.messages.create(**kwargs))
    assert len(whole) >= 8, whole
    stop = whole[len(whole) // 2:len(whole) // 2 + 3]
    cut = client.messages.create(stop_sequences=[stop], **kwargs)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert text_of(cut) == whole[:whole.find(stop)]


def test_a_tool_use_and_tool_result_round_trip(client):
    forced = dict(model=MODEL, max_tokens=48, extra_body=GREEDY, messages=ASK, tools=[WEATHER],
                  tool_choice={"type": "tool", "name": "get_weather"})
    first = client.messages.create(**forced)
    (call,) = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    assert isinstance(call.input, dict) and isinstance(call.input["city"], str)

    # Streamed, the SDK assembles the same call from its input_json_delta events.
    with client.messages.stream(**forced) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds  # the SDK read input_json_delta events
    (streamed_call,) = final.content
    assert streamed_call.type == "tool_use" and streamed_call.input == call.input
    assert final.stop_reason == "tool_use"

    counted = client.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER],
                                           tool_choice={"type": "tool", "name": "get_weather"})
    assert counted.input_tokens == read(first.usage)

    # The assistant's content goes back as it came, the result answers its id; the model answers in text.
    second = client.messages.create(model=MODEL, max_tokens=32, extra_body=GREEDY, tools=[WEATHER],
                                    tool_choice={"type": "none"}, messages=[
        *ASK, {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": '{"weather": "sunny, 21 C"}'}]}])
    assert [b.type for b in second.content] == ["text"] and text_of(second).strip()
    assert second.stop_reason in ("end_turn", "max_tokens")

    # A result naming no call is refused in Anthropic's shape, before any generation.
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=MODEL, max_tokens=8, messages=[*ASK, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_unknown", "content": "x"}]}])
    assert refused.value.body["type"] == "error" and "tool_use_id" in refused.value.body["error"]["message"]


def test_an_image_block_runs_through_the_projector(client):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png_bytes()).decode()}}
    with_image = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]
    text_only = [{"role": "user", "content": "What is this?"}]
    seen = client.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, messages=with_image)
    plain = client.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, messages=text_only)
    assert seen.usage.output_tokens >= 1
    # 32x32 in 8x8 patches: 16 image embeddings on top of the text prompt.
    assert read(seen.usage) >= read(plain.usage) + 16
    assert client.messages.count_tokens(model=MODEL, messages=with_image).input_tokens == read(seen.usage)

    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://example.invalid/cat.png"}}]}])
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert "base64" in refused.value.body["error"]["message"]


def test_the_key_is_read_from_x_api_key(daemon):
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(base_url=daemon.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=ASK)
    assert refused.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                             "message": refused.value.body["error"]["message"]}}
