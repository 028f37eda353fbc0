"""A request as the daemon sees it while it waits, runs and answers."""

from __future__ import annotations

import asyncio
import contextvars
import time
from dataclasses import dataclass, field

from daemon import protocol as p


@dataclass(frozen=True)
class JobFailure:
    status: int
    code: str
    message: str
    retry_after: float | None = None


Item = p.Tokens | p.PromptProgress | p.Done | p.Answer | JobFailure

# The prompt-cache scope of the request being handled (p.Submit.cache_scope): set by the
# HTTP layer from the named key and the body's cache_salt, read by Controller.new_job,
# so that no route has to thread it through by hand.
request_cache_scope: contextvars.ContextVar[str] = contextvars.ContextVar("request_cache_scope", default="")


@dataclass
class Job:
    submit: p.Submit | p.Query  # a generation, or one-step work answered by one p.Answer
    endpoint: str
    keep_alive: float | None = None  # how long the model stays awake after it (statemachine RequestArrived)
    accepted_at: float = field(default_factory=time.monotonic)
    cold: bool = False  # arrived while no worker was ready: its first token paid for a load
    dispatched: bool = False
    finished: bool = False
    first_token_at: float | None = None
    max_wait: float | None = None  # X-Dormouse-Max-Wait: how long this client may wait for a wake
    wake_seconds: float | None = None  # measured wait for the wake, when it was cold (X-Dormouse-Wake-Seconds)
    items: asyncio.Queue[Item] = field(default_factory=asyncio.Queue)
    # Set once the request is handed to a worker or answered: the wait for a wake is over.
    _placed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def id(self) -> str:
        return self.submit.request_id

    def put(self, item: Item) -> None:
        if isinstance(item, p.Tokens) and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if isinstance(item, (p.Done, p.Answer, JobFailure)):
            self.finished = True
        self.items.put_nowait(item)
        self._placed.set()

    def mark_dispatched(self) -> None:
        self.dispatched = True
        self._placed.set()

    async def next(self, wake_limit: float | None) -> Item:
        """The next item. `wake_limit` bounds only the wait for a worker to take
        the request (counted from acceptance): once dispatched, a request waits
        for its slot and its tokens as long as they take (a queued request on a
        ready model is bounded by the queue size, not by wake_timeout).
        Raises TimeoutError when the wake takes longer."""
        if wake_limit is not None and not self._placed.is_set():
            remaining = self.accepted_at + wake_limit - time.monotonic()
            await asyncio.wait_for(self._placed.wait(), max(remaining, 0.0))
        return await self.items.get()
