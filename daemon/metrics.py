"""Prometheus metrics, in the daemon process only (the worker reports over the
protocol). Base units, no colons, prefix dormouse_.

Every per-model series carries a `model` label: `MetricFamilies` holds the
families once per process (one registry), and `Metrics` is one model's view
of them, with the same attribute names as the families, each already bound to
the model. Code that serves one model never spells the label.

A few per-request facts (token counts, prefill and decode seconds, queue time,
finish reason) are kept in families outside the registry: only the names other
tools read (daemon/metrics_compat.py, `metrics_compat`) show them, so that
Dormouse's own text is the same whether those are on or off."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from daemon.metrics_compat import CompatExport
from statemachine import ServerState, SlotState

if TYPE_CHECKING:
    from daemon.protocol import Done, SlotStates

# No `<name>_created` series beside each counter and histogram (one per series, 49 on a fresh
# daemon): Prometheus reads the text format, which needs none, and they doubled what a scrape
# lists. prometheus_client has one switch for this, for the whole process (the daemon's alone).
disable_created_metrics()

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30, 60)
RESUME_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
REQUEST_TOKEN_BUCKETS = (*(m * 10**e for e in range(6) for m in (1, 2, 5)), 10**6)  # 1, 2, 5, 10, ... as vLLM's
# A Done's finish_reason -> the reason vLLM counts it under (request_success_total{finished_reason}).
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


class Bound:
    """A metric family with its `model` label set: `.labels(**rest)` for the
    other labels, or inc/set/observe directly when `model` is the only one."""

    def __init__(self, family, model: str) -> None:
        self._family = family
        self._model = model

    def labels(self, **labels):
        return self._family.labels(model=self._model, **labels)

    def clear(self) -> None:
        """Remove this model's series only (the family's clear() would take every model's)."""
        for labelvalues in list(self._family._metrics):
            if labelvalues[0] == self._model:
                self._family.remove(*labelvalues)

    def __getattr__(self, name: str):
        return getattr(self._family.labels(model=self._model), name)


