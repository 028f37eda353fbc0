"""Chat templates with tools (daemon/worker/chat.py): a template that knows
tools gets them and the messages as they are; the built-in Gemma template and
the fallback get the Hermes convention in plain turns; and a plain chat
renders exactly as it did before tools."""

from __future__ import annotations

import json

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from daemon.protocol import ChatMessage, ChatPart, Tool, ToolCall
from daemon.tools.parse import parse_tool_calls
from daemon.worker.chat import (
    FALLBACK_TEMPLATE,
    GEMMA_TEMPLATE,
    ChatRenderer,
    ChatTemplateError,
    template_messages,
    tool_schemas,
)

WEATHER = Tool(
    name="get_weather",
    description="Current weather for a city.",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
CLOCK = Tool(name="get_time", description="The time <now> in a timezone, e.g. 'UTC'.", parameters={"type": "object", "properties": {}})

# A small template in the style of Qwen 2.5's: it names `tools` and renders
# message.tool_calls and tool turns itself.
QWEN_LIKE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + message.content }}"
    "{%- for tool_call in message.tool_calls or [] %}{%- set tool_call = tool_call.function %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' + (tool_call.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

PLAIN_CHATS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " What is 2+2? "},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
]


def renderer(template: str | None) -> ChatRenderer:
    return ChatRenderer(template, bos_token="<bos>", eos_token="<eos>")


def render_as_before(template: str, messages: list[dict]) -> str:
    """The renderer as it was before tools, for comparison."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, bos_token="<bos>", eos_token="<eos>", add_generation_prompt=True)


def round_trip() -> list[dict]:
    """A weather question, the model's call, the result, as template messages."""
    messages = [
        ChatMessage(role="system", content="You are helpful."),
        ChatMessage(role="user", content=[ChatPart(type="text", text="Weather in Zürich and the time?")]),
        ChatMessage(
            role="assistant",
            content="",
            tool_calls=[
                ToolCall(id="call_1", name="get_weather", arguments='{"city": "Zürich"}'),
                ToolCall(id="call_2", name="get_time", arguments="{}"),
            ],
        ),
        ChatMessage(role="tool", content='{"temp_c": 21}', tool_call_id="call_1", name="get_weather"),
        ChatMessage(role="tool", content="14:05", tool_call_id="call_2", name="get_time"),
    ]
    contents = ["You are helpful.", "Weather in Zürich and the time?", "", '{"temp_c": 21}', "14:05"]
    return template_messages(messages, contents)


# -- plain chats are unchanged ---------------------------------------------------------


@pytest.mark.parametrize("template", [GEMMA_TEMPLATE, FALLBACK_TEMPLATE, QWEN_LIKE])
@pytest.mark.parametrize("messages", PLAIN_CHATS)
def test_plain_chat_renders_as_before(template, messages):
    chat = renderer(None if template is FALLBACK_TEMPLATE else template)
    assert chat.render(messages) == render_as_before(template, messages)
    assert chat.render(messages, tools=[]) == render_as_before(template, messages)


def test_gemma_plain_chat_exact():
    assert renderer(GEMMA_TEMPLATE).render(PLAIN_CHATS[1]) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    )


def test_template_messages_plain_chat_is_role_and_content_only():
    messages = [ChatMessage(role="system", content="s"), ChatMessage(role="user", content="u")]
    assert template_messages(messages, ["s", "u"]) == [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    with pytest.raises(ValueError):
        template_messages(messages, ["s"])


# -- template_messages ------------------------------------------------------------------


def test_template_messages_tool_calls_and_results():
    rendered = round_trip()
    assert rendered[2] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}},
        ],
    }
    assert rendered[3] == {"role": "tool", "content": '{"temp_c": 21}', "tool_call_id": "call_1", "name": "get_weather"}


@pytest.mark.parametrize("arguments", ['{"city": ', "[1, 2]", "not json", "[" * 100_000])
def test_template_messages_keeps_arguments_that_are_not_an_object(arguments):
    message = ChatMessage(role="assistant", tool_calls=[ToolCall(id="c", name="f", arguments=arguments)])
    assert template_messages([message], [""])[0]["tool_calls"][0]["function"]["arguments"] == arguments


def test_tool_schemas():
    assert tool_schemas(None) is None and tool_schemas([]) is None
    assert tool_schemas([WEATHER]) == [
        {"type": "function", "function": {"name": "get_weather", "description": WEATHER.description, "parameters": WEATHER.parameters}}
    ]
    shaped = {"type": "function", "function": {"name": "x", "parameters": {}}}
    assert tool_schemas([shaped]) == [shaped]


