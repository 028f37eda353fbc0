"""The controller's start and stop tasks: load a worker, tear it down, see its memory come back.

A mixin of Controller (daemon/model/controller.py), kept apart so that the
controller reads as the owner task it is: it decides events and carries out
commands, and for StartWorker, StopWorker, Doze and Rouse it spawns one of
the tasks here (through `_transition`, which turns whatever a task raises
into its one outcome event). Loading waits for the fleet's admission first,
then builds the worker's ModelSpec from the settings and records the wake;
a stop records the sleep and what the worker saved. After every worker exit
(a sleep, a crash, a failed load) `_check_memory_returned` checks that the
process and its GPU memory are gone. The spare worker spawned ahead of the
next wake is chosen here too (lean for a deep sleep, importing for a light one).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

import psutil

from config.models import model_dir_name
from daemon import protocol as p
from daemon.model.kv_files import describe_dir
from daemon.model.load_progress import progress_lines
from daemon.model.reports import phase_seconds, sleep_record, wake_record
from daemon.model.supervisor import LoadFailed
from statemachine import Event, LoadNotAdmitted, ServerState, SleepCompleted, WorkerLoadFailed, WorkerReady

# Worker load errors (p.Error.code) that the same configuration always repeats.
PERMANENT_LOAD_ERRORS = frozenset({"chat_template"})


class WorkerLifecycle:
    """Mixed into Controller: uses its settings, machine, supervisor, metrics, log, nvml and tasks."""

    async def _transition(self, work: Awaitable[Event | None], on_crash: Callable[[Exception], Event]) -> None:
        """Run a start or stop task and post its one outcome. Whatever it raises
        becomes an outcome too, so LOADING, WAKING and UNLOADING always end."""
        try:
            event = await work
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug or an OS limit; the state machine must hear of it
            self.metrics.transition_errors.inc()
            self.log.exception("controller.transition_failed", error=repr(exc))
            await self.supervisor.kill_current(f"its start or stop failed: {exc!r}")
            event = on_crash(exc)
        if event is not None:
            self.post(event)

    @staticmethod
    def _start_crashed(exc: Exception) -> Event:
        return WorkerLoadFailed(f"internal error while starting the worker: {exc!r}")

    def _stop_crashed(self, exc: Exception) -> Event:
        self._forget_worker()
        return SleepCompleted({"clean": False})

    async def _admit(self, reason: str) -> LoadNotAdmitted | None:
        """Wait for the fleet's word; a stop calls the wait off."""
        if self.admission is None:
            return None
        self._admission_wait = asyncio.ensure_future(self.admission(reason))
        try:
            await asyncio.wait({self._admission_wait})
        finally:
            if not self._admission_wait.done():
                self._admission_wait.cancel()  # this task itself was cancelled
        if self._admission_wait.cancelled():
            return LoadNotAdmitted("the load was called off", "cancelled")
        return self._admission_wait.result()

    async def _start_worker(self, reason: str) -> Event:
        start = time.perf_counter()
        refusal = await self._admit(reason)
        self.last_refusal = refusal
        if refusal is not None:
            self.log.warning("load.not_admitted", reason=refusal.reason, code=refusal.code)
            return refusal
        admitted_after = time.perf_counter() - start
        tier = "light" if self.machine.keeper_held else "deep"
        nbytes, cold = await asyncio.to_thread(self._files_in_cache, 0.0)
        self._begin_wake_prediction(tier, nbytes, cold)
        # A multi-GB load takes minutes on a slow disk: one line now, so the log does not go quiet.
        on_gpu = self.nvml.available and self.settings.n_gpu_layers != 0
        self.log.info("load.begin", reason=reason, file=self.model_path, bytes=nbytes, bytes_from_disk=cold,
                      device=("GPU" if self.settings.n_gpu_layers == -1 else f"GPU ({self.settings.n_gpu_layers} "
                              "layers), CPU") if on_gpu else "CPU",
                      expected_seconds=round(self.wake_prediction.seconds, 1) if self.wake_prediction else None)
        try:
            # A wake that a request triggered skips the warm-up decode: that request's
            # own prompt pays the same lazy initialisation, so a warm-up would only
            # delay its first token (measured by bench/resume.py).
            spec = self._model_spec(warmup=self.settings.warmup and reason != "request")
            expected = round(self.wake_prediction.seconds, 1) if self.wake_prediction else None
            async with progress_lines(self.log, expected, self._bytes_from_disk_left):
                result = await self.supervisor.start(spec, timeout=self.settings.load_timeout)
        except LoadFailed as exc:
            self.metrics.load_failures.inc()
            self.log.error("load.failed", reason=str(exc))
            if exc.pid is not None:
                self._spawn(self._check_memory_returned(exc.pid, "load_failed"))
            return WorkerLoadFailed(str(exc), permanent=exc.code in PERMANENT_LOAD_ERRORS)
        ready = result.ready
        self.last_wake = wake_record(result, reason, time.perf_counter() - start)
        self.last_wake["admission_seconds"] = admitted_after
        self._record_wake(self.last_wake, tier, nbytes, cold)
        self.model_info = ready.model_info
        for reason, count in ready.kv_rejected.items():
            self.metrics.kv_rejected.labels(reason=reason).inc(count)
        if ready.kv_rejected:
            self.log.warning("kv_cache.rejected_files", during="load", files=dict(ready.kv_rejected))
        self._spawn(self._refresh_kv_saved())  # the worker may have deleted files; the wake does not wait
        self.n_ctx_slot = ready.n_ctx_slot
        self.slots = [p.SlotInfo(i, "idle") for i in range(ready.n_slots)]
        self.metrics.set_slots([s.state for s in self.slots])  # the worker reports slots only when one changes
        self.metrics.observe_wake(self.last_wake, ready.model_info.get("memory_by_device") or {})
        self.log.info("wake.done", reason=reason, seconds=round(self.last_wake["seconds"], 4), file=self.model_path,
                      prespawned=result.prespawned, phases=phase_seconds(self.last_wake), pid=result.worker.pid)
        self._ready_at = time.monotonic()
        return WorkerReady(ready.n_slots, ready.model_info)

    async def _bytes_from_disk_left(self) -> int:
        """For load.progress: the model's bytes not yet in the page cache, measured now, off the loop."""
        return (await asyncio.to_thread(self._files_in_cache, 0.0))[1]

    async def _stop_worker(self, reason: str, tier: str = "deep") -> Event | None:
        if self._admission_wait is not None and not self._admission_wait.done():
            self._admission_wait.cancel()  # no worker yet: the start task reports LoadNotAdmitted
            return None
        start = time.perf_counter()
        if tier == "light":  # before the worker lets go of the pages, so that none leaves the page cache
            await self._open_keeper()
        result = await self.supervisor.stop(timeout=self.settings.teardown_timeout)
        if result.aborted_load or result.already_gone:
            return None  # the start task, or the unexpected-exit report, is that worker's one outcome
        seconds = time.perf_counter() - start
        self.last_sleep = sleep_record(result, reason, seconds, await self._check_memory_returned(result.pid, "sleep"))
        self.last_sleep["tier"] = tier
        self.metrics.observe_sleep(self.last_sleep)
        self._forget_worker()
        self.log.info("sleep.done", reason=reason, seconds=round(seconds, 4), clean=self.last_sleep["clean"],
                      phases=phase_seconds(self.last_sleep, 5), pid=result.pid)
        if result.report is not None:
            self.metrics.observe_write_errors(result.report.kv_save_errors)  # cumulative: only the new ones count
        if result.report is not None and result.report.kv_save_errors:
            self.log.warning("sleep.kv_save_failed", files=result.report.kv_save_errors)
        await self._refresh_kv_saved()
        return SleepCompleted({"clean": self.last_sleep["clean"]})

    async def _refresh_kv_saved(self) -> None:
        """What prompt caches are on disk, for /props and the gauge (headers only, off the loop)."""
        self.kv_saved = await asyncio.to_thread(describe_dir, self.kv_dir)
        self.metrics.set_disk_tier(self.kv_saved)

    def _forget_worker(self) -> None:
        """No worker holds the model any more: nothing of its slots or memory is shown."""
        self._ready_at = None
        self.slots = []
        self.metrics.set_slots([])
        self.metrics.memory_bytes.clear()

    def _spare_imports(self) -> tuple[str, ...]:
        """A light-tier model's spare worker imports the engine's modules before it says Hello, so
        that its wake pays for the weights and the contexts only (issue 19: light within 1.05x a
        bare load); a deep sleep's spare stays lean (numpy alone is ~26 MiB): `_lean_spare`."""
        if self.state is not ServerState.LIGHT_SLEEP:
            return ()
        s = self.settings
        return p.engine_modules(s.embeddings, s.model_draft is not None, s.mmproj is not None)

    async def _prespawn(self) -> None:
        await self.supervisor.prespawn(self._spare_imports())
        if self.state is ServerState.SLEEPING:  # deep by the time it said Hello
            await self._lean_spare()

    async def _lean_spare(self) -> None:
        """The model went from light to deep sleep with no worker exiting: its spare, spawned
        for the light tier, is swapped for one that imported nothing more than a worker must."""
        if await self.supervisor.drop_importing_spare() and self.state is ServerState.SLEEPING:
            await self.supervisor.prespawn()

    def _model_spec(self, warmup: bool) -> p.ModelSpec:
        s = self.settings
        template = s.chat_template  # Jinja text or a llama.cpp built-in name (worker/chat.py tells them apart)
        if s.chat_template_file:  # the file comes first
            try:
                template = s.chat_template_file.read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise LoadFailed(f"chat_template_file {s.chat_template_file} cannot be read: {exc}") from None
        return p.ModelSpec(
            model=self.model_path,
            model_draft=str(s.model_draft) if s.model_draft else None,
            mmproj=str(s.mmproj) if s.mmproj else None,
            ctx_size=s.ctx_size,
            parallel=s.parallel,
            threads=s.threads,
            n_gpu_layers=s.n_gpu_layers,
            batch_size=s.batch_size,
            chat_template=template,
            chat_template_kwargs=dict(s.chat_template_kwargs),
            draft_max=s.draft_max,
            draft_min=s.draft_min,
            draft_p_min=s.draft_p_min,
            warmup=warmup,
            cpu_repack=s.cpu_repack,
            kv_dir=str(self.kv_dir),
            kv_min_tokens=s.kv_cache_min_tokens,
            kv_disk_bytes=s.kv_cache_disk_bytes,
            kv_shared_dir=str(s.shared_cache_dir) if s.shared_cache_dir else None,
            prompt_cache_ram_bytes=s.prompt_cache_ram_bytes,
            slot_dir=str(s.slot_save_path / model_dir_name(self.model_id)) if s.slot_save_path else None,
            embeddings=s.embeddings,
            pooling=s.pooling,
            cache_deterministic=s.cache_deterministic,
            kv_unified=s.kv_unified,
            cache_checkpoint_every=s.cache_checkpoint_every,
            load_mode=s.load_mode,
            llama_options=dict(s.llama_options),
        )

    async def _check_memory_returned(self, pid: int | None, after: str) -> dict[str, Any]:
        """After a worker exit (a sleep, a crash, a failed or killed load): did its
        memory come back? On GPU, NVML must list nothing for the old pid (polled:
        drivers report late)."""
        if pid is None:
            return {"checked": False}
        try:
            gone = psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            gone = True
        released, seconds = await self.nvml.wait_released(pid)
        self.metrics.memory_reclaim_seconds.set(seconds)
        result = {"process_gone": gone, "gpu_checked": self.nvml.available, "gpu_released": released,
                  "seconds": seconds}
        self.last_memory_check = {"after": after, "pid": pid, **result}
        if not (gone and released):
            self.metrics.memory_not_returned.labels(after=after).inc()
        log = self.log.info if (gone and released) else self.log.error
        log("worker.memory_returned", pid=pid, after=after, **result)
        return result
