"""Saved prompt caches on disk: what a sleep writes and a wake may read back.

One file per saved slot prefix, in the model's own directory
(`state_dir/kv/<model id>/`), named by a hash of its tokens:

    b"DMKV" | u32 format version | u32 header length | header (msgpack) | state

The header carries the model's fingerprint (file size, mtime and a hash of
the GGUF's first MiB), the context parameters that decide the KV layout
(slot context, cache types, layers, embedding width, sliding-window mode),
the token list and a checksum of the state bytes. A file that does not
match the model or the layout, is truncated, or fails its checksum is
deleted and counted, never trusted. Files are written atomically (temporary
file, fsync, rename, fsync of the directory) and kept within a byte budget,
least recently used deleted first.

Pure Python, no llama.cpp: the worker writes and reads them, the daemon
reads their headers to show what is saved while the model sleeps.
"""

from __future__ import annotations

import hashlib
import os
import stat as stat_mode
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

MAGIC = b"DMKV"
FORMAT_VERSION = 1
PREFIX = struct.Struct("<4sII")
SUFFIX = ".kv"
MAX_HEADER_BYTES = 16 * 2**20  # a token list of a few million ids at most
HEAD_BYTES_HASHED = 2**20


class KvFileError(ValueError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # truncated, corrupt, other_model, other_layout, version, unreadable


Scalar = str | int | bool


class KvHeader(msgspec.Struct):
    version: int
    model: dict[str, Scalar]  # flat: a nested header is not one of ours
    layout: dict[str, Scalar]
    tokens: list[int]
    state_bytes: int
    checksum: str


def model_fingerprint(path: str | Path) -> dict[str, Any]:
    """Size, mtime and a hash of the first MiB: a replaced or edited GGUF never matches."""
    stat = os.stat(path)
    with open(path, "rb") as f:
        head = hashlib.blake2b(f.read(HEAD_BYTES_HASHED), digest_size=16).hexdigest()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "head": head}


def tokens_name(tokens: list[int]) -> str:
    return hashlib.blake2b(struct.pack(f"<{len(tokens)}i", *tokens), digest_size=16).hexdigest() + SUFFIX


def checksum(state: bytes) -> str:
    return hashlib.blake2b(state, digest_size=16).hexdigest()


def write_file(directory: Path, header: KvHeader, state: bytes) -> Path:
    """Atomically: a reader sees the old file, or the whole new one."""
    directory.mkdir(parents=True, exist_ok=True)
    body = msgspec.msgpack.encode(header)
    target = directory / tokens_name(header.tokens)
    temporary = directory / f".{target.name}.{os.getpid()}.tmp"
    try:
        with open(temporary, "wb") as f:
            f.write(PREFIX.pack(MAGIC, FORMAT_VERSION, len(body)))
            f.write(body)
            f.write(state)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return target


