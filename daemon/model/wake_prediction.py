"""How long a wake will take, predicted before it starts from this host's past wakes.

A wake from the light or deep tier costs a fixed part (spawn or take a
worker, backend, contexts, handshake) and a part that grows with the bytes
the weights phases read: the bytes already in the page cache at the rate
the cache gives, the rest at the rate the disk gives. Which bytes are
cached is measured, not guessed (mincore, daemon/model/keeper.py), so one
formula covers light (all cached), deep with a warm cache and deep with a
cold one:

    seconds = fixed + cached_bytes / cache_rate + cold_bytes / disk_rate

A drowsy wake reads no weights: it is a context creation, predicted by
the median of this model's past ones.

Each wake is a sample (tier, bytes, cold bytes, seconds, weights seconds);
the rates and fixed costs are medians over the latest samples, so one slow
wake (a busy disk) moves nothing. Samples are kept in the state directory
beside the footprints (wake_history.json, written atomically, bounded).
What is read back is checked whole before any of it is used: a bounded
regular file, JSON without NaN or Infinity, the expected shape, finite
numbers in sane ranges (`_why_bad`). A file that fails is set aside
(renamed to wake_history.json.bad, a log line says which file and why) and
the history starts empty: a prediction is an optimisation, never a reason to
fail a request. Until a host has samples the defaults below stand, and the
prediction says so (`basis`).
"""

from __future__ import annotations

import contextvars
import json
import math
import os
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon.model.footprint_store import decode_json, read_regular, set_aside

FILE_NAME = "wake_history.json"
MAX_SAMPLES = 256
MAX_FILE_BYTES = 1024 * 1024
TIERS = ("drowsy", "light", "deep")
MAX_MODEL_CHARS = 256
MAX_SAMPLE_BYTES = 1 << 50  # 1 PiB: no model file is larger
MAX_SAMPLE_SECONDS = 86400.0  # a wake longer than a day is no measurement
RECENT = 16  # the medians are over this many latest samples
WARM_FRACTION = 0.05  # at most this much of the file read from disk: a sample of the cache's rate
COLD_FRACTION = 0.5  # at least this much: a sample of the disk's rate
MIN_RATE_BYTES = 64 * 2**20  # another model's sample says a rate for this one only from this size on

# Before any sample: modest rates, so a first prediction errs on the slow side.
DEFAULT_CACHE_RATE = 2e9  # bytes/s from the page cache into the worker
DEFAULT_DISK_RATE = 2e8  # bytes/s from disk
DEFAULT_FIXED_SECONDS = 0.5  # spawn, backend, contexts
DEFAULT_DROWSY_SECONDS = 0.1  # a context creation


@dataclass(frozen=True)
class Prediction:
    seconds: float
    tier: str
    bytes: int
    cold_bytes: int
    basis: str  # "measured" (from this host's samples), "load" (a first rouse: the load's contexts) or "default"

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 4), "tier": self.tier, "bytes": self.bytes,
                "cold_bytes": self.cold_bytes, "basis": self.basis}


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v > 0 and math.isfinite(v)]
    return statistics.median(values) if values else None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _why_bad(sample: Any) -> str | None:
    """Why a sample read back cannot be used (None: it can)."""
    if not isinstance(sample, dict):
        return f"a sample is a {type(sample).__name__}, not an object"
    model, tier = sample.get("model"), sample.get("tier")
    if not isinstance(model, str) or not 0 < len(model) <= MAX_MODEL_CHARS:
        return "a sample's model is not a name"
    if tier not in TIERS:
        return f"a sample's tier is not one of {', '.join(TIERS)}"
    nbytes, cold, seconds, weights = (sample.get(k) for k in ("bytes", "cold_bytes", "seconds", "weights_seconds"))
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (nbytes, cold)):
        return "a sample's bytes or cold_bytes is not an integer"
    if not 0 <= cold <= nbytes <= MAX_SAMPLE_BYTES:
        return f"a sample's bytes ({nbytes}) or cold_bytes ({cold}) is out of range"
    if not _number(seconds) or not _number(weights):
        return "a sample's seconds or weights_seconds is not a finite number"
    if not 0 < seconds <= MAX_SAMPLE_SECONDS or not 0 <= weights <= seconds:
        return f"a sample's seconds ({seconds}) or weights_seconds ({weights}) is out of range"
    if "at" in sample and not _number(sample["at"]):
        return "a sample's time is not a finite number"
    return None


