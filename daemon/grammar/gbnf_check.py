"""Bounds on a raw GBNF grammar (llama-server's `grammar` field) before
llama.cpp's parser sees it.

llama.cpp's GBNF parser recurses once per nested group (20,000 parentheses
overflow the worker's stack: SIGSEGV), and expands `{m,n}` by copying the
element, looping without end when n < m. Both happen in
llama_sampler_init_grammar, on the thread that decodes every slot, so the
text is scanned here first: strings, character classes and comments are
skipped, groups counted, repetitions checked.

What a scan cannot bound is the matching cost: a grammar whose rules can
match the same text many ways (a run of optional elements) makes llama.cpp
track a number of parse stacks that grows combinatorially, and one step can
take minutes. That is why raw grammars are off unless the operator trusts the
clients (`raw_grammar = true`); json_schema and response_format build their
grammar from a checked schema and are always on.
"""

from __future__ import annotations

import re

MAX_GROUP_DEPTH = 16
MAX_QUANTIFIERS = 256
MAX_REPEAT = 1000

_BRACES = re.compile(r"\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}")


class GbnfRefused(ValueError):
    pass


def check_gbnf(text: str) -> None:
    """Raise GbnfRefused when the text nests groups too deeply, repeats an
    element more than MAX_REPEAT times or backwards, or has too many quantifiers."""
    depth = quantifiers = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"' or c == "[":
            i = _skip_quoted(text, i, '"' if c == '"' else "]")
            continue
        if c == "#":
            end = text.find("\n", i)
            i = n if end < 0 else end
            continue
        if c == "(":
            depth += 1
            if depth > MAX_GROUP_DEPTH:
                raise GbnfRefused(f"groups nest more than {MAX_GROUP_DEPTH} deep")
        elif c == ")":
            depth -= 1
        elif c in "?*+":
            quantifiers += 1
        elif c == "{":
            match = _BRACES.match(text, i)
            if match is None:
                raise GbnfRefused(f"a repetition at character {i} is not {{m}}, {{m,}} or {{m,n}}")
            low = int(match[1])
            high = low if match[2] is None else (int(match[3]) if match[3] else None)
            if low > MAX_REPEAT or (high is not None and high > MAX_REPEAT):
                raise GbnfRefused(f"a repetition {match[0]} repeats more than {MAX_REPEAT} times")
            if high is not None and high < low:
                raise GbnfRefused(f"a repetition {match[0]} has its upper bound below its lower bound")
            quantifiers += 1
            i = match.end()
            continue
        if quantifiers > MAX_QUANTIFIERS:
            raise GbnfRefused(f"more than {MAX_QUANTIFIERS} quantifiers (?, *, +, {{m,n}})")
        i += 1


def _skip_quoted(text: str, start: int, close: str) -> int:
    """The index after a string literal or a character class (backslash escapes skipped)."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == close:
            return i + 1
        if text[i] == "\n" and close == '"':
            break
        i += 1
    raise GbnfRefused(f"an unterminated {'string' if close == chr(34) else 'character class'} at character {start}")
