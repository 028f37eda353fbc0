"""Saved prompt caches on disk: what a sleep writes and a wake may read back.

One file per saved slot prefix, in the model's own directory
(`state_dir/kv/<model id>/`), named by a hash of its tokens:

    b"DMKV" | u32 format version | u32 header length | header (msgpack) | state

The header carries the model's fingerprint (file size, mtime and a hash of
the GGUF's first MiB), the context parameters that decide the KV layout
(slot context, cache types, layers, embedding width, sliding-window mode),
the token list and a checksum that seals the whole file: the header's
fields (its checksum left blank) and the state bytes (format 3: xxh3-128,
which checks at memory speed; format 2's blake2b, still read, cost three
quarters of a restore). A token list swapped
into another file's header fails it, and so does a file renamed to another
prompt's name (the name must be the hash of the tokens it holds). A file
that does not match the model or the layout, is truncated, is misnamed or
fails its checksum is deleted and counted, never trusted. Files are written
atomically (temporary file, fsync, rename, fsync of the directory) and kept
within a byte budget, least recently used deleted first.

The directory is the daemon's own, so nothing below state_dir is followed:
every operation walks from state_dir to `kv/<model id>` refusing a symbolic
link at either step (O_NOFOLLOW), then reads, renames and deletes relative
to that directory's descriptor, each file opened O_NOFOLLOW too. A link
planted there can never make the worker read or delete files elsewhere; a
refused directory raises UnsafeDirectory (an OSError), and the worker
serves without saved prompts for that model.

A restore reads a file with one open into a buffer the caller keeps
(read_sealed), and checks a file's seal once per process: a file whose
identity (device, inode, size, mtime and ctime, which no write leaves
unchanged once its clock tick has passed) matches one already checked is
not hashed again (VerifiedSeals).

Pure Python, no llama.cpp: the worker writes and reads them, the daemon
reads their headers to show what is saved while the model sleeps.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat as stat_mode
import struct
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import msgspec
import numpy as np
import xxhash

from daemon.model.prefix_index import INDEX_BLOCK, MAX_SHARERS, PrefixIndex, chain_keys  # noqa: F401 (re-exported)

MAGIC = b"DMKV"
# 2: the checksum seals the header too (1 covered the state only); files of 1 are deleted at the next scan.
# 3: the seal is xxh3-128 (2's blake2b hashed at ~0.5 GB/s, a file's read at several); files of 2 are still read.
FORMAT_VERSION = 3
READ_VERSIONS = (2, 3)
PREFIX = struct.Struct("<4sII")
SUFFIX = ".kv"
TOUCH_SECONDS = 60.0  # a restored file's mtime is moved at most this often (KvIndex.touch)
MAX_HEADER_BYTES = 16 * 2**20  # a token list of a few million ids at most
HEAD_BYTES_HASHED = 2**20
# state_dir/kv/<model id>: the two levels the daemon makes, so neither may be a link.
# (state_dir itself is the operator's: systemd's StateDirectory= with DynamicUser is one.)
OWN_LEVELS = 2
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class KvFileError(ValueError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # truncated, corrupt, other_model, other_layout, version, unreadable


class UnsafeDirectory(OSError):
    """The model's directory, or state_dir/kv, is a symbolic link or not a directory."""


Scalar = str | int | bool


class KvHeader(msgspec.Struct, omit_defaults=True):  # omit_defaults: a scope of "" encodes as before scopes
    version: int
    model: dict[str, Scalar]  # flat: a nested header is not one of ours
    layout: dict[str, Scalar]
    tokens: list[int]
    state_bytes: int
    checksum: str  # seal(): set by write_file, whatever the caller put here
    scope: str = ""  # scope_id() of the cache scope that wrote it ("" for the scope of requests with no key or salt)


def scope_id(scope: str) -> str:
    """What a file (and an entry) carries of its cache scope: a hash, so that
    a key's name never appears in a header or a file name. "" stays "" (the
    files written before scopes belong to it)."""
    if not scope:
        return ""
    return hashlib.blake2b(scope.encode("utf-8"), digest_size=16, person=b"dormouse-scope").hexdigest()


def model_fingerprint(path: str | Path) -> dict[str, Any]:
    """Size, mtime and a hash of the first MiB: a replaced or edited GGUF never matches."""
    info = os.stat(path)
    with open(path, "rb") as f:
        head = hashlib.blake2b(f.read(HEAD_BYTES_HASHED), digest_size=16).hexdigest()
    return {"size": info.st_size, "mtime_ns": info.st_mtime_ns, "head": head}


