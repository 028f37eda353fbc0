"""The shared disk tier (issue 31): the prompt cache's files on storage that
several replicas mount (`shared_cache_dir`: a ReadWriteMany volume, NFS, a
directory in tests), so that a conversation's next turn on another replica
restores its prompt instead of reading it again.

The files are daemon/model/kv_files.py's, sealed and checked as the own tier's
(read_sealed: never installed unchecked), in

    <shared_cache_dir>/kv/<key>/<hash of the tokens and scope>.kv

where <key> hashes the model's content (its size and the hash of its first
MiB: not its mtime, which each replica's copy has its own) and the context
layout (kv_cache.context_layout: the slot context, cache types, llama.cpp
version...). Only replicas whose saved bytes mean the same thing share a
directory, so a file there that does not match is broken, not another
replica's.

Several writers at once:
- each write goes to a temporary file of a random name, fsynced, then renamed
  over the entry's name: a reader sees the old file or the whole new one, and
  two replicas writing the same entry at once each rename a whole file (the
  last one stays; both hold the same tokens). A reader that opened the file
  before keeps reading the inode it opened.
- a replica's index is its own view of the directory, listed again when a
  lookup or a write finds the directory changed (its mtime: one stat) or
  REFRESH_SECONDS have passed (file systems whose mtime is coarse, NFS's
  attribute cache); only new names are read (their headers), at most
  MAX_NEW_HEADERS a time, so a lookup costs a stat, a refresh a listing.
- the budget (kv_cache_disk_bytes) is kept by every writer over the whole
  listing, least recently used first (a restore moves a file's mtime: the
  order is the same for every replica); a file another replica deletes under a
  read is a miss there ("unreadable": forgotten, never an error to the client).
- nothing is followed out of the directory (kv_files' O_NOFOLLOW walk below
  shared_cache_dir), and shared_cache_dir itself is never created: a volume
  that is not mounted is unreachable, not an empty local directory filled by
  mistake.

A replica that cannot reach the directory (gone, unmounted, refused) serves
from its own tier and tries again after RETRY_SECONDS; each failure is counted
(`unreachable`, `write_errors`), none reaches a request.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from daemon.model import kv_files as kv
from daemon.model.kv_files import FORMAT_VERSION, KvEntry, KvFileError, KvHeader, KvIndex, VerifiedSeals
from daemon.worker.kv_cache import best_indexed, held_by
from daemon.worker.reuse import ReuseRule

REFRESH_SECONDS = 2.0  # the directory is listed again at least this often while it is used, changed or not
RETRY_SECONDS = 5.0  # an unreachable directory is tried again after this long
STALE_TEMPORARY_SECONDS = 3600.0  # a temporary file this old is a writer that died mid-write: deleted
MAX_NEW_HEADERS = 4096  # headers read per refresh at most (a directory of a million files is listed, read in steps)


def content_fingerprint(path: str | Path) -> dict[str, Any]:
    """The model file by its content: size and the hash of its first MiB (kv_files' own, without the mtime)."""
    found = kv.model_fingerprint(path)
    return {"size": found["size"], "head": found["head"]}


def directory_key(model: dict[str, Any], layout: dict[str, Any]) -> str:
    text = json.dumps({"model": model, "layout": layout}, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=12, person=b"dormouse-share").hexdigest()


class SharedPrompts:
    """One model's files in shared_cache_dir, as this replica sees them. Any thread: the lock guards the index."""

    def __init__(self, base: Path, model_path: str, layout: dict[str, Any], rule: ReuseRule, budget: int,
                 clock=time.monotonic) -> None:
        self.base = Path(base)
        self.model = content_fingerprint(model_path)
        self.directory = self.base / "kv" / directory_key(self.model, layout)
        self.rule = rule
        self.budget = budget
        self.clock = clock
        self.lock = threading.Lock()
        self.index = KvIndex(self.directory, self.model, layout)
        self.index.cut_back = rule.replaces
        self.known: set[str] = set()  # names whose header was read (or refused)
        self.checked_at = float("-inf")
        self.down_until = float("-inf")
        self.stamp: tuple[int, int] | None = None  # the directory's (inode, mtime) at the last listing
        self.pending = False  # names left unread by the last listing (MAX_NEW_HEADERS)
        self.verified = VerifiedSeals()
        self.counts = {"unreachable": 0, "write_errors": 0, "files_written": 0, "written_bytes": 0, "evictions": 0,
                       "rejected": 0}
        self.reachable = True
        self.refresh(force=True)

    # -- the view of the directory ----------------------------------------------------

    def owns(self, entry: KvEntry) -> bool:
        return entry.path.parent == self.directory

    def _down(self, exc: BaseException) -> None:
        if self.reachable:
            self.counts["unreachable"] += 1
        self.reachable = False
        self.down_until = self.clock() + RETRY_SECONDS
        with self.lock:  # nothing of it is restored meanwhile
            for entry in list(self.index.entries):
                self.index.forget(entry)
            self.known.clear()

    def refresh(self, force: bool = False) -> bool:
        """List the directory again when it changed (or REFRESH_SECONDS passed, or forced) and read the
        new names' headers; forget the names gone. Whether it is reachable."""
        now = self.clock()
        if now < self.down_until:
            return False
        if not self.base.is_dir():  # not mounted, removed: never created here
            self._down(FileNotFoundError(errno.ENOENT, str(self.base)))
            return False
        try:
            info = os.stat(self.directory, follow_symlinks=False)
            stamp = (info.st_ino, info.st_mtime_ns)
        except OSError:
            stamp = None  # not made yet (made below), or refused there
        if not force and not self.pending and stamp is not None and stamp == self.stamp \
                and now - self.checked_at < REFRESH_SECONDS:
            return self.reachable
        self.checked_at, self.stamp = now, stamp
        try:
            with kv._directory(self.directory, create=True) as dir_fd:
                names = os.listdir(dir_fd)
                files = {n for n in names if n.endswith(kv.SUFFIX) and not n.startswith(".")}
                self._clean_temporaries(dir_fd, names)
                new = sorted(files - self.known)
                self.pending = len(new) > MAX_NEW_HEADERS
                found = [self._read_entry(dir_fd, name) for name in new[:MAX_NEW_HEADERS]]
        except OSError as exc:  # gone under us, refused (a link), unreadable
            self._down(exc)
            return False
        with self.lock:
            for entry in [e for e in self.index.entries if e.path.name not in files]:  # deleted by another replica
                self.index.forget(entry)
            self.known &= files
            for name, entry in found:
                self.known.add(name)
                if entry is not None:
                    self.index.entries.append(entry)
                    self.index._file(entry)
        self.reachable = True
        return True

    def _read_entry(self, dir_fd: int, name: str) -> tuple[str, KvEntry | None]:
        try:
            try:
                with kv._open_file(dir_fd, name) as f:
                    header, offset = kv._read_header(f, name)
                    info = os.fstat(f.fileno())
            except FileNotFoundError:
                return name, None  # deleted since the listing
            except OSError as exc:
                raise KvFileError("unreadable", f"{name}: {exc.strerror or exc}") from None
            if header.model != self.model or header.layout != self.index.layout:
                raise KvFileError("corrupt", f"{name}: another model or layout in this model's directory")
            if len(header.tokens) > int(self.index.layout.get("n_ctx_slot", len(header.tokens))):
                raise KvFileError("corrupt", f"{name}: more tokens than a slot holds")
        except KvFileError as exc:
            self.counts["rejected"] += 1
            if exc.reason != "unreadable":  # broken for every replica: deleted (the rename is atomic, so not half-written)
                try:
                    kv._unlink(dir_fd, name)
                except OSError:
                    pass
            return name, None
        return name, KvEntry(self.directory / name, header.tokens, header.state_bytes, offset, info.st_size,
                             info.st_mtime, header.scope)

    def _clean_temporaries(self, dir_fd: int, names: list[str]) -> None:
        for name in names:
            if name.startswith(".") and name.endswith(".tmp"):  # another writer's, maybe in progress: only if old
                try:
                    info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    if time.time() - info.st_mtime > STALE_TEMPORARY_SECONDS:
                        kv._unlink(dir_fd, name)
                except OSError:
                    pass

    # -- lookups and restores --------------------------------------------------------

    def best(self, tokens: list[int], scope: str = "") -> tuple[KvEntry | None, int]:
        if not self.refresh():
            return None, 0
        with self.lock:
            return best_indexed(self.rule, self.index.prefix, tokens, scope)

    def holds(self, tokens: list[int], scope: str = "") -> bool:
        """Held already, or unreachable (nothing to write there now)."""
        if not self.refresh():
            return True
        with self.lock:
            return held_by(self.rule, self.index.prefix, tokens, scope)

    def read(self, entry: KvEntry, out: np.ndarray | None = None) -> tuple[np.ndarray | None, str | None]:
        """(the checked state, None) or (None, why not). A file that fails its seal is deleted; one that is
        gone (another replica's eviction, the volume) is forgotten."""
        try:
            header, state = kv.read_sealed(entry.path, out, self.verified)
        except KvFileError as exc:
            self._reject(entry, exc.reason)
            return None, exc.reason
        if header.tokens != entry.tokens or header.scope != entry.scope:
            self._reject(entry, "corrupt")
            return None, "corrupt"
        return state, None

    def touch(self, entry: KvEntry) -> None:
        try:
            with self.lock:
                self.index.touch(entry)  # the mtime: least recently used goes first, for every replica
        except OSError:
            pass

    def _reject(self, entry: KvEntry, reason: str) -> None:
        with self.lock:
            if reason == "unreadable":
                self.index.forget(entry)
            else:
                try:
                    self.index.reject(entry.path, reason)
                except OSError:
                    self.index.forget(entry)
                self.counts["rejected"] += 1

    # -- writes ----------------------------------------------------------------------

    def write(self, tokens: list[int], state, scope: str = "") -> int:
        """Write one entry (sealed, atomically, under a temporary name of its own); the bytes written, 0 when it
        was held, cannot fit, or the directory cannot be reached. Never raises: failures are counted."""
        if len(state) > self.budget or self.holds(tokens, scope):
            return 0
        header = KvHeader(FORMAT_VERSION, self.model, self.index.layout, tokens, len(state), "", scope=scope)
        try:
            path = kv.write_file(self.directory, header, memoryview(state))
            _, offset = kv.read_header(path)
            with self.lock:
                self.index.add(path, tokens, header.state_bytes, offset, scope=scope,
                               supersede=self.rule.replaces(len(tokens)))
                self.known.add(path.name)
            self.refresh(force=True)  # the others' files count against the budget too
            with self.lock:
                self.counts["evictions"] += self.index.keep_within(self.budget)
            size = path.stat().st_size if path.exists() else 0
        except (OSError, KvFileError) as exc:
            self.counts["write_errors"] += 1
            if isinstance(exc, OSError) and not self.base.is_dir():
                self._down(exc)
            return 0
        self.counts["files_written"] += 1
        self.counts["written_bytes"] += size
        return size

    def summary(self) -> dict[str, Any]:
        with self.lock:
            return {"entries": len(self.index.entries), "bytes": self.index.disk_bytes,
                    "reachable": int(self.reachable), **self.counts}
