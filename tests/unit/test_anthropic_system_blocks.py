"""Anthropic's `system` as a list of text blocks is one system prompt whose blocks are
separate paragraphs: joined with a newline (as llama.cpp's chat layer joins text parts),
never run together ("You are a pirate.Answer in French.")."""

from __future__ import annotations

from daemon.http.dialects.anthropic.request import MessagesRequest

USER = [{"role": "user", "content": "hi"}]


def system_of(system) -> str | None:
    request = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": USER, "system": system})
    first = request.chat_messages()[0]
    return first.content if first.role == "system" else None


def test_system_blocks_are_joined_with_a_newline():
    blocks = [{"type": "text", "text": "You are a pirate."}, {"type": "text", "text": "Answer in French."}]
    assert system_of(blocks) == "You are a pirate.\nAnswer in French."


def test_one_block_a_string_and_empty_blocks():
    assert system_of([{"type": "text", "text": "Be brief."}]) == "Be brief."
    assert system_of("You are a pirate.Answer") == "You are a pirate.Answer"
    assert system_of([{"type": "text", "text": "a"}, {"type": "text", "text": ""}, {"type": "text", "text": "b"}]) \
        == "a\nb"
    assert system_of([{"type": "text", "text": ""}]) is None