class MetricFamilies:
    """Every per-model family, created once per process in one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.names: list[str] = []
        self._define(r)
        self._define_request_detail()
        self.names = [name for name, value in vars(self).items() if hasattr(value, "_metrics")]
        self._compat: CompatExport | None = None

    def render(self, compat: Sequence[str] = ()) -> tuple[bytes, str]:
        """Prometheus text: the registry's families; then, for each kind in
        `compat` (llamacpp, vllm, otel), the names that kind's tools read."""
        body = generate_latest(self.registry)
        if compat:
            if self._compat is None:  # it keeps the window of llama-server's throughput gauges
                self._compat = CompatExport(self)
            body += self._compat.render(compat)
        return body, CONTENT_TYPE_LATEST

    def _define_request_detail(self) -> None:
        """Per request, at its Done: outside the registry (registry=None), read only
        by the compatibility exports."""
        M = ["model"]  # noqa: N806
        self.request_prompt_tokens = Histogram(
            "dormouse_request_prompt_tokens", "Prompt tokens of each finished generation", M,
            buckets=REQUEST_TOKEN_BUCKETS, registry=None)
        self.request_generation_tokens = Histogram(
            "dormouse_request_generation_tokens", "Generated tokens of each finished generation (all choices)", M,
            buckets=REQUEST_TOKEN_BUCKETS, registry=None)
        self.request_max_generation_tokens = Histogram(
            "dormouse_request_max_generation_tokens", "Generated tokens of each finished generation, per choice", M,
            buckets=REQUEST_TOKEN_BUCKETS, registry=None)
        self.request_queue_seconds = Histogram(
            "dormouse_request_queue_seconds", "From accepted until the worker began it (a wake included)", M,
            buckets=RESUME_BUCKETS, registry=None)
        self.request_prefill_seconds = Histogram(
            "dormouse_request_prefill_seconds", "Reading the prompt, to the first token", M, buckets=RESUME_BUCKETS,
            registry=None)
        self.request_decode_seconds = Histogram(
            "dormouse_request_decode_seconds", "From the first token to the last", M, buckets=RESUME_BUCKETS,
            registry=None)
        self.request_inference_seconds = Histogram(
            "dormouse_request_inference_seconds", "Prefill and decode", M, buckets=RESUME_BUCKETS, registry=None)
        self.requests_finished = Counter(
            "dormouse_requests_finished", "Generations the worker finished, by vLLM's finished_reason", M + ["reason"],
            registry=None)

    def _define(self, r: CollectorRegistry) -> None:
        M = ["model"]  # noqa: N806 - the label every family here starts with
        self.state = Gauge("dormouse_state", "1 for the server's current state, 0 for the others", M + ["state"], registry=r)
        # reason: startup (the first load), request, admin, retry: a startup load is not a wake,
        # and mixing it in would hide what users wait for.
        self.resume_seconds = Histogram(
            "dormouse_resume_seconds", "Time from load decision to a loaded, ready worker, by reason", M + ["reason"],
            buckets=RESUME_BUCKETS, registry=r
        )
        self.resume_phase_seconds = Histogram(
            "dormouse_resume_phase_seconds", "Duration of each phase of a load", M + ["reason", "phase"], buckets=RESUME_BUCKETS,
            registry=r
        )
        self.sleep_seconds = Histogram(
            "dormouse_sleep_seconds", "Time to tear the worker down and see it exit", M, buckets=LATENCY_BUCKETS, registry=r
        )
        self.sleep_phase_seconds = Histogram(
            "dormouse_sleep_phase_seconds", "Duration of each teardown step", M + ["phase"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.sleep_freed_bytes = Gauge(
            "dormouse_sleep_freed_bytes", "Bytes each teardown step gave back in the last sleep", M + ["phase"], registry=r
        )
        self.memory_reclaim_seconds = Gauge(
            "dormouse_memory_reclaim_seconds", "After the last worker exit, how long until its memory was seen given back", M, registry=r
        )
        self.sleeps = Counter("dormouse_sleeps_total", "Sleeps, by reason", M + ["reason"], registry=r)
        self.wakes = Counter("dormouse_wakes_total", "Wakes (loads after a sleep), by reason", M + ["reason"], registry=r)
        self.memory_bytes = Gauge(
            "dormouse_memory_bytes", "Memory held by the loaded worker, by device and component", M + ["device", "component"], registry=r
        )
        self.gpu_memory_used_bytes = Gauge(
            "dormouse_gpu_memory_used_bytes", "GPU memory used by the worker process (NVML)", M + ["gpu"], registry=r
        )
        self.worker_rss_bytes = Gauge("dormouse_worker_rss_bytes", "Resident memory of the worker process", M, registry=r)
        self.ttft_seconds = Histogram(
            "dormouse_time_to_first_token_seconds", "From request accepted to first token", M + ["start"], buckets=RESUME_BUCKETS, registry=r
        )
        self.inter_token_seconds = Histogram(
            "dormouse_inter_token_seconds", "Mean time between tokens of a request", M, buckets=LATENCY_BUCKETS, registry=r
        )
        self.request_seconds = Histogram(
            "dormouse_request_duration_seconds", "From request accepted to answer complete", M + ["endpoint", "outcome"], buckets=RESUME_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("dormouse_prompt_tokens_total", "Prompt tokens processed", M, registry=r)
        self.generated_tokens = Counter("dormouse_generated_tokens_total", "Tokens generated", M, registry=r)
        self.requests_in_flight = Gauge("dormouse_requests_in_flight", "Requests handed to the worker", M, registry=r)
        self.requests_waiting = Gauge("dormouse_requests_waiting", "Requests accepted and waiting for a worker", M, registry=r)
        self.requests = Counter("dormouse_requests_total", "Requests answered, by endpoint and status", M + ["endpoint", "status"], registry=r)
        self.slots = Gauge("dormouse_slots", "Slots by state", M + ["state"], registry=r)
        self.decodes = Counter("dormouse_decodes_total", "llama_decode calls of the model for prompts and generation "
                               "(a step of several slots is one call; embeddings not counted)", M, registry=r)
        self.decode_busy_slots = Counter("dormouse_decode_busy_slots_total", "Busy slots summed over the decodes "
                                         "(divided by dormouse_decodes_total: the mean slots per decode)", M, registry=r)
        self.sequence_tokens_max = Gauge("dormouse_sequence_tokens_max", "The longest sequence (prompt and answer) a "
                                         "slot has held since the daemon started", M, registry=r)
        self.speculative_rounds = Counter("dormouse_speculative_rounds_total", "Verification steps that checked one or "
                                          "more drafted tokens", M, registry=r)
        self.draft_tokens = Counter("dormouse_speculative_draft_tokens_total", "Tokens proposed by the draft model", M, registry=r)
        self.accepted_tokens = Counter("dormouse_speculative_accepted_tokens_total", "Drafted tokens the target accepted", M, registry=r)
        self.worker_restarts = Counter("dormouse_worker_restarts_total", "Workers that exited without being asked to", M, registry=r)
        self.load_failures = Counter("dormouse_load_failures_total", "Loads that failed", M, registry=r)
        self.memory_not_returned = Counter(
            "dormouse_memory_not_returned_total", "Worker exits after which its memory was not seen given back, by what ended it",
            M + ["after"], registry=r
        )
        self.poison_refusals = Counter(
            "dormouse_poison_requests_refused_total", "Requests refused because the same request was in flight at two worker deaths",
            M, registry=r
        )
        self.transition_errors = Counter(
            "dormouse_transition_errors_total", "Start or stop tasks that raised (each still ended its state)", M, registry=r
        )
        self.invalid_transitions = Counter(
            "dormouse_invalid_transitions_total", "Events with no row in the state table (a bug), dropped", M + ["state", "event"],
            registry=r
        )
        # One family for the prompt cache, dormouse_prompt_cache_* (its tiers: daemon/worker/prompt_cache.py):
        # hits, misses and restored tokens are counted once, by tier, not again for the disk tier alone.
        self.kv_saved_bytes = Counter("dormouse_prompt_cache_saved_bytes_total",
                                      "Bytes of prompt-cache files the worker wrote (its own disk tier and the shared "
                                      "tier, each copy counted), reported at each sleep", M, registry=r)
        self.kv_rejected = Counter("dormouse_prompt_cache_rejected_files_total",
                                   "Disk-tier files deleted as untrustworthy, by reason", M + ["reason"], registry=r)
        self.kv_restore_seconds = Histogram("dormouse_prompt_cache_restore_seconds",
                                            "Time to restore a prompt from the ram or disk tier",
                                            M, buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_cache_hits = Counter("dormouse_prompt_cache_hits_total",
                                         "Requests whose cached prompt tokens came from this tier", M + ["tier"], registry=r)
        self.prompt_cache_restored_tokens = Counter("dormouse_prompt_cache_tokens_total",
                                                    "Prompt tokens not read again, by the tier they came from",
                                                    M + ["tier"], registry=r)
        # The disk tier's hits by where the file was (issue 31): state_dir or shared_cache_dir.
        self.prompt_cache_disk_origin_hits = Counter(
            "dormouse_prompt_cache_disk_hits_total",
            "Requests whose cached prompt tokens came from a disk-tier file, by origin: own (state_dir) or shared "
            "(shared_cache_dir, written by any replica)", M + ["origin"], registry=r)
        self.prompt_cache_disk_origin_tokens = Counter(
            "dormouse_prompt_cache_disk_tokens_total",
            "Prompt tokens restored from disk-tier files, by origin: own (state_dir) or shared (shared_cache_dir)",
            M + ["origin"], registry=r)
        self.prompt_cache_shared_reachable = Gauge(
            "dormouse_prompt_cache_shared_reachable",
            "1 while shared_cache_dir is reachable from the worker, 0 while it serves from its own tier alone "
            "(absent without shared_cache_dir)", M, registry=r)
        self.prompt_cache_misses = Counter("dormouse_prompt_cache_misses_total",
                                           "Requests that looked in every tier and found nothing to keep", M, registry=r)
        self.prompt_cache_bytes = Gauge("dormouse_prompt_cache_bytes", "Bytes the prompt cache holds, by tier",
                                        M + ["tier"], registry=r)
        self.prompt_cache_entries = Gauge("dormouse_prompt_cache_entries", "Prompt prefixes the tier holds",
                                          M + ["tier"], registry=r)
        self.prompt_cache_write_errors = Counter(
            "dormouse_prompt_cache_write_errors_total",
            "Prompt cache entries not written to disk (a full, failing or read-only state directory)", M, registry=r)
        self.unclean_sleeps = Counter("dormouse_unclean_sleeps_total",
                                      "Sleeps whose worker died or was killed before its report", M + ["reason"],
                                      registry=r)
        self.prompt_cache_evictions = Counter("dormouse_prompt_cache_evictions_total",
                                              "Entries dropped to stay within the tier's budget", M + ["tier"], registry=r)
        self.idle_timeout_seconds = Gauge("dormouse_idle_timeout_seconds", "Configured idle sleep timeout (-1: never)", M, registry=r)
        # The sleep tiers (daemon/model/controller.py): which one, what a wake from it should take, how it went.
        self.sleep_tier = Gauge("dormouse_sleep_tier", "1 for the sleep tier the model is in (awake while ready; "
                                "going down: the tier it goes to; waking: the one it wakes from; starting, a first "
                                "load, failed, stopping: none)",
                                M + ["tier"], registry=r)
        self.wake_predicted_seconds = Gauge("dormouse_wake_predicted_seconds",
                                            "Predicted duration of a wake from the current tier (0 while awake)", M, registry=r)
        self.wake_prediction_error_seconds = Histogram(
            "dormouse_wake_prediction_error_seconds", "Measured wake less its prediction, absolute", M + ["tier"],
            buckets=LATENCY_BUCKETS, registry=r)
        self.wake_refusals = Counter("dormouse_wake_refusals_total",
                                     "Requests refused at once: the predicted wake exceeds what they may wait", M, registry=r)
        self.keeper_bytes = Gauge("dormouse_keeper_bytes", "Bytes of the model's files the light tier's keeper holds "
                                  "warm in the page cache", M + ["kind"], registry=r)


class Metrics:
    """One model's view of the families (a fresh registry when none is given,
    as tests and a fleet of one need)."""

    def __init__(self, families: MetricFamilies | None = None, model: str = "default") -> None:
        families = families or MetricFamilies()
        self.registry = families.registry
        self.model = model
        for name in families.names:
            setattr(self, name, Bound(getattr(families, name), model))
        for state in ServerState:
            self.state.labels(state=state.value).set(0)
        for slot_state in SlotState:
            self.slots.labels(state=slot_state.value).set(0)
        for start in ("cold", "warm"):
            self.ttft_seconds.labels(start=start)
        for after in ("sleep", "crash", "load_failed"):
            self.memory_not_returned.labels(after=after)
        for tier in ("slot", "ram", "disk"):
            self.prompt_cache_hits.labels(tier=tier)
            self.prompt_cache_restored_tokens.labels(tier=tier)
        self.prompt_cache: dict[str, dict[str, float]] = {}  # the worker's latest PromptCache.summary (/props)
        self._evictions_seen: dict[str, float] = {}
        self._write_errors_seen = 0  # the worker's count, cumulative in one worker

    def observe_wake(self, record: dict, memory_by_device: dict[str, dict[str, int]]) -> None:
        self._write_errors_seen = 0  # a new worker counts its write errors from 0
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

    def observe_write_errors(self, count: int) -> None:
        """The worker's write errors so far (a new worker counts from 0 again)."""
        seen = self._write_errors_seen
        self.prompt_cache_write_errors.inc(count - seen if count >= seen else count)
        self._write_errors_seen = count

    def observe_sleep(self, record: dict) -> None:
        self.sleep_seconds.observe(record["seconds"])
        self.sleeps.labels(reason=record["reason"]).inc()
        if not record.get("clean", True):
            self.unclean_sleeps.labels(reason=record["reason"]).inc()
        for phase in record["phases"]:
            self.sleep_phase_seconds.labels(phase=phase["name"]).observe(phase["seconds"])
            if phase["name"] == "kv_save":  # bytes written, not freed
                self.kv_saved_bytes.inc(phase["freed_bytes"])
            else:
                self.sleep_freed_bytes.labels(phase=phase["name"]).set(phase["freed_bytes"])
        self.memory_bytes.clear()

    def observe_request(self, done: Done, accepted_at: float, choices: int = 1) -> None:
        """A generation's end (its protocol Done), for the compatibility exports and the prompt cache's tiers."""
        self.observe_prompt_cache(done)
        reason = FINISH_REASONS.get(done.finish_reason, "error")
        self.requests_finished.labels(reason=reason).inc()
        if reason == "error":  # refused by the worker (too long, invalid): nothing was computed
            return
        self.request_prompt_tokens.observe(done.prompt_tokens)
        self.request_generation_tokens.observe(done.completion_tokens)
        self.request_max_generation_tokens.observe(-(-done.completion_tokens // max(choices, 1)))
        self.request_prefill_seconds.observe(done.prompt_seconds)
        self.request_decode_seconds.observe(done.generation_seconds)
        self.request_inference_seconds.observe(done.prompt_seconds + done.generation_seconds)
        waited = time.monotonic() - accepted_at - done.prompt_seconds - done.generation_seconds
        self.request_queue_seconds.observe(max(waited, 0.0))

    def observe_prompt_cache(self, done: Done) -> None:
        if done.cache_tier in ("slot", "ram", "disk"):
            self.prompt_cache_hits.labels(tier=done.cache_tier).inc()
            self.prompt_cache_restored_tokens.labels(tier=done.cache_tier).inc(done.cached_tokens)
        elif done.kv_lookup == "miss":
            self.prompt_cache_misses.inc()
        if not done.prompt_cache:
            return
        self.prompt_cache = done.prompt_cache
        for tier in ("ram", "disk"):
            held = done.prompt_cache.get(tier, {})
            self.prompt_cache_bytes.labels(tier=tier).set(held.get("bytes", 0))
            self.prompt_cache_entries.labels(tier=tier).set(held.get("entries", 0))
            count = held.get("evictions", 0)  # cumulative in one worker: a new worker starts again from 0
            seen = self._evictions_seen.get(tier, 0)
            self.prompt_cache_evictions.labels(tier=tier).inc(count - seen if count >= seen else count)
            self._evictions_seen[tier] = count
        self.observe_write_errors(done.prompt_cache.get("disk", {}).get("write_errors", 0))
        self.observe_disk_origins(done.prompt_cache.get("disk", {}))

    def observe_disk_origins(self, disk: dict) -> None:
        """The worker's cumulative disk hits by origin (own, shared) as counters: a new worker starts again
        from 0, as for evictions."""
        for origin, counts in (disk.get("origin") or {}).items():
            for what, family in (("hits", self.prompt_cache_disk_origin_hits),
                                 ("restored_tokens", self.prompt_cache_disk_origin_tokens)):
                count, key = counts.get(what, 0), f"{origin}.{what}"
                seen = self._evictions_seen.get(key, 0)
                family.labels(origin=origin).inc(count - seen if count >= seen else count)
                self._evictions_seen[key] = count
        if "shared" in disk:
            self.prompt_cache_shared_reachable.set(disk["shared"].get("reachable", 0))

    def set_disk_tier(self, saved: dict) -> None:
        """The disk tier as the daemon reads it from the files (kv_files.describe_dir): while the
        model sleeps no worker reports it, and the sleep itself has just written to it."""
        self.prompt_cache_bytes.labels(tier="disk").set(saved["bytes"])
        self.prompt_cache_entries.labels(tier="disk").set(saved["files"])

    def set_state(self, state: ServerState) -> None:
        for s in ServerState:
            self.state.labels(state=s.value).set(1 if s is state else 0)

    def set_tier(self, tier: str | None) -> None:
        """tier: awake, drowsy, light or deep; None: none of them (neither awake nor asleep)."""
        for name in ("awake", "drowsy", "light", "deep"):
            self.sleep_tier.labels(tier=name).set(1 if name == tier else 0)

    def add_decodes(self, states: "SlotStates") -> None:
        """The worker's decode counts since its last report (daemon.protocol.SlotStates)."""
        self.decodes.inc(states.decodes)
        self.decode_busy_slots.inc(states.busy_slot_decodes)
        self.speculative_rounds.inc(states.draft_rounds)
        if states.tokens_max > self.sequence_tokens_max._value.get():
            self.sequence_tokens_max.set(states.tokens_max)

    def set_slots(self, states: list[str]) -> None:
        for slot_state in SlotState:
            self.slots.labels(state=slot_state.value).set(sum(1 for s in states if s == slot_state.value))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
