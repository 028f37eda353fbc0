"""Tool calls recognised in canned model output (daemon/tools/parse.py): the
formats of Hermes/Qwen, Llama 3.x, Mistral and Dormouse's own grammar, whole
and streamed, and hostile output that must stay content without raising."""

from __future__ import annotations

import json
import time

import pytest

from daemon.tools.parse import (
    ParsedCall,
    ToolCallStream,
    new_call_id,
    parse_tool_calls,
    stream_deltas,
)

TOOLS = {"get_weather", "get_time", "search"}


def call(name: str, arguments: dict) -> ParsedCall:
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


def grows_linearly(run, size: int, factor: int = 8, slack: float = 3.0) -> bool:
    """run(size) and run(factor * size), timed (best of three): True when the
    larger took less than `slack` times `factor` as long, i.e. far from the
    factor**2 a quadratic scan would take. A ratio, not a wall-clock bound, so
    a loaded machine slows both sides alike."""
    def best(n: int) -> float:
        times = []
        for _ in range(3):
            started = time.perf_counter()
            run(n)
            times.append(time.perf_counter() - started)
        return min(times)

    small, large = best(size), best(factor * size)
    return large < slack * factor * max(small, 1e-4)


def streamed(text: str, pieces: int | list[str] = 3, tools=TOOLS) -> tuple[str, list[ParsedCall]]:
    """Feed `text` in pieces of that many characters (or the given pieces);
    every streamed piece must be free of call markup."""
    parts = pieces if isinstance(pieces, list) else [text[i : i + pieces] for i in range(0, len(text), pieces)]
    stream = ToolCallStream(tools)
    out = []
    for part in parts:
        released = stream.feed(part)
        for marker in ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>"):
            assert marker not in released
        out.append(released)
    rest, calls = stream.finish()
    return "".join(out) + rest, calls


# -- Hermes / Qwen 2.5 / Qwen 3 ---------------------------------------------------


QWEN_ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
QWEN_TWO = (
    "I'll look both up.\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>'
)


def test_hermes_single_call():
    assert parse_tool_calls(QWEN_ONE, TOOLS) == (None, [call("get_weather", {"city": "Paris", "unit": "celsius"})])


def test_hermes_content_before_and_several_calls_in_order():
    content, calls = parse_tool_calls(QWEN_TWO, TOOLS)
    assert content == "I'll look both up."
    assert calls == [call("get_weather", {"city": "Paris"}), call("get_time", {"timezone": "Europe/Paris"})]


def test_hermes_text_after_the_calls_is_content():
    text = 'Checking.<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>\nDone.'
    assert parse_tool_calls(text, TOOLS) == ("Checking.\nDone.", [call("search", {"q": "x"})])


def test_hermes_unterminated_final_block_with_complete_json():
    text = 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
    assert parse_tool_calls(text, TOOLS) == ("Sure.", [call("get_time", {})])


CUT_CALLS = {  # an answer cut inside a call -> its content (issue 16: the markup came back as content)
    "hermes, after a call": ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
                             '<tool_call>\n{"name": "search", "argu', None),
    "hermes, the only call": ('Sure.\n<tool_call>\n{"name": "get_time", "argum', "Sure."),
    "hermes, right after the tag": ("Sure.\n<tool_call>\n", "Sure."),
    "hermes, a cut call before the next": ('<tool_call>{"name": "get_t<tool_call>{"name": "get_time", '
                                           '"arguments": {}}</tool_call>', None),
    "hermes, in the closing tag": ('Sure.<tool_call>{"name": "get_time", "arguments": {}}</tool_', "Sure."),
    "mistral array": ('Of course.[TOOL_CALLS][{"name": "search", "arguments": {"q": "mis', "Of course."),
    "mistral v11": ('[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]search[ARGS]{"q": "a', None),
    "mistral v11, in the name": ("[TOOL_CALLS]get_ti", None),
    "python tag": ('<|python_tag|>{"name": "search", "parameters": {"q": "lla', None),
}


