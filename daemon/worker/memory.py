"""What each component holds, in bytes.

Freed RSS inside a live process says little (glibc keeps freed pages), so
component sizes come from llama.cpp's own accounting: every buffer it
allocates is logged as "<device> <kind> buffer size = N MiB". The ledger
parses those lines while a phase runs and credits the bytes to the phase's
component, by device. The process's RSS is read from /proc for the whole.
"""

from __future__ import annotations

import re
from collections import defaultdict

import psutil

_BUFFER_LINE = re.compile(r"(?P<device>[\w.\-]+)\s+(?P<kind>[\w ]*?)\s*buffer size\s*=\s*(?P<mib>[\d.]+)\s*MiB")


class BufferLedger:
    def __init__(self) -> None:
        self.component = "other"
        self.bytes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))  # component -> device -> bytes

    def observe(self, line: str) -> None:
        match = _BUFFER_LINE.search(line)
        if match is None:
            return
        device = match["device"].removesuffix("_Mapped").removesuffix("_REPACK")
        self.bytes[self.component][device] += int(float(match["mib"]) * 1024 * 1024)

    def total(self, component: str) -> int:
        return sum(self.bytes.get(component, {}).values())

    def by_component(self) -> dict[str, int]:
        return {component: sum(devices.values()) for component, devices in self.bytes.items()}

    def by_device(self) -> dict[str, dict[str, int]]:
        return {component: dict(devices) for component, devices in self.bytes.items()}

    def forget(self, component: str) -> int:
        """The component was freed: drop it and return what it held."""
        return sum(self.bytes.pop(component, {}).values())


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss
