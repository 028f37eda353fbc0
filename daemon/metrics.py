"""Prometheus metrics, in the daemon process only (the worker reports over the
protocol). Base units, no colons, prefix dormouse_."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from statemachine import ServerState, SlotState

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30, 60)
RESUME_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.state = Gauge("dormouse_state", "1 for the server's current state, 0 for the others", ["state"], registry=r)
        # reason: startup (the first load), request, admin, retry: a startup load is not a wake,
        # and mixing it in would hide what users wait for.
        self.resume_seconds = Histogram(
            "dormouse_resume_seconds", "Time from load decision to a loaded, ready worker, by reason", ["reason"],
            buckets=RESUME_BUCKETS, registry=r
        )
        self.resume_phase_seconds = Histogram(
            "dormouse_resume_phase_seconds", "Duration of each phase of a load", ["reason", "phase"], buckets=RESUME_BUCKETS,
            registry=r
        )
        self.sleep_seconds = Histogram(
            "dormouse_sleep_seconds", "Time to tear the worker down and see it exit", buckets=LATENCY_BUCKETS, registry=r
        )
        self.sleep_phase_seconds = Histogram(
            "dormouse_sleep_phase_seconds", "Duration of each teardown step", ["phase"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.sleep_freed_bytes = Gauge(
            "dormouse_sleep_freed_bytes", "Bytes each teardown step gave back in the last sleep", ["phase"], registry=r
        )
        self.memory_reclaim_seconds = Gauge(
            "dormouse_memory_reclaim_seconds", "After the last worker exit, how long until its memory was seen given back", registry=r
        )
        self.sleeps = Counter("dormouse_sleeps_total", "Sleeps, by reason", ["reason"], registry=r)
        self.wakes = Counter("dormouse_wakes_total", "Wakes (loads after a sleep), by reason", ["reason"], registry=r)
        self.memory_bytes = Gauge(
            "dormouse_memory_bytes", "Memory held by the loaded worker, by device and component", ["device", "component"], registry=r
        )
        self.gpu_memory_used_bytes = Gauge(
            "dormouse_gpu_memory_used_bytes", "GPU memory used by the worker process (NVML)", ["gpu"], registry=r
        )
        self.worker_rss_bytes = Gauge("dormouse_worker_rss_bytes", "Resident memory of the worker process", registry=r)
        self.ttft_seconds = Histogram(
            "dormouse_time_to_first_token_seconds", "From request accepted to first token", ["start"], buckets=RESUME_BUCKETS, registry=r
        )
        self.inter_token_seconds = Histogram(
            "dormouse_inter_token_seconds", "Mean time between tokens of a request", buckets=LATENCY_BUCKETS, registry=r
        )
        self.request_seconds = Histogram(
            "dormouse_request_duration_seconds", "From request accepted to answer complete", ["endpoint", "outcome"], buckets=RESUME_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("dormouse_prompt_tokens_total", "Prompt tokens processed", registry=r)
        self.cached_prompt_tokens = Counter("dormouse_prompt_cached_tokens_total", "Prompt tokens reused from a slot's cache", registry=r)
        self.generated_tokens = Counter("dormouse_generated_tokens_total", "Tokens generated", registry=r)
        self.requests_in_flight = Gauge("dormouse_requests_in_flight", "Requests handed to the worker", registry=r)
        self.requests_waiting = Gauge("dormouse_requests_waiting", "Requests accepted and waiting for a worker", registry=r)
        self.requests = Counter("dormouse_requests_total", "Requests answered, by endpoint and status", ["endpoint", "status"], registry=r)
        self.slots = Gauge("dormouse_slots", "Slots by state", ["state"], registry=r)
        self.draft_tokens = Counter("dormouse_speculative_draft_tokens_total", "Tokens proposed by the draft model", registry=r)
        self.accepted_tokens = Counter("dormouse_speculative_accepted_tokens_total", "Drafted tokens the target accepted", registry=r)
        self.worker_restarts = Counter("dormouse_worker_restarts_total", "Workers that exited without being asked to", registry=r)
        self.load_failures = Counter("dormouse_load_failures_total", "Loads that failed", registry=r)
        self.memory_not_returned = Counter(
            "dormouse_memory_not_returned_total", "Worker exits after which its memory was not seen given back, by what ended it",
            ["after"], registry=r
        )
        self.poison_refusals = Counter(
            "dormouse_poison_requests_refused_total", "Requests refused because the same request was in flight at two worker deaths",
            registry=r
        )
        self.transition_errors = Counter(
            "dormouse_transition_errors_total", "Start or stop tasks that raised (each still ended its state)", registry=r
        )
        self.invalid_transitions = Counter(
            "dormouse_invalid_transitions_total", "Events with no row in the state table (a bug), dropped", ["state", "event"],
            registry=r
        )
        self.idle_timeout_seconds = Gauge("dormouse_idle_timeout_seconds", "Configured idle sleep timeout (-1: never)", registry=r)

        for state in ServerState:
            self.state.labels(state=state.value).set(0)
        for slot_state in SlotState:
            self.slots.labels(state=slot_state.value).set(0)
        for start in ("cold", "warm"):
            self.ttft_seconds.labels(start=start)
        for after in ("sleep", "crash", "load_failed"):
            self.memory_not_returned.labels(after=after)

    def observe_wake(self, record: dict, memory_by_device: dict[str, dict[str, int]]) -> None:
        reason = record["reason"]
        self.resume_seconds.labels(reason=reason).observe(record["seconds"])
        for phase in record["phases"]:
            self.resume_phase_seconds.labels(reason=reason, phase=phase["name"]).observe(phase["seconds"])
        self.memory_bytes.clear()
        for component, devices in memory_by_device.items():
            for device, size in devices.items():
                self.memory_bytes.labels(device=device, component=component).set(size)
        if record["reason"] != "startup":  # the first load is not a wake
            self.wakes.labels(reason=record["reason"]).inc()

    def observe_sleep(self, record: dict) -> None:
        self.sleep_seconds.observe(record["seconds"])
        self.sleeps.labels(reason=record["reason"]).inc()
        for phase in record["phases"]:
            self.sleep_phase_seconds.labels(phase=phase["name"]).observe(phase["seconds"])
            self.sleep_freed_bytes.labels(phase=phase["name"]).set(phase["freed_bytes"])
        self.memory_bytes.clear()

    def set_state(self, state: ServerState) -> None:
        for s in ServerState:
            self.state.labels(state=s.value).set(1 if s is state else 0)

    def set_slots(self, states: list[str]) -> None:
        for slot_state in SlotState:
            self.slots.labels(state=slot_state.value).set(sum(1 for s in states if s == slot_state.value))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
