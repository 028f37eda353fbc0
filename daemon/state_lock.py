"""One daemon per state directory.

Two daemons on one state_dir (two instances on one host, a unit started
twice) would rewrite each other's saved prompt caches and footprints.json.
The daemon holds an exclusive flock on `state_dir/dormouse.lock` for its
whole life, with its pid written in the file so that a refused daemon can
name the one in the way.

flock belongs to the open file, so the kernel drops it when the holder
exits however it exits (SIGKILL, OOM kill): a lock file left by a dead
daemon holds a stale pid and no lock, and the next daemon takes it. The
file is never deleted: deleting it would let a third daemon lock a new
file while a second still holds the old one. The descriptor is not
inherited (Python opens files non-inheritable), so a worker process that
outlives the daemon does not keep the directory locked.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

LOCK_NAME = "dormouse.lock"
_MAX_PID_BYTES = 32


class StateDirInUse(RuntimeError):
    """Another live process holds the state directory; the message names it."""

    def __init__(self, directory: Path, pid: int | None) -> None:
        holder = f"pid {pid}" if pid is not None else "a process whose pid is not written yet"
        super().__init__(f"state directory {directory} is in use by another dormouse daemon ({holder}); stop it, "
                         f"or give each daemon its own state_dir")
        self.directory = directory
        self.pid = pid


class StateDirLock:
    """Held from acquire() until release() or the process's exit."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> "StateDirLock":
        """Take the lock or raise StateDirInUse; OSError when the directory cannot be made or opened."""
        self.directory.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: a symlink planted as the lock file must not make us truncate what it points to.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_pid(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StateDirInUse(self.directory, holder) from None
            raise
        # Ours now: whatever pid the file held was a dead process's.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    def __enter__(self) -> "StateDirLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        raw = os.pread(fd, _MAX_PID_BYTES, 0)
    except OSError:
        return None
    text = raw.decode("ascii", errors="replace").strip()
    return int(text) if text.isdigit() else None
