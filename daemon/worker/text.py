"""Turning generated tokens into text: UTF-8 pieces and stop strings.

A token can end in the middle of a UTF-8 character, and a stop string can
span several tokens. Text that might be the start of a stop string is held
back, so a stop is never streamed to the client.
"""

from __future__ import annotations

import codecs


class Utf8Assembler:
    """Bytes in, whole characters out; a split character waits for its tail."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes) -> str:
        return self._decoder.decode(data)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class StopMatcher:
    """Streams text, cutting at the first stop string and holding back any tail
    that could still grow into one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.stopped = False
        self.matched = ""  # the stop string that ended the text (llama-server's stopping_word)

    def feed(self, text: str) -> str:
        """Text that is safe to send now. After a stop is found, `stopped` is set
        and everything from the stop on is dropped."""
        if self.stopped:
            return ""
        buffer = self._pending + text
        if not self.stops:
            self._pending = ""
            return buffer
        found = [(at, stop) for stop in self.stops if (at := buffer.find(stop)) >= 0]
        cut = min(found)[0] if found else -1
        if cut >= 0:
            self.stopped = True
            self.matched = min(found)[1]
            self._pending = ""
            return buffer[:cut]
        hold = self._longest_stop_prefix_suffix(buffer)
        self._pending = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold]

    def flush(self) -> str:
        """At the end of generation, held-back text was not a stop after all."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:n]):
                    best = n
                    break
        return best
