"""The `functions` template variable (issue 29): llama-server gives FireFunction v2's template the
request's tools as indented JSON, and "" without tools; a template that reads it must render."""

from __future__ import annotations

import json

from daemon.worker.chat import ChatRenderer

# Reads `functions` as FireFunction v2's does (and names tools, so the renderer hands them over).
TEMPLATE = ("{% if tools %}{% endif %}{% if functions %}FUNCTIONS:{{ functions }}\n{% endif %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
TOOL = {"type": "function", "function": {"name": "lookup", "description": "Finds a word",
                                         "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "hi"}]


def test_functions_is_empty_without_tools():
    renderer = ChatRenderer(TEMPLATE, "<s>", "</s>")
    for tools in (None, []):
        assert renderer.prompt(ASK, tools=tools, add_generation_prompt=False).text == "user: hi\n"


def test_functions_is_the_tools_as_indented_json():
    text = ChatRenderer(TEMPLATE, "<s>", "</s>").prompt(ASK, tools=[TOOL], add_generation_prompt=False).text
    head, rest = text.split("\n", 1)[0], text.split("FUNCTIONS:", 1)[1]
    assert head.startswith("FUNCTIONS:[")
    listed = json.loads(rest[: rest.rindex("]") + 1])
    assert [f["function"]["name"] for f in listed] == ["lookup"]
    assert '\n  {' in rest  # indented, as llama-server's dump(2)


def test_a_request_may_still_set_it():
    text = ChatRenderer(TEMPLATE, "<s>", "</s>").prompt(ASK, add_generation_prompt=False,
                                                        kwargs={"functions": "mine"}).text
    assert text.startswith("FUNCTIONS:mine\n")
