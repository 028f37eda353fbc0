"""Tool calls in a model's output text.

A model given OpenAI `tools` answers with a call in its family's own markup;
this module turns that text back into (content, calls). Recognised:

  Hermes, Qwen 2.5, Qwen 3  <tool_call>{"name": "f", "arguments": {...}}</tool_call>, one or more
                            blocks (newlines inside allowed); a block left unterminated (at the
                            end, or before the next <tool_call>) counts if its JSON is complete.
  Llama 3.1 to 3.3          [<|python_tag|>]{"name": "f", "parameters": {...}} ("arguments" too),
                            several separated by ";" or newlines: the whole output.
  Mistral                   [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...], and v11's
                            [TOOL_CALLS]f[ARGS]{...} (repeated, [CALL_ID]x tolerated).
  Dormouse's grammar        [{"name": "f", "arguments": {...}}, ...]: the whole output, as the
                            grammar for tool_choice "required" or a named function produces it.

Only names among the declared tools count as calls: a Hermes block that names
anything else stays in the content, and a JSON or Mistral answer with any such
item is content as a whole (it is one answer, not a list of independent blocks).
Arguments must be a JSON object, or a string that holds one (kept as given);
an absent or null one is "{}".

A call cut short (by max_tokens, or a model that stops inside it) is markup,
never content: a Hermes block with no end whose body is nothing or the start
of a JSON object, and a [TOOL_CALLS] or <|python_tag|> region whose JSON
stops before it closes, are left out of the content (the answer's
finish_reason says it was cut).

Parsing is linear: str.find and json.JSONDecoder.raw_decode, no backtracking
regular expressions; JSON nested past Python's recursion limit is content,
never a RecursionError.

ToolCallStream does the same incrementally for streamed answers, holding back
text from where a call could begin so that streamed content never carries call
markup; stream_deltas cuts the calls into OpenAI's `delta.tool_calls` pieces.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
MISTRAL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
MISTRAL_CALL_ID = "[CALL_ID]"
PYTHON_TAG = "<|python_tag|>"
MARKERS = (HERMES_OPEN, MISTRAL_CALLS, PYTHON_TAG)  # where calls can begin mid-output
JSON_OPENERS = ("{", "[")  # ... or at the very start, as bare JSON

_decoder = json.JSONDecoder()
_space = re.compile(r"\s*")  # one greedy class: linear, cannot backtrack


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


def new_call_id() -> str:
    """An id in the shape OpenAI's look: "call_" and 24 url-safe characters."""
    return "call_" + secrets.token_urlsafe(18)  # 18 bytes are 24 base64 characters, no padding


