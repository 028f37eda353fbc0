"""OpenAI Responses on the real daemon and the bundled model, driven by the
clients people use: the openai SDK's responses.create (text, streamed, a
function-tool round trip), responses.parse with a pydantic model, and the
OpenAI Agents SDK (openai-agents) with its default model settings and a
function tool. One daemon for the module; answers are kept short."""

from __future__ import annotations

import asyncio
import json

import openai
import pydantic
import pytest

pytestmark = pytest.mark.e2e

MODEL = "gemma-3-270m-q4_k_m"
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}, "strict": True}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, bundled_model):
    from tests.conftest import DaemonProcess

    # --n-predict: a request naming no limit (the Agents SDK's default) stops there.
    d = DaemonProcess("--model", bundled_model, "--threads", "2", "--parallel", "2", "--ctx-size", "2048",
                      "--sleep-idle-seconds", "-1", "--n-predict", "24", log_path=tmp_path_factory.mktemp("d") / "daemon.log")
    d.wait_state("ready", timeout=120)
    yield d
    d.stop()


@pytest.fixture
def client(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_text_streamed_and_not_say_the_same(client, daemon):
    kwargs = dict(model=MODEL, instructions="Answer in a few words.", input="Name a colour.", max_output_tokens=16,
                  temperature=0)
    whole = client.responses.create(**kwargs)
    assert whole.status in ("completed", "incomplete") and whole.output_text.strip()
    assert whole.usage.output_tokens <= 16 and whole.usage.input_tokens > 5
    events = list(client.responses.create(stream=True, **kwargs))
    assert events[0].type == "response.created" and events[-1].type == "response." + whole.status
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text == events[-1].response.output_text  # greedy: the same answer
    # The count endpoint reads what the generation read.
    counted = daemon.http.post("/v1/responses/input_tokens", json={k: v for k, v in kwargs.items()
                                                                   if k in ("model", "instructions", "input")})
    assert counted.json() == {"object": "response.input_tokens", "input_tokens": whole.usage.input_tokens}


def test_a_function_tool_round_trip(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=48, temperature=0)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert isinstance(json.loads(call.arguments)["city"], str)
    # The call and its output go back as items; the model answers in text.
    second = client.responses.create(model=MODEL, input=ask + [
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"weather": "sunny, 21 C"}'}],
        tools=[WEATHER], tool_choice="none", max_output_tokens=32, temperature=0)
    assert second.output[0].type == "message" and second.output_text.strip()


def test_a_forced_call_wins_over_text_format(client):
    """Issue 30: text.format with a forced tool_choice was a 400; as in OpenAI's API the call is the answer."""
    fmt = {"format": {"type": "json_schema", "name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
        "additionalProperties": False}}}
    reply = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER], text=fmt,
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=48, temperature=0)
    (call,) = [item for item in reply.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)


def test_a_streamed_forced_call_assembles_to_the_call(client):
    events = list(client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER], stream=True,
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=48, temperature=0))
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item.type for e in done] == ["function_call"] and done[0].item.arguments == arguments
    assert isinstance(json.loads(arguments)["city"], str)


class Colour(pydantic.BaseModel):
    name: str
    warm: bool


def test_responses_parse_gives_the_pydantic_model(client):
    r = client.responses.parse(model=MODEL, input="Describe the colour red as JSON.", text_format=Colour,
                               max_output_tokens=32, temperature=0)
    assert isinstance(r.output_parsed, Colour) and r.output_parsed.name


def test_the_agents_sdk_with_its_default_model_settings_and_a_function_tool(daemon):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from agents.exceptions import ModelBehaviorError

    set_tracing_disabled(True)  # no traces exported to a remote service
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    def agent(**kwargs) -> Agent:
        model = OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
            base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=120))
        return Agent(name="weather", instructions="You answer questions about the weather briefly.", model=model,
                     tools=[get_weather], **kwargs)

    async def default_settings():
        """What the SDK sends by default (include: [], strict tools, no limit) is served: the run ends
        with an answer, or, when the 270M model writes past the daemon's n_predict, with the SDK's own
        reading of an incomplete response (it raises on one, as on OpenAI's)."""
        try:
            return (await Runner.run(agent(), "What is the weather in Paris?", max_turns=3)).final_output
        except ModelBehaviorError as exc:
            assert "response.incomplete" in str(exc) and "max_output_tokens" in str(exc), exc
            return None

    async def forced_call():
        """The tool called through a streamed run: the call's arguments parsed by the SDK, the tool run."""
        run = Runner.run_streamed(agent(model_settings=ModelSettings(tool_choice="required", max_tokens=48),
                                        tool_use_behavior="stop_on_first_tool"), "What is the weather in Paris?")
        kinds = [event.type async for event in run.stream_events()]
        return run, kinds

    answer = asyncio.run(default_settings())
    assert answer is None or isinstance(answer, str)
    run, kinds = asyncio.run(forced_call())
    assert "raw_response_event" in kinds and calls and isinstance(calls[0], str)
    assert run.final_output == f"sunny in {calls[0]}"
