"""Disk-tier restores read off the decode thread (issue 26, tier speed).

Reading a saved prompt's file and checking its seal takes as long as
several prompt chunks; on the decode thread it stalled every other stream
for that long. Here one reader thread opens, reads and checks the file
(disk_tier.SavedPrompts.read: the seal is checked before anything is
handed back), while the slot that asked waits, reserved, and the decode
loop steps the others. The decode thread then does only the last move,
llama_state_seq_set_data (SavedPrompts.install), when the read is done.

The reader reads into a buffer it keeps for the next read (a fresh one
costs a page fault per 4 KiB, as much as the read itself). The writer of
the disk tier waits while a read is in flight (`idle`): a restore someone
waits for goes before a write nobody waits for.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from daemon.model.kv_files import KvEntry


@dataclass(eq=False)
class DiskRead:
    """One file being read and checked for a slot that waits for it."""

    entry: KvEntry
    scope: str  # the request's cache scope (its name: the slot takes it once restored)
    started: float  # perf_counter() when the lookup began (the restore's time counts from there)
    done: threading.Event = field(default_factory=threading.Event)
    state: np.ndarray | None = None  # the checked state, once done (None: see reason)
    reason: str | None = None  # why the file was not used (it is forgotten or deleted already)
    buffer: np.ndarray | None = None  # what `state` is a view of, handed back by release()
    read_seconds: float = 0.0  # the reader's own time (open, read, check)


class DiskReader:
    """One thread that reads and checks disk-tier files, in the order asked."""

    def __init__(self, disk: Any) -> None:
        self.disk = disk  # a disk_tier.SavedPrompts
        self.requests: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None
        self.spare: np.ndarray | None = None  # the buffer kept for the next read
        self.lock = threading.Lock()
        self.in_flight = 0
        self.idle = threading.Event()  # set while no read is queued or running (the writer waits for it)
        self.idle.set()
        # Reads wait for this before they start: set, except in a test that holds a read in flight
        # to count what the decode loop does meanwhile (tests/e2e/test_disk_restore_off_thread.py).
        self.gate = threading.Event()
        self.gate.set()
        self.reads = 0

    def start(self, entry: KvEntry, scope: str, started: float) -> DiskRead:
        read = DiskRead(entry, scope, started)
        with self.lock:
            self.in_flight += 1
            self.idle.clear()
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="prompt-cache-reader", daemon=True)
            self.thread.start()
        self.requests.put(read)
        return read

    def release(self, read: DiskRead) -> None:
        """The decode thread is done with the read's state: its buffer serves the next read."""
        buffer, read.buffer, read.state = read.buffer, None, None
        if buffer is not None:
            self._keep(buffer)

    def _keep(self, buffer: np.ndarray) -> None:
        with self.lock:  # the decode thread hands buffers back, the reader takes them
            if self.spare is None or len(buffer) > len(self.spare):
                self.spare = buffer  # the larger of the two: the next read of that size needs no new pages

    def _buffer(self, size: int) -> np.ndarray:
        with self.lock:
            spare, self.spare = self.spare, None
        if spare is not None and len(spare) >= size:
            return spare
        return np.empty(size, np.uint8)

    def _loop(self) -> None:
        while True:
            read = self.requests.get()
            try:
                self.gate.wait()
                begin = time.perf_counter()
                buffer = self._buffer(read.entry.state_bytes)
                try:
                    read.state, read.reason = self.disk.read(read.entry, buffer)
                except Exception as exc:  # noqa: BLE001 - a bug must not leave the slot waiting forever
                    read.state, read.reason = None, f"unreadable ({exc!r:.100})"
                if read.state is None:
                    self._keep(buffer)  # nothing of it is handed out
                else:
                    read.buffer = buffer
                read.read_seconds = time.perf_counter() - begin
                self.reads += 1
            finally:
                with self.lock:
                    self.in_flight -= 1
                    if self.in_flight == 0:
                        self.idle.set()
                read.done.set()
