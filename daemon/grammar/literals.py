"""A set of literal alternatives as a prefix tree in GBNF, so that llama.cpp's
grammar matcher tracks few parse stacks.

The matcher keeps one stack per alternative that is still possible, and at a
step whose sampled token the grammar refuses it checks the whole vocabulary
against every stack: about 1.6 ms per stack for Gemma 3's 262k tokens on one
CPU core. An enum of 1400 forty-digit strings written as 1400 alternatives
cost 2.3 s per such step (three of them paused a neighbour stream 41 s).
Written as a tree, the alternatives at any point are the distinct ways the
values continue there (10 for digits), whatever the number of values.

Branches whose rest is the same are merged into one character class
(["a", "b", "c"] is `"\\"" [abc] "\\""`), each branching node is a rule of its
own (a long chain of nested groups would overflow llama.cpp's recursive GBNF
parser), and the tree is built from the sorted values and written without
recursion, in memory linear in their number, so no set of values can exhaust
Python's stack.

An alternative can carry a continuation (the GBNF that follows it), which is
how one tool's name leads to that tool's arguments in the forced-call grammar.
"""

from __future__ import annotations

import bisect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class LiteralTree:
    """The GBNF expression for the alternatives, and the most alternatives the
    matcher can hold at one point of it (its widest branching)."""

    expression: str
    width: int


def literal_tree(alternatives: list[tuple[str, str]], add_rule: Callable[[str, str], str], name: str,
                 format_literal: Callable[[str], str]) -> LiteralTree:
    """alternatives: (text, continuation GBNF or ""), distinct texts. add_rule(name,
    body) -> the rule's name as added; format_literal(text) -> a GBNF string literal."""
    items = sorted(alternatives)
    texts = [text for text, _ in items]
    emitted: dict[str, str] = {}  # body -> rule name: equal subtrees are one rule
    width = 1

    def rule_for(body: str) -> str:
        if body not in emitted:
            emitted[body] = add_rule(f"{name}-{len(emitted)}", body)
        return emitted[body]

    # A node is the run texts[lo:hi] (sorted) that shares texts[lo][:depth]; its
    # edges are labelled with the text they add (a chain of one-way characters
    # is one label, "abc", not three nested alternatives). Written bottom-up
    # with a stack, so that no depth of the tree recurses.
    expression: dict[tuple[int, int, int], str] = {}
    edges: dict[tuple[int, int, int], list[tuple[str, tuple[int, int, int]]]] = {}
    stack: list[tuple[tuple[int, int, int], bool]] = [((0, len(items), 0), False)]
    while stack:
        node, children_done = stack.pop()
        lo, hi, depth = node
        ends_here = len(texts[lo]) == depth
        if not children_done:
            edges[node] = _edges(texts, lo + ends_here, hi, depth)
            stack.append((node, True))
            stack.extend((child, False) for _, child in edges[node])
            continue
        end = items[lo][1] if ends_here else None  # the continuation of the text that ends here
        if not edges[node]:
            expression[node] = end or ""
            continue
        # Labels that differ only in their first character and lead to the same
        # rest are one branch: a class of those characters, then the rest.
        branches: dict[tuple[str, str], list[str]] = {}  # (label after its first character, rest) -> firsts
        for label, child in edges.pop(node):
            branches.setdefault((label[1:], expression[child]), []).append(label[0])
        here = []
        for (tail, rest), firsts in branches.items():
            head = format_literal(firsts[0] + tail) if len(firsts) == 1 else \
                _joined(_char_class(firsts), format_literal(tail) if tail else "")
            here.append(_joined(head, rest))
        optional = end == ""  # a text ends here with nothing after it: the rest is optional
        if end:
            here.append(end)
        width = max(width, len(here) + optional)
        body = here[0] if len(here) == 1 else rule_for(" | ".join(here))
        if optional:  # a rule, not a group: nested groups would nest as deep as the tree
            body = f"{body if ' ' not in body else rule_for(body)}?"
        expression[node] = body
    return LiteralTree(expression[(0, len(items), 0)] or '""', width)


def max_fanout(texts: list[str]) -> int:
    """The most edges out of one node of the prefix tree of these texts (no
    classes merged): the stacks the matcher holds there."""
    ordered = sorted(set(texts))
    most, stack = 1, [(0, len(ordered), 0)]
    while stack:
        lo, hi, depth = stack.pop()
        ends_here = len(ordered[lo]) == depth
        edges = _edges(ordered, lo + ends_here, hi, depth)
        most = max(most, len(edges) + ends_here)
        stack.extend(child for _, child in edges)
    return most


def _edges(texts: list[str], lo: int, hi: int, depth: int) -> list[tuple[str, tuple[int, int, int]]]:
    """The edges out of the node texts[lo:hi] at `depth`: one per next character,
    each labelled up to where its texts part (or one of them ends)."""
    out = []
    while lo < hi:
        prefix = texts[lo][: depth + 1]
        # The run that goes on with this character ends at the first text past
        # every text that starts with `prefix` (they are sorted).
        end = bisect.bisect_left(texts, prefix[:-1] + chr(ord(prefix[-1]) + 1), lo, hi) \
            if ord(prefix[-1]) < sys.maxunicode else hi
        label_end = len(os.path.commonprefix([texts[lo], texts[end - 1]]))
        out.append((texts[lo][depth:label_end], (lo, end, label_end)))
        lo = end
    return out


def _joined(head: str, rest: str) -> str:
    return f"{head} {rest}" if rest else head


def _char_class(chars: list[str]) -> str:
    return "[" + "".join(_class_member(c) for c in sorted(chars)) + "]"


def _class_member(char: str) -> str:
    if char in "]\\^-[":
        return "\\" + char
    code = ord(char)
    if code < 0x20 or code == 0x7F:
        return f"\\x{code:02X}"
    return char
