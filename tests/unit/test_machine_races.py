"""The state machine against a simulated daemon: random interleavings of
requests, timers, admin calls, crashes and task outcomes, delivered through
one FIFO mailbox as the controller delivers them.

The simulation keeps the supervisor's contract (exactly one outcome per
worker: a start task's Ready or LoadFailed, a stop task's SleepCompleted, or
an unexpected exit, never two) and lets everything else race: a timer fires
after it was disarmed, a worker dies in the same loop turn as an idle timer
or a POST /sleep, a dispatch that failed to encode posts its finish behind a
queued WorkerExited. Checked after every event: no event lacks a row, and a
transitional state always has something under way that will end it. Checked
at the end: every request was answered, and a stop exits.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from statemachine import (
    ArmIdleTimer,
    ArmRetryTimer,
    CancelRequest,
    Dispatch,
    Exit,
    FailRequests,
    IdleTimerFired,
    LoadNotAdmitted,
    PolicyChanged,
    Policy,
    Reject,
    RequestAbandoned,
    RequestArrived,
    RequestFinished,
    RetryTimerFired,
    ServerMachine,
    ServerState as S,
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

OUTCOMES = (WorkerReady, WorkerLoadFailed, LoadNotAdmitted, WorkerExited, SleepCompleted)


class SimulatedDaemon:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        policy = Policy(idle_seconds=rng.choice([5.0, -1.0]), parallel=2, max_queued=3, early_crash_seconds=5.0)
        self.machine = ServerMachine(policy)
        self.mailbox: deque = deque()
        self.worker: str | None = None  # loading, serving, stopping, dead (exit reported or to be)
        self.start_task = False  # a start task will post Ready or LoadFailed
        self.stop_task = False  # a stop task will post SleepCompleted
        self.idle_generation: int | None = None
        self.retry_generation: int | None = None
        self.next_id = 0
        self.known: list[str] = []
        self.dispatched: set[str] = set()
        self.open_jobs: set[str] = set()  # the controller's jobs: accepted, not answered yet
        self.abandoned: set[str] = set()
        self.decided: set[str] = set()  # requests whose arrival the machine has seen
        self.exited = False
        self.stop_sent = False

    # -- the owner task -----------------------------------------------------

    def deliver_one(self) -> None:
        event = self.mailbox.popleft()
        commands = self.machine.handle(event)  # raises on a missing row: the test fails
        if isinstance(event, RequestArrived):
            self.decided.add(event.request_id)
        for command in commands:
            self.execute(command)
        self.check_transitional_state_ends()

    def execute(self, command) -> None:
        if isinstance(command, StartWorker):
            assert self.worker in (None, "dead"), f"start while a worker is {self.worker}"
            self.worker, self.start_task = "loading", True
        elif isinstance(command, StopWorker):
            if self.worker == "loading":  # killed mid-load: the start task reports it
                self.worker = "dead"
            elif self.worker == "serving":
                self.worker, self.stop_task = "stopping", True
            # dead: its exit is already reported; the stop reports nothing (already_gone)
        elif isinstance(command, Dispatch):
            for rid in command.request_ids:
                if self.rng.random() < 0.05:  # failed to encode: answered 400, finish posted
                    self.answer(rid)
                    self.mailbox.append(RequestFinished(rid, ok=False))
                else:
                    self.dispatched.add(rid)
        elif isinstance(command, (Reject, FailRequests)):
            for rid in command.request_ids:
                self.dispatched.discard(rid)
                self.answer(rid)
        elif isinstance(command, CancelRequest):
            pass  # the worker answers with a finish, if it lives
        elif isinstance(command, ArmIdleTimer):
            self.idle_generation = command.generation
        elif isinstance(command, ArmRetryTimer):
            self.retry_generation = command.generation
        elif isinstance(command, Exit):
            # Every request the machine saw was answered (but those whose client
            # left); arrivals still in the mailbox are failed by the controller's
            # final sweep, as the daemon stops.
            left = (self.open_jobs & self.decided) - self.abandoned
            assert not left, f"exit with unanswered requests {sorted(left)}"
            assert not self.machine.in_flight and not self.machine.waiting
            self.exited = True

    def answer(self, rid: str) -> None:
        # As the controller: the first answer (a Done, a rejection, a failure)
        # closes the job; a later one for the same id finds nothing to answer.
        self.open_jobs.discard(rid)

    def check_transitional_state_ends(self) -> None:
        state = self.machine.state
        queued = any(isinstance(e, OUTCOMES) for e in self.mailbox)
        if state in (S.LOADING, S.WAKING):
            assert self.start_task or queued, f"{state} with no load under way"
        if state is S.UNLOADING:
            assert self.stop_task or self.start_task or queued, "unloading with no teardown under way"
        if state is S.STOPPING and not self.exited:
            assert self.start_task or self.stop_task or queued or self.dispatched or self.worker == "serving", \
                "stopping with nothing that will end it"

    # -- the world: what can happen next ------------------------------------

    def possible(self, external: bool) -> list:
        acts = []
        if self.start_task:
            acts.append(self.finish_start)
        if self.stop_task:
            acts.append(self.finish_stop)
        if self.worker == "serving" and self.dispatched:
            acts.append(self.finish_request)
        if self.idle_generation is not None:
            acts.append(self.fire_idle)
        if self.retry_generation is not None:
            acts.append(self.fire_retry)
        if external:
            acts += [self.arrive, self.arrive, self.abandon, self.admin_sleep, self.admin_wake, self.stale_timer,
                     self.policy_change]
            if self.worker == "serving":
                acts.append(self.crash)
            if not self.stop_sent and self.rng.random() < 0.02:
                acts.append(self.request_stop)
        return acts

    def finish_start(self) -> None:
        self.start_task = False
        roll = self.rng.random()
        if self.worker == "loading" and roll < 0.7:
            self.worker = "serving"
            self.mailbox.append(WorkerReady(2))
        elif roll < 0.85:  # the fleet did not admit it: no worker was started
            self.worker = None
            self.mailbox.append(LoadNotAdmitted("does not fit", "insufficient_memory", 1.0))
        else:
            self.worker = None
            self.mailbox.append(WorkerLoadFailed("boom"))

    def finish_stop(self) -> None:
        self.stop_task = False
        self.worker = None
        self.mailbox.append(SleepCompleted())

    def finish_request(self) -> None:
        rid = self.rng.choice(sorted(self.dispatched))
        self.dispatched.discard(rid)
        self.answer(rid)
        self.mailbox.append(RequestFinished(rid, ok=self.rng.random() < 0.9))

    def crash(self) -> None:
        self.worker = "dead"
        self.mailbox.append(WorkerExited("SIGKILL", uptime=self.rng.choice([0.5, 100.0])))

    def fire_idle(self) -> None:
        self.mailbox.append(IdleTimerFired(self.idle_generation))
        self.idle_generation = None

    def fire_retry(self) -> None:
        self.mailbox.append(RetryTimerFired(self.retry_generation))
        self.retry_generation = None

    def stale_timer(self) -> None:
        kind = self.rng.choice([IdleTimerFired, RetryTimerFired])
        self.mailbox.append(kind(self.rng.randrange(0, 5)))

    def arrive(self) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.known.append(rid)
        self.open_jobs.add(rid)
        self.mailbox.append(RequestArrived(rid))

    def abandon(self) -> None:
        if self.known:
            rid = self.rng.choice(self.known)
            self.abandoned.add(rid)
            self.mailbox.append(RequestAbandoned(rid))

    def admin_sleep(self) -> None:
        self.mailbox.append(SleepRequested(1, self.rng.choice(["admin", "evict"])))

    def admin_wake(self) -> None:
        self.mailbox.append(WakeRequested(1))

    def policy_change(self) -> None:
        self.mailbox.append(PolicyChanged(self.machine.policy))

    def request_stop(self) -> None:
        self.stop_sent = True
        self.mailbox.append(StopRequested())

    # -- driving --------------------------------------------------------------

    def step(self, external: bool) -> bool:
        acts = self.possible(external)
        if self.mailbox and (not acts or self.rng.random() < 0.5):
            self.deliver_one()
            return True
        if not acts:
            return False
        self.rng.choice(acts)()
        return True


def settle(sim: SimulatedDaemon, limit: int = 10_000) -> None:
    """Only what is already under way happens, until nothing is left."""
    for _ in range(limit):
        if sim.exited or not sim.step(external=False):
            return
    raise AssertionError("the simulation did not settle")


@pytest.mark.parametrize("seed", range(300))
def test_random_interleavings_never_lack_a_row_and_always_end(seed):
    rng = random.Random(seed)
    sim = SimulatedDaemon(rng)
    sim.mailbox.append(Started())
    for _ in range(rng.randrange(20, 250)):
        if sim.exited:
            break
        sim.step(external=True)
    settle(sim)
    if not sim.exited:
        sim.request_stop()
        settle(sim)
    assert sim.exited, f"stop did not exit (state {sim.machine.state}, worker {sim.worker})"
