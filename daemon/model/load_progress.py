"""Progress lines while a model loads (issue 30: "nothing is logged while a
multi-GB model loads").

`load.begin` says what is read and how long it should take; then, until the
worker says Ready, one `load.progress` line after FIRST_AFTER seconds and every
EVERY seconds after that: the seconds so far, the prediction, and how many of
the model's bytes are still not in the page cache (the part of the read that is
left, when the disk is the slow part). A log that goes quiet for minutes reads
as a hang; these lines say it is still reading.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

FIRST_AFTER = 5.0  # a load this short needs no progress line
EVERY = 10.0


@asynccontextmanager
async def progress_lines(log, expected_seconds: float | None, bytes_from_disk: Callable[[], Awaitable[int | None]],
                         sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> AsyncIterator[None]:
    """Logs load.progress while the body runs. bytes_from_disk: the model's bytes not yet in the
    page cache (measured off the event loop by the caller); sleep: asyncio.sleep (tests step it)."""
    start = time.monotonic()

    async def tick() -> None:
        wait = FIRST_AFTER
        while True:
            await sleep(wait)
            wait = EVERY
            left = await bytes_from_disk()
            log.info("load.progress", seconds=round(time.monotonic() - start, 1), expected_seconds=expected_seconds,
                     bytes_from_disk_left=left)

    ticker = asyncio.create_task(tick(), name="load-progress")
    try:
        yield
    finally:
        ticker.cancel()
        try:
            await ticker
        except asyncio.CancelledError:
            pass
        except Exception:  # a failed residency read must not fail the load it only reports on
            pass
