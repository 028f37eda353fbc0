"""Spawns and watches worker processes; speaks the protocol from the daemon's side.

A worker is `python -m <worker_module> --fd N` with one end of a socketpair.
It says Hello once its imports are done; Load makes it load; Sleep makes it
tear down in order, report and exit. The supervisor notices a death at once
(EOF on the socket), relays the worker's stderr into the log, and can keep one
worker spawned ahead of time (imports done, no backend, no model) so a wake
skips interpreter start-up and imports.

The controller gets exactly one outcome per worker: start() raises LoadFailed,
or stop() returns a result (the worker tore down, or died while doing so), or
on_unexpected_exit is called (it died while serving). A stop() that finds its
worker already gone returns `already_gone`: the exit was (or is about to be)
reported through on_unexpected_exit, and must not be reported twice.

A serving worker is pinged, and answers from its channel thread at once, even
mid-step, with the age of its current step (daemon/worker/channel.py). It is
killed when it answers nothing for `liveness_timeout` seconds (stopped,
deadlocked) or when one step has run longer than that (hung in a kernel): a
step is at most one prompt chunk (or one image of a prompt with images), so a
worker that is slow but progressing (steps keep ending) is never killed,
however long its work. Its death is an
ordinary unexpected exit whose reason says it hung.

Workers run in a session of their own (start_new_session): the signals a
terminal sends to its foreground process group (Ctrl-C, hang-up, Ctrl-Z) reach
the daemon only, which then sleeps its models in order, saving what a sleep saves.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from daemon import protocol as p
from daemon.model.liveness import LivenessClock


class LoadFailed(RuntimeError):
    def __init__(self, message: str, pid: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.pid = pid  # the worker that was started and is gone now, if any
        self.code = code  # the worker's p.Error code, when it said why


@dataclass
class Worker:
    proc: asyncio.subprocess.Process
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    spawned_at: float
    hello: p.Hello | None = None
    phase: str = "spawned"  # spawned, loading, serving, stopping, gone
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=20))
    last_heard: float = field(default_factory=time.monotonic)  # any message counts as a sign of life
    step_seconds: float = 0.0  # the age of its current step, as its last Pong said (0: between steps)
    kill_reason: str | None = None  # why the daemon killed it, if it did
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task] = field(default_factory=list)
    imports: tuple[str, ...] = ()  # engine modules it imported before Hello (`--import`)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exit_reason(self) -> str:
        code = self.proc.returncode
        if code is None:
            how = "closed its channel"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with status {code}"
        if self.kill_reason:
            how += f" ({self.kill_reason})"
        detail = next((line for line in reversed(self.stderr_tail) if line.strip()), "")
        return f"worker pid {self.pid} {how}" + (f" ({detail})" if detail else "")


@dataclass
class StopResult:
    report: p.SleepReport | None  # None: the worker died during teardown or had to be killed
    pid: int | None
    aborted_load: bool = False  # it was still loading and was killed; start() reports that
    already_gone: bool = False  # it died before the stop; on_unexpected_exit reports that


@dataclass
class StartResult:
    ready: p.Ready
    worker: Worker
    spawn_seconds: float  # 0 when a spawned-ahead worker was taken
    handshake_seconds: float
    prespawned: bool


class Supervisor:
    def __init__(
        self,
        worker_module: str,
        on_message: Callable[[p.ToDaemon], None],
        on_unexpected_exit: Callable[[Worker, str], None],
        log,
        hello_timeout: float = 30.0,
        liveness_timeout: float = 0.0,
    ) -> None:
        self.worker_module = worker_module
        self.on_message = on_message
        self.on_unexpected_exit = on_unexpected_exit
        self.log = log
        self.hello_timeout = hello_timeout
        self.liveness_timeout = liveness_timeout  # 0: no pings
        self.current: Worker | None = None
        self.spare: Worker | None = None
        self._spawning: asyncio.Task | None = None
        self._pending: asyncio.Future | None = None  # Ready/Error during load, SleepReport during stop
        self._starting = False  # a start() is under way (spawning, handshaking or loading)
        self._abort_start = False  # a stop came during it: start() ends its worker and fails
        self.last_exit_at: float | None = None
        self.last_exit_pid: int | None = None

    # -- spawning ---------------------------------------------------------------

    async def _spawn(self, imports: tuple[str, ...] = ()) -> Worker:
        """imports: engine modules the worker imports before Hello (protocol.engine_modules)."""
        start = time.perf_counter()
        try:
            parent, child = socket.socketpair()
        except OSError as exc:  # out of file descriptors
            raise LoadFailed(f"cannot create the worker's channel: {exc}") from None
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", self.worker_module, "--fd", str(child.fileno()),
                *(["--import", ",".join(imports)] if imports else []),
                pass_fds=(child.fileno(),),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,  # a terminal's Ctrl-C is for the daemon, which sleeps the worker in order
            )
        except OSError as exc:  # fork or exec refused: out of memory, processes, fds
            parent.close()
            raise LoadFailed(f"cannot start a worker process: {exc}") from None
        finally:
            child.close()
        reader, writer = await asyncio.open_unix_connection(sock=parent)
        worker = Worker(proc, reader, writer, spawned_at=start, imports=imports)
        worker.tasks.append(asyncio.create_task(self._relay_stderr(worker), name=f"worker-{proc.pid}-stderr"))
        try:
            message = await asyncio.wait_for(self._read(worker), self.hello_timeout)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
            await self._kill(worker)
            raise LoadFailed(f"worker did not say hello: {worker.exit_reason() if worker.proc.returncode is not None else exc!r}") from None
        except BaseException:  # cancelled (the daemon is stopping): leave no process behind
            await asyncio.shield(self._kill(worker))
            raise
        if not isinstance(message, p.Hello) or message.protocol != p.PROTOCOL_VERSION:
            await self._kill(worker)
            raise LoadFailed(f"worker spoke an unexpected first message: {message!r}")
        worker.hello = message
        self.log.debug("worker.spawned", pid=worker.pid, import_seconds=round(message.import_seconds, 4))
        return worker

    async def prespawn(self, imports: tuple[str, ...] = ()) -> None:
        """Keep one worker ready to load (imports done, nothing loaded); `imports`: the engine's too."""
        if self.spare is not None or self._spawning is not None:
            return
        self._spawning = asyncio.current_task()
        try:
            self.spare = await self._spawn(imports)
        except LoadFailed as exc:
            self.log.warning("worker.prespawn_failed", error=str(exc))
        finally:
            self._spawning = None

    async def drop_importing_spare(self) -> bool:
        """End the spare if it imported the engine (a light-tier spare, once its model sleeps
        deep: nothing is to be held for it then); True if there was one."""
        spare = self.spare
        if spare is None or not spare.imports or self._spawning is not None:
            return False
        self.spare = None
        await self._kill(spare)
        return True

    async def _take_worker(self) -> tuple[Worker, float, bool]:
        if self._spawning is not None:
            await asyncio.shield(self._spawning)
        spare, self.spare = self.spare, None
        if spare is not None and spare.proc.returncode is None:
            return spare, 0.0, True
        if spare is not None:
            await self._kill(spare)
        start = time.perf_counter()
        worker = await self._spawn()
        return worker, time.perf_counter() - start, False

    # -- lifecycle ----------------------------------------------------------------

    async def start(self, spec: p.ModelSpec, timeout: float) -> StartResult:
        self._starting, self._abort_start = True, False
        try:
            return await self._start(spec, timeout)
        finally:
            self._starting = False

    async def _start(self, spec: p.ModelSpec, timeout: float) -> StartResult:
        worker, spawn_seconds, prespawned = await self._take_worker()
        if self._abort_start:  # stopped while it was being spawned: it never loads
            await self._kill(worker)
            raise LoadFailed("stopped before it loaded", worker.pid)
        self.current = worker
        worker.phase = "loading"
        handshake_start = time.perf_counter()
        loop = asyncio.get_running_loop()
        self._pending = loop.create_future()
        worker.tasks.append(asyncio.create_task(self._read_loop(worker), name=f"worker-{worker.pid}-reader"))
        self.send(p.Load(spec))
        try:
            outcome = await asyncio.wait_for(asyncio.shield(self._pending), timeout)
        except asyncio.TimeoutError:
            await self._kill(worker)
            raise LoadFailed(f"load took longer than {timeout:g}s (load_timeout)", worker.pid) from None
        if isinstance(outcome, p.Ready):
            worker.phase = "serving"
            worker.last_heard = time.monotonic()
            if self.liveness_timeout > 0:
                worker.tasks.append(asyncio.create_task(self._watch_liveness(worker), name=f"worker-{worker.pid}-liveness"))
            return StartResult(outcome, worker, spawn_seconds, time.perf_counter() - handshake_start, prespawned)
        await self._reap(worker)
        reason = outcome.message if isinstance(outcome, p.Error) else worker.exit_reason()
        raise LoadFailed(reason, worker.pid, getattr(outcome, "code", None))

    async def stop(self, timeout: float) -> StopResult:
        """Ordered teardown, then wait for the process to exit."""
        worker = self.current
        if self._starting and (worker is None or worker.phase == "loading"):
            # Nothing to tear down in order yet: the start ends its worker (now, or as
            # soon as it is spawned) and reports the load as failed.
            self._abort_start = True
            if worker is not None:
                await self._kill(worker)
            return StopResult(None, worker.pid if worker else None, aborted_load=True)
        if worker is None or worker.phase == "gone":
            return StopResult(None, worker.pid if worker else self.last_exit_pid, already_gone=True)
        worker.phase = "stopping"
        loop = asyncio.get_running_loop()
        self._pending = loop.create_future()
        self.send(p.Sleep())
        report = None
        try:
            outcome = await asyncio.wait_for(asyncio.shield(self._pending), timeout)
            report = outcome if isinstance(outcome, p.SleepReport) else None
            if report is not None:  # what this sleep (idle, admin, evict, shutdown or a signal) kept on disk
                saved = next((ph for ph in report.phases if ph.name == "kv_save"), None)
                self.log.info("worker.kv_saved", pid=worker.pid, files=report.kv_saved_files,
                              bytes=saved.bytes if saved else 0, errors=report.kv_save_errors,
                              seconds=round(saved.seconds, 4) if saved else 0.0)
        except asyncio.TimeoutError:
            self.log.warning("worker.teardown_timeout", pid=worker.pid, timeout=timeout)
            worker.kill_reason = f"teardown took longer than {timeout:g}s"
            await self._kill(worker)
        await self._reap(worker)
        return StopResult(report, worker.pid)

    async def doze(self, timeout: float) -> p.DozeReport | None:
        """The drowsy tier: the worker frees its contexts and keeps the weights. None: it
        did not say it had (it died, or is killed now): its exit is reported as usual
        (on_unexpected_exit), the one outcome of that worker."""
        worker = self.current
        if worker is None or worker.phase != "serving":
            return None
        self._pending = asyncio.get_running_loop().create_future()
        self.send(p.Doze())
        try:
            outcome = await asyncio.wait_for(asyncio.shield(self._pending), timeout)
        except asyncio.TimeoutError:
            outcome = None
            worker.kill_reason = f"doze took longer than {timeout:g}s"
        if isinstance(outcome, p.DozeReport):
            return outcome
        if worker.proc.returncode is None:  # it answered something else, or nothing: it cannot be trusted drowsy
            worker.kill_reason = worker.kill_reason or f"it answered a doze with {type(outcome).__name__}"
            worker.proc.kill()
        return None

    async def rouse(self, timeout: float) -> p.Ready:
        """The drowsy worker creates its contexts again; raises LoadFailed as a load does."""
        worker = self.current
        if worker is None or worker.phase != "serving":
            raise LoadFailed("the drowsy worker is gone", worker.pid if worker else None)
        self._starting, self._abort_start = True, False
        worker.phase = "loading"  # a death now is this rouse's failure, not an unexpected exit
        self._pending = asyncio.get_running_loop().create_future()
        self.send(p.Rouse())
        try:
            outcome = await asyncio.wait_for(asyncio.shield(self._pending), timeout)
        except asyncio.TimeoutError:
            await self._kill(worker)
            raise LoadFailed(f"rouse took longer than {timeout:g}s (load_timeout)", worker.pid) from None
        finally:
            self._starting = False
        if isinstance(outcome, p.Ready):
            worker.phase = "serving"
            worker.last_heard = time.monotonic()
            watching = any(t.get_name().endswith("-liveness") and not t.done() for t in worker.tasks)
            if self.liveness_timeout > 0 and not watching:  # the watch ends once it sees the phase left serving
                worker.tasks.append(asyncio.create_task(self._watch_liveness(worker), name=f"worker-{worker.pid}-liveness"))
            return outcome
        await self._reap(worker)
        reason = outcome.message if isinstance(outcome, p.Error) else worker.exit_reason()
        raise LoadFailed(reason, worker.pid, getattr(outcome, "code", None))

    def send(self, message: p.Message) -> None:
        worker = self.current
        if worker is None or worker.writer.is_closing():
            return
        worker.writer.write(p.encode(message))

    async def kill_current(self, reason: str) -> None:
        """End the current worker now; its exit is reported as usual (EOF)."""
        worker = self.current
        if worker is not None and worker.proc.returncode is None:
            worker.kill_reason = reason
            worker.proc.kill()
            await worker.exited.wait()

    async def close(self) -> None:
        for worker in (self.spare, self.current):
            if worker is not None and worker.proc.returncode is None:
                await self._kill(worker)
        self.spare = self.current = None

    # -- I/O ----------------------------------------------------------------------

    async def _read(self, worker: Worker) -> p.ToDaemon:
        header = await worker.reader.readexactly(p.HEADER.size)
        body = await worker.reader.readexactly(p.check_length(p.HEADER.unpack(header)[0]))
        return p.decode_for_daemon(body)

    async def _read_loop(self, worker: Worker) -> None:
        try:
            while True:
                message = await self._read(worker)
                worker.last_heard = time.monotonic()
                if isinstance(message, p.Pong):
                    worker.step_seconds = message.step_seconds
                    continue
                if isinstance(message, (p.Ready, p.Error, p.SleepReport, p.DozeReport)):
                    self._resolve(message)
                elif isinstance(message, p.LoadProgress):
                    self.log.debug("worker.load_progress", pid=worker.pid, phase=message.phase, seconds=round(message.seconds, 4))
                else:
                    self.on_message(message)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, OSError, p.msgspec.DecodeError) as exc:
            if not isinstance(exc, (asyncio.IncompleteReadError, ConnectionError)):
                self.log.error("worker.bad_message", pid=worker.pid, error=repr(exc))
        await self._reap(worker)
        phase = worker.phase
        worker.phase = "gone"
        self._resolve(None)
        if phase == "serving":
            self.on_unexpected_exit(worker, worker.exit_reason())

    async def _watch_liveness(self, worker: Worker) -> None:
        """Ping a serving worker; kill it when nothing has come back for liveness_timeout, or
        when its last Pong says one step has run longer than that (stuck, though answering).
        LivenessClock forgives the time this process itself was stalled."""
        timeout = self.liveness_timeout
        interval = max(0.1, timeout / 4)
        clock = LivenessClock(timeout, interval)
        seq = 0
        worker.step_seconds = 0.0
        while worker.phase == "serving" and worker.proc.returncode is None:
            due = time.monotonic() + interval
            await asyncio.sleep(interval)
            if worker.phase != "serving":
                return  # a teardown has its own bound
            now = time.monotonic()
            clock.woke(now, due)
            hung, seconds = clock.verdict(now, worker.last_heard, worker.step_seconds) or ("", 0.0)
            if hung == "silent":
                self.log.error("worker.hung", pid=worker.pid, silent_seconds=round(seconds, 3), timeout=timeout)
                worker.kill_reason = f"it answered no ping for {timeout:g}s: hung (worker_liveness_timeout)"
                worker.proc.kill()  # SIGKILL ends a stopped process too; EOF reports the exit
                return
            if hung == "stuck":
                self.log.error("worker.hung", pid=worker.pid, step_seconds=round(seconds, 3), timeout=timeout)
                worker.kill_reason = (f"one step ran {seconds:.0f}s, longer than {timeout:g}s: "
                                      "hung (worker_liveness_timeout)")
                worker.proc.kill()
                return
            seq += 1
            if not worker.writer.is_closing():
                worker.writer.write(p.encode(p.Ping(seq)))

    def _resolve(self, outcome: p.ToDaemon | None) -> None:
        if self._pending is not None and not self._pending.done():
            self._pending.set_result(outcome)

    async def _relay_stderr(self, worker: Worker) -> None:
        assert worker.proc.stderr is not None
        async for raw in worker.proc.stderr:
            line = raw.decode("utf-8", errors="replace").rstrip()
            if line:
                worker.stderr_tail.append(line)
                self.log.info("worker.stderr", pid=worker.pid, line=line)

    async def _reap(self, worker: Worker) -> None:
        if worker.exited.is_set():
            return
        worker.writer.close()
        try:
            try:
                await asyncio.wait_for(worker.proc.wait(), 10)
            except asyncio.TimeoutError:
                worker.proc.kill()
                await worker.proc.wait()
            # Let the stderr relay drain so exit reasons can quote the last line.
            for task in worker.tasks:
                if task.get_name().endswith("stderr"):
                    try:
                        await asyncio.wait_for(asyncio.shield(task), 1)
                    except asyncio.TimeoutError:
                        pass
        finally:
            # asyncio never closes a subprocess transport by itself; an unclosed one
            # warns at garbage collection, possibly after the loop is gone.
            transport = getattr(worker.proc, "_transport", None)
            if transport is not None:
                transport.close()
        worker.exited.set()
        if self.current is worker:
            self.current = None
        self.last_exit_at = time.monotonic()
        self.last_exit_pid = worker.pid

    async def _kill(self, worker: Worker) -> None:
        if worker.proc.returncode is None:
            worker.proc.kill()
        await self._reap(worker)