# -- a template that knows tools ------------------------------------------------------------


def test_native_template_gets_tools_and_messages_as_they_are():
    chat = renderer(QWEN_LIKE)
    assert chat.supports_tools
    text = chat.render(round_trip(), tools=[WEATHER, CLOCK])
    assert text.startswith("<|im_start|>system\nYou are helpful.\n\n# Tools\n<tools>\n")
    assert json.dumps(tool_schemas([WEATHER])[0], ensure_ascii=False) in text
    # tojson is plain JSON (not Jinja's HTML-escaping one): <, > and ' survive.
    assert "The time <now> in a timezone, e.g. 'UTC'." in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>' in text
    assert '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n{\"temp_c\": 21}\n</tool_response><|im_end|>" in text
    assert "<tool_response>\n14:05\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_native_template_without_tools_gets_none():
    chat = renderer("{{ 'tools=' ~ (tools | string) }}")
    assert chat.render([{"role": "user", "content": "x"}]) == "tools=None"
    assert chat.render([{"role": "user", "content": "x"}], tools=[CLOCK]).startswith("tools=[{")


# -- the built-in Gemma template and the fallback: the Hermes convention ----------------------


@pytest.mark.parametrize("template", [GEMMA_TEMPLATE, None])
def test_tools_are_described_in_the_system_turn(template):
    chat = renderer(template)
    assert not chat.supports_tools
    text = chat.render([{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, CLOCK])
    for tool in (WEATHER, CLOCK):
        assert tool.name in text and tool.description in text
    assert json.dumps(WEATHER.parameters) in text
    assert '<tool_call>\n{"name": <name>, "arguments": <args-object>}\n</tool_call>' in text
    # Prepended to the system turn, which still follows, and before the question.
    assert text.index("get_weather") < text.index("You are helpful.") < text.index("Weather in Paris?")


def test_a_system_turn_is_added_when_there_is_none():
    text = renderer(None).render([{"role": "user", "content": "Hi"}], tools=[CLOCK])
    assert text.startswith("system: You can call these tools")
    assert text.endswith("user: Hi\nassistant:")


def test_gemma_round_trip_renders_calls_and_results():
    text = renderer(GEMMA_TEMPLATE).render(round_trip(), tools=[WEATHER, CLOCK])
    calls = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    responses = '<tool_response>\n{"temp_c": 21}\n</tool_response>\n<tool_response>\n14:05\n</tool_response>'
    assert f"<start_of_turn>model\n{calls}<end_of_turn>\n" in text
    # The consecutive results are one user turn, so Gemma's turns still alternate.
    assert f"<start_of_turn>user\n{responses}<end_of_turn>\n<start_of_turn>model\n" in text
    assert text.count("<start_of_turn>user") == 2 and text.count("<start_of_turn>model") == 2
    # What the model is shown is what the parser reads back.
    assert [c.name for c in parse_tool_calls(calls, {"get_weather", "get_time"})[1]] == ["get_weather", "get_time"]


def test_round_trip_renders_without_tools_in_the_request():
    text = renderer(None).render(round_trip())
    assert "You can call these tools" not in text
    assert 'assistant: <tool_call>\n{"name": "get_weather"' in text
    assert 'user: <tool_response>\n{"temp_c": 21}\n</tool_response>\n<tool_response>\n14:05\n</tool_response>\nassistant:' in text
    assert "tool:" not in text


def test_assistant_content_comes_before_its_calls():
    messages = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "content": "noon", "tool_call_id": "c"},
        {"role": "user", "content": "Thanks"},
    ]
    text = renderer(None).render(messages)
    assert 'assistant: Checking.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n' in text
    assert "user: <tool_response>\nnoon\n</tool_response>\nuser: Thanks\n" in text


def test_unparsed_arguments_are_shown_as_sent():
    messages = [ChatMessage(role="assistant", tool_calls=[ToolCall(id="c", name="f", arguments="{broken")])]
    text = renderer(None).render(template_messages(messages, [""]))
    assert '{"name": "f", "arguments": "{broken"}' in text


def test_a_template_error_is_a_chat_template_error():
    chat = renderer("{{ messages[0].content | items | list }}")
    with pytest.raises(ChatTemplateError):
        chat.render([{"role": "user", "content": "x"}])