def tokens_name(tokens: list[int], scope: str = "") -> str:
    """The file name for a token list in a scope (scope_id(): a hash). Raises
    struct.error for ids outside int32."""
    digest = hashlib.blake2b(digest_size=16)
    if scope:
        digest.update(b"scope:" + scope.encode("ascii") + b"\0")
    digest.update(struct.pack(f"<{len(tokens)}i", *tokens))
    return digest.hexdigest() + SUFFIX


def checksum(state: bytes) -> str:
    """A digest of the state alone. Kept for callers that still fill
    KvHeader.checksum with it; write_file replaces it with seal()."""
    return hashlib.blake2b(state, digest_size=16).hexdigest()


def seal(header: KvHeader, state, version: int = FORMAT_VERSION) -> str:
    """The checksum a file of format `version` carries: its format, every header
    field (the checksum itself blank) and the state. Re-encoding a decoded header
    gives the bytes write_file encoded (msgspec keeps field and key order), so a
    reader needs nothing but the header and the state to check it. `state`: any
    buffer (bytes, memoryview, a uint8 numpy array). xxhash and hashlib hash
    without the GIL, so the decode thread runs on while a reader checks."""
    body = msgspec.msgpack.encode(msgspec.structs.replace(header, checksum=""))
    digest = xxhash.xxh3_128() if version >= 3 else hashlib.blake2b(digest_size=16)
    digest.update(PREFIX.pack(MAGIC, version, len(body)))
    digest.update(body)
    digest.update(state)
    return digest.hexdigest()


FileIdentity = tuple[int, int, int, int, int]  # (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)
# A file's timestamps move in clock ticks (a few ms, the kernel's coarse clock): a write in the same tick as
# the check could leave them as they were. A check counts only once its file's last change is this far past.
SETTLED_NS = 200_000_000


