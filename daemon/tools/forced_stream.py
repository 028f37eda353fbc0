"""A forced tool call's arguments, streamed as they are generated.

With tool_choice "required" or a named function the grammar makes the whole
answer `[{"name": "f", "arguments": {...}}, ...]`, the name first. So a call
can be announced as soon as its arguments begin, and each piece of the
arguments' JSON passed on as it arrives, as OpenAI streams `delta.tool_calls`:
first {index, id, type, function: {name, arguments: ""}}, then
{index, function: {arguments: piece}} pieces that concatenate to the
arguments as the model wrote them.

One pass over the characters, with a little state kept between pieces (how
deep in the JSON, inside a string or not, the key being read), so a long
answer costs what its length does. Calls this scan could not stream (never
the grammar's output) are counted, so the caller can send them whole at the
end (`announced`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from typing import Any

CALL_DEPTH = 2  # inside the array (1), inside one call's object (2)


class ForcedCallStream:
    """feed(piece) -> the `delta.tool_calls` lists to send now, one per chunk."""

    def __init__(self, tool_names: Collection[str], new_id: Callable[[], str], most: int | None = None) -> None:
        self._names = frozenset(tool_names)
        self._new_id = new_id
        self._most = most  # calls to stream at most (the grammar holds it already)
        self.announced = 0  # calls streamed so far
        self._depth = 0  # containers open
        self._in_string = False
        self._escaped = False
        self._text: list[str] = []  # a string being read in a call's object: a key, or the name
        self._expect_key = False
        self._key: str | None = None  # the key whose value comes next
        self._name: str | None = None
        self._streaming = False  # inside arguments being streamed

    def feed(self, piece: str) -> list[list[dict[str, Any]]]:
        out: list[list[dict[str, Any]]] = []
        start = 0  # where this piece's part of the streamed arguments begins
        for i, c in enumerate(piece):
            if self._streaming:
                if self._step(c) and self._depth == CALL_DEPTH:  # the arguments' own closing brace
                    self._send_arguments(out, piece[start:i + 1])
                    self._streaming = False
                continue
            self._read_call(c)
            if self._depth == CALL_DEPTH + 1 and self._key == "arguments" and c == "{" and self._can_announce():
                out.append([{"index": self.announced, "id": self._new_id(), "type": "function",
                             "function": {"name": self._name, "arguments": ""}}])
                self.announced += 1
                self._streaming, start = True, i
        if self._streaming:
            self._send_arguments(out, piece[start:])
        return out

    def _send_arguments(self, out: list, text: str) -> None:
        if text:
            out.append([{"index": self.announced - 1, "function": {"arguments": text}}])

    def _can_announce(self) -> bool:
        return self._name in self._names and (self._most is None or self.announced < self._most)

    def _step(self, c: str) -> bool:
        """Track strings and depth; True when `c` closed a container."""
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string = False
            return False
        if c == '"':
            self._in_string = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            return True
        return False

    def _read_call(self, c: str) -> None:
        """Outside the arguments: the keys of a call's object and its name."""
        in_call = self._depth == CALL_DEPTH
        was_in_string = self._in_string
        if in_call and was_in_string and not (c == '"' and not self._escaped):
            self._text.append(c)
        if in_call and not was_in_string:
            if c == '"':
                self._text = []
            elif c == ",":
                self._key, self._expect_key = None, True
        opened = not was_in_string and c == "{" and self._depth == CALL_DEPTH - 1
        self._step(c)
        if opened:  # a call's object begins
            self._name, self._key, self._expect_key = None, None, True
        if in_call and was_in_string and not self._in_string:
            value = _decoded("".join(self._text))
            if self._expect_key:
                self._key, self._expect_key = value, False
            elif self._key == "name":
                self._name = value


def _decoded(raw: str) -> str | None:
    """A JSON string's contents, unescaped."""
    try:
        value = json.loads(f'"{raw}"')
    except ValueError:
        return None
    return value if isinstance(value, str) else None
