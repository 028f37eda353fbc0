"""The worker's end of the socketpair: framed messages, blocking.

A reader thread turns incoming frames into a queue, so the decode loop can
check for cancels between steps without blocking, and block when idle.
EOF (the daemon went away) arrives as None.

The reader thread also answers the daemon's liveness pings itself, at once,
even in the middle of a decode (llama.cpp runs without the GIL): the Pong
says how long the decode loop has been inside its current step (step_begins
/ step_ends around each round of the loop). So the daemon tells a worker that
is slow but progressing (steps end) from one that is stuck (a step that never
ends, while the pings are still answered) and from one that answers nothing
at all (stopped, deadlocked): daemon/model/supervisor.py judges.
"""

from __future__ import annotations

import queue
import socket
import threading
import time

from daemon import protocol as p


class Channel:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inbox: queue.Queue[p.ToWorker | None] = queue.Queue()
        self._send_lock = threading.Lock()  # the decode loop and the reader thread (Pong) both send
        self._step_started = 0.0  # time.monotonic() when the current step began; 0: between steps
        self.steps = 0  # steps ended
        self._reader = threading.Thread(target=self._read_loop, name="dormouse-channel", daemon=True)
        self._reader.start()

    def send(self, message: p.Message) -> None:
        data = p.encode(message)
        try:
            with self._send_lock:  # frames never interleave
                self.sock.sendall(data)
        except OSError:
            pass  # the daemon is gone; the reader sees EOF and the loop exits

    def receive(self, block: bool = True) -> p.ToWorker | None | bool:
        """Next message; None on EOF; False when not blocking and nothing is there."""
        try:
            return self.inbox.get(block=block)
        except queue.Empty:
            return False

    # -- the decode loop's progress, for the pings --

    def step_begins(self) -> None:
        self._step_started = time.monotonic()

    def step_ends(self) -> None:
        self._step_started = 0.0
        self.steps += 1

    def step_progressed(self) -> None:
        """A long piece of work (a prompt with images, read image by image) finished one bounded part: the
        step's age starts again, as it would at the next round of the loop."""
        self.step_ends()
        self.step_begins()

    def step_seconds(self) -> float:
        """How long the current step has run; 0 between steps."""
        started = self._step_started
        return max(0.0, time.monotonic() - started) if started else 0.0

    # -- reading --

    def _read_exact(self, n: int) -> bytes | None:
        chunks = bytearray()
        while len(chunks) < n:
            try:
                chunk = self.sock.recv(n - len(chunks))
            except OSError:
                return None
            if not chunk:
                return None
            chunks += chunk
        return bytes(chunks)

    def _read_loop(self) -> None:
        while True:
            header = self._read_exact(p.HEADER.size)
            if header is None:
                break
            body = self._read_exact(p.check_length(p.HEADER.unpack(header)[0]))
            if body is None:
                break
            message = p.decode_for_worker(body)
            if isinstance(message, p.Ping):  # answered here, off the decode loop (see the module's docstring)
                self.send(p.Pong(message.seq, step_seconds=round(self.step_seconds(), 3)))
                continue
            self.inbox.put(message)
        self.inbox.put(None)
