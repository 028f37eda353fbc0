"""ToolMode: how an answer's tool calls become OpenAI's message (found by
review: a forced call cut by max_tokens came back as raw JSON content with no
calls, parallel_tool_calls false was ignored in auto mode, and a cut answer
said finish_reason "tool_calls")."""

from daemon.http.core.job import ToolMode
from daemon.tools.parse import forced_calls

CALL = '{"name": "f", "arguments": {"a": 1}}'


def test_a_forced_answer_cut_short_keeps_its_complete_calls_and_is_never_content():
    forced = ToolMode(("f",), forced=True, parallel=True)
    assert forced.calls(f"[{CALL}, {CALL}, " + '{"name": "f", "argu', "length") == (
        None, forced_calls(f"[{CALL}, {CALL}]", ["f"]), "length")
    content, calls, reason = forced.calls('[{"name": "', "length")
    assert content is None and calls == [] and reason == "length"
    content, calls, reason = forced.calls(f"[{CALL}]", "stop")
    assert content is None and len(calls) == 1 and reason == "tool_calls"


def test_parallel_false_keeps_the_first_call_in_either_mode():
    for forced in (True, False):
        mode = ToolMode(("f",), forced=forced, parallel=False)
        text = f"[{CALL}, {CALL}]" if forced else f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL}\n</tool_call>"
        assert len(mode.calls(text, "stop")[1]) == 1


def test_an_auto_answer_cut_after_a_call_says_length():
    auto = ToolMode(("f",), forced=False, parallel=True)
    content, calls, reason = auto.calls(f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n" + '{"name": "', "length")
    assert len(calls) == 1 and reason == "length"
    assert auto.calls("just words", "stop") == ("just words", [], "stop")


def test_an_auto_answer_cut_inside_a_call_has_no_markup_in_its_content():
    """Issue 16: the cut block came back as content beside the parsed calls."""
    auto = ToolMode(("f",), forced=False, parallel=True)
    text = f"Checking.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n" + '{"name": "f", "argu'
    assert auto.calls(text, "length") == ("Checking.", forced_calls(f"[{CALL}]", ["f"]), "length")
    assert auto.calls("Checking.\n<tool_call>\n{\"na", "length") == ("Checking.", [], "length")
