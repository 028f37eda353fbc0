"""String patterns: an ECMA-262 regular expression (JSON Schema's `pattern`)
translated into GBNF for the inside of a JSON string.

llama-cpp-python's own translation breaks on `\\d`, `.` and quotes, so
schema_walk.py translates every pattern here and the converter only wraps the
result in quotes. A class or '.' never matches what JSON must escape.
"""

from __future__ import annotations

import json
import re

from daemon.grammar.limits import MAX_REPEAT

MAX_PATTERN_CHARS = 1000
MAX_PATTERN_GROUP_DEPTH = 16


class _Translated:
    def __init__(self, gbnf: str, repeats: int) -> None:
        self.gbnf = gbnf
        self.repeats = repeats


# Characters a JSON string cannot hold unescaped: a pattern's classes and dots
# leave them out (stricter, still valid); literal ones are written escaped.
_JSON_ESCAPED = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]
_CLASS_ESCAPES = {"d": [(0x30, 0x39)], "w": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
                  "s": [(0x20, 0x20)]}  # \s: only the space (the others need escapes in JSON)
_CONTROL_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f", "v": "\v"}
_METACHARS = set(".^$|?*+()[]{}\\/-")


class PatternTranslator:
    """An ECMA-262 regular expression -> GBNF for the inside of a JSON string.

    Whole-match: an unanchored pattern is matched as if anchored (stricter,
    still valid). Supported: literals, escapes of metacharacters, \\d \\w \\s
    (and \\D \\W \\S), classes and negated classes, '.', groups and (?:...),
    alternation, * + ? {n} {n,} {n,m} (lazy forms: the same strings).
    Refused: lookarounds, backreferences, word boundaries, \\p{...}, anchors
    inside the pattern, and repeating something that can match nothing."""

    def __init__(self, pattern: str) -> None:
        if len(pattern) > MAX_PATTERN_CHARS:
            raise ValueError(f"longer than {MAX_PATTERN_CHARS} characters")
        body = pattern[1:] if pattern.startswith("^") else pattern
        if body.endswith("$"):
            before = body[:-1]
            if (len(before) - len(before.rstrip("\\"))) % 2 == 0:  # "\\$" is a literal dollar
                body = before
        self.text = body
        self.i = 0
        self.repeats = 0

    def translate(self) -> _Translated:
        gbnf, _ = self._alternation(0)
        if self.i < len(self.text):
            raise ValueError(f"unbalanced ')' at {self.i}")
        return _Translated(gbnf, self.repeats)

    def _peek(self) -> str:
        return self.text[self.i] if self.i < len(self.text) else ""

    def _alternation(self, depth: int) -> tuple[str, bool]:
        if depth > MAX_PATTERN_GROUP_DEPTH:
            raise ValueError(f"groups nested deeper than {MAX_PATTERN_GROUP_DEPTH}")
        branches = [self._sequence(depth)]
        while self._peek() == "|":
            self.i += 1
            branches.append(self._sequence(depth))
        gbnf = " | ".join(b for b, _ in branches)
        return (f"({gbnf})" if len(branches) > 1 else gbnf), any(n for _, n in branches)

    def _sequence(self, depth: int) -> tuple[str, bool]:
        parts: list[str] = []
        nullable = True
        while self._peek() not in ("", "|", ")"):
            atom, atom_nullable = self._atom(depth)
            quantified, atom_nullable = self._quantified(atom, atom_nullable)
            if quantified == atom and _is_literal(atom) and parts and _is_literal(parts[-1]):
                parts[-1] = parts[-1][:-1] + atom[1:]  # "a" "b" -> "ab"
            else:
                parts.append(quantified)
            nullable = nullable and atom_nullable
        return (" ".join(parts) if parts else '""'), nullable

    def _atom(self, depth: int) -> tuple[str, bool]:
        c = self.text[self.i]
        self.i += 1
        if c == "(":
            if self.text.startswith("?:", self.i):
                self.i += 2
            elif self._peek() == "?":
                raise ValueError("lookarounds and named groups are not supported")
            inner, nullable = self._alternation(depth + 1)
            if self._peek() != ")":
                raise ValueError("unbalanced '('")
            self.i += 1
            return f"({inner})", nullable
        if c == "[":
            return self._class(), False
        if c == ".":
            return _gbnf_class([(0x2028, 0x2029)], negated=True), False
        if c == "\\":
            return self._escape(), False
        if c in "^$":
            raise ValueError(f"anchor {c!r} inside the pattern is not supported")
        if c in "*+?{":
            raise ValueError(f"quantifier {c!r} with nothing to repeat at {self.i - 1}")
        return _gbnf_literal(c), False

    def _escape(self) -> str:
        c = self._peek()
        self.i += 1
        if c in _CLASS_ESCAPES:
            return _gbnf_class(_CLASS_ESCAPES[c], negated=False)
        if c.lower() in _CLASS_ESCAPES:
            return _gbnf_class(_CLASS_ESCAPES[c.lower()] if c != "S" else [(0x09, 0x0D), (0x20, 0x20)],
                               negated=True)
        return _gbnf_literal(self._escaped_char(c))

    def _escaped_char(self, c: str) -> str:
        if c in _METACHARS:
            return c
        if c in _CONTROL_ESCAPES:
            return _CONTROL_ESCAPES[c]
        for prefix, digits in (("x", 2), ("u", 4)):
            code = self.text[self.i:self.i + digits]
            if c == prefix and re.fullmatch(rf"[0-9a-fA-F]{{{digits}}}", code):
                self.i += digits
                return chr(int(code, 16))
        raise ValueError(f"escape \\{c} is not supported")

    def _class(self) -> str:
        negated = self._peek() == "^"
        self.i += negated
        ranges: list[tuple[int, int]] = []
        while self._peek() not in ("]", ""):
            low = self._class_char(ranges)
            if low is None:
                continue
            if self._peek() == "-" and self.text[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                high = self._class_char(ranges)
                if high is None or high < low:
                    raise ValueError("bad range in a character class")
                ranges.append((low, high))
            else:
                ranges.append((low, low))
        if self._peek() != "]":
            raise ValueError("unbalanced '['")
        self.i += 1
        if not negated and not _subtract(ranges, _JSON_ESCAPED):
            raise ValueError("character class matches only characters a JSON string must escape")
        return _gbnf_class(ranges, negated)

    def _class_char(self, ranges: list[tuple[int, int]]) -> int | None:
        """One class member's code point; a \\d-like escape adds its ranges and gives None."""
        c = self.text[self.i]
        self.i += 1
        if c != "\\":
            return ord(c)
        e = self._peek()
        if not e:
            raise ValueError("unbalanced '['")
        self.i += 1
        if e in _CLASS_ESCAPES:
            ranges.extend(_CLASS_ESCAPES[e])
            return None
        if e == "b":
            raise ValueError("\\b in a class is not supported")
        if e in "]-^":
            return ord(e)
        return ord(self._escaped_char(e))

    def _quantified(self, atom: str, nullable: bool) -> tuple[str, bool]:
        c = self._peek()
        if c not in ("*", "+", "?", "{"):
            return atom, nullable
        low, high = self._quantifier()
        if self._peek() == "?":
            self.i += 1  # lazy: the same set of whole matches
        if self._peek() in ("*", "+", "?", "{"):
            raise ValueError("a quantifier cannot follow a quantifier")
        if nullable and (high is None or high > 1):
            raise ValueError("repeating an expression that can match nothing")
        self.repeats += high if high is not None else low
        suffix = {(0, None): "*", (1, None): "+", (0, 1): "?"}.get((low, high))
        if suffix is None:
            suffix = f"{{{low},{'' if high is None else high}}}" if high != low else f"{{{low}}}"
        return f"{atom}{suffix}", nullable or low == 0

    def _quantifier(self) -> tuple[int, int | None]:
        c = self.text[self.i]
        self.i += 1
        if c != "{":
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        match = re.match(r"(\d+)(,(\d*))?\}", self.text[self.i:])
        if not match:
            raise ValueError("'{' must start a quantifier {n}, {n,} or {n,m}")
        self.i += match.end()
        low = int(match.group(1))
        high = low if match.group(2) is None else (int(match.group(3)) if match.group(3) else None)
        if max(low, high or 0) > MAX_REPEAT:
            raise ValueError(f"a count above {MAX_REPEAT}")
        if high is not None and high < low:
            raise ValueError(f"{{{low},{high}}}: the bounds are reversed")
        return low, high


def _is_literal(gbnf: str) -> bool:
    return len(gbnf) >= 2 and gbnf[0] == '"' and gbnf[-1] == '"'


def _subtract(ranges: list[tuple[int, int]], removed: list[tuple[int, int]]) -> list[tuple[int, int]]:
    result = list(ranges)
    for r_low, r_high in removed:
        kept = []
        for low, high in result:
            if high < r_low or low > r_high:
                kept.append((low, high))
                continue
            if low < r_low:
                kept.append((low, r_low - 1))
            if high > r_high:
                kept.append((r_high + 1, high))
        result = kept
    return result


def _gbnf_class(ranges: list[tuple[int, int]], negated: bool) -> str:
    """A GBNF character class that never matches what JSON must escape."""
    if negated:
        members = ranges + _JSON_ESCAPED
    else:
        members = _subtract(ranges, _JSON_ESCAPED)
    body = "".join(_gbnf_char(lo) if lo == hi else f"{_gbnf_char(lo)}-{_gbnf_char(hi)}" for lo, hi in members)
    return f"[{'^' if negated else ''}{body}]"


def _gbnf_char(code: int) -> str:
    if chr(code).isascii() and chr(code).isalnum():
        return chr(code)
    if code <= 0xFF:
        return f"\\x{code:02X}"
    return f"\\u{code:04X}" if code <= 0xFFFF else f"\\U{code:08X}"


def _gbnf_literal(char: str) -> str:
    """A GBNF literal for one character of the decoded string: its JSON spelling."""
    spelled = json.dumps(char, ensure_ascii=False)[1:-1]
    return '"' + spelled.replace("\\", "\\\\").replace('"', '\\"') + '"'