@pytest.mark.parametrize("case", list(CUT_CALLS))
@pytest.mark.parametrize("size", [1, 4, 1000])
def test_a_call_cut_short_is_never_content(case, size):
    text, content = CUT_CALLS[case]
    parsed_content, calls = parse_tool_calls(text, TOOLS)
    assert parsed_content == content
    assert streamed(text, size) == (content or "", calls)
    for marker in ("<tool_call>", "</tool_", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", '"name"'):
        assert marker not in (parsed_content or "")


def test_markup_that_is_not_a_call_being_written_stays_content():
    for text in ("Wrap a call in <tool_call> and you are done.",  # prose after the tag
                 '<tool_call>{"name": "launch_missiles", "arguments": {}}</tool_call>',  # a complete, undeclared call
                 '<tool_call>{"name": "launch_missiles", "arguments": {}}'):
        assert parse_tool_calls(text, TOOLS) == (text, [])
        assert streamed(text, 3) == (text, [])


def test_hermes_unterminated_block_before_the_next_one():
    text = '<tool_call>{"name": "get_time", "arguments": {}}\n<tool_call>{"name": "search", "arguments": {"q": "a"}}</tool_call>'
    assert parse_tool_calls(text, TOOLS)[1] == [call("get_time", {}), call("search", {"q": "a"})]


def test_hermes_qwen3_thinking_stays_in_content():
    text = "<think>\nThe user wants weather.\n</think>\n\n" + QWEN_ONE
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "<think>\nThe user wants weather.\n</think>"
    assert [c.name for c in calls] == ["get_weather"]


def test_hermes_unknown_name_stays_content_known_one_counts():
    unknown = '<tool_call>\n{"name": "launch_missiles", "arguments": {}}\n</tool_call>'
    content, calls = parse_tool_calls(unknown + "\n" + QWEN_ONE, TOOLS)
    assert content == unknown
    assert [c.name for c in calls] == ["get_weather"]
    assert parse_tool_calls(unknown, TOOLS) == (unknown, [])


def test_hermes_malformed_json_is_content():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'  # one } short
    assert parse_tool_calls(text, TOOLS) == (text, [])
    trailing = '<tool_call>\n{"name": "get_weather", "arguments": {}} extra\n</tool_call>'
    assert parse_tool_calls(trailing, TOOLS) == (trailing, [])


def test_hermes_whitespace_and_no_newlines():
    text = '  <tool_call>   {"name":"search","arguments":{"q":"a b"}}   </tool_call>  '
    assert parse_tool_calls(text, TOOLS) == (None, [call("search", {"q": "a b"})])


# -- Llama 3.1 / 3.2 / 3.3 ---------------------------------------------------------


def test_llama_bare_json_with_parameters():
    text = '{"name": "get_weather", "parameters": {"city": "Lyon"}}'
    assert parse_tool_calls(text, TOOLS) == (None, [call("get_weather", {"city": "Lyon"})])


def test_llama_python_tag_and_arguments_key():
    text = '<|python_tag|>{"name": "search", "arguments": {"q": "llama"}}'
    assert parse_tool_calls(text, TOOLS) == (None, [call("search", {"q": "llama"})])


def test_llama_several_separated_by_semicolons_and_newlines():
    text = (
        '{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {}}\n'
        '{"name": "search", "parameters": {"q": "pasta"}}\n'
    )
    calls = parse_tool_calls(text, TOOLS)[1]
    assert calls == [call("get_weather", {"city": "Rome"}), call("get_time", {}), call("search", {"q": "pasta"})]


def test_llama_content_before_python_tag():
    text = 'Let me search.<|python_tag|>{"name": "search", "parameters": {"q": "x"}}'
    assert parse_tool_calls(text, TOOLS) == ("Let me search.", [call("search", {"q": "x"})])


def test_llama_json_followed_by_prose_is_content():
    text = '{"name": "search", "parameters": {"q": "x"}} and then I would summarise'
    assert parse_tool_calls(text, TOOLS) == (text, [])


def test_llama_builtin_tool_syntax_is_content():
    text = '<|python_tag|>brave_search.call(query="weather")'
    assert parse_tool_calls(text, TOOLS) == (text, [])


def test_plain_json_answer_is_not_a_call():
    text = '{"name": "Ada Lovelace", "born": 1815}'
    assert parse_tool_calls(text, TOOLS) == (text, [])


def test_openai_shaped_object_is_accepted():
    text = '{"type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}'
    assert parse_tool_calls(text, TOOLS) == (None, [call("get_time", {"tz": "UTC"})])


# -- Mistral -------------------------------------------------------------------------


def test_mistral_array():
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Nice"}}, {"name": "get_time", "arguments": {}}]'
    assert parse_tool_calls(text, TOOLS) == (None, [call("get_weather", {"city": "Nice"}), call("get_time", {})])


def test_mistral_array_after_content():
    text = 'Of course.\n[TOOL_CALLS][{"name": "search", "arguments": {"q": "mistral"}}]'
    assert parse_tool_calls(text, TOOLS) == ("Of course.", [call("search", {"q": "mistral"})])


def test_mistral_v11_single_and_repeated():
    one = '[TOOL_CALLS]get_weather[ARGS]{"city": "Brest"}'
    assert parse_tool_calls(one, TOOLS) == (None, [call("get_weather", {"city": "Brest"})])
    two = '[TOOL_CALLS]get_weather[ARGS]{"city": "Brest"}[TOOL_CALLS]get_time[ARGS]{}'
    assert parse_tool_calls(two, TOOLS)[1] == [call("get_weather", {"city": "Brest"}), call("get_time", {})]
    joined = 'get_weather[ARGS]{"city": "Brest"}search[ARGS]{"q": "x"}'
    assert [c.name for c in parse_tool_calls("[TOOL_CALLS]" + joined, TOOLS)[1]] == ["get_weather", "search"]


def test_mistral_v11_call_id_is_tolerated():
    text = '[TOOL_CALLS]search[CALL_ID]a1b2c3d4e[ARGS]{"q": "x"}'
    assert parse_tool_calls(text, TOOLS) == (None, [call("search", {"q": "x"})])


def test_mistral_unknown_name_is_content_and_a_cut_call_is_not():
    for text in (
        '[TOOL_CALLS][{"name": "search", "arguments": {}}, {"name": "rm_rf", "arguments": {}}]',
        '[TOOL_CALLS]rm_rf[ARGS]{"path": "/"}',
    ):
        assert parse_tool_calls(text, TOOLS) == (text, []), text
    for text in ('[TOOL_CALLS]search[ARGS]{"q": ', "[TOOL_CALLS]"):  # cut short: markup, not content
        assert parse_tool_calls(text, TOOLS) == (None, []), text


# -- Dormouse's grammar (tool_choice required / named) -------------------------------


def test_grammar_array_one_and_several():
    one = '[{"name": "get_time", "arguments": {"tz": "UTC"}}]'
    assert parse_tool_calls(one, TOOLS) == (None, [call("get_time", {"tz": "UTC"})])
    several = '\n [ {"name": "search", "arguments": {"q": "a"}} ,\n {"name": "search", "arguments": {"q": "b"}} ] \n'
    assert parse_tool_calls(several, TOOLS) == (None, [call("search", {"q": "a"}), call("search", {"q": "b"})])


def test_grammar_array_invalid_is_content():
    for text in (
        "[]",
        '[{"name": "search", "arguments": {}}] trailing',
        '[{"name": "nope", "arguments": {}}]',
        '[{"arguments": {}}]',
        '["search"]',
        "[1, 2, 3]",
    ):
        assert parse_tool_calls(text, TOOLS) == (text, []), text


# -- arguments -------------------------------------------------------------------------


def test_arguments_keep_unicode_unescaped():
    text = '<tool_call>{"name": "search", "arguments": {"q": "crème brûlée 東京 🍮"}}</tool_call>'
    assert parse_tool_calls(text, TOOLS)[1][0].arguments == '{"q": "crème brûlée 東京 🍮"}'


def test_arguments_given_as_a_json_string_are_kept_as_given():
    text = '<tool_call>{"name": "search", "arguments": "{\\"q\\":\\"x\\"}"}</tool_call>'
    assert parse_tool_calls(text, TOOLS)[1] == [ParsedCall("search", '{"q":"x"}')]


def test_arguments_missing_or_null_are_an_empty_object():
    for text in ('[{"name": "get_time"}]', '[{"name": "get_time", "arguments": null}]'):
        assert parse_tool_calls(text, TOOLS)[1] == [ParsedCall("get_time", "{}")]


@pytest.mark.parametrize("arguments", ["[1, 2]", "42", '"not json"', '"[1]"', "true"])
def test_non_object_arguments_are_not_a_call(arguments):
    text = f'<tool_call>{{"name": "search", "arguments": {arguments}}}</tool_call>'
    assert parse_tool_calls(text, TOOLS) == (text, [])


def test_non_string_name_is_not_a_call():
    text = '<tool_call>{"name": ["search"], "arguments": {}}</tool_call>'
    assert parse_tool_calls(text, TOOLS) == (text, [])


def test_no_tools_declared_means_no_calls():
    assert parse_tool_calls(QWEN_ONE, []) == (QWEN_ONE, [])


def test_plain_text_is_returned_unchanged():
    for text in ("", "  Hello there.  \n", "Use [brackets] and {braces} <freely>.", "a < b and [TOOL", "<tool_cal"):
        assert parse_tool_calls(text, TOOLS) == (text, [])


# -- hostile output ------------------------------------------------------------------------


HOSTILE_TAGS = {  # (a repeated unit, what follows the repeats, the content of n repeats)
    # Blocks with no end and no JSON in them are calls cut short: markup, never content.
    "open tags": ("<tool_call>", "", lambda n: None),
    "open tags with a brace": ("<tool_call>{", "", lambda n: None),
    "empty blocks": ("<tool_call></tool_call>", "", lambda n: "<tool_call></tool_call>" * n),
    "stray closes": ("</tool_call>", "<tool_call>", lambda n: "</tool_call>" * n),
}


@pytest.mark.parametrize("case", list(HOSTILE_TAGS))
def test_a_megabyte_of_open_tags_is_never_a_call_and_linear(case):
    unit, tail, content = HOSTILE_TAGS[case]
    text = unit * 90_000 + tail
    assert parse_tool_calls(text, TOOLS) == (content(90_000), [])
    assert streamed(text, 997) == (content(90_000) or "", [])
    assert grows_linearly(lambda n: parse_tool_calls(unit * n + tail, TOOLS), 11_000)
    assert grows_linearly(lambda n: streamed(unit * n + tail, 997), 11_000)


def test_many_valid_calls_are_linear():
    block = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert len(parse_tool_calls(block * 20_000, TOOLS)[1]) == 20_000
    assert grows_linearly(lambda n: parse_tool_calls(block * n, TOOLS), 2_500)


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_deep_nesting_is_content_not_recursion_error(depth):
    nested = "[" * depth + "]" * depth
    for text in (
        f'<tool_call>{{"name": "search", "arguments": {{"q": {nested}}}}}</tool_call>',
        f'[{{"name": "search", "arguments": {{"q": {nested}}}}}]',
        f'[TOOL_CALLS]search[ARGS]{{"q": {nested}}}',
        f'{{"name": "search", "parameters": {{"q": {nested}}}}}',
        "[" * depth,
        "{" * depth,
    ):
        content, calls = parse_tool_calls(text, TOOLS)
        # Shallow nesting is a fine call; past the recursion limit it is content.
        assert (content, calls) == (text, []) or (content is None and len(calls) == 1)
        assert streamed(text, 4096)[0] in (text, "")


def test_deep_nesting_past_the_limit_is_content():
    nested = "[" * 100_000 + "]" * 100_000
    text = f'<tool_call>{{"name": "search", "arguments": {{"q": {nested}}}}}</tool_call>'
    assert parse_tool_calls(text, TOOLS) == (text, [])


# -- streaming ------------------------------------------------------------------------------


CANNED = [
    QWEN_ONE,
    QWEN_TWO,
    'Checking.<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>\nDone.',
    'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n',
    '<|python_tag|>{"name": "search", "arguments": {"q": "llama"}}',
    '{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {}}',
    'Of course.\n[TOOL_CALLS][{"name": "search", "arguments": {"q": "mistral"}}]',
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Brest"}[TOOL_CALLS]get_time[ARGS]{}',
    '\n [ {"name": "search", "arguments": {"q": "a"}} ] \n',
    "Just a plain answer, with [brackets] and a < sign.",
    "Ends on a partial marker <tool_ca",
    '<tool_call>\n{"name": "launch_missiles", "arguments": {}}\n</tool_call>',
    '{"name": "Ada Lovelace", "born": 1815}',
    "",
    "   ",
]


@pytest.mark.parametrize("text", CANNED)
@pytest.mark.parametrize("size", [1, 2, 5, 13, 1000])
def test_stream_agrees_with_whole_parse(text, size):
    content, calls = parse_tool_calls(text, TOOLS)
    assert streamed(text, size) == ((content or "") if calls else text, calls)


def test_stream_releases_content_before_the_call_early():
    stream = ToolCallStream(TOOLS)
    assert stream.feed("The weather ") == "The weather"
    assert stream.feed("in Paris: ") == " in Paris:"
    assert stream.feed("<tool") == ""
    assert stream.feed('_call>{"name": "get_weather", "arguments": {}}</tool_call>') == ""
    assert stream.finish() == ("", [ParsedCall("get_weather", "{}")])


def test_stream_releases_a_false_marker_start():
    stream = ToolCallStream(TOOLS)
    assert stream.feed("Compare a <to") == "Compare a"
    assert stream.feed("ol> tag") == " <tool> tag"
    assert stream.finish() == ("", [])


def test_stream_holds_output_that_opens_with_json_until_finish():
    stream = ToolCallStream(TOOLS)
    assert stream.feed("  {") == ""
    assert stream.feed('"answer": 42}') == ""
    assert stream.finish() == ('  {"answer": 42}', [])


def test_stream_content_around_calls():
    text = "Let me check.\n\n<tool_call>\n{\"name\": \"search\", \"arguments\": {}}\n</tool_call>\nAnd then this."
    assert streamed(text, 4) == ("Let me check.\n\n\nAnd then this.", [ParsedCall("search", "{}")])


def test_stream_whitespace_only_pieces_are_cheap():
    def feed_spaces(n: int) -> None:
        stream = ToolCallStream(TOOLS)
        assert stream.feed("x") == "x"
        for _ in range(n):
            assert stream.feed(" ") == ""
        assert stream.feed("y") == " " * n + "y"

    feed_spaces(200_000)
    assert grows_linearly(feed_spaces, 25_000)


# -- ids and deltas -----------------------------------------------------------------------------


def test_new_call_id_shape():
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100
    for call_id in ids:
        assert call_id.startswith("call_") and len(call_id) == 29
        assert all(c.isalnum() or c in "-_" for c in call_id[5:])


@pytest.mark.parametrize("fragment", [1, 3, 32, 10_000])
def test_stream_deltas_reassemble_exactly(fragment):
    calls = [call("get_weather", {"city": "Zürich", "unit": "celsius", "days": list(range(30))}), ParsedCall("get_time", "{}")]
    ids = [new_call_id(), new_call_id()]
    deltas = stream_deltas(calls, ids, fragment)
    assembled: dict[int, dict] = {}
    for delta in deltas:
        assert len(delta) == 1
        item = delta[0]
        if "id" in item:
            assert item["type"] == "function" and item["function"]["arguments"] == ""
            assembled[item["index"]] = {"id": item["id"], "name": item["function"]["name"], "arguments": ""}
        else:
            assert set(item) == {"index", "function"} and 0 < len(item["function"]["arguments"]) <= fragment
            assembled[item["index"]]["arguments"] += item["function"]["arguments"]
    assert [assembled[i] for i in range(2)] == [
        {"id": ids[i], "name": calls[i].name, "arguments": calls[i].arguments} for i in range(2)
    ]
    assert deltas[0][0]["index"] == 0 and deltas[-1][0]["index"] == 1  # in order, call by call


def test_stream_deltas_checks_its_inputs():
    with pytest.raises(ValueError):
        stream_deltas([ParsedCall("f", "{}")], [])
    with pytest.raises(ValueError):
        stream_deltas([ParsedCall("f", "{}")], ["call_x"], fragment=0)
    assert stream_deltas([], []) == []