def _open_regular(path: Path):
    """A binary file object for a regular file. O_NONBLOCK: a FIFO planted as
    x.kv must not block the open; O_NOFOLLOW: no symlink is followed."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    if not stat_mode.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise KvFileError("corrupt", f"{path.name}: not a regular file")
    return os.fdopen(fd, "rb")


def read_header(path: Path) -> tuple[KvHeader, int]:
    """The header and the offset of the state bytes; checks everything but the checksum."""
    try:
        with _open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(PREFIX.size)
            if len(prefix) < PREFIX.size:
                raise KvFileError("truncated", f"{path.name}: shorter than its prefix")
            magic, version, header_len = PREFIX.unpack(prefix)
            if magic != MAGIC:
                raise KvFileError("corrupt", f"{path.name}: not a saved prompt cache")
            if version != FORMAT_VERSION:
                raise KvFileError("version", f"{path.name}: format {version}, this daemon reads {FORMAT_VERSION}")
            if header_len > MAX_HEADER_BYTES or PREFIX.size + header_len > size:
                raise KvFileError("truncated", f"{path.name}: header of {header_len} bytes past the end")
            raw = f.read(header_len)
    except OSError as exc:
        raise KvFileError("unreadable", f"{path.name}: {exc.strerror}") from None
    try:
        header = msgspec.msgpack.decode(raw, type=KvHeader)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise KvFileError("corrupt", f"{path.name}: header does not decode ({exc!r:.200})") from None
    offset = PREFIX.size + header_len
    if size != offset + header.state_bytes:
        raise KvFileError("truncated", f"{path.name}: {size - offset} state bytes, the header says {header.state_bytes}")
    return header, offset


def read_state(path: Path, header: KvHeader, offset: int) -> bytes:
    try:
        with _open_regular(path) as f:
            f.seek(offset)
            state = f.read(header.state_bytes)
    except OSError as exc:
        raise KvFileError("unreadable", f"{path.name}: {exc.strerror}") from None
    if len(state) != header.state_bytes:
        raise KvFileError("truncated", f"{path.name}: ends early")
    if checksum(state) != header.checksum:
        raise KvFileError("corrupt", f"{path.name}: the state fails its checksum")
    return state


@dataclass
class KvEntry:
    path: Path
    tokens: list[int]
    state_bytes: int
    offset: int
    file_bytes: int
    used_at: float  # mtime: written, or last restored


@dataclass
class KvIndex:
    """The saved prefixes of one model, as far as their headers tell."""

    directory: Path
    model: dict[str, Any]
    layout: dict[str, Any]
    entries: list[KvEntry] = field(default_factory=list)
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> files deleted

    @classmethod
    def scan(cls, directory: Path, model: dict[str, Any], layout: dict[str, Any], delete_bad: bool = True) -> "KvIndex":
        index = cls(directory, model, layout)
        if delete_bad and directory.is_dir():
            for leftover in directory.glob(".*.tmp"):  # a save killed mid-write
                leftover.unlink(missing_ok=True)
        for path in sorted(directory.glob("*" + SUFFIX)) if directory.is_dir() else []:
            try:
                header, offset = read_header(path)
                if header.model != model:
                    raise KvFileError("other_model", f"{path.name}: saved for another model file")
                if header.layout != layout:
                    raise KvFileError("other_layout", f"{path.name}: saved with other context parameters")
                if len(header.tokens) > int(layout.get("n_ctx_slot", len(header.tokens))):
                    raise KvFileError("corrupt", f"{path.name}: more tokens than a slot holds")
            except KvFileError as exc:
                if delete_bad:
                    index.reject(path, exc.reason)
                continue
            stat = path.stat()
            index.entries.append(KvEntry(path, header.tokens, header.state_bytes, offset, stat.st_size, stat.st_mtime))
        return index

    def reject(self, path: Path, reason: str) -> None:
        """Forget a file that is not to be trusted, and delete it if the directory lets us."""
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass  # a read-only state directory: never trusted all the same
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        self.entries = [e for e in self.entries if e.path != path]

    def longest_prefix_of(self, tokens: list[int], longer_than: int) -> KvEntry | None:
        """The saved entry whose tokens are the longest prefix of `tokens`, if longer than `longer_than`."""
        best = None
        for entry in self.entries:
            n = len(entry.tokens)
            if n > longer_than and n <= len(tokens) and (best is None or n > len(best.tokens)) \
                    and tokens[:n] == entry.tokens:
                best = entry
        return best

    def add(self, path: Path, tokens: list[int], state_bytes: int, offset: int) -> None:
        """A new file; older files it makes useless (a prefix of its tokens) go."""
        for entry in list(self.entries):
            if entry.path == path:  # rewritten in place
                self.entries.remove(entry)
            elif len(entry.tokens) < len(tokens) and tokens[:len(entry.tokens)] == entry.tokens:
                entry.path.unlink(missing_ok=True)  # superseded: the new file restores all it did and more
                self.entries.remove(entry)
        stat = path.stat()
        self.entries.append(KvEntry(path, tokens, state_bytes, offset, stat.st_size, stat.st_mtime))

    def touch(self, entry: KvEntry) -> None:
        os.utime(entry.path)
        entry.used_at = entry.path.stat().st_mtime

    @property
    def disk_bytes(self) -> int:
        return sum(e.file_bytes for e in self.entries)

    def keep_within(self, budget: int) -> int:
        """Delete the least recently used files until the rest fit; how many went."""
        gone = 0
        for entry in sorted(self.entries, key=lambda e: e.used_at):
            if self.disk_bytes <= budget:
                break
            entry.path.unlink(missing_ok=True)
            self.entries.remove(entry)
            gone += 1
        return gone

    def summary(self) -> dict[str, Any]:
        return {"files": len(self.entries), "bytes": self.disk_bytes,
                "prefixes": sorted((len(e.tokens) for e in self.entries), reverse=True)[:32]}


def describe_dir(directory: Path) -> dict[str, Any]:
    """What is saved, from the headers alone (the daemon cannot judge the
    layout without llama.cpp; the worker checks and deletes at its load)."""
    files, total, prefixes = 0, 0, []
    for path in directory.glob("*" + SUFFIX) if directory.is_dir() else []:
        try:
            header, _ = read_header(path)
            size = path.stat().st_size
        except (KvFileError, OSError):
            continue
        files += 1
        total += size
        prefixes.append(len(header.tokens))
    return {"files": files, "bytes": total, "prefixes": sorted(prefixes, reverse=True)[:32]}
