"""Ollama's /api/pull answered by the code of `dormouse pull` (daemon/model/hub.py).

Ollama streams a pull as JSON objects: {"status": "pulling manifest"}, then
for each layer {"status": "pulling <digest[:12]>", "digest": "sha256:...",
"total": N, "completed": M} as the bytes arrive, then "verifying sha256
digest", "writing manifest", "success"; a failure is one {"error": "..."}
object, the last. A model by name here is a GGUF (and its projector) of a
Hugging Face repository, which is what Ollama's own `hf.co/owner/repo:QUANT`
names mean, so each file plays a layer's part: its digest is the hub's sha256
of it (a large file's ETag).

huggingface_hub downloads synchronously; the download runs on a thread and
its tqdm progress comes back through a queue, so the generator yields as the
bytes arrive. Leaving the generator early (the client went away) cancels the
download at its next chunk (huggingface_hub removes its partial file: this
version downloads into a temporary file of its own and does not resume).
"""

from __future__ import annotations

import hashlib
import io
import queue
import threading
from pathlib import Path
from typing import Any, Iterator

from daemon.model.hub import HubError, HubFile, HubName, _download, hub_cache_dir, lookup

OLLAMA_DEFAULT_TAG = "latest"  # Ollama's name for "no tag": here, the repository's default quant


class _Cancelled(Exception):
    """Raised inside the download thread when the reader is gone."""


def _progress_class(events: queue.Queue, cancelled: threading.Event) -> type:
    from tqdm import tqdm

    class QueueProgress(tqdm):
        """huggingface_hub's tqdm_class: (bytes done, total) into the queue; draws nothing."""

        def __init__(self, *args, **kwargs) -> None:
            kwargs["file"] = io.StringIO()  # tqdm counts, and draws into nothing kept
            kwargs["disable"] = False
            kwargs.pop("name", None)  # huggingface_hub's own tqdm takes a name; plain tqdm refuses it
            super().__init__(*args, **kwargs)
            events.put(("progress", (int(self.n), int(self.total or 0))))

        def update(self, n: float = 1) -> bool | None:
            if cancelled.is_set():
                raise _Cancelled()
            shown = super().update(n)
            events.put(("progress", (int(self.n), int(self.total or 0))))
            return shown

    return QueueProgress


def _fetch(name: HubName, filename: str, endpoint: str, cache: Path, progress: type, events: queue.Queue) -> None:
    try:
        local = _download(name, filename, "main", endpoint, cache, None, False, progress)
    except HubError as exc:
        events.put(("error", str(exc)))
    except _Cancelled:
        events.put(("error", "cancelled"))
    except Exception as exc:  # a thread's exception would be lost: the reader must hear of it
        events.put(("error", f"downloading {filename} failed: {type(exc).__name__}: {str(exc)[:200]}"))
    else:
        events.put(("done", local))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _layer(entry: HubFile) -> dict[str, Any]:
    label = entry.digest or hashlib.sha256(entry.filename.encode()).hexdigest()  # a small file has no sha256 ETag
    shown: dict[str, Any] = {"status": f"pulling {label[:12]}"}
    if entry.digest:
        shown["digest"] = f"sha256:{entry.digest}"
    return shown


def pull_stream(name: Any, settings) -> Iterator[dict[str, Any]]:
    """Pull `name` (hf.co/owner/repo[:QUANT], or owner/repo[:QUANT]; ':latest' is the default quant) into the
    daemon's cache (hub_cache_dir(state_dir)), the files `serve` and `dormouse pull` use, yielding Ollama's
    progress objects."""
    from huggingface_hub import constants

    from daemon.model.files import ModelFileError, check_gguf, state_dir

    if isinstance(name, str) and name.strip().lower().endswith(":" + OLLAMA_DEFAULT_TAG):
        name = name.strip()[:-len(OLLAMA_DEFAULT_TAG) - 1]
    cache = hub_cache_dir(state_dir(settings))
    yield {"status": "pulling manifest"}
    try:
        plan = lookup(name, cache_dir=cache)
    except HubError as exc:
        yield {"error": f"pull model manifest: {exc}"}
        return
    endpoint = constants.ENDPOINT.rstrip("/")
    fetched: list[tuple[Path, str | None]] = []  # downloaded now, with the digest the hub gave
    for entry in plan.files:
        shown = _layer(entry)
        if entry.cached is not None:
            size = entry.cached.stat().st_size
            yield {**shown, "total": size, "completed": size}
            continue
        events: queue.Queue = queue.Queue()
        cancelled = threading.Event()
        worker = threading.Thread(target=_fetch, name="ollama-pull", daemon=True,
                                  args=(plan.name, entry.filename, endpoint, cache,
                                        _progress_class(events, cancelled), events))
        worker.start()
        total, last = entry.size or 0, -1
        try:
            while True:
                kind, value = events.get()
                if kind == "error":
                    yield {"error": str(value)}
                    return
                if kind == "done":
                    size = Path(value).stat().st_size
                    fetched.append((Path(value), entry.digest))
                    if last != size:
                        yield {**shown, "total": size, "completed": size}
                    break
                done, total = value[0], value[1] or total
                if done != last:
                    last = done
                    yield {**shown, "total": total, "completed": done}
        finally:
            cancelled.set()  # a reader that left mid-file: the thread stops at its next chunk
    yield {"status": "verifying sha256 digest"}
    try:
        for path, digest in fetched:
            check_gguf(path, "pulled")
            if digest is not None and _sha256(path) != digest:
                yield {"error": f"{path.name}: its sha256 is not the hub's {digest}: pull it again"}
                return
    except ModelFileError as exc:
        yield {"error": str(exc)}
        return
    yield {"status": "writing manifest"}
    yield {"status": "success"}