class VerifiedSeals:
    """The files whose seal this process has checked, by identity: a restore of
    the same file again reads it but does not hash it again. Any write to the
    file changes its ctime (and a replacement its inode), so a changed file is
    checked afresh; a file changed within its clock tick is never remembered
    (SETTLED_NS). Bounded: the oldest identities go first."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self.held: dict[FileIdentity, None] = {}

    def __contains__(self, identity: FileIdentity) -> bool:
        return identity in self.held

    def add(self, identity: FileIdentity, now_ns: int) -> None:
        if now_ns - identity[4] < SETTLED_NS or now_ns - identity[3] < SETTLED_NS:
            return  # changed too recently for its timestamps to show a change made next
        self.held[identity] = None
        while len(self.held) > self.limit:
            del self.held[next(iter(self.held))]


def identity_of(info: os.stat_result) -> FileIdentity:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


# -- the directory, never through a link --

def _split(directory: Path) -> tuple[Path, tuple[str, ...]]:
    """(the operator's part, the daemon's own last OWN_LEVELS names)."""
    parts = directory.parts
    own = min(OWN_LEVELS, len(parts) - (1 if directory.anchor else 0))
    return Path(*parts[:len(parts) - own]), parts[len(parts) - own:]


@contextmanager
def _directory(directory: Path, create: bool = False) -> Iterator[int]:
    """A descriptor on `directory` itself, walked to without following a link in
    the daemon's own levels. FileNotFoundError when absent (and not `create`),
    UnsafeDirectory when a level is a link or not a directory."""
    base, own = _split(directory)
    if create:
        base.mkdir(parents=True, exist_ok=True)
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in own:
            if name in (".", ".."):
                raise UnsafeDirectory(errno.EINVAL, f"{directory}: {name!r} in the prompt cache's path")
            if create:
                try:
                    os.mkdir(name, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                child = os.open(name, _DIRECTORY_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise UnsafeDirectory(exc.errno, f"{directory}: {name} is a symbolic link or not a directory; "
                                                 f"saved prompt caches are off for this model (nothing below "
                                                 f"state_dir is followed: move state_dir itself instead)") from None
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def _open_file(dir_fd: int, name: str) -> BinaryIO:
    """A regular file in the directory. O_NOFOLLOW: no link is followed;
    O_NONBLOCK: a FIFO planted as x.kv must not block the open."""
    fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    if not stat_mode.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise KvFileError("corrupt", f"{name}: not a regular file")
    return os.fdopen(fd, "rb")


def _unlink(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


# -- one file --

def write_file(directory: Path, header: KvHeader, state: bytes, name: str | None = None) -> Path:
    """Atomically: a reader sees the old file, or the whole new one. The header is
    sealed here (its checksum set to seal()). `name`: a name of the caller's
    (POST /slots save), else the hash of the tokens. Raises OSError, UnsafeDirectory included."""
    sealed = msgspec.structs.replace(header, checksum=seal(header, state))  # FORMAT_VERSION's seal
    body = msgspec.msgpack.encode(sealed)
    name = name or tokens_name(header.tokens, header.scope)
    # A name no other writer can have: replicas sharing a directory (shared_cache_dir) may run on two hosts
    # with the same pid, and two threads of one process may write the same entry.
    temporary = f".{name}.{uuid.uuid4().hex}.tmp"
    with _directory(directory, create=True) as dir_fd:
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dir_fd)
            with os.fdopen(fd, "wb") as f:
                f.write(PREFIX.pack(MAGIC, FORMAT_VERSION, len(body)))
                f.write(body)
                f.write(state)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        finally:
            _unlink(dir_fd, temporary)
        os.fsync(dir_fd)  # the rename itself survives a crash
    return directory / name


def _read_header(f: BinaryIO, name: str, named: bool = True) -> tuple[KvHeader, int]:
    header, offset, _ = _read_versioned_header(f, name, named)
    return header, offset


def _read_versioned_header(f: BinaryIO, name: str, named: bool = True,
                           size: int | None = None) -> tuple[KvHeader, int, int]:
    """(header, offset of the state, the file's format version)."""
    size = os.fstat(f.fileno()).st_size if size is None else size
    prefix = f.read(PREFIX.size)
    if len(prefix) < PREFIX.size:
        raise KvFileError("truncated", f"{name}: shorter than its prefix")
    magic, version, header_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise KvFileError("corrupt", f"{name}: not a saved prompt cache")
    if version not in READ_VERSIONS:
        raise KvFileError("version", f"{name}: format {version}, this daemon reads {READ_VERSIONS}")
    if header_len > MAX_HEADER_BYTES or PREFIX.size + header_len > size:
        raise KvFileError("truncated", f"{name}: header of {header_len} bytes past the end")
    raw = f.read(header_len)
    try:
        header = msgspec.msgpack.decode(raw, type=KvHeader)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise KvFileError("corrupt", f"{name}: header does not decode ({exc!r:.200})") from None
    offset = PREFIX.size + header_len
    if size != offset + header.state_bytes:
        raise KvFileError("truncated", f"{name}: {size - offset} state bytes, the header says {header.state_bytes}")
    try:
        own = tokens_name(header.tokens, header.scope)
    except (struct.error, UnicodeEncodeError):
        raise KvFileError("corrupt", f"{name}: token ids outside int32") from None
    if named and own != name:
        raise KvFileError("corrupt", f"{name}: holds the tokens of {own}, not its own")
    return header, offset, version


def read_header(path: Path, named: bool = True) -> tuple[KvHeader, int]:
    """The header and the offset of the state bytes; checks everything but the
    checksum. named=False: a file named by the caller (a slot file), not by its tokens."""
    try:
        with _directory(path.parent) as dir_fd, _open_file(dir_fd, path.name) as f:
            return _read_header(f, path.name, named)
    except OSError as exc:
        raise KvFileError("unreadable", f"{path.name}: {exc.strerror or exc}") from None


def read_state(path: Path, header: KvHeader, offset: int, named: bool = True) -> bytes:
    """The state bytes, if the file still holds `header` (read again here: the
    file may have been replaced since) and its seal holds over header and state."""
    try:
        with _directory(path.parent) as dir_fd, _open_file(dir_fd, path.name) as f:
            found, found_offset, version = _read_versioned_header(f, path.name, named)
            state = f.read(found.state_bytes)  # the file is at the state's offset
    except OSError as exc:
        raise KvFileError("unreadable", f"{path.name}: {exc.strerror or exc}") from None
    if found != header or found_offset != offset:
        raise KvFileError("corrupt", f"{path.name}: changed since its header was read")
    if len(state) != header.state_bytes:
        raise KvFileError("truncated", f"{path.name}: ends early")
    if seal(found, state, version) != found.checksum:
        raise KvFileError("corrupt", f"{path.name}: header or state fails its checksum")
    return state


def read_sealed(path: Path, out: np.ndarray | None = None, verified: VerifiedSeals | None = None,
                named: bool = True) -> tuple[KvHeader, np.ndarray]:
    """A whole file with one open: its header (every check of read_header) and
    its state, read straight into `out` (a uint8 array, when large enough: a
    buffer used again has its pages in place) and checked against the seal,
    unless `verified` holds this very file (same identity) checked before.
    The state returned is a view of `out` or a new array. Raises KvFileError
    (unreadable, truncated, corrupt, version); never returns bytes unchecked."""
    try:
        with _directory(path.parent) as dir_fd, _open_file(dir_fd, path.name) as f:
            info = os.fstat(f.fileno())
            header, _, version = _read_versioned_header(f, path.name, named, info.st_size)
            n = header.state_bytes
            state = out[:n] if out is not None and len(out) >= n else np.empty(n, np.uint8)
            got = 0
            while got < n:  # the file is at the state's offset
                read = f.readinto(memoryview(state)[got:])
                if not read:
                    break
                got += read
    except OSError as exc:
        raise KvFileError("unreadable", f"{path.name}: {exc.strerror or exc}") from None
    if got != n:
        raise KvFileError("truncated", f"{path.name}: ends early")
    identity = identity_of(info)
    if verified is None or identity not in verified:
        if seal(header, state, version) != header.checksum:
            raise KvFileError("corrupt", f"{path.name}: header or state fails its checksum")
        if verified is not None:
            verified.add(identity, time.time_ns())
    return header, state


# -- the model's files --

@dataclass
class KvEntry:
    path: Path
    tokens: list[int]
    state_bytes: int
    offset: int
    file_bytes: int
    used_at: float  # mtime: written, or last restored
    scope: str = ""  # scope_id() of the scope that wrote it


@dataclass
class KvIndex:
    """The saved prefixes of one model, as far as their headers tell."""

    directory: Path
    model: dict[str, Any]
    layout: dict[str, Any]
    entries: list[KvEntry] = field(default_factory=list)
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> files deleted
    cut_back: Any = None  # n -> whether a state of n tokens may be cut back (full attention); None: always
    _prefix: Any = None  # the PrefixIndex of the entries, built at its first use, kept in step after

    @property
    def prefix(self) -> "PrefixIndex":
        if self._prefix is None:
            self._prefix = PrefixIndex()
            for entry in self.entries:
                self._file(entry)
        return self._prefix

    def _file(self, entry: KvEntry) -> None:
        if self._prefix is not None:
            self._prefix.add(entry, self.cut_back(len(entry.tokens)) if self.cut_back else True)

    def _unfile(self, entry: KvEntry) -> None:
        if self._prefix is not None:
            self._prefix.remove(entry)

    def forget(self, entry: KvEntry) -> None:
        """Drop an entry from the index (its file left as it is)."""
        self.entries = [e for e in self.entries if e is not entry]
        self._unfile(entry)

    @classmethod
    def scan(cls, directory: Path, model: dict[str, Any], layout: dict[str, Any], delete_bad: bool = True) -> "KvIndex":
        """Raises UnsafeDirectory (an OSError) for a directory behind a link; an absent one is empty."""
        index = cls(directory, model, layout)
        try:
            with _directory(directory) as dir_fd:
                index._scan(dir_fd, delete_bad)
        except FileNotFoundError:
            pass
        return index

    def _scan(self, dir_fd: int, delete_bad: bool) -> None:
        names = sorted(os.listdir(dir_fd))
        if delete_bad:
            for name in names:
                if name.startswith(".") and name.endswith(".tmp"):  # a save killed mid-write
                    try:
                        _unlink(dir_fd, name)
                    except OSError:  # a directory of that name, a read-only state directory
                        pass
        for name in names:
            if not name.endswith(SUFFIX) or name.startswith("."):
                continue
            try:
                try:
                    with _open_file(dir_fd, name) as f:
                        header, offset = _read_header(f, name)
                        info = os.fstat(f.fileno())
                except OSError as exc:
                    raise KvFileError("unreadable", f"{name}: {exc.strerror or exc}") from None
                if header.model != self.model:
                    raise KvFileError("other_model", f"{name}: saved for another model file")
                if header.layout != self.layout:
                    raise KvFileError("other_layout", f"{name}: saved with other context parameters")
                if len(header.tokens) > int(self.layout.get("n_ctx_slot", len(header.tokens))):
                    raise KvFileError("corrupt", f"{name}: more tokens than a slot holds")
            except KvFileError as exc:
                if delete_bad:
                    self._reject_in(dir_fd, name, exc.reason)
                continue
            self.entries.append(KvEntry(self.directory / name, header.tokens, header.state_bytes, offset,
                                        info.st_size, info.st_mtime, header.scope))

    def reject(self, path: Path, reason: str) -> None:
        """Forget a file that is not to be trusted, and delete it if the directory lets us."""
        try:
            with _directory(path.parent) as dir_fd:
                _unlink(dir_fd, path.name)
        except OSError:
            pass  # a read-only or refused state directory: never trusted all the same
        self._count(path, reason)

    def _reject_in(self, dir_fd: int, name: str, reason: str) -> None:
        try:
            _unlink(dir_fd, name)
        except OSError:
            pass
        self._count(self.directory / name, reason)

    def _count(self, path: Path, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        for entry in [e for e in self.entries if e.path == path]:
            self.forget(entry)

    def longest_prefix_of(self, tokens: list[int], longer_than: int, scope: str = "") -> KvEntry | None:
        """The saved entry of `scope` (a scope_id) whose tokens are the longest prefix of `tokens`, if longer
        than `longer_than`."""
        best = None
        for entry in self.entries:
            n = len(entry.tokens)
            if n > longer_than and n <= len(tokens) and (best is None or n > len(best.tokens)) \
                    and entry.scope == scope and tokens[:n] == entry.tokens:
                best = entry
        return best

    def add(self, path: Path, tokens: list[int], state_bytes: int, offset: int, scope: str = "",
            supersede: bool = True) -> None:
        """A new file. supersede: older files of its scope that it makes useless (a prefix of its
        tokens) go; the caller says False when the new state cannot be cut back to them (a window
        or a recurrent state: the shorter file is a checkpoint that still serves a regenerate)."""
        with _directory(self.directory) as dir_fd:
            for entry in list(self.entries):
                if entry.path == path:  # rewritten in place
                    self.forget(entry)
                elif supersede and entry.scope == scope and len(entry.tokens) < len(tokens) \
                        and tokens[:len(entry.tokens)] == entry.tokens:
                    _unlink(dir_fd, entry.path.name)  # superseded: the new file restores all it did and more
                    self.forget(entry)
            info = os.stat(path.name, dir_fd=dir_fd, follow_symlinks=False)
        entry = KvEntry(path, tokens, state_bytes, offset, info.st_size, info.st_mtime, scope)
        self.entries.append(entry)
        self._file(entry)

    def touch(self, entry: KvEntry) -> None:
        """Mark an entry used (least recently used files go first). The file's mtime
        (what a restart orders by) moves at most once a TOUCH_SECONDS: a utime changes
        the ctime too, and with it the identity VerifiedSeals knows the file by."""
        now = time.time()
        with _directory(self.directory) as dir_fd:  # walked each time: a directory turned link raises here
            if now - entry.used_at >= TOUCH_SECONDS:
                os.utime(entry.path.name, dir_fd=dir_fd, follow_symlinks=False)
        entry.used_at = now

    @property
    def disk_bytes(self) -> int:
        return sum(e.file_bytes for e in self.entries)

    def keep_within(self, budget: int) -> int:
        """Delete the least recently used files until the rest fit; how many went.
        A directory that cannot be opened (gone, refused) deletes nothing: never raises."""
        gone = 0
        if self.disk_bytes <= budget:
            return gone
        try:
            with _directory(self.directory) as dir_fd:
                for entry in sorted(self.entries, key=lambda e: e.used_at):
                    if self.disk_bytes <= budget:
                        break
                    _unlink(dir_fd, entry.path.name)
                    self.forget(entry)
                    gone += 1
        except OSError:
            pass
        return gone

    def summary(self) -> dict[str, Any]:
        return {"files": len(self.entries), "bytes": self.disk_bytes,
                "prefixes": sorted((len(e.tokens) for e in self.entries), reverse=True)[:32]}


def describe_dir(directory: Path) -> dict[str, Any]:
    """What is saved, from the headers alone (the daemon cannot judge the
    layout without llama.cpp; the worker checks and deletes at its load).
    A directory behind a link shows nothing: the worker will not use it."""
    files, total, prefixes = 0, 0, []
    try:
        with _directory(directory) as dir_fd:
            for name in os.listdir(dir_fd):
                if not name.endswith(SUFFIX) or name.startswith("."):
                    continue
                try:
                    with _open_file(dir_fd, name) as f:
                        header, _ = _read_header(f, name)
                        size = os.fstat(f.fileno()).st_size
                except (KvFileError, OSError):
                    continue
                files += 1
                total += size
                prefixes.append(len(header.tokens))
    except OSError:
        pass
    return {"files": files, "bytes": total, "prefixes": sorted(prefixes, reverse=True)[:32]}