def parse_tool_calls(text: str, tool_names: Collection[str]) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a whole answer. With calls, or a call cut short,
    content is the text outside them, stripped, None if empty; otherwise it
    is `text` unchanged."""
    start = _call_region_start(text)
    if start < 0:
        return text, []
    region = text[start:]
    region_content, calls = _parse_region(region, frozenset(tool_names))
    if not calls and region_content == region:
        return text, []
    return (text[:start] + region_content).strip() or None, calls


def stream_deltas(calls: list[ParsedCall], ids: list[str], fragment: int = 32,
                  first_index: int = 0) -> list[list[dict[str, Any]]]:
    """OpenAI's streamed `delta["tool_calls"]` values, in order: per call, one
    that names it (with empty arguments), then its arguments in pieces of at
    most `fragment` characters, which concatenate to the arguments exactly.
    The calls are numbered from first_index (after calls already streamed)."""
    if len(ids) != len(calls):
        raise ValueError(f"{len(calls)} calls but {len(ids)} ids")
    if fragment < 1:
        raise ValueError("fragment must be at least 1")
    deltas: list[list[dict[str, Any]]] = []
    for index, (call, call_id) in enumerate(zip(calls, ids), start=first_index):
        deltas.append([{"index": index, "id": call_id, "type": "function", "function": {"name": call.name, "arguments": ""}}])
        for start in range(0, len(call.arguments), fragment):
            deltas.append([{"index": index, "function": {"arguments": call.arguments[start : start + fragment]}}])
    return deltas


class ToolCallStream:
    """Incremental parse_tool_calls: feed(piece) -> content safe to stream now;
    finish() -> (remaining content, calls), once, at the end.

    Holds back text from the point where a call could be starting (a prefix of
    `<tool_call>`, `[TOOL_CALLS]` or `<|python_tag|>`, or the whole output when
    its first non-space character is `{` or `[`), and trailing whitespace (it
    may be all that separates the content from a call), so streamed content
    never contains call markup. Text that turns out not to be a call is released,
    at the latest by finish(). The content streamed plus finish()'s equals
    parse_tool_calls' content, but for whitespace at the very start.
    """

    def __init__(self, tool_names: Collection[str]) -> None:
        self._names = frozenset(tool_names)
        self._started = False  # a non-space character has arrived
        self._released = False  # some content has gone out
        self._space: list[str] = []  # whitespace held back after the released content
        self._partial = ""  # after _space: a tail that may be the start of a marker
        self._gap: list[str] = []  # the whitespace held when the call region began
        self._region: list[str] | None = None  # everything from where the calls begin

    def feed(self, piece: str) -> str:
        if self._region is not None:
            self._region.append(piece)
            return ""
        if not self._started:
            if not piece.strip():
                self._space.append(piece)
                return ""
            self._started = True
            if piece.lstrip().startswith(JSON_OPENERS):
                self._region, self._space = [*self._space, piece], []
                return ""
        text, self._partial = self._partial + piece, ""
        marker_at = _first_marker(text)
        if marker_at >= 0:
            out = self._release(text[:marker_at])
            self._gap, self._space = self._space, []
            self._region = [text[marker_at:]]
            return out
        cut = len(text) - _marker_prefix_length(text)
        self._partial = text[cut:]
        return self._release(text[:cut])

    def finish(self) -> tuple[str, list[ParsedCall]]:
        if self._region is None:
            rest = "".join(self._space) + self._partial
            self._space, self._partial = [], ""
            return rest, []
        region = "".join(self._region)
        content, calls = _parse_region(region, self._names)
        if not calls and content == region:
            return "".join(self._gap) + region, []
        if not content.strip():
            return "", calls
        content = content.rstrip()
        # Continue the released content after the whitespace that separated it
        # from the calls; with none released, this is the start of the content.
        return ("".join(self._gap) + content if self._released else content.lstrip()), calls

    def _release(self, text: str) -> str:
        """Whatever of the held whitespace and `text` can go out: all but the
        trailing whitespace, which is held in turn."""
        body = text.rstrip()
        if not body:
            if text:
                self._space.append(text)
            return ""
        out = "".join(self._space) + body
        self._space = [text[len(body) :]] if len(body) < len(text) else []
        self._released = True
        return out


# -- where the calls begin -----------------------------------------------------


def _call_region_start(text: str) -> int:
    """Where calls could begin: 0 when the output opens with JSON, else the
    first marker; -1 when nowhere."""
    if text.lstrip().startswith(JSON_OPENERS):
        return 0
    return _first_marker(text)


def _first_marker(text: str) -> int:
    found = [at for at in (text.find(marker) for marker in MARKERS) if at >= 0]
    return min(found, default=-1)


def _marker_prefix_length(text: str) -> int:
    """The length of the longest end of `text` that is the start of a marker."""
    return _prefix_length(text, MARKERS)


def _prefix_length(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that is a proper start of one of `markers`."""
    for length in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        tail = text[-length:]
        if any(marker.startswith(tail) for marker in markers):
            return length
    return 0


def _is_cut_json(text: str) -> bool:
    """Nothing but whitespace, or the start of a JSON object or array that
    stops before it closes: what a call cut short leaves. One pass, no
    recursion; brackets are matched, so prose with a stray brace is not it."""
    body = text.strip()
    if not body:
        return True
    if body[0] not in "{[":
        return False
    closers = {"{": "}", "[": "]"}
    expected: list[str] = []
    in_string = escaped = False
    for c in body:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in closers:
            expected.append(closers[c])
        elif c in "}]":
            if not expected or expected.pop() != c:
                return False
            if not expected:
                return False  # it closed: whole JSON (with or without text after), not cut
    return True


