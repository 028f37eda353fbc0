"""Integer ranges in GBNF: exactly the JSON integers from a minimum to a
maximum, digit by digit (the converter ignores minimum and maximum).

schema_walk.py turns minimum/maximum and their exclusive forms into an
inclusive pair of ints; the converter writes that pair with
`integer_range_gbnf`, and width.py counts its alternatives.
"""

from __future__ import annotations

import re

INTEGER_DIGITS = 16  # the converter's plain integer has at most 16 digits; an open range keeps that


def integer_range_gbnf(low: int | None, high: int | None) -> str:
    """A GBNF expression for exactly the JSON integers from `low` to `high`
    (inclusive; None: open, up to INTEGER_DIGITS digits like the plain integer):
    no leading zeros, no "-0", no "+", a sign only on negatives. Parenthesized
    where it holds an alternation, so that a rule can follow it with " space"."""
    top = 10**INTEGER_DIGITS - 1
    branches = []
    if low is None or low < 0:  # "-" and a magnitude from max(1, -high) to -low
        least = 1 if high is None or high >= 0 else -high
        branches.append(f'"-" {_grouped(_magnitudes(least, top if low is None else -low))}')
    if high is None or high >= 0:
        branches.append(_magnitudes(max(low or 0, 0), top if high is None else high))
    return _grouped(" | ".join(branches))


def _magnitudes(low: int, high: int) -> str:
    """Decimal spellings (no leading zeros) of low..high, 0 <= low <= high: one
    alternative per length, consecutive lengths whose every value is in range merged."""
    pieces: list[str] = []
    full: list[int] = []  # a run of lengths n, each whole (1-9 for n = 1): [1-9] then n-1 digits

    def flush() -> None:
        if full:
            pieces.append(f"[1-9] {_digits(full[0] - 1, full[-1] - 1)}".rstrip())
            full.clear()

    for n in range(len(str(low)), len(str(high)) + 1):
        first = low if n == len(str(low)) else 10 ** (n - 1)
        last = high if n == len(str(high)) else 10**n - 1
        if first == max(10 ** (n - 1), 1) and last == 10**n - 1:
            full.append(n)
            continue
        flush()
        pieces.append(_same_length(str(first), str(last)))
    flush()
    return " | ".join(pieces)


def _same_length(low: str, high: str) -> str:
    """The digit strings of one length from `low` to `high`: the common prefix,
    then at the first differing digit d1 < d2: d1 and a tail >= low's, the digits
    between and any tail, d2 and a tail <= high's (whole tails merged into the middle)."""
    i = 0
    while i < len(low) and low[i] == high[i]:
        i += 1
    prefix = f'"{low[:i]}"' if i else ""
    if i == len(low):
        return prefix
    d1, d2, tail_low, tail_high = low[i], high[i], low[i + 1:], high[i + 1:]
    k = len(tail_low)
    low_whole, high_whole = tail_low == "0" * k, tail_high == "9" * k
    alternatives = []
    if not low_whole:
        alternatives.append(_joined(f'"{d1}"', _same_length(tail_low, "9" * k)))
    start, end = (d1 if low_whole else chr(ord(d1) + 1)), (d2 if high_whole else chr(ord(d2) - 1))
    if start <= end:
        middle = f'"{start}"' if start == end else f"[{start}-{end}]"
        alternatives.append(f"{middle} {_digits(k, k)}".rstrip())
    if not high_whole:
        alternatives.append(_joined(f'"{d2}"', _same_length("0" * k, tail_high)))
    rest = " | ".join(alternatives)
    return _joined(prefix, rest) if prefix else rest


def _joined(literal: str, rest: str) -> str:
    """A literal followed by `rest` ("1" "2" -> "12")."""
    head, _, tail = rest.partition(" ")
    if re.fullmatch(r'"[0-9]+"', head) and " | " not in rest:
        return f"{literal[:-1]}{head[1:]} {tail}".rstrip()
    return f"{literal} {_grouped(rest)}"


def _digits(least: int, most: int) -> str:
    """least to most decimal digits, as GBNF ("" for none)."""
    if most == 0:
        return ""
    if least == most:
        return "[0-9]" if least == 1 else f"[0-9]{{{least}}}"
    return f"[0-9]{{{least},{most}}}"


def _grouped(alternatives: str) -> str:
    return f"({alternatives})" if " | " in alternatives else alternatives
