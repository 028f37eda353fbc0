"""The controller: the one task that owns the state machine and the worker.

Everything that can change state arrives as an event in one mailbox; the
owner task feeds each event to the pure ServerMachine and carries out the
commands it returns (start or stop a worker, dispatch or reject requests,
arm timers). Work that takes time (loading, tearing down) runs in tasks that
post their outcome back as events, so the owner never blocks and events are
decided strictly in arrival order.

Two guarantees keep one bad event from hurting everyone: every start or stop
task ends in exactly one outcome event, whatever it raises (so no transitional
state is left without a task that will end it), and an event the table has no
row for is logged, counted and dropped rather than stopping the owner.

Two mixins hold the rest: the start and stop tasks themselves
(worker_lifecycle.WorkerLifecycle) and the sleep tiers with the predicted
wake (sleep_tiers.SleepTiers).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
import uuid
from collections import OrderedDict
from typing import Any, Awaitable, Callable

import msgspec

import psutil

from config import Settings
from config.models import model_dir_name
from daemon import protocol as p
from daemon.gpu import Nvml
from daemon.model.files import state_dir
from daemon.model.jobs import Job, JobFailure, request_cache_scope
from daemon.model.kv_files import describe_dir
from daemon.metrics import Metrics
from daemon.model.sleep_tiers import SleepTiers
from daemon.model.supervisor import Supervisor, Worker
from daemon.model.wake_prediction import history_for, requested_max_wait
from daemon.model.worker_lifecycle import WorkerLifecycle
from statemachine import (
    ArmIdleTimer,
    ArmRetryTimer,
    CancelRequest,
    Command,
    DisarmIdleTimer,
    Dispatch,
    Doze,
    Event,
    Exit,
    FailRequests,
    IdleTimerFired,
    LoadNotAdmitted,
    Policy,
    Reject,
    ReleaseKeeper,
    Reply,
    RequestAbandoned,
    RequestArrived,
    RequestFinished,
    RetryTimerFired,
    Rouse,
    ServerMachine,
    ServerState,
    SleepCompleted,
    SleepRequested,
    Started,
    StartWorker,
    StopRequested,
    StopWorker,
    WakeRequested,
    WorkerExited,
    WorkerLoadFailed,
    WorkerReady,
)
from statemachine.states import HEALTHY_STATES

# A request that was being served when a worker died this many times is
# refused rather than allowed to take the model down again.
POISON_CRASHES = 2
# What an operator's sleep or an eviction leaves a model "unloaded" in (a drowsy one keeps its weights: loaded).
UNLOADED_STATES = frozenset({ServerState.STARTING, ServerState.UNLOADING, ServerState.SLEEPING, ServerState.LIGHT_SLEEP})
POISON_MEMORY = 1024  # fingerprints remembered (least recently struck forgotten first)
# After the shutdown deadline, cancelled requests get this long to finish
# before the worker is killed (a hung worker never answers a cancel).
CANCEL_GRACE_SECONDS = 2.0


class Controller(SleepTiers, WorkerLifecycle):
    def __init__(self, settings: Settings, model_path: str, metrics: Metrics, log, model_id: str = "default") -> None:
        self.settings = settings
        self.model_id = model_id
        # This model's prompt caches, saved at each sleep (daemon/model/kv_files.py).
        self.kv_dir = state_dir(settings) / "kv" / model_dir_name(model_id)
        self.kv_saved: dict[str, Any] = describe_dir(self.kv_dir)
        metrics.set_disk_tier(self.kv_saved)
        self.model_path = model_path
        self.metrics = metrics
        self.log = log.bind(model=model_id)  # with several models, every line says whose it is
        self.machine = ServerMachine(
            Policy(
                idle_seconds=settings.sleep_idle_seconds,
                parallel=settings.parallel,
                max_queued=settings.max_queued,
                retry_max_seconds=settings.retry_max_seconds,
                early_crash_seconds=settings.early_crash_seconds,
                drowsy_seconds=settings.drowsy_after,
                deep_after_seconds=settings.deep_after,
            )
        )
        self.wake_history = history_for(state_dir(settings))  # this host's past wakes: the prediction's basis
        self._init_tiers()
        self.supervisor = Supervisor(settings.worker_module, self._on_worker_message, self._on_worker_died, self.log,
                                     liveness_timeout=settings.worker_liveness_timeout)
        self.mailbox: asyncio.Queue[Event] = asyncio.Queue()
        self.jobs: dict[str, Job] = {}
        self.nvml = Nvml()
        self.stopped = asyncio.Event()
        self.state_listeners: list[Callable[[ServerState, ServerState], None]] = []
        self.closed = False  # the owner task has decided to exit
        self.event_listeners: list[Callable[[Event], None]] = []  # after each decided event (the fleet re-plans)

        self.model_info: dict[str, Any] = {}
        self.n_ctx_slot = 0
        self.slots: list[p.SlotInfo] = []
        self.last_wake: dict[str, Any] | None = None
        self.last_sleep: dict[str, Any] | None = None
        self.state_since = time.time()
        self._ready_at: float | None = None  # monotonic time the current worker said Ready
        self.last_memory_check: dict[str, Any] | None = None  # after the last worker exit, of any kind
        self._crash_strikes: OrderedDict[bytes, int] = OrderedDict()  # request fingerprint -> crashes it was in

        self._tickets = itertools.count(1)
        self._replies: dict[int, asyncio.Future] = {}
        self._idle_timer: asyncio.TimerHandle | None = None
        self._retry_timer: asyncio.TimerHandle | None = None
        self._state_changed = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        # Set by the fleet: asked before every load; answers None (load now) or
        # why not. A fleet of one has none and always loads.
        self.admission: Callable[[str], Awaitable[LoadNotAdmitted | None]] | None = None
        self._admission_wait: asyncio.Future | None = None
        self.last_refusal: LoadNotAdmitted | None = None  # why the last load was not admitted, if it was not
        # Set by the fleet while another model's load waits for this busy one to
        # finish: new requests are held here, in arrival order, instead of keeping
        # it busy for ever, so that it falls idle and can be put to sleep.
        self.holding = False
        self.held: OrderedDict[str, Job] = OrderedDict()
        # Not loaded yet, or put to sleep by an operator or an eviction since (not by its idle timer):
        # with models_autoload = false only POST /models/load loads it (llama-server's router "unloaded").
        self.unloaded = True
        metrics.idle_timeout_seconds.set(settings.sleep_idle_seconds)
        metrics.set_state(self.state)
        metrics.set_tier(None)

    # -- public ---------------------------------------------------------------

    @property
    def state(self) -> ServerState:
        return self.machine.state

    @property
    def healthy(self) -> bool:
        return self.state in HEALTHY_STATES

    def post(self, event: Event) -> None:
        self.mailbox.put_nowait(event)

    async def run(self, load_at_start: bool = True) -> None:
        """The owner task: decide every event in order."""
        self.post(Started(load=load_at_start))
        while True:
            event = await self.mailbox.get()
            before = self.state
            try:
                commands = self.machine.handle(event)
            except Exception as exc:  # noqa: BLE001 - a missing row is a bug, but never a dead daemon
                self._drop(event, exc)
                continue
            if self.state is not before:
                self._on_state_change(before, event)
            if isinstance(event, SleepRequested) and self.state in UNLOADED_STATES:
                self.unloaded = True  # an operator's sleep or an eviction, the model asleep already or not
            for command in commands:
                try:
                    self._execute(command)
                except Exception as exc:  # noqa: BLE001 - one bad command must not stop the owner
                    self.log.exception("controller.command_failed", command=type(command).__name__, error=repr(exc))
                    for request_id in getattr(command, "request_ids", ()):
                        self._fail(request_id, JobFailure(500, "internal_error", f"internal error: {exc!r}"))
            if isinstance(event, RequestAbandoned) and event.request_id not in self.machine.in_flight:
                self.jobs.pop(event.request_id, None)
            self._after_event(event)
            self._tell(self.event_listeners, event)
            if any(isinstance(c, Exit) for c in commands):
                self.closed = True  # from here on, nothing reads the mailbox
                break
        self._cancel_timers()
        self._close_keeper()
        for task in list(self._tasks):
            task.cancel()
        await self.supervisor.close()
        # Requests that arrived after the decision to exit (still in the mailbox)
        # are answered too: nothing is left waiting on a daemon that is gone.
        self.held.clear()
        for request_id in list(self.jobs):
            self._fail(request_id, JobFailure(503, "shutting_down", "server is shutting down"))
        self.stopped.set()

    def new_job(self, endpoint: str, params: p.SamplingParams, tools=(), keep_alive: float | None = None,
                max_wait: float | None = None, **fields) -> Job:
        """A generation: answered by Tokens (of n choices), then one Done.
        `fields` are p.Submit's (prompt or messages, n, cache_prompt, ...).
        keep_alive: how long the model stays awake once idle after it
        (statemachine.events.RequestArrived); None: sleep_idle_seconds."""
        fields.setdefault("cache_scope", request_cache_scope.get())
        submit = p.Submit(_request_id(endpoint), params, tools=list(tools), **fields)
        return self._accept(Job(submit, endpoint, keep_alive=keep_alive), max_wait)

    def new_query(self, endpoint: str, kind: str, keep_alive: float | None = None, max_wait: float | None = None,
                  **fields) -> Job:
        """One-step work on the loaded model (tokenize, detokenize,
        apply_template, count_chat, embed), answered by one Answer. It wakes the
        model and waits its turn like a generation: the state machine sees a request."""
        fields.setdefault("cache_scope", request_cache_scope.get())
        return self._accept(Job(p.Query(_request_id(endpoint), kind, **fields), endpoint, keep_alive=keep_alive),
                            max_wait)

    def _accept(self, job: Job, max_wait: float | None = None) -> Job:
        """max_wait: how long the client may wait for a wake (X-Dormouse-Max-Wait, daemon/http/cold_start.py);
        None: the one set for this request by the HTTP layer, else wake_timeout."""
        request_id = job.id
        job.cold = self.state is not ServerState.READY
        if max_wait is None:
            max_wait = requested_max_wait.get()
        # Read by the HTTP layer (_first_item's wait, cold_start's headers): set here, not Job fields (jobs.py).
        job.max_wait = max_wait
        job.wake_seconds = None
        if self.closed:  # this model has stopped (others of the fleet may still be draining)
            job.put(JobFailure(503, "shutting_down", "server is shutting down", 1.0))
            return job
        if self.unloaded and not self.settings.models_autoload and self.state in UNLOADED_STATES:
            job.put(JobFailure(400, "model_not_loaded", f"model {self.model_id} is not loaded, and models_autoload is "
                                                        "off: load it first (POST /models/load)"))
            return job
        if self._crash_strikes.get(_fingerprint(job.submit), 0) >= POISON_CRASHES:
            self.metrics.poison_refusals.inc()
            job.put(JobFailure(400, "request_crashed_worker",
                               f"this request was being served when the worker died {POISON_CRASHES} times; "
                               "it is refused so that it cannot take the model down again"))
            return job
        refusal = self.too_slow(max_wait) if job.cold else None
        if refusal is not None:  # at once, not after the wait: and the wake starts, so a retry finds it awake
            job.put(refusal)
            if self.state in (ServerState.SLEEPING, ServerState.LIGHT_SLEEP, ServerState.DROWSY):
                self.post(WakeRequested(0))
            return job
        if self.holding:
            return self._hold(job)
        self.jobs[request_id] = job
        self.post(RequestArrived(request_id, job.keep_alive))
        return job

    def _hold(self, job: Job) -> Job:
        # Held requests count against the same capacity as accepted ones, so that
        # all of them are accepted when they are released.
        if len(self.held) + len(self.machine.in_flight) + len(self.machine.waiting) >= self.machine.policy.capacity:
            job.put(JobFailure(503, "queue_full",
                               f"server busy: {self.machine.policy.capacity} requests already accepted", 1.0))
            return job
        self.jobs[job.id] = job
        self.held[job.id] = job
        return job

    def hold_requests(self) -> None:
        """The fleet's word: keep new requests back (see `held`)."""
        self.holding = True

    def release_held(self) -> None:
        """The fleet's word: feed requests again, the held ones first, in order."""
        self.holding = False
        while self.held:
            request_id, job = self.held.popitem(last=False)
            job.cold = job.cold or self.state is not ServerState.READY
            self.post(RequestArrived(request_id, job.keep_alive))

    def abandon(self, job: Job) -> None:
        """The client is gone or gave up: free its place, wherever it is."""
        if self.held.pop(job.id, None) is not None:  # the state machine never saw it
            self.jobs.pop(job.id, None)
            return
        if not job.finished:
            self.post(RequestAbandoned(job.id))

    async def admin(self, event_type: type[SleepRequested] | type[WakeRequested], **fields) -> tuple[bool, str]:
        if self.closed:
            return False, "the server is shutting down"
        ticket = next(self._tickets)
        future = asyncio.get_running_loop().create_future()
        self._replies[ticket] = future
        self.post(event_type(ticket, **fields))
        return await future

    async def wait_for(self, predicate: Callable[[ServerState], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not predicate(self.state):
            self._state_changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._state_changed.wait(), remaining)
            except asyncio.TimeoutError:
                return predicate(self.state)
        return True

    async def shutdown(self, timeout: float) -> None:
        """Stop taking requests, let in-flight ones finish up to `timeout`, tear down.

        Bounded whatever the worker does: in-flight requests get `timeout`, then
        a cancel and CANCEL_GRACE_SECONDS, then the worker is killed; a
        teardown gets `teardown_timeout`. systemd's TimeoutStopSec must cover
        the sum (tests/unit/test_shutdown_budget.py checks the unit file)."""
        self.post(StopRequested())
        if await self._stopped_within(timeout):
            return
        self.log.warning("shutdown.deadline", cancelled=len(self.machine.in_flight))
        for request_id in list(self.machine.in_flight):
            self.post(RequestAbandoned(request_id))
        if await self._stopped_within(CANCEL_GRACE_SECONDS):
            return
        self.log.error("shutdown.killing_worker", reason="requests did not finish after their cancel")
        await self.supervisor.kill_current("the shutdown deadline passed")
        await self.stopped.wait()

    async def _stopped_within(self, seconds: float) -> bool:
        try:
            await asyncio.wait_for(asyncio.shield(self.stopped.wait()), seconds)
            return True
        except asyncio.TimeoutError:
            return False

    # -- commands -----------------------------------------------------------------

    def _execute(self, command: Command) -> None:
        if isinstance(command, StartWorker):
            self._spawn(self._transition(self._start_worker(command.reason), self._start_crashed))
        elif isinstance(command, StopWorker):
            self._spawn(self._transition(self._stop_worker(command.reason, command.tier), self._stop_crashed))
        elif isinstance(command, Doze):
            self._spawn(self._transition(self._doze(), self._doze_crashed))
        elif isinstance(command, Rouse):
            self._spawn(self._transition(self._rouse(command.reason), self._start_crashed))
        elif isinstance(command, ReleaseKeeper):
            self._close_keeper()
        elif isinstance(command, Dispatch):
            for request_id in command.request_ids:
                job = self.jobs[request_id]
                if job.cold:  # what this request waited for the wake (X-Dormouse-Wake-Seconds)
                    job.wake_seconds = time.monotonic() - job.accepted_at
                job.mark_dispatched()
                try:
                    self.supervisor.send(job.submit)
                except (TypeError, ValueError, OverflowError) as exc:  # validation let through what msgpack refuses
                    self._fail(request_id, JobFailure(400, "invalid_request", f"request cannot be sent to the worker: {exc}"))
                    self.post(RequestFinished(request_id, ok=False))
        elif isinstance(command, Reject):
            for request_id in command.request_ids:
                self._fail(request_id, JobFailure(503, command.code, command.reason, command.retry_after))
        elif isinstance(command, FailRequests):
            for request_id in command.request_ids:
                self._fail(request_id, JobFailure(503, "worker_exited", command.reason, 1.0))
        elif isinstance(command, CancelRequest):
            self.supervisor.send(p.Cancel(command.request_id))
        elif isinstance(command, ArmIdleTimer):
            self._cancel_idle_timer()
            loop = asyncio.get_running_loop()
            self._idle_timer = loop.call_later(command.seconds, self.post, IdleTimerFired(command.generation))
        elif isinstance(command, DisarmIdleTimer):
            self._cancel_idle_timer()
        elif isinstance(command, ArmRetryTimer):
            if self._retry_timer is not None:
                self._retry_timer.cancel()
            loop = asyncio.get_running_loop()
            self._retry_timer = loop.call_later(command.seconds, self.post, RetryTimerFired(command.generation))
        elif isinstance(command, Reply):
            future = self._replies.pop(command.ticket, None)
            if future is not None and not future.done():
                future.set_result((command.ok, command.message))
        elif isinstance(command, Exit):
            pass
        else:  # pragma: no cover - a new command without a case here is a bug
            raise TypeError(f"unknown command {command!r}")

    def _fail(self, request_id: str, failure: JobFailure) -> None:
        job = self.jobs.pop(request_id, None)
        if job is not None:
            job.put(failure)

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- from the worker ------------------------------------------------------------

    def _on_worker_message(self, message: p.ToDaemon) -> None:
        if isinstance(message, p.Tokens):
            job = self.jobs.get(message.request_id)
            if job is not None:
                if job.first_token_at is None:
                    ttft = time.monotonic() - job.accepted_at
                    self.metrics.ttft_seconds.labels(start="cold" if job.cold else "warm").observe(ttft)
                job.put(message)
        elif isinstance(message, p.PromptProgress):
            job = self.jobs.get(message.request_id)
            if job is not None:
                job.put(message)
        elif isinstance(message, p.Done):
            job = self.jobs.pop(message.request_id, None)
            if job is not None:
                self._account(job, message)
                job.put(message)
            self.post(RequestFinished(message.request_id, ok=message.finish_reason in ("stop", "length")))
        elif isinstance(message, p.Answer):
            job = self.jobs.pop(message.request_id, None)
            if job is not None:
                job.put(message)
            self.post(RequestFinished(message.request_id, ok=message.error is None))
        elif isinstance(message, p.SlotStates):
            self.slots = message.slots
            self.metrics.set_slots([s.state for s in message.slots])
            self.metrics.add_decodes(message)
        elif isinstance(message, p.Error):
            self.log.error("worker.error", message=message.message, during=message.during)

    def _account(self, job: Job, done: p.Done) -> None:
        m = self.metrics
        m.prompt_tokens.inc(done.prompt_tokens)
        m.generated_tokens.inc(done.completion_tokens)
        self.note_service(done.prompt_seconds + done.generation_seconds)
        m.draft_tokens.inc(done.drafted_tokens)
        m.accepted_tokens.inc(done.accepted_tokens)
        m.observe_request(done, job.accepted_at, job.submit.n)  # per request, for metrics_compat
        if done.completion_tokens > 1 and done.generation_seconds > 0 and job.submit.n == 1:  # n choices decode side by side
            m.inter_token_seconds.observe(done.generation_seconds / (done.completion_tokens - 1))
        if done.kv_lookup == "hit":  # hits, misses and tokens by tier: observe_request's observe_prompt_cache
            m.kv_restore_seconds.observe(done.restore_seconds)
        if done.kv_rejected:
            m.kv_rejected.labels(reason=done.kv_rejected).inc()
            self.log.warning("kv_cache.rejected_files", during="restore", files={done.kv_rejected: 1})

    def _on_worker_died(self, worker: Worker, reason: str) -> None:
        uptime = None if self._ready_at is None else time.monotonic() - self._ready_at
        self.metrics.worker_restarts.inc()
        self.log.error("worker.died", pid=worker.pid, reason=reason, uptime=uptime)
        for request_id in self.machine.in_flight:
            job = self.jobs.get(request_id)
            if job is not None:
                self._strike(_fingerprint(job.submit))
        self._forget_worker()
        self._spawn(self._check_memory_returned(worker.pid, "crash"))
        self.post(WorkerExited(reason, uptime))

    def _strike(self, fingerprint: bytes) -> None:
        self._crash_strikes[fingerprint] = self._crash_strikes.get(fingerprint, 0) + 1
        self._crash_strikes.move_to_end(fingerprint)
        while len(self._crash_strikes) > POISON_MEMORY:
            self._crash_strikes.popitem(last=False)

    def _drop(self, event: Event, exc: Exception) -> None:
        """An event the table has no row for (a bug): say so loudly, count it,
        answer whoever waits on it, and keep deciding the next events."""
        name = type(event).__name__
        self.metrics.invalid_transitions.labels(state=str(self.state), event=name).inc()
        self.log.error("controller.invalid_transition", state=str(self.state), event_type=name, error=repr(exc))
        if isinstance(event, RequestArrived):
            self._fail(event.request_id, JobFailure(500, "internal_error", f"internal error: {exc}"))
        elif isinstance(event, (SleepRequested, WakeRequested)):
            self._execute(Reply(event.ticket, False, f"internal error: {exc}"))

    # -- bookkeeping ----------------------------------------------------------------

    def _on_state_change(self, before: ServerState, event: Event) -> None:
        after = self.state
        if after is ServerState.READY:
            self.unloaded = False
        self.state_since = time.time()
        self.metrics.set_state(after)
        self.tier_gauges()
        self.log.info("state", before=str(before), after=str(after), cause=type(event).__name__)
        self._state_changed.set()
        self._tell(self.state_listeners, before, after)

    def _tell(self, listeners: list[Callable], *args) -> None:
        """A listener's bug is logged; it never stops the owner task."""
        for listener in listeners:
            try:
                listener(*args)
            except Exception as exc:  # noqa: BLE001
                self.log.exception("controller.listener_failed", listener=repr(listener), error=repr(exc))

    def _after_event(self, event: Event) -> None:
        self.metrics.requests_in_flight.set(len(self.machine.in_flight))
        self.metrics.requests_waiting.set(len(self.machine.waiting))
        worker_gone = isinstance(event, (SleepCompleted, WorkerExited, WorkerLoadFailed))
        if worker_gone and self.settings.spawn_ahead and self.state in (ServerState.SLEEPING, ServerState.FAILED,
                                                                          ServerState.LIGHT_SLEEP):
            self._spawn(self._prespawn())
        spare = self.supervisor.spare
        if self.state is ServerState.SLEEPING and spare is not None and spare.imports:
            self._spawn(self._lean_spare())

    def _cancel_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _cancel_timers(self) -> None:
        self._cancel_idle_timer()
        if self._retry_timer is not None:
            self._retry_timer.cancel()
            self._retry_timer = None

    def sample_worker_memory(self) -> None:
        """Worker RSS and per-GPU memory (NVML) into the metrics; zero when no worker holds a model."""
        worker = self.supervisor.current
        rss = 0
        if worker is not None and worker.phase == "serving":
            try:
                rss = psutil.Process(worker.pid).memory_info().rss
            except psutil.Error:
                pass
        self.metrics.worker_rss_bytes.set(rss)
        self.metrics.gpu_memory_used_bytes.clear()
        if worker is not None and self.nvml.available:
            for gpu, used in self.nvml.used_by(worker.pid).items():
                self.metrics.gpu_memory_used_bytes.labels(gpu=str(gpu)).set(used)

    def idle_deadline(self) -> float | None:
        """Seconds until the idle timer fires, if armed."""
        if self._idle_timer is None or self._idle_timer.cancelled():
            return None
        return max(0.0, self._idle_timer.when() - asyncio.get_running_loop().time())


def _request_id(endpoint: str) -> str:
    return f"{endpoint.split('.')[0][:4]}-{uuid.uuid4().hex[:24]}"


def _fingerprint(message: p.Submit | p.Query) -> bytes:
    """What a request asks for, without its id: the same request sent again
    has the same fingerprint."""
    anonymous = msgspec.structs.replace(message, request_id="")
    return hashlib.blake2b(msgspec.msgpack.encode(anonymous), digest_size=16).digest()