class WakeHistory:
    """The samples of one state directory (shared by every model of the daemon: `history_for`)."""

    def __init__(self, directory: Path, logger: Any = None) -> None:
        self.path = Path(directory) / FILE_NAME
        self.log = logger
        self.samples: list[dict[str, Any]] = self._read()
        self._lock = threading.Lock()

    def _read(self) -> list[dict[str, Any]]:
        """Every sample of the file, or none: a file that fails any check is set aside whole."""
        try:
            raw = read_regular(self.path, MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            return self._set_aside(str(exc) or type(exc).__name__)
        if len(raw) > MAX_FILE_BYTES:
            return self._set_aside(f"larger than {MAX_FILE_BYTES} bytes")
        try:
            data = decode_json(raw)
        except ValueError as exc:
            return self._set_aside(f"not JSON: {exc}")
        samples = data.get("samples") if isinstance(data, dict) else None
        if not isinstance(samples, list):
            return self._set_aside("no list of samples")
        if len(samples) > MAX_SAMPLES:
            return self._set_aside(f"{len(samples)} samples, more than {MAX_SAMPLES}")
        for sample in samples:
            why = _why_bad(sample)
            if why is not None:
                return self._set_aside(why)
        return [{k: sample[k] for k in ("model", "tier", "bytes", "cold_bytes", "seconds", "weights_seconds")}
                | {"at": float(sample.get("at", 0.0))} for sample in samples]

    def _set_aside(self, why: str) -> list[dict[str, Any]]:
        set_aside(self.path, why, self.log, "wake_history.set_aside")
        return []

    def record(self, model: str, tier: str, nbytes: int, cold_bytes: int, seconds: float,
               weights_seconds: float) -> None:
        sample = {"model": model, "tier": tier, "bytes": int(nbytes), "cold_bytes": int(cold_bytes),
                  "seconds": float(seconds), "weights_seconds": float(weights_seconds), "at": time.time()}
        if _why_bad(sample) is not None:  # e.g. a clock step: what could not be read back is not kept
            return
        with self._lock:
            self.samples = (self.samples + [sample])[-MAX_SAMPLES:]
            self._write()

    def _write(self) -> None:
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".wake_history.", dir=self.path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump({"version": 1, "samples": self.samples}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            tmp = None
        except OSError as exc:  # a prediction is an optimisation, never a reason to fail
            if self.log is not None:
                self.log.warning("wake_history.write_failed", path=str(self.path), error=str(exc))
        finally:
            if tmp is not None:  # a full or failing disk: no temporary file left behind
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    # -- the fitted host figures --

    def _recent(self, tiers: tuple[str, ...], model: str | None = None) -> list[dict[str, Any]]:
        return [s for s in self.samples if s["tier"] in tiers and (model is None or s["model"] == model)][-RECENT:]

    def _rate(self, tiers: tuple[str, ...], model: str | None, keep: Any, read: Any, seconds: Any) -> float | None:
        """Bytes per second over the latest samples of `tiers` that `keep` accepts: the median of
        the model's own where it has some (the same file, so the same fixed part in every one);
        else the median over every model's large enough to measure a rate (a small file's weights
        phase is mostly fixed cost: 0.5 MB in 0.05 s is no 10 MB/s page cache)."""
        def pairs(samples: list[dict[str, Any]]) -> list[tuple[float, float]]:
            found = [(read(s), seconds(s)) for s in samples if keep(s)]
            return [(b, t) for b, t in found if b > 0 and t > 0]

        if model is not None:
            own = pairs(self._recent(tiers, model))
            if own:
                return _median([b / t for b, t in own])
        return _median([b / t for b, t in pairs(self._recent(tiers)) if b >= MIN_RATE_BYTES])

    def cache_rate(self, model: str | None = None) -> float | None:
        return self._rate(("light", "deep"), model, lambda s: s["cold_bytes"] <= WARM_FRACTION * s["bytes"],
                          lambda s: s["bytes"] - s["cold_bytes"], lambda s: s["weights_seconds"])

    def disk_rate(self, model: str | None = None) -> float | None:
        cache = self.cache_rate(model) or DEFAULT_CACHE_RATE
        return self._rate(("deep",), model, lambda s: s["cold_bytes"] >= COLD_FRACTION * s["bytes"],
                          lambda s: s["cold_bytes"],
                          lambda s: s["weights_seconds"] - (s["bytes"] - s["cold_bytes"]) / cache)

    def fixed_seconds(self, model: str, tier: str | None = None) -> float | None:
        """The part of a wake that is not the weights phase: the tier's own first (a light tier's
        spare worker has imported the engine already, a deep one's imports it during the wake),
        then the model's, then any model's."""
        own_tier = tier if tier in ("light", "deep") else None
        samples = ((self._recent((own_tier,), model) if own_tier else []) or self._recent(("light", "deep"), model)
                   or (self._recent((own_tier,)) if own_tier else []) or self._recent(("light", "deep")))
        return _median([s["seconds"] - s["weights_seconds"] for s in samples])

    def figures(self, model: str | None = None) -> dict[str, Any]:
        """The rates a prediction for `model` uses (None: this host's, over the samples of every
        model whose files are at least MIN_RATE_BYTES)."""
        return {"cache_bytes_per_second": self.cache_rate(model), "disk_bytes_per_second": self.disk_rate(model),
                "samples": len(self.samples), "file": str(self.path)}

    def predict(self, model: str, tier: str, nbytes: int, cold_bytes: int,
                contexts_seconds: float | None = None) -> Prediction:
        """contexts_seconds: for a drowsy wake, what creating this model's contexts took at its
        latest load, the estimate until the model has drowsy samples of its own."""
        if tier == "drowsy":
            seconds = _median([s["seconds"] for s in self._recent(("drowsy",), model)])
            if seconds:
                return Prediction(seconds, tier, 0, 0, "measured")
            # Not "measured": a load's first contexts may pay one-time setup a rouse does not, and
            # only a prediction from the tier's own wakes refuses a request (SleepTiers.too_slow).
            if contexts_seconds:
                return Prediction(contexts_seconds, tier, 0, 0, "load")
            return Prediction(DEFAULT_DROWSY_SECONDS, tier, 0, 0, "default")
        cache, disk, fixed = self.cache_rate(model), self.disk_rate(model), self.fixed_seconds(model, tier)
        cold_bytes = min(max(cold_bytes, 0), nbytes)
        seconds = ((fixed if fixed is not None else DEFAULT_FIXED_SECONDS)
                   + (nbytes - cold_bytes) / (cache or DEFAULT_CACHE_RATE)
                   + cold_bytes / (disk or DEFAULT_DISK_RATE))
        # Measured only where each figure this wake needs came from samples.
        measured = cache is not None and fixed is not None and (cold_bytes == 0 or disk is not None)
        if not math.isfinite(seconds) or seconds < 0:  # cannot be from checked samples; never a 500 if it were
            return Prediction(DEFAULT_FIXED_SECONDS, tier, nbytes, cold_bytes, "default")
        return Prediction(seconds, tier, nbytes, cold_bytes, "measured" if measured else "default")


# The client's bound on its wait for a wake (X-Dormouse-Max-Wait), for the request being handled:
# set by the HTTP layer (daemon/http/cold_start.py), read by Controller._accept. None: wake_timeout.
requested_max_wait: contextvars.ContextVar[float | None] = contextvars.ContextVar("requested_max_wait", default=None)

_histories: dict[Path, WakeHistory] = {}
_histories_lock = threading.Lock()


def history_for(directory: Path) -> WakeHistory:
    """One history per state directory, however many models share it."""
    key = Path(directory).resolve()
    with _histories_lock:
        if key not in _histories:
            from daemon.logs import get_logger

            _histories[key] = WakeHistory(key, get_logger())
        return _histories[key]
