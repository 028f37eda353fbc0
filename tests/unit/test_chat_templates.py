"""The worker's chat template renderer with real Jinja templates (issue 17,
item 7): what transformers and llama-server let templates use (loop controls,
{% generation %}, strftime_now, date_string, tools, chat_template_kwargs),
templates that refuse the system role, reasoning_content handed back,
assistant prefill, llama.cpp's built-in template names, load-time refusal; and
the thinking parser (daemon/tools/reasoning.py), whole and streamed."""

from __future__ import annotations

import random
from datetime import datetime

import pytest

from daemon.protocol import ChatMessage
from daemon.tools.reasoning import ReasoningMode, ReasoningStream, ends_inside_reasoning, markers_in, split_reasoning
from daemon.worker.chat import (
    RESERVED_VARIABLES,
    ChatRenderer,
    ChatTemplateError,
    ChatTemplateInvalid,
    apply_llama_cpp_template,
    fold_system_message,
    llama_cpp_template_names,
    template_messages,
)


def renderer(template: str | None) -> ChatRenderer:
    return ChatRenderer(template, bos_token="<bos>", eos_token="<eos>")


USER = {"role": "user", "content": "Hi"}

# -- what templates may use ------------------------------------------------------------------

# Command R7B / Kimi style: loop controls.
LOOP_CONTROLS = (
    "{% for m in messages %}"
    "{% if m.content == 'SKIP' %}{% continue %}{% endif %}"
    "{% if m.content == 'STOP' %}{% break %}{% endif %}"
    "[{{ m.role }}:{{ m.content }}]"
    "{% endfor %}{% if add_generation_prompt %}[assistant:{% endif %}"
)

# SmolLM3 / LFM2.5 style: transformers' assistant mask block.
GENERATION_BLOCK = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<a>{% generation %}{{ m.content }}{% endgeneration %}</a>"
    "{% else %}<u>{{ m.content }}</u>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
)


def test_break_and_continue_work():
    chat = renderer(LOOP_CONTROLS)
    text = chat.render([{"role": "system", "content": "S"}, {"role": "user", "content": "SKIP"}, USER,
                        {"role": "user", "content": "STOP"}, {"role": "user", "content": "never"}])
    assert text == "[system:S][user:Hi][assistant:"


def test_generation_block_renders_its_body():
    chat = renderer(GENERATION_BLOCK)
    text = chat.render([USER, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}])
    assert text == "<u>Hi</u><a>Hello</a><u>Again</u><a>"


def test_strftime_now_date_string_and_datetime():
    chat = renderer("{{ strftime_now('%Y-%m-%d') }}|{{ date_string }}|{{ datetime }}")
    before = datetime.now()
    text = chat.render([USER])
    today, date_string, stamp = text.split("|")
    assert today in (before.strftime("%Y-%m-%d"), datetime.now().strftime("%Y-%m-%d"))
    assert date_string in (before.strftime("%d %b %Y"), datetime.now().strftime("%d %b %Y"))
    assert stamp in (before.strftime("%b %d %Y"), datetime.now().strftime("%b %d %Y"))


def test_strftime_now_has_the_time_of_day():
    """Not today's date at midnight: Llama 3.x templates print the hour."""
    text = renderer("{{ strftime_now('%H:%M') }}").render([USER])
    now = datetime.now()
    assert text in (now.strftime("%H:%M"), datetime.fromtimestamp(now.timestamp() - 60).strftime("%H:%M"))


def test_tools_reach_a_template_that_names_them():
    chat = renderer("{{ tools | map(attribute='function.name') | join(',') }}")
    assert chat.render([USER], tools=[{"type": "function", "function": {"name": "f"}},
                                      {"type": "function", "function": {"name": "g"}}]) == "f,g"


# -- chat_template_kwargs --------------------------------------------------------------------

QWEN3_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_enable_thinking_defaults_to_true_as_llama_server():
    assert renderer("{{ enable_thinking }}").render([USER]) == "True"


