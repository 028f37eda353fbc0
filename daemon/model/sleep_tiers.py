"""The controller's side of the sleep tiers and of the predicted wake.

A mixin of Controller (daemon/model/controller.py), kept apart so that the
controller reads as the owner task it is. It carries out the state
machine's tier commands and answers three questions about a wake:

- drowsy: Doze asks the worker to save its prompt caches and free its
  contexts (supervisor.doze); Rouse asks it to create them again.
- light: before the worker lets go of the weights, a Keeper maps the
  model's files and keeps their pages in the page cache (refreshed every
  keeper_refresh_seconds); ReleaseKeeper lets go (the deep tier).
- How long would a wake take now (`predict_wake`: bytes, tier, how much of
  the files is in the page cache, this host's past wakes), and may this
  request wait that long (`too_slow`: else 503 at once, with Retry-After)?

Two bounds, two waits (`too_slow`):
- `wake_timeout` bounds the wait for a wake: from acceptance until a worker
  takes the request (daemon/model/jobs.py Job.next). Every request waiting
  for a wake is handed to the worker when it is ready, however many there
  are, so the wait behind other requests for a slot is no part of it: the
  predicted wake (plus, in a fleet, the other loads this one waits for) is
  what is compared with wake_timeout.
- `X-Dormouse-Max-Wait` is the client's own bound on its time to first
  token: the predicted wake plus the wait for a free slot behind the
  requests already accepted. It refuses a request early; without it, a
  queue never does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from typing import Any, Callable

from daemon.model.jobs import JobFailure
from daemon.model.keeper import Keeper, resident_bytes
from daemon.model.supervisor import LoadFailed
from daemon.model.wake_prediction import Prediction
from statemachine import DozeCompleted, Event, ServerState, WorkerLoadFailed, WorkerReady

S = ServerState
RESIDENCY_MAX_AGE = 2.0  # seconds a page-cache measurement of the files stands (mincore costs ms per GB)
WEIGHT_PHASES = ("model", "draft_model", "mmproj")  # the phases that read the files
SERVICE_SMOOTHING = 0.2  # weight of the newest request in the running mean of request seconds


class SleepTiers:
    """Mixed into Controller: uses its settings, machine, supervisor, metrics, log and model files."""

    def _init_tiers(self) -> None:
        self.keeper: Keeper | None = None
        self._keeper_task: asyncio.Task | None = None
        self._residency: tuple[float, int, int] | None = None  # (when, bytes, cold bytes) of the model's files
        self.wake_prediction: Prediction | None = None  # what the wake under way (or the last) was predicted to take
        self._wake_started: float | None = None
        self._wake_mark: tuple[Any, float] | None = None  # (state, state_since) when the wake under way began
        # Set by the fleet (daemon/fleet/owner.py): seconds a load of this model would wait for the
        # fleet's other loads (one at a time), predicted from this host's wakes. None: no fleet wait.
        self.fleet_wait: Callable[[], float] | None = None
        self.last_doze: dict[str, Any] | None = None
        self.service_seconds = 0.0  # running mean of a request's prompt + generation seconds (the queue's pace)

    # -- the files a wake reads --

    @property
    def model_files(self) -> list[str]:
        s = self.settings
        return [str(f) for f in (self.model_path, s.model_draft, s.mmproj) if f]

    def _files_in_cache(self, max_age: float = RESIDENCY_MAX_AGE) -> tuple[int, int]:
        """(bytes of the model's files, bytes of them not in the page cache), measured at most max_age ago."""
        now = time.monotonic()
        if self._residency is None or now - self._residency[0] > max_age:
            total = cold = 0
            for path in self.model_files:
                resident, size = resident_bytes(path)
                total, cold = total + size, cold + size - resident
            self._residency = (now, total, cold)
        return self._residency[1], self._residency[2]

    # -- the prediction --

    @property
    def sleep_tier(self) -> str | None:
        """The tier the model sleeps in (drowsy, light, deep); None while awake."""
        return self.machine.tier if self.state is not S.READY else None

    def predict_wake(self) -> Prediction | None:
        """What a wake from here would take; None while awake. During a wake: what is left of it."""
        state = self.state
        if state is S.READY:
            return None
        if state in (S.WAKING, S.LOADING, S.ROUSING) and self._wake_under_way():
            left = max(0.0, self.wake_prediction.seconds - (time.monotonic() - self._wake_started))
            return dataclasses.replace(self.wake_prediction, seconds=left)
        if state in (S.WAKING, S.LOADING):  # not begun yet (the fleet's admission): the whole wake is ahead
            tier = "light" if self.machine.keeper_held else "deep"
        else:
            tier = self.machine.tier or "deep"
        if tier == "drowsy":
            return self._predict_rouse()
        nbytes, cold = self._files_in_cache()
        return self.wake_history.predict(self.model_id, tier, nbytes, cold)

    def _wake_under_way(self) -> bool:
        """The wake of this very state began (_begin_wake_prediction), not an earlier one (a wake
        that failed, or one still waiting for the fleet's admission: its prediction is stale)."""
        return (self.wake_prediction is not None and self._wake_started is not None
                and self._wake_mark == (self.state, getattr(self, "state_since", None)))

    def _predict_rouse(self) -> Prediction:
        """A drowsy wake creates the contexts again: before this model's first one, the contexts'
        phases of its latest load (this host, this model, these settings) are the estimate."""
        contexts = None
        if self.last_wake and self.last_wake.get("tier") != "drowsy":
            contexts = sum(ph["seconds"] for ph in self.last_wake.get("phases", [])
                           if ph["name"] in ("context", "draft_context")) or None
        return self.wake_history.predict(self.model_id, "drowsy", 0, 0, contexts_seconds=contexts)

    def queue_wait(self) -> float:
        """Seconds a new request would wait for a slot behind those already accepted (counted
        from the jobs, so a burst whose arrivals the owner task has not read yet counts whole)."""
        ahead = max(len(self.jobs), len(self.machine.in_flight) + len(self.machine.waiting))
        parallel = max(self.settings.parallel, 1)
        if ahead < parallel:
            return 0.0
        return ((ahead - parallel) // parallel + 1) * self.service_seconds

    def _fleet_seconds(self) -> float:
        if self.fleet_wait is None:
            return 0.0
        try:
            seconds = float(self.fleet_wait())
        except Exception as exc:  # noqa: BLE001 - a prediction never fails a request
            self.log.warning("wake_prediction.fleet_wait_failed", error=repr(exc))
            return 0.0
        return seconds if math.isfinite(seconds) and seconds > 0 else 0.0

    def too_slow(self, max_wait: float | None) -> JobFailure | None:
        """503 at once when this request cannot be served within what it may wait.

        - The wake (predicted, plus the fleet's other loads ahead of it) against wake_timeout,
          which bounds only the wait for a worker to take the request: every request waiting
          for a wake is handed over at once when it is ready, so the queue behind them is no
          part of it. Without the client's own bound, only a prediction from this host's
          wakes refuses: a default guess never turns a request away.
        - With X-Dormouse-Max-Wait (the client's time to first token): the wake against it
          too, and the wake plus the wait for a slot behind the requests already accepted."""
        if self.state in (S.READY, S.FAILED, S.STOPPING) or self.closed:
            return None
        try:
            prediction = self.predict_wake()
        except Exception as exc:  # noqa: BLE001 - a prediction is an optimisation: never a 500, never no wake
            self.log.exception("wake_prediction.failed", error=repr(exc))
            return None
        if prediction is None or not math.isfinite(prediction.seconds) \
                or (max_wait is None and prediction.basis != "measured"):
            return None
        timeout = self.settings.wake_timeout
        fleet = self._fleet_seconds()
        wake = prediction.seconds + fleet
        behind = f" plus {fleet:.1f}s for the fleet's other loads" if fleet else ""
        what = (f"its wake is predicted to take {prediction.seconds:.1f}s{behind} "
                f"({prediction.basis})")
        limit = timeout if max_wait is None else min(max_wait, timeout)
        if wake > limit:
            bound = "X-Dormouse-Max-Wait" if max_wait is not None and max_wait < timeout else "wake_timeout"
            wait = wake
        else:
            if max_wait is None:
                return None
            queue = self.queue_wait()
            if wake + queue <= max_wait:
                return None
            what = (f"its first token is predicted in {wake + queue:.1f}s: {what}, then {queue:.1f}s for a slot "
                    f"behind the requests already accepted")
            limit, bound, wait = max_wait, "X-Dormouse-Max-Wait, time to first token", wake + queue
        self.metrics.wake_refusals.inc()
        return JobFailure(503, "wake_too_slow",
                          f"model {self.model_id} is {self.state} ({prediction.tier} tier): {what}, more than the "
                          f"{limit:g}s this request may wait ({bound}); the wake has started", max(1.0, math.ceil(wait)))

    def _begin_wake_prediction(self, tier: str, nbytes: int, cold: int) -> None:
        self.wake_prediction = self._predict_rouse() if tier == "drowsy" else \
            self.wake_history.predict(self.model_id, tier, nbytes, cold)
        self._wake_started = time.monotonic()
        self._wake_mark = (self.state, getattr(self, "state_since", None))

    def _record_wake(self, record: dict[str, Any], tier: str, nbytes: int, cold: int) -> None:
        """The measured wake beside its prediction, and a sample for the next ones."""
        predicted = self.wake_prediction
        record["tier"] = tier
        record["bytes"], record["cold_bytes"] = nbytes, cold
        record["predicted"] = predicted.as_dict() if predicted else None
        if predicted is not None:
            record["prediction_error_seconds"] = record["seconds"] - predicted.seconds
            self.metrics.wake_prediction_error_seconds.labels(tier=tier).observe(abs(record["prediction_error_seconds"]))
        weights = sum(ph["seconds"] for ph in record["phases"] if ph["name"] in WEIGHT_PHASES)
        # A wake for a request has no warm-up and no wait for the fleet: the sample is the load alone.
        extra = sum(ph["seconds"] for ph in record["phases"] if ph["name"] == "warmup") \
            + record.get("admission_seconds", 0.0)
        if tier == "drowsy" or nbytes > 0:  # a file that is not there (a test's fake) teaches nothing
            self.wake_history.record(self.model_id, tier, nbytes, cold, record["seconds"] - extra, weights)
        self._residency = None

    def gauge_tier(self) -> str | None:
        """The tier dormouse_sleep_tier says: awake only while READY; a resting state's tier (on
        the way down: the tier it goes to; rousing: drowsy); waking: the tier it wakes from (the
        keeper still holds a light model's pages); None (every tier 0) while it is neither awake
        nor asleep (starting, a first load, failed, stopping)."""
        state = self.state
        if state is S.READY:
            return "awake"
        if state is S.WAKING:
            return "light" if self.machine.keeper_held else "deep"
        return self.machine.tier

    def tier_gauges(self) -> None:
        self.metrics.set_tier(self.gauge_tier())
        prediction = self.predict_wake()
        self.metrics.wake_predicted_seconds.set(prediction.seconds if prediction else 0.0)

    def note_service(self, seconds: float) -> None:
        self.service_seconds += SERVICE_SMOOTHING * (seconds - self.service_seconds)

    # -- light: the keeper --

    async def _open_keeper(self) -> None:
        if self.keeper is not None:
            return
        self.keeper = Keeper(self.model_files, self.settings.keeper_mlock_bytes).open()
        self.metrics.keeper_bytes.labels(kind="mapped").set(self.keeper.bytes)
        self.metrics.keeper_bytes.labels(kind="locked").set(self.keeper.locked_bytes)
        if self.keeper.errors:
            self.log.warning("keeper.errors", errors=self.keeper.errors)
        self._keeper_task = asyncio.create_task(self._refresh_keeper(self.keeper), name=f"keeper-{self.model_id}")

    async def _refresh_keeper(self, keeper: Keeper) -> None:
        """Read back what the page cache lost, now (after the worker's exit) and every keeper_refresh_seconds."""
        while True:
            await asyncio.sleep(0.05)  # the worker's teardown first: its own pages are the warmest
            read = await asyncio.to_thread(keeper.refresh)
            self._residency = None  # measured again next time: the pages it read are in the cache now
            if read:
                self.log.info("keeper.refreshed", bytes_read=read)
            await asyncio.sleep(self.settings.keeper_refresh_seconds)

    def _close_keeper(self) -> None:
        if self._keeper_task is not None:
            self._keeper_task.cancel()
            self._keeper_task = None
        if self.keeper is not None:
            self.keeper.close()
            self.keeper = None
        self.metrics.keeper_bytes.clear()

    # -- drowsy: doze and rouse --

    async def _doze(self) -> Event | None:
        start = time.perf_counter()
        report = await self.supervisor.doze(timeout=self.settings.teardown_timeout)
        if report is None:
            return None  # it died or was killed: its exit (WorkerExited) is the outcome
        self.last_doze = {"at": time.time(), "seconds": time.perf_counter() - start,
                          "phases": [{"name": ph.name, "seconds": ph.seconds, "freed_bytes": ph.bytes,
                                      "skipped": ph.skipped} for ph in report.phases],
                          "worker_rss_before": report.rss_before, "worker_rss_after": report.rss_after,
                          "kv_saved_files": report.kv_saved_files, "kv_save_errors": report.kv_save_errors}
        self.slots = []
        self.metrics.set_slots([])
        for component in ("context", "draft_context"):
            for device in (self.model_info.get("memory_by_device") or {}).get(component, {}):
                self.metrics.memory_bytes.labels(device=device, component=component).set(0)
        self.log.info("doze.done", seconds=round(self.last_doze["seconds"], 4), kv_saved_files=report.kv_saved_files)
        self._spawn(self._refresh_kv_saved())
        return DozeCompleted({"seconds": self.last_doze["seconds"]})

    @staticmethod
    def _doze_crashed(exc: Exception) -> None:
        return None  # _transition killed the worker: its exit is reported

    async def _rouse(self, reason: str) -> Event:
        start = time.perf_counter()
        self._begin_wake_prediction("drowsy", 0, 0)
        try:
            ready = await self.supervisor.rouse(timeout=self.settings.load_timeout)
        except LoadFailed as exc:
            self.metrics.load_failures.inc()
            self.log.error("rouse.failed", reason=str(exc))
            return WorkerLoadFailed(f"rouse failed: {exc}")
        record = {"reason": reason, "at": time.time(), "seconds": time.perf_counter() - start, "prespawned": True,
                  "worker_pid": self.supervisor.current.pid if self.supervisor.current else None,
                  "phases": [{"name": ph.name, "seconds": ph.seconds, "bytes": ph.bytes} for ph in ready.phases]}
        self._record_wake(record, "drowsy", 0, 0)
        self.last_wake = record
        self.model_info = ready.model_info
        self.n_ctx_slot = ready.n_ctx_slot
        from daemon import protocol as p

        self.slots = [p.SlotInfo(i, "idle") for i in range(ready.n_slots)]
        self.metrics.set_slots([s.state for s in self.slots])  # the worker reports slots only when one changes
        self.metrics.observe_wake(record, ready.model_info.get("memory_by_device") or {})
        self.log.info("rouse.done", reason=reason, seconds=round(record["seconds"], 4))
        return WorkerReady(ready.n_slots, ready.model_info)

    # -- what /props shows --

    def tier_props(self) -> dict[str, Any]:
        s = self.settings
        prediction = self.predict_wake()
        return {
            "tier": self.sleep_tier,
            "sleep_tiers": {"drowsy_after": s.drowsy_after, "sleep_idle_seconds": s.sleep_idle_seconds,
                            "deep_after": s.deep_after, "load_mode": s.load_mode,
                            "keeper_mlock_bytes": s.keeper_mlock_bytes},
            "wake_prediction": prediction.as_dict() if prediction else None,
            "wake_history": self.wake_history.figures(self.model_id),
            "keeper": self.keeper.describe() if self.keeper else None,
            "last_doze": self.last_doze,
        }
