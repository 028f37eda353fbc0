"""Download progress as plain lines, for when there is no terminal to draw a bar on.

huggingface_hub draws tqdm bars on a terminal and nothing elsewhere: a daemon
started by systemd or Docker would download gigabytes in silence. This tqdm
class renders nothing itself (tqdm's own output goes nowhere) and hands a
line to `emit` at the start, at each further tenth of the file and at the end:
at most a dozen lines a file, each readable in a journal.
"""

from __future__ import annotations

import io
from typing import Callable

from tqdm import tqdm

STEPS = 10  # a line at each tenth


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


class _LineProgress(tqdm):
    emit: Callable[[str], None] = staticmethod(print)

    def __init__(self, *args, **kwargs) -> None:
        kwargs["file"] = io.StringIO()  # tqdm still counts (n, total, rate) but draws into nothing kept
        kwargs["disable"] = False
        kwargs.pop("name", None)  # huggingface_hub's own tqdm takes a name; plain tqdm refuses it
        super().__init__(*args, **kwargs)
        self._step = -1
        self._report()

    def _report(self, final: bool = False) -> None:
        # huggingface_hub's description is the file's URL cut to its last 40 characters: its last part names the file
        label = self.desc.rstrip(": ").rsplit("/", 1)[-1] or "download"
        if not self.total:
            if final:
                type(self).emit(f"{label}: {_size(self.n)} done")
            return
        step = min(STEPS, int(self.n * STEPS // self.total))
        if step == self._step:
            return
        self._step = step
        rate = self.format_dict.get("rate")
        speed = f", {_size(rate)}/s" if rate else ""
        type(self).emit(f"{label}: {_size(self.n)} of {_size(self.total)} ({step * 100 // STEPS}%{speed})")

    def update(self, n: float = 1) -> bool | None:
        shown = super().update(n)
        self._report()
        return shown

    def close(self) -> None:
        if not getattr(self, "_closed_once", False) and hasattr(self, "_step"):
            self._closed_once = True
            self._report(final=True)
        super().close()


def line_progress(emit: Callable[[str], None]) -> type[tqdm]:
    """A tqdm class for huggingface_hub's `tqdm_class` that reports through `emit`."""
    return type("LineProgress", (_LineProgress,), {"emit": staticmethod(emit)})
