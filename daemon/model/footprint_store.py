"""Measured footprints, kept in the state directory for the next start.

After a load the worker reports what each component holds; those bytes beat
any prediction, so they are kept under a key that names exactly what was
loaded: each file's path, size and mtime, and every setting that changes
the bytes. A changed file or setting makes a new key, never a stale hit.

One small JSON file, written atomically (temporary file, fsync, rename,
fsync of the directory) and bounded (the least recently put entries go
first). A file that does not read or does not have the expected shape (no
NaN or Infinity, sizes non-negative integers up to MAX_COMPONENT_BYTES, at
most MAX_COMPONENTS per entry, keys no longer than MAX_KEY_CHARS) is set
aside (renamed to footprints.json.bad, a log line naming it and why) and the
next put starts a new one: a measurement is an optimisation, never a reason
to fail (nor to hang: a FIFO or a device planted as the file is not read).
A value of the right shape is still only a claim: the server lets it stand
only near the prediction (daemon/model/footprint.py's plausible()).

`read_regular`, `decode_json` and `set_aside` are the state directory's
reading rules, shared with daemon/model/wake_prediction.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any

FILE_NAME = "footprints.json"
FORMAT_VERSION = 1
MAX_ENTRIES = 256
MAX_FILE_BYTES = 4 * 1024 * 1024  # 256 entries take about 100 KB
MAX_COMPONENTS = 16  # the worker reports model, context, draft_model, draft_context, mmproj, ...
MAX_COMPONENT_NAME = 64
MAX_COMPONENT_BYTES = 1 << 50  # 1 PiB: no device holds more
MAX_KEY_CHARS = 128  # footprint_key is 64 hex digits


def _file_identity(path: str | Path | None) -> str | None:
    """Raises OSError when the file cannot be stat'ed: there is nothing to load then."""
    if path is None:
        return None
    resolved = Path(path).resolve()
    info = resolved.stat()
    return f"{resolved}:{info.st_size}:{info.st_mtime_ns}"


