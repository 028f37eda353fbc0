"""An object's properties in GBNF: linear to build, and few parse stacks to match.

The required properties come first, in their declared order, then any subset
of the optional ones, in their declared order. llama-cpp-python's converter
writes the optional part as one alternative per property that may come next,
built by recursing over the properties after it once per starting property:
quadratic work (900 optional properties took seconds per tool, on the event
loop as it was), one Python frame per property (990 raised RecursionError),
and, between two properties, one parse stack per property that may follow,
each of which llama.cpp's matcher checks against the whole vocabulary at a
step (64 of them: about 200 ms per such step on one core).

Here, after the optional property o_j, what may follow is a comma and then a
prefix tree of the names of o_j+1..o_n, each leaf going on with that
property's value and what may follow it:

    rest_j ::= ( "," space "\\"" names_j )?      names_j: a tree of o_j+1..o_n

so the matcher holds one stack per way the remaining names begin, not one
per name. The trees are persistent: names_j is names_j+1 with o_j+1 added,
which copies only the nodes on o_j+1's path, so building all of them costs
about what the names' lengths add up to, done in one backward loop with no
recursion.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from daemon.grammar.literals import max_fanout


class _Node:
    """A node of a persistent radix tree of names: edges (label, child) by
    first character; a child is a node or a leaf (the GBNF after the name)."""

    __slots__ = ("edges",)

    def __init__(self, edges: dict[str, tuple[str, "_Node | str"]]) -> None:
        self.edges = edges


def _with_name(root: _Node | None, name: str, leaf: str) -> _Node:
    """A tree holding root's names and `name` (names are prefix-free: each ends
    with its closing quote), sharing every node off name's path."""
    path: list[tuple[_Node, str, str]] = []  # (node, first character, label) walked down
    node, rest = root, name
    while node is not None and rest[0] in node.edges:
        label, child = node.edges[rest[0]]
        common = len(os.path.commonprefix([label, rest]))
        if common < len(label):  # the name leaves this edge midway: split it there
            new = _Node({label[common]: (label[common:], child), rest[common]: (rest[common:], leaf)})
            path.append((node, rest[0], label[:common]))
            break
        path.append((node, rest[0], label))
        node, rest = child, rest[common:]  # a whole label matched: its child is a node (prefix-free names)
    else:
        new = _Node({**(node.edges if node is not None else {}), rest[0]: (rest, leaf)})
    while path:  # copy the nodes above, each pointing at its new child
        parent, first, label = path.pop()
        new = _Node({**parent.edges, first: (label, new)})
    return new


def object_rule(required: list[str], optional: list[tuple[str, str]], name: str,
                add_rule: Callable[[str, str], str], format_literal: Callable[[str], str]) -> str:
    """The object's GBNF. required: the rule names of each required property's
    `"key" space ":" space value`, in order; optional: (the key's JSON spelling,
    its value's rule name), in order."""
    prefix = f"{name}-" if name else ""
    rules: dict[_Node, str] = {}  # node (by identity) -> its rule: nodes shared between trees are one rule

    def names_rule(node: _Node) -> str:
        """The rule of a tree, written bottom-up (a stack, not recursion)."""
        stack = [(node, False)]
        while stack:
            current, children_done = stack.pop()
            if current in rules:
                continue
            children = [c for _, c in current.edges.values() if isinstance(c, _Node) and c not in rules]
            if not children_done and children:
                stack.append((current, True))
                stack.extend((c, False) for c in children)
                continue
            alternatives = [f"{format_literal(label)} {child if isinstance(child, str) else rules[child]}"
                            for label, child in current.edges.values()]
            rules[current] = add_rule(f"{prefix}keys-{len(rules)}", " | ".join(alternatives))
        return rules[node]

    tree: _Node | None = None  # the names of the properties after the current one
    for key, value_rule in reversed(optional):
        stem = f"{prefix}{_json_stem(key)}"
        rest = add_rule(f"{stem}-rest", f'( "," space "\\"" {names_rule(tree)} )?') if tree is not None else ""
        tree = _with_name(tree, key[1:], f'space ":" space {value_rule} {rest}'.rstrip())
    body = '"{" space'
    if required:
        body += " " + ' "," space '.join(required)
        if tree is not None:
            body += f' ( "," space "\\"" {names_rule(tree)} )?'
    elif tree is not None:
        body += f' ( "\\"" {names_rule(tree)} )?'
    return body + ' "}" space'


def _json_stem(spelling: str) -> str:
    """A rule-name stem from a key's JSON spelling."""
    return "".join(c if c.isalnum() else "-" for c in spelling[1:-1]).strip("-") or "key"


def names_width(spellings: list[str]) -> int:
    """The most ways the names of these keys can go on at one point of their
    tree: the stacks between two optional properties."""
    return max_fanout([s[1:] for s in spellings]) if spellings else 1