def test_kwargs_reach_the_template():
    chat = renderer(QWEN3_LIKE)
    assert chat.render([USER]).endswith("<|im_start|>assistant\n")
    assert chat.render([USER], kwargs={"enable_thinking": False}).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    text = renderer("{{ custom.depth }}-{{ flag }}").render([USER], kwargs={"custom": {"depth": 3}, "flag": "x"})
    assert text == "3-x"


def test_kwargs_cannot_replace_what_the_server_sets():
    chat = renderer("{{ messages | length }} {{ bos_token }} {{ add_generation_prompt }}")
    text = chat.render([USER], kwargs={"messages": [], "bos_token": "EVIL", "add_generation_prompt": False})
    assert text == "1 <bos> True"


def test_reserved_variables_match_the_http_layer():
    from daemon.http.core.schemas import TEMPLATE_VARIABLES

    assert TEMPLATE_VARIABLES == RESERVED_VARIABLES


# -- reasoning_content handed back ------------------------------------------------------------


def test_reasoning_content_reaches_templates_that_read_it():
    messages = [ChatMessage("user", "2+2?"), ChatMessage("assistant", "4", reasoning_content="Two and two."),
                ChatMessage("user", "3+3?")]
    text = renderer(QWEN3_LIKE).render(template_messages(messages, ["2+2?", "4", "3+3?"]))
    assert "<|im_start|>assistant\n<think>\nTwo and two.\n</think>\n\n4<|im_end|>" in text


def test_reasoning_content_is_left_out_when_unset():
    items = template_messages([ChatMessage("assistant", "4")], ["4"])
    assert items == [{"role": "assistant", "content": "4"}]


# -- the system role -------------------------------------------------------------------------

# Gemma 2's template, as its GGUF carries it.
GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)


def test_gemma2_system_message_is_folded_into_the_first_user_turn():
    chat = renderer(GEMMA2)
    assert not chat.supports_system_role
    text = chat.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<bos><start_of_turn>user\nBe brief.\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_a_template_that_drops_the_system_message_gets_it_folded():
    chat = renderer("{% for m in messages %}{% if m.role != 'system' %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}")
    assert not chat.supports_system_role
    assert chat.render([{"role": "system", "content": "S"}, USER]) == "<user>S\nHi"


def test_a_template_with_a_system_role_keeps_it():
    chat = renderer(QWEN3_LIKE)
    assert chat.supports_system_role
    assert "<|im_start|>system\nS<|im_end|>" in chat.render([{"role": "system", "content": "S"}, USER])


def test_a_lone_system_message_is_dropped_for_such_templates():
    assert fold_system_message([{"role": "system", "content": "S"}]) == []
    assert fold_system_message([USER]) == [USER]


def test_gemma2_with_tools_folds_the_tool_description_too():
    text = renderer(GEMMA2).render([USER], tools=[{"type": "function", "function": {"name": "clock"}}])
    assert text.startswith("<bos><start_of_turn>user\nYou can call these tools")
    assert text.endswith("\nHi<end_of_turn>\n<start_of_turn>model\n")


# -- assistant prefill and add_generation_prompt -------------------------------------------------


def test_a_final_assistant_message_is_continued_not_closed():
    chat = renderer(GEMMA2)
    messages = [USER, {"role": "assistant", "content": "The answer is"}]
    prompt = chat.prompt(messages, continue_final=True)
    assert prompt.text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nThe answer is"
    assert not prompt.reasoning_open
    closed = chat.render(messages, add_generation_prompt=False)
    assert closed.endswith("<start_of_turn>model\nThe answer is<end_of_turn>\n")


