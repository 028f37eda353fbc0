"""load.progress lines while a model loads: one after FIRST_AFTER seconds, then every EVERY
seconds, each with what is left to read; none once the load is over (steps counted, no clock)."""

import asyncio

from daemon.model import load_progress
from daemon.model.load_progress import progress_lines


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def info(self, event: str, **fields) -> None:
        self.lines.append((event, fields))


def test_lines_follow_the_schedule_and_stop_with_the_load():
    async def scenario():
        log, waits, ticks = Log(), [], asyncio.Queue()

        async def sleep(seconds: float) -> None:  # each wait lasts until the test lets it end
            waits.append(seconds)
            await ticks.get()

        left = iter([300, 120])

        async def bytes_from_disk() -> int:
            return next(left)

        async with progress_lines(log, 42.0, bytes_from_disk, sleep=sleep):
            for _ in range(2):
                await ticks.put(None)
                for _ in range(5):
                    await asyncio.sleep(0)
        await asyncio.sleep(0)
        return log, waits

    log, waits = asyncio.run(scenario())
    assert waits[:3] == [load_progress.FIRST_AFTER, load_progress.EVERY, load_progress.EVERY]
    assert [e for e, _ in log.lines] == ["load.progress"] * 2  # the third wait was cut short by the end
    assert [f["bytes_from_disk_left"] for _, f in log.lines] == [300, 120]
    assert all(f["expected_seconds"] == 42.0 for _, f in log.lines)


def test_a_failing_residency_read_does_not_fail_the_load():
    async def scenario():
        async def sleep(seconds: float) -> None:
            await asyncio.sleep(0)

        async def broken() -> int:
            raise OSError("the file went away")

        async with progress_lines(Log(), None, broken, sleep=sleep):
            for _ in range(10):
                await asyncio.sleep(0)
        return "loaded"

    assert asyncio.run(scenario()) == "loaded"


def test_a_short_load_logs_nothing():
    async def scenario():
        log = Log()

        async def bytes_from_disk() -> int:
            return 0

        async with progress_lines(log, 1.0, bytes_from_disk):  # the real sleep: 5 s never pass
            await asyncio.sleep(0)
        return log

    assert asyncio.run(scenario()).lines == []
