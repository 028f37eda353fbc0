"""The worker's end of the socketpair: framed messages, blocking.

A reader thread turns incoming frames into a queue, so the decode loop can
check for cancels between steps without blocking, and block when idle.
EOF (the daemon went away) arrives as None.
"""

from __future__ import annotations

import queue
import socket
import threading

from daemon import protocol as p


class Channel:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inbox: queue.Queue[p.ToWorker | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read_loop, name="dormouse-channel", daemon=True)
        self._reader.start()

    def send(self, message: p.Message) -> None:
        try:
            self.sock.sendall(p.encode(message))
        except OSError:
            pass  # the daemon is gone; the reader sees EOF and the loop exits

    def receive(self, block: bool = True) -> p.ToWorker | None | bool:
        """Next message; None on EOF; False when not blocking and nothing is there."""
        try:
            return self.inbox.get(block=block)
        except queue.Empty:
            return False

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
            self.inbox.put(p.decode_for_worker(body))
        self.inbox.put(None)
