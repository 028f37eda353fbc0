"""The light tier's keeper: the daemon keeps a sleeping model's files warm in
the page cache, so that the next wake never reads the disk.

The worker has exited (the GPU is empty); the keeper holds a read-only shared
mapping of each file (GGUF, draft, projector) with MADV_WILLNEED, which asks
the kernel to read in whatever is missing. It touches no page itself, so the
daemon's RSS does not grow: the pages stay in the page cache, where the next
worker's mmap (or read) finds them. The kernel may still reclaim unmapped
page-cache pages under memory pressure, so `refresh()` advises again (the
controller calls it periodically while light); pages within `mlock_bytes` are
locked and cannot be reclaimed at all (they then count in the daemon's RSS).

`resident_bytes(path)` (mincore) says how much of a file is in the page cache
now: the wake prediction reads it for the deep tier (warm or cold cache).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from dataclasses import dataclass, field

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
_libc.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.munlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
MAP_FAILED = ctypes.c_void_p(-1).value
_LOW_BIT = bytes(b & 1 for b in range(256))
READ_CHUNK = 4 * 2**20
SCAN_PAGES = 16384  # pages mincore reports per call (16 KiB of vector for 64 MiB of file)


class Mapping:
    """A read-only shared mapping of a whole file, by libc (Python's mmap gives no
    address for a read-only map, and mincore/mlock need one)."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.size = os.fstat(fd).st_size
            self.address = None
            if self.size:
                address = _libc.mmap(None, self.size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if address in (None, MAP_FAILED):
                    raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
                self.address = address
        finally:
            os.close(fd)  # the mapping outlives the descriptor

    def madvise(self, advice: int) -> None:
        if self.address and _libc.madvise(self.address, self.size, advice) != 0:
            raise OSError(ctypes.get_errno(), "madvise failed")

    def _scan(self):
        """(first page, residency of SCAN_PAGES pages, 1 where in the page cache) chunk by chunk:
        one small buffer, so a 16 GB file costs no 4 MiB allocation (the daemon's RSS must not
        creep with sleep cycles: tests/reliability/test_wake_drift.py)."""
        if not self.address:
            return
        pages = (self.size + PAGE - 1) // PAGE
        vec = (ctypes.c_ubyte * SCAN_PAGES)()
        for first in range(0, pages, SCAN_PAGES):
            n = min(SCAN_PAGES, pages - first)
            length = min(self.size - first * PAGE, n * PAGE)
            if _libc.mincore(self.address + first * PAGE, length, vec) != 0:
                return
            yield first, ctypes.string_at(vec, n).translate(_LOW_BIT)

    def resident(self) -> int:
        return min(self.size, sum(chunk.count(1) for _, chunk in self._scan()) * PAGE)

    def missing_ranges(self) -> list[tuple[int, int]]:
        """(offset, length) of the runs of pages that are not in the page cache."""
        ranges: list[list[int]] = []
        for first, chunk in self._scan():
            at = 0
            while True:
                start = chunk.find(0, at)
                if start < 0:
                    break
                end = chunk.find(1, start)
                end = len(chunk) if end < 0 else end
                offset = (first + start) * PAGE
                if ranges and ranges[-1][0] + ranges[-1][1] == offset:
                    ranges[-1][1] += (end - start) * PAGE  # a run that goes on from the last chunk
                else:
                    ranges.append([offset, (end - start) * PAGE])
                at = end
        return [(o, min(n, self.size - o)) for o, n in ranges]

    def lock(self, n: int) -> bool:
        return bool(self.address) and _libc.mlock(self.address, n) == 0

    def unlock(self, n: int) -> None:
        if self.address and n:
            _libc.munlock(self.address, n)

    def close(self) -> None:
        if self.address:
            _libc.munmap(self.address, self.size)
            self.address = None


def resident_bytes(path: str) -> tuple[int, int]:
    """(bytes of `path` in the page cache now, its size); (0, 0) when it cannot be read."""
    try:
        view = Mapping(path)
    except OSError:
        return 0, 0
    try:
        return view.resident(), view.size
    finally:
        view.close()


@dataclass
class _Held:
    path: str
    size: int
    view: Mapping
    locked: int = 0  # bytes mlocked from the start of the mapping


@dataclass
class Keeper:
    """Holds files warm; `close()` lets go. One per model, while it is in the light tier."""

    paths: list[str]
    mlock_bytes: int = 0  # at most this many bytes locked in RAM (0: advise only)
    held: list[_Held] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def open(self) -> "Keeper":
        budget = self.mlock_bytes
        for path in self.paths:
            try:
                view = Mapping(path)
            except OSError as exc:
                self.errors.append(f"{path}: {exc}")
                continue
            held = _Held(path, view.size, view)
            self.held.append(held)
            self._advise(held)
            if budget > 0:
                want = min(held.size, budget) // PAGE * PAGE
                if want and view.lock(want):
                    held.locked = want
                    budget -= want
                elif want:
                    self.errors.append(f"{path}: mlock of {want} bytes refused (errno {ctypes.get_errno()}; "
                                       "RLIMIT_MEMLOCK or CAP_IPC_LOCK)")
        return self

    def _advise(self, held: _Held) -> None:
        try:
            held.view.madvise(mmap.MADV_WILLNEED)
        except OSError as exc:
            self.errors.append(f"{held.path}: madvise: {exc}")

    def refresh(self) -> int:
        """Read back in whatever the page cache lacks (the kernel reclaimed it, or it was
        never read): MADV_WILLNEED alone reads ahead only a device's readahead window
        (8 MiB here), so the missing runs are read, through a buffer that is reused
        (page-cache pages, not the daemon's RSS). Blocking: run it in a thread. Returns
        the bytes read."""
        read = 0
        # An anonymous mapping, not a bytearray: malloc would keep a freed 4 MiB in the arena of
        # whichever pool thread ran this (RSS that grows by 4 MiB per new thread); munmap gives it back.
        buf = mmap.mmap(-1, READ_CHUNK)
        try:
            read = self._read_missing(buf)
        finally:
            buf.close()
        return read

    def _read_missing(self, buf: mmap.mmap) -> int:
        read = 0
        for held in list(self.held):
            self._advise(held)
            try:
                fd = os.open(held.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                self.errors.append(f"{held.path}: {exc}")
                continue
            try:
                for offset, length in held.view.missing_ranges():
                    end = offset + length
                    while offset < end:
                        with memoryview(buf) as view:
                            n = os.preadv(fd, [view[:min(READ_CHUNK, end - offset)]], offset)
                        if n <= 0:
                            break
                        offset += n
                        read += n
            except OSError as exc:
                self.errors.append(f"{held.path}: read: {exc}")
            finally:
                os.close(fd)
        return read

    @property
    def bytes(self) -> int:
        return sum(h.size for h in self.held)

    @property
    def locked_bytes(self) -> int:
        return sum(h.locked for h in self.held)

    def resident(self) -> int:
        return sum(h.view.resident() for h in self.held)

    def describe(self) -> dict:
        return {"files": [h.path for h in self.held], "bytes": self.bytes, "locked_bytes": self.locked_bytes,
                "errors": self.errors[-4:]}

    def close(self) -> None:
        for held in self.held:
            held.view.unlock(held.locked)
            held.view.close()
        self.held.clear()