def test_add_generation_prompt_false_leaves_the_turn_unopened():
    assert renderer(QWEN3_LIKE).render([USER], add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"


def test_continuing_needs_a_final_assistant_message_without_calls():
    chat = renderer(QWEN3_LIKE)
    with pytest.raises(ChatTemplateError, match="assistant"):
        chat.prompt([USER], continue_final=True)
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]
    with pytest.raises(ChatTemplateError, match="tool calls"):
        chat.prompt([USER, {"role": "assistant", "content": "", "tool_calls": calls}], continue_final=True)


def test_continuing_a_thinking_template_writes_the_block_out():
    chat = renderer(QWEN3_LIKE)
    prompt = chat.prompt([USER, {"role": "assistant", "content": "Four", "reasoning_content": "2+2"}], continue_final=True)
    assert prompt.text.endswith("<|im_start|>assistant\n<think>2+2</think>Four")
    assert not prompt.reasoning_open


def test_continuing_the_thinking_itself_leaves_the_block_open():
    chat = renderer(QWEN3_LIKE)
    prompt = chat.prompt([USER, {"role": "assistant", "content": "", "reasoning_content": "Let me"}],
                         continue_final=True, kwargs={"enable_thinking": False})
    # the generation prompt's own empty block is replaced by the one continued
    assert prompt.text.endswith("<|im_start|>assistant\n<think>Let me")
    assert prompt.reasoning_open


# DeepSeek R1's generation prompt opens the thinking block itself.
R1_LIKE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
           "{% if add_generation_prompt %}<|Assistant|><think>\n{% endif %}")


def test_a_generation_prompt_that_opens_thinking_is_reported():
    prompt = renderer(R1_LIKE).prompt([USER])
    assert prompt.text.endswith("<think>\n") and prompt.reasoning_open
    assert not renderer(QWEN3_LIKE).prompt([USER]).reasoning_open
    assert not renderer(QWEN3_LIKE).prompt([USER], kwargs={"enable_thinking": False}).reasoning_open


# -- templates refused at load -----------------------------------------------------------------


@pytest.mark.parametrize("source", [
    "{% for m in messages %}{{ m.content }}",  # unclosed block
    "{% bogus %}",  # unknown tag
    "{{ messages | no_such_filter }}",  # unknown filter: Jinja checks at compile time
    "{% generation %}unclosed",
])
def test_a_template_that_does_not_compile_is_refused_at_load(source):
    with pytest.raises(ChatTemplateInvalid) as caught:
        renderer(source)
    assert str(caught.value).startswith("chat template:")
    assert not isinstance(caught.value, ChatTemplateError)  # not a request's error: a load's


def test_a_template_that_fails_at_render_is_the_requests_error():
    chat = renderer("{{ raise_exception('no') if messages[0].content == 'bad' else 'ok' }}")
    assert chat.render([USER]) == "ok"
    with pytest.raises(ChatTemplateError, match="no"):
        chat.render([{"role": "user", "content": "bad"}])


# -- llama.cpp's built-in templates ------------------------------------------------------------


def test_builtin_names_are_llama_cpps():
    from config.models import LLAMA_CPP_CHAT_TEMPLATES

    assert {"chatml", "llama3", "gemma", "mistral-v7", "phi3", "deepseek3", "llama2"} <= llama_cpp_template_names()
    assert set(LLAMA_CPP_CHAT_TEMPLATES) == llama_cpp_template_names()  # the config's copy is llama.cpp's list


def test_builtin_chatml_renders_as_llama_cpp():
    chat = renderer("chatml")
    assert chat.builtin == "chatml" and not chat.supports_tools
    text = chat.render([{"role": "system", "content": "S"}, USER])
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_builtin_llama3_and_prefill():
    chat = renderer("llama3")
    text = chat.render([USER])
    assert text == "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    prompt = chat.prompt([USER, {"role": "assistant", "content": "Sure"}], continue_final=True)
    assert prompt.text == text + "Sure"


def test_builtin_template_gets_tools_as_hermes_turns():
    text = renderer("chatml").render([USER], tools=[{"type": "function", "function": {"name": "clock"}}])
    assert text.startswith("<|im_start|>system\nYou can call these tools")


