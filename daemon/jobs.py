"""A request as the daemon sees it while it waits, runs and answers."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from daemon import protocol as p


@dataclass(frozen=True)
class JobFailure:
    status: int
    code: str
    message: str
    retry_after: float | None = None


Item = p.Tokens | p.Done | JobFailure


@dataclass
class Job:
    submit: p.Submit
    endpoint: str
    accepted_at: float = field(default_factory=time.monotonic)
    cold: bool = False  # arrived while no worker was ready: its first token paid for a load
    dispatched: bool = False
    finished: bool = False
    first_token_at: float | None = None
    items: asyncio.Queue[Item] = field(default_factory=asyncio.Queue)

    @property
    def id(self) -> str:
        return self.submit.request_id

    def put(self, item: Item) -> None:
        if isinstance(item, p.Tokens) and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if isinstance(item, (p.Done, JobFailure)):
            self.finished = True
        self.items.put_nowait(item)

    async def next(self, wait_limit: float | None) -> Item:
        """The next item; raises TimeoutError only while not yet dispatched."""
        if self.dispatched or not self.items.empty():
            return await self.items.get()
        return await asyncio.wait_for(self.items.get(), wait_limit)
