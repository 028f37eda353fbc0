"""A request's grammar, built off the event loop, within a time bound, a few
at a time.

Building is pure Python and runs milliseconds within the limits of limits.py,
but it ran on the event loop before those limits existed, and one request
then froze every model, /health, /metrics and the watchdog pings for 38 s. So
it runs on a small thread pool: while a build runs, the loop still gets the
interpreter every switch interval and keeps answering.

A thread cannot be killed, so the time bound is kept by the build itself: its
deadline is checked at every schema node (schema_walk.py, converter.py), and a
build past it stops with a refusal that names the field (a 400). The deadline
runs from when the request asked, so a build that waited in the queue past it
never starts, and that one is the server's fault: GrammarBusy, a 503. The pool
has MAX_BUILDERS threads, and at most MAX_PENDING builds are running or queued;
past that a request is refused at once, so a crowd of hostile schemas can
neither grow threads nor a queue.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from daemon.grammar.build import grammar_for
from daemon.grammar.limits import BUILD_SECONDS, Deadline

MAX_BUILDERS = 2
MAX_PENDING = 16


class GrammarBusy(RuntimeError):
    """Too many grammars are being built, or this one waited past its deadline."""


class _Builders:
    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.pending = 0  # submitted, not finished

    def submit(self, fields: dict[str, Any], deadline: Deadline) -> Future:
        with self._lock:
            if self.pending >= MAX_PENDING:
                raise GrammarBusy(f"{MAX_PENDING} grammars are being built")
            self.pending += 1
            if self._pool is None:
                self._pool = ThreadPoolExecutor(MAX_BUILDERS, thread_name_prefix="dormouse-grammar")
            pool = self._pool
        try:
            future = pool.submit(_build, fields, deadline)
        except BaseException:
            self._finished(None)
            raise
        # Counted until the thread is done, not until the caller stops waiting.
        future.add_done_callback(self._finished)
        return future

    def _finished(self, _future: Future | None) -> None:
        with self._lock:
            self.pending -= 1


_builders = _Builders()


def _build(fields: dict[str, Any], deadline: Deadline) -> str | None:
    if deadline.passed():
        raise GrammarBusy("the grammar waited past its deadline for a free builder")
    return grammar_for(**fields, deadline=deadline)


async def build_grammar(**fields: Any) -> str | None:
    """grammar_for(**fields), on a builder thread. Raises GrammarRefused (a
    400) as grammar_for does, for a build past its time too; GrammarBusy when
    too many are being built."""
    deadline = Deadline(BUILD_SECONDS)
    future = _builders.submit(fields, deadline)
    # The build stops itself at the deadline; the wait is bounded as well, in
    # case one step of it (a single large json.dumps) runs past it.
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), BUILD_SECONDS * 2 + 1)
    except TimeoutError:
        raise GrammarBusy("a grammar build did not finish") from None


def pending_builds() -> int:
    """Builds running or queued now (for tests and metrics)."""
    return _builders.pending
