"""A state directory the daemon cannot write: said once, not found out later.

The daemon still serves from a read-only state directory (a read-only root,
an image layer, a wrong owner), but what it keeps there does not persist. Before,
that was found only by reading debug lines; now the start logs one warning
naming each loss, and `dormouse check-config` prints the same line.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

# What the daemon writes under state_dir, and what a user loses without it.
LOST_WITHOUT_STATE = ("the prompt cache's disk tier (prompts saved at sleep: kv/)",
                      "the wake-time history that predicts wakes",
                      "measured memory footprints (the next start predicts again)",
                      "the state lock (two daemons could share the directory)")


def unwritable(directory: Path) -> str | None:
    """Why nothing can be written in directory (or, while it does not exist, in the
    nearest parent it would be created in), or None when it can be."""
    target = Path(directory)
    while not target.exists():
        if target.parent == target:
            return f"none of {directory}'s parents exists"
        target = target.parent
    if not target.is_dir():
        return f"{target} is not a directory"
    try:
        probe = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
        os.close(probe)
    except OSError as exc:
        return f"{target}: {exc.strerror or exc}"
    # access(2) answers for the real user and knows a read-only mount (EROFS).
    if not os.access(target, os.W_OK | os.X_OK):
        try:
            readonly = os.statvfs(target).f_flag & os.ST_RDONLY
        except OSError:
            readonly = False
        return f"{target} is on a read-only file system" if readonly else \
            f"{target} is not writable by this user ({os.strerror(errno.EACCES)})"
    return None


def state_dir_warning(directory: Path) -> str | None:
    """The one line to log and to print, or None when the state directory is usable."""
    why = unwritable(directory)
    if why is None:
        return None
    return (f"state directory {directory} cannot be written ({why}); the daemon serves, but nothing there "
            f"persists: " + "; ".join(LOST_WITHOUT_STATE) + ". Set state_dir (--state-dir) to a writable directory")