# -- the formats ---------------------------------------------------------------


def _parse_region(region: str, names: frozenset[str]) -> tuple[str, list[ParsedCall]]:
    """(content outside the calls and the calls cut short, unstripped; calls)
    of text that starts where the calls could begin. The content is `region`
    itself when it holds neither a call nor a cut one."""
    try:
        if region.startswith(HERMES_OPEN):
            return _parse_hermes(region, names)
        if region.startswith(MISTRAL_CALLS):
            content, calls = _parse_mistral(region[len(MISTRAL_CALLS) :], names)
        else:
            content, calls = "", _parse_json_calls(region.removeprefix(PYTHON_TAG), names)
    except RecursionError:  # from json.dumps of arguments nested past the limit
        return region, []
    if calls:
        return content, calls
    if region.startswith(PYTHON_TAG) and _is_cut_json(region[len(PYTHON_TAG) :]):
        return "", []  # a special token opened a call whose JSON never closed
    if region.startswith(MISTRAL_CALLS) and _is_cut_mistral(region[len(MISTRAL_CALLS) :]):
        return "", []
    return region, []


def _parse_hermes(region: str, names: frozenset[str]) -> tuple[str, list[ParsedCall]]:
    content: list[str] = []
    calls: list[ParsedCall] = []
    pos = 0
    open_at = region.find(HERMES_OPEN)
    close_at = region.find(HERMES_CLOSE)
    # Every find starts past the last one's answer, so the scan stays linear
    # even for a megabyte of "<tool_call>" with no end.
    while open_at >= 0:
        content.append(region[pos:open_at])
        body_start = open_at + len(HERMES_OPEN)
        next_open = region.find(HERMES_OPEN, body_start)
        if 0 <= close_at < body_start:  # a stray close before this block
            close_at = region.find(HERMES_CLOSE, body_start)
        terminated = close_at >= 0 and (next_open < 0 or close_at < next_open)
        if terminated:
            body_end, block_end = close_at, close_at + len(HERMES_CLOSE)
        else:  # unterminated: the block runs to the next one or the end
            body_end = block_end = next_open if next_open >= 0 else len(region)
        body = region[body_start:body_end]
        if not terminated and next_open < 0:  # cut at the end, perhaps inside "</tool_call>"
            body = body[: len(body) - _prefix_length(body, (HERMES_CLOSE,))]
        call = _call_from_json_text(body, names)
        if call is not None:
            calls.append(call)
        elif terminated or not _is_cut_json(body):
            content.append(region[open_at:block_end])
        pos, open_at = block_end, next_open
    content.append(region[pos:])
    return "".join(content), calls


def _parse_mistral(rest: str, names: frozenset[str]) -> tuple[str, list[ParsedCall]]:
    """What follows [TOOL_CALLS]: a JSON array of calls, or (v11) name[ARGS]{...}
    repeated, each perhaps after its own [TOOL_CALLS]. Text after them is content."""
    start = _skip_space(rest, 0)
    if rest.startswith("[", start):
        items, end = _decode(rest, start)
        if not isinstance(items, list):
            return "", []
        return rest[end:], _all_calls(items, names)
    calls: list[ParsedCall] = []
    pos = 0
    while (args_at := rest.find(MISTRAL_ARGS, pos)) >= 0:
        name = rest[pos:args_at].split(MISTRAL_CALL_ID, 1)[0].strip()  # newer tokenizers add [CALL_ID]id
        arguments, end = _decode(rest, _skip_space(rest, args_at + len(MISTRAL_ARGS)))
        call = _call_from_object({"name": name, "arguments": arguments}, names) if end >= 0 else None
        if call is None:
            return "", []
        calls.append(call)
        pos = _skip_space(rest, end)
        if rest.startswith(MISTRAL_CALLS, pos):
            pos += len(MISTRAL_CALLS)
    return rest[pos:], calls


