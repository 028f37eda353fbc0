"""The fake worker (tests/fakes/fake_worker.py) with a prompt cache's RAM tier
that grows as it serves, for the fleet's budget tests (issue 26).

Each request that ends adds one entry of FAKE_CACHE_ENTRY_BYTES (default
1 MiB) to the tier, as the real worker stashes a slot's prefix when the slot
goes to another prompt; least recently used entries go when the tier is past
its budget (ModelSpec.prompt_cache_ram_bytes at first), and an entry larger
than the budget is not kept, as RamTier.put. Every Done carries the tier as
PromptCache.summary does ({"ram": {"bytes", "budget_bytes", "entries", ...}}),
and a `prompt_cache_shrink` query lowers the budget as PromptCache.shrink does
(never raises it) and answers the bytes held.

Every report is also appended to FAKE_CACHE_LOG (when set), one JSON line
{"pid", "bytes", "budget"} after every change, so a test can check what the
tier really held at every moment, not only what the daemon last heard.
"""

from __future__ import annotations

import json
import os
import sys

import msgspec

from daemon import protocol as p
from daemon.worker.channel import Channel
from tests.fakes import fake_worker


class RamTier:
    def __init__(self, budget: int, entry: int) -> None:
        self.budget = budget
        self.entry = entry
        self.entries: list[int] = []
        self.evictions = 0

    @property
    def bytes(self) -> int:
        return sum(self.entries)

    def put(self) -> None:
        if self.entry > self.budget:
            return
        self.entries.append(self.entry)
        self._fit()

    def shrink(self, budget: int) -> int:
        self.budget = max(0, min(self.budget, budget))
        self._fit()
        return self.bytes

    def _fit(self) -> None:
        while self.bytes > self.budget and self.entries:
            self.entries.pop(0)
            self.evictions += 1
        log(self)

    def summary(self) -> dict:
        return {"ram": {"entries": len(self.entries), "bytes": self.bytes, "budget_bytes": self.budget,
                        "evictions": self.evictions},
                "disk": {"entries": 0, "bytes": 0}}


def log(tier: RamTier) -> None:
    path = os.environ.get("FAKE_CACHE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "bytes": tier.bytes, "budget": tier.budget}) + "\n")


TIER: list[RamTier] = []  # set when the Load arrives


class TierChannel(Channel):
    def receive(self, block: bool = True):
        message = super().receive(block)
        if isinstance(message, p.Load):
            TIER[:] = [RamTier(message.spec.prompt_cache_ram_bytes,
                               int(os.environ.get("FAKE_CACHE_ENTRY_BYTES", str(2**20))))]
        return message

    def send(self, message: p.Message) -> None:
        if isinstance(message, p.Done) and TIER:
            if message.finish_reason in ("stop", "length"):
                TIER[0].put()
            message = msgspec.structs.replace(message, prompt_cache=TIER[0].summary())
        super().send(message)


def answer(query: p.Query) -> p.Answer:
    if query.kind == "prompt_cache_shrink":
        if len(query.tokens) != 1 or query.tokens[0] < 0:
            return p.Answer(query.request_id, error="prompt_cache_shrink takes one budget in bytes",
                            error_code="invalid_request")
        return p.Answer(query.request_id, tokens=[TIER[0].shrink(query.tokens[0]) if TIER else 0])
    return plain_answer(query)


plain_answer = fake_worker.fake_answer

if __name__ == "__main__":
    fake_worker.Channel = TierChannel
    fake_worker.fake_answer = answer
    sys.exit(fake_worker.main())