def footprint_key(model_path: str | Path, ctx_size: int, parallel: int, cache_type_k: str = "f16",
                  cache_type_v: str = "f16", model_draft: str | Path | None = None, mmproj: str | Path | None = None,
                  n_gpu_layers: int = -1, *, batch_size: int = 512, draft_max: int = 16, embeddings: bool = False,
                  kv_unified: bool = False) -> str:
    """A stable key for one load configuration (batch_size, draft_max and
    embeddings size the compute and output buffers, so they are part of it too)."""
    identity = {
        "model": _file_identity(model_path), "model_draft": _file_identity(model_draft),
        "mmproj": _file_identity(mmproj), "ctx_size": ctx_size, "parallel": parallel,
        "cache_type_k": cache_type_k.lower(), "cache_type_v": cache_type_v.lower(), "n_gpu_layers": n_gpu_layers,
        "batch_size": batch_size, "draft_max": draft_max if model_draft else None,
        **({"embeddings": True} if embeddings else {}),  # absent when off: keys measured before stay valid
        **({"kv_unified": True} if kv_unified else {}),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def _valid_components(value: Any) -> bool:
    return isinstance(value, dict) and len(value) <= MAX_COMPONENTS and all(
        isinstance(name, str) and 0 < len(name) <= MAX_COMPONENT_NAME
        and isinstance(size, int) and not isinstance(size, bool) and 0 <= size <= MAX_COMPONENT_BYTES
        for name, size in value.items())


class FootprintStore:
    """The file is read once, at first use, and rewritten on every put: one daemon
    owns its state directory, and a put happens once per load."""

    def __init__(self, state_dir: Path, logger: Any = None, max_entries: int = MAX_ENTRIES) -> None:
        self.path = Path(state_dir) / FILE_NAME
        self.log = logger
        self.max_entries = max_entries
        self._entries: dict[str, dict[str, int]] | None = None  # put order: oldest first
        self._lock = threading.Lock()

    def get(self, key: str) -> dict[str, int] | None:
        with self._lock:
            components = self._loaded().get(key)
            return dict(components) if components is not None else None

    def put(self, key: str, components: dict[str, int]) -> None:
        if not _valid_components(components):
            raise ValueError(f"components must map names to non-negative integers, got {components!r}")
        with self._lock:
            entries = self._loaded()
            entries.pop(key, None)
            entries[key] = dict(components)
            while len(entries) > self.max_entries:
                del entries[next(iter(entries))]
            self._write(entries)

    # -- the file --

    def _warn(self, event: str, **fields: Any) -> None:
        if self.log is not None:
            self.log.warning(event, path=str(self.path), **fields)

    def _loaded(self) -> dict[str, dict[str, int]]:
        if self._entries is None:
            self._entries = self._read()
        return self._entries

    def _read(self) -> dict[str, dict[str, int]]:
        try:
            raw = read_regular(self.path, MAX_FILE_BYTES + 1)
            if len(raw) > MAX_FILE_BYTES:
                raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
            data = decode_json(raw)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:  # ValueError: not a regular file, bad JSON or UTF-8, NaN, nesting
            set_aside(self.path, str(exc) or type(exc).__name__, self.log, "footprint_store.unreadable")
            return {}
        entries = data.get("entries") if isinstance(data, dict) and data.get("version") == FORMAT_VERSION else None
        if not isinstance(entries, dict) or not all(isinstance(k, str) and 0 < len(k) <= MAX_KEY_CHARS
                                                    and _valid_components(v) for k, v in entries.items()):
            set_aside(self.path, f"expected version {FORMAT_VERSION} with entries of at most {MAX_COMPONENTS} "
                                 f"sizes of 0 to {MAX_COMPONENT_BYTES} bytes", self.log, "footprint_store.wrong_shape")
            return {}
        return dict(list(entries.items())[-self.max_entries:])

    def _write(self, entries: dict[str, dict[str, int]]) -> None:
        payload = json.dumps({"version": FORMAT_VERSION, "entries": entries}, indent=1).encode()
        tmp_name = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp_name = tempfile.mkstemp(dir=self.path.parent, prefix=f".{FILE_NAME}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_name, self.path)
            tmp_name = None
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)  # the rename itself survives a crash
            finally:
                os.close(dir_fd)
        except OSError as exc:
            self._warn("footprint_store.write_failed", error=str(exc))
        finally:
            if tmp_name is not None:
                try:
                    os.unlink(tmp_name)
                except OSError:
                    pass


def read_regular(path: Path, limit: int) -> bytes:
    """Up to `limit` bytes of a regular file. O_NONBLOCK: opening a FIFO must not
    wait for a writer (the daemon reads this before it serves anything)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        return f.read(limit)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def decode_json(raw: bytes) -> Any:
    """JSON as the daemon wrote it: NaN, Infinity and -Infinity (which Python's json reads by
    default) and absurd nesting are ValueErrors, as bad JSON or UTF-8 is."""
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deep") from None


def set_aside(path: Path, why: str, log: Any, event: str) -> Path | None:
    """A state file that failed its checks: renamed to NAME.bad (an operator may look at it;
    the daemon writes a new one), else deleted; either way a warning (`event`) names it and
    why. A directory in its place is left alone (the next write fails and says so). The
    renamed path, or None when nothing was moved."""
    bad = path.with_name(path.name + ".bad")
    kept: Path | None = None
    if path.is_symlink() or not path.is_dir():
        try:
            os.replace(path, bad)  # whatever it is (a FIFO too): the next write puts a regular file there
            kept = bad
        except OSError:
            try:
                os.unlink(path)
            except OSError:
                pass
    if log is not None:
        log.warning(event, path=str(path), error=why[:200], moved_to=str(kept) if kept else None)
    return kept