def _is_cut_mistral(rest: str) -> bool:
    """What follows [TOOL_CALLS] stops inside a call: an array that never
    closes, a name still being written, or the JSON after its last [ARGS]."""
    if rest.lstrip().startswith("["):
        return _is_cut_json(rest)
    args_at = rest.rfind(MISTRAL_ARGS)
    if args_at < 0:
        return len(rest.split()) <= 1
    return _is_cut_json(rest[args_at + len(MISTRAL_ARGS) :])


def _parse_json_calls(text: str, names: frozenset[str]) -> list[ParsedCall]:
    """The whole text as calls: a JSON array of them (Dormouse's grammar, or a
    list some models write), or objects separated by ";" or whitespace (Llama)."""
    pos = _skip_space(text, 0)
    if text.startswith("[", pos):
        items, end = _decode(text, pos)
        if not isinstance(items, list) or _skip_space(text, end) != len(text):
            return []
        return _all_calls(items, names)
    objects = []
    while pos < len(text):
        value, end = _decode(text, pos)
        if not isinstance(value, dict):
            return []
        objects.append(value)
        pos = _skip_space(text, end)
        if text.startswith(";", pos):
            pos = _skip_space(text, pos + 1)
    return _all_calls(objects, names)


# -- one call ------------------------------------------------------------------


def _all_calls(items: list[Any], names: frozenset[str]) -> list[ParsedCall]:
    """All the items as calls, or none: one answer is not half a call list."""
    calls = [_call_from_object(item, names) for item in items]
    if not calls or any(call is None for call in calls):
        return []
    return calls  # type: ignore[return-value]


def _call_from_json_text(text: str, names: frozenset[str]) -> ParsedCall | None:
    """A call from text that is one JSON object and nothing else but whitespace."""
    value, end = _decode(text, _skip_space(text, 0))
    if end < 0 or _skip_space(text, end) != len(text):
        return None
    return _call_from_object(value, names)


def _call_from_object(value: Any, names: frozenset[str]) -> ParsedCall | None:
    if not isinstance(value, dict):
        return None
    if "name" not in value and isinstance(value.get("function"), dict):
        value = value["function"]  # OpenAI's own shape, which some models echo
    name = value.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    arguments = _arguments_json(value["arguments"] if "arguments" in value else value.get("parameters"))
    return None if arguments is None else ParsedCall(name, arguments)


def _arguments_json(value: Any) -> str | None:
    """Arguments as JSON text of an object; None when they are not one."""
    if value is None:
        return "{}"  # a function without parameters: models leave the key out
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            return None
        return value if isinstance(parsed, dict) else None
    return None


def _decode(text: str, pos: int) -> tuple[Any, int]:
    """One JSON value at text[pos:] and where it ends; (None, -1) if there is none."""
    try:
        return _decoder.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None, -1


def _skip_space(text: str, pos: int) -> int:
    return _space.match(text, pos).end()  # type: ignore[union-attr]


def forced_calls(text: str, tool_names: Collection[str]) -> list[ParsedCall]:
    """The calls in an answer that a grammar forced into the call array
    (tool_choice required or named), even when it was cut short by max_tokens:
    every complete item, in order. Such an answer is never content."""
    names = frozenset(tool_names)
    _, calls = parse_tool_calls(text, names)
    if calls:
        return calls
    pos = _skip_space(text, 0)
    if not text.startswith("[", pos):
        return []
    pos += 1
    out: list[ParsedCall] = []
    while True:
        pos = _skip_space(text, pos)
        value, pos = _decode(text, pos)
        if pos < 0:
            return out  # the item that was cut
        call = _call_from_object(value, names)
        if call is None:
            return out
        out.append(call)
        pos = _skip_space(text, pos)
        if not text.startswith(",", pos):
            return out
        pos += 1
