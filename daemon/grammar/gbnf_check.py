"""Bounds on a raw GBNF grammar (llama-server's `grammar` field) before
llguidance's GBNF reader (`llguidance.gbnf_to_lark`, build.py) sees it.

The reader is a recursive-descent parser in Python: groups nested ~2,000 deep
end in a RecursionError, and each `{m,n}` repetition becomes grammar that
llguidance compiles (its time and memory grow with the counts, and `{m,n}`
with n < m has no meaning). So the text is scanned here first, in one pass
with no recursion: strings, character classes and comments are skipped,
groups counted, repetitions checked, and a refusal names the bound it broke
rather than the reader's error.

What matching costs is llguidance's to bound, not this file's: its parser
stops at its own limits (LLParserLimits: a row of the Earley parser past its
item limit, the lexer's fuel), and the request ends with an error, never a
stall (daemon/worker/structured.py). So raw grammars are on by default, as in
llama-server; `raw_grammar = false` refuses them. json_schema and
response_format build their grammar from a checked schema and are always on.
"""

from __future__ import annotations

import re

MAX_GROUP_DEPTH = 16
MAX_QUANTIFIERS = 256
MAX_REPEAT = 1000
# The reader's time grows with the square of the rules (measured: 250 rules 0.1-0.2 s, 500 0.4-0.7 s,
# 1,000 1.5-2.6 s, 2,000 6-11 s of Python on a builder thread); hand-written grammars hold tens.
MAX_RULES = 512
# {m,n} copies its element up to max(m, n) times: the characters of the
# elements times their counts, summed, bound what the parser builds.
MAX_EXPANDED_CHARS = 200_000

_BRACES = re.compile(r"\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}")


class GbnfRefused(ValueError):
    pass


def check_gbnf(text: str) -> None:
    """Raise GbnfRefused when the text nests groups too deeply, repeats an
    element more than MAX_REPEAT times, backwards, or into more than
    MAX_EXPANDED_CHARS, or has more than MAX_QUANTIFIERS quantifiers or
    MAX_RULES rules."""
    quantifiers = expanded = rules = 0
    groups: list[int] = []  # where each open group starts
    element = 0  # where the last element (string, class, group, rule name) starts
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"' or c == "[":
            element = i
            i = _skip_quoted(text, i, '"' if c == '"' else "]")
            continue
        if c == "#":  # llama.cpp ends a comment at \r as well as \n
            i = _line_end(text, i)
            continue
        if c == ":" and text.startswith("::=", i):
            rules += 1
            if rules > MAX_RULES:
                raise GbnfRefused(f"more than {MAX_RULES} rules")
            i += 3
            continue
        if c == "(":
            groups.append(i)
            if len(groups) > MAX_GROUP_DEPTH:
                raise GbnfRefused(f"groups nest more than {MAX_GROUP_DEPTH} deep")
        elif c == ")":
            element = groups.pop() if groups else i
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
            expanded += (i - element) * max(low, high or 0, 1)
            if expanded > MAX_EXPANDED_CHARS:
                raise GbnfRefused(f"repetitions expand to more than {MAX_EXPANDED_CHARS} characters of grammar")
            quantifiers += 1
            i = match.end()
        elif c.isalnum() or c in "-_":
            if i == 0 or not (text[i - 1].isalnum() or text[i - 1] in "-_"):
                element = i  # a rule name starts
        if quantifiers > MAX_QUANTIFIERS:
            raise GbnfRefused(f"more than {MAX_QUANTIFIERS} quantifiers (?, *, +, {{m,n}})")
        if c != "{":
            i += 1


def _line_end(text: str, start: int) -> int:
    ends = [j for j in (text.find("\n", start), text.find("\r", start)) if j >= 0]
    return min(ends) if ends else len(text)


def _skip_quoted(text: str, start: int, close: str) -> int:
    """The index after a string literal or a character class (backslash escapes skipped)."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == close:
            return i + 1
        if text[i] in "\r\n" and close == '"':
            break
        i += 1
    raise GbnfRefused(f"an unterminated {'string' if close == chr(34) else 'character class'} at character {start}")
