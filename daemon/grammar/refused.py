"""How a grammar build fails: GrammarRefused, the 400 that names the request
field, and the checks every grammar we hand out passes last.

Whatever stops a build (a limit of limits.py, its time bound, a recursion too
deep for Python) becomes a GrammarRefused through `refusals`, never a 500.
"""

from __future__ import annotations

import contextlib

from daemon.grammar.limits import LimitExceeded

MAX_GRAMMAR_BYTES = 256 * 1024  # what we produce


class GrammarRefused(ValueError):
    """A constraint the grammar cannot enforce, or a malformed one: a 400 naming `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@contextlib.contextmanager
def refusals(param: str):
    """Whatever stops a build (a limit, its time bound, a recursion too deep
    for Python) is a refusal that names the field, never a 500."""
    try:
        yield
    except LimitExceeded as exc:
        raise GrammarRefused(f"{param}: {exc}", param) from None
    except RecursionError:
        raise GrammarRefused(f"{param} is nested too deeply to build a grammar for", param) from None


def checked_output(gbnf: str, param: str) -> str:
    try:
        size = len(gbnf.encode("utf-8"))
    except UnicodeEncodeError:
        raise GrammarRefused(f"{param} holds a lone UTF-16 surrogate, which is not text", param) from None
    if "\x00" in gbnf:
        raise GrammarRefused(f"{param} holds a NUL character", param)
    if size > MAX_GRAMMAR_BYTES:
        raise GrammarRefused(f"the grammar for {param} would be {size} bytes; at most {MAX_GRAMMAR_BYTES} "
                             "are accepted", param)
    return gbnf