def test_builtin_template_output_grows_past_any_first_guess():
    long = "x" * 100_000
    assert apply_llama_cpp_template("chatml", [{"role": "user", "content": long}], False).count("x") == 100_000


# -- the thinking parser -----------------------------------------------------------------------


@pytest.mark.parametrize("text,expected", [
    ("<think>\nStep one.\n</think>\n\nFour.", ("Step one.", "Four.")),
    ("  <think>a</think>b", ("a", "b")),
    ("<think>cut short", ("cut short", "")),
    ("No thinking here.", (None, "No thinking here.")),
    ("Later <think>x</think> is content", (None, "Later <think>x</think> is content")),
    ("[THINK]m[/THINK]ok", ("m", "ok")),
    ("<seed:think>s</seed:think>ok", ("s", "ok")),
    ("<|START_THINKING|>c<|END_THINKING|>ok", ("c", "ok")),
])
def test_split_reasoning(text, expected):
    assert split_reasoning(text) == expected


def test_split_reasoning_opened_by_the_prompt():
    assert split_reasoning("Thinking.\n</think>\nAnswer", open_at_start=True) == ("Thinking.", "Answer")
    assert split_reasoning("never closed", open_at_start=True) == ("never closed", "")


def test_formats():
    text = "<think>r</think>c"
    assert ReasoningMode("none").split(text) == (None, text)
    assert ReasoningMode("auto").split(text) == ("r", "c")
    assert ReasoningMode("deepseek").split(text) == ("r", "c")
    assert ReasoningMode("deepseek-legacy").split(text) == ("r", text)


def test_markers_helpers():
    assert markers_in(QWEN3_LIKE) == ("<think>", "</think>")
    assert markers_in(GEMMA2) is None
    assert ends_inside_reasoning("<|Assistant|><think>\n") == "</think>"
    assert ends_inside_reasoning("<think></think>") is None


def streamed(pieces: list[str], open_at_start: bool = False) -> tuple[str, str, list[tuple[str, str]]]:
    stream = ReasoningStream(open_at_start)
    outs = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    return "".join(r for r, _ in outs), "".join(c for _, c in outs), outs


SAMPLES = [
    "<think>\nStep one.\nStep two.\n</think>\n\nThe answer is 4.",
    "  <think>a < b and </thi are not markers</think>  rest </think> stays",
    "<think>never closed, trailing space   ",
    "Plain answer with <think> later.",
    "<",
    "<thi",
    "   ",
    "",
    "[THINK]x[/THINK]y",
    "<think></think>only content",
]


@pytest.mark.parametrize("text", SAMPLES)
def test_streamed_pieces_add_up_to_the_whole_split(text):
    reasoning, content = split_reasoning(text)
    rng = random.Random(text)
    for _ in range(40):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        got_reasoning, got_content, _ = streamed(pieces)
        assert got_reasoning == (reasoning or "")
        assert got_content == content
    per_char_reasoning, per_char_content, _ = streamed(list(text))
    assert (per_char_reasoning, per_char_content) == (reasoning or "", content)


@pytest.mark.parametrize("text", ["Thinking.\n</think>\nAnswer", "no close at all", "a</thinking is not</think>b"])
def test_streamed_opened_by_the_prompt(text):
    reasoning, content = split_reasoning(text, open_at_start=True)
    assert streamed(list(text), open_at_start=True)[:2] == (reasoning, content)
    assert streamed([text], open_at_start=True)[:2] == (reasoning, content)


def test_the_stream_never_shows_a_marker_and_streams_as_it_goes():
    _, _, outs = streamed(["<th", "ink>", "Step", " one", "</th", "ink>", "Four", "."])
    assert all("<" not in r and "<" not in c for r, c in outs)
    assert outs[2] == ("Step", "") and outs[3] == (" one", "")
    assert outs[6] == ("", "Four")
