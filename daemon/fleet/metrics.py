"""The fleet's own metrics (per-model ones carry a `model` label in Metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class FleetMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.budget_bytes = Gauge("dormouse_fleet_memory_budget_bytes", "Memory the fleet may fill with models", registry=r)
        self.planned_bytes = Gauge(
            "dormouse_fleet_memory_planned_bytes", "Bytes of the models that hold (or are loading into) memory, as planned",
            registry=r)
        self.evictions = Counter("dormouse_fleet_evictions_total", "Models put to sleep to make room for another",
                                 ["model"], registry=r)
        self.admission_waits = Counter(
            "dormouse_fleet_load_waits_total", "Loads that had to wait for memory or for another load", ["model"], registry=r)
        self.admission_refusals = Counter(
            "dormouse_fleet_load_refusals_total", "Loads refused: it can never fit, or it did not fit within wake_timeout",
            ["model", "reason"], registry=r)
        self.drains = Counter(
            "dormouse_fleet_drains_total",
            "Times a busy model's new requests were held so that it could finish and make room for another",
            ["model"], registry=r)
        self.loads_in_progress = Gauge("dormouse_fleet_loads_in_progress", "Models loading right now", registry=r)
        self.loads_in_progress_max = Gauge(
            "dormouse_fleet_loads_in_progress_max", "The most models seen loading at the same moment (1: one at a time)",
            registry=r)
        self.footprint_bytes = Gauge(
            "dormouse_model_footprint_bytes", "A model's memory footprint: predicted from its GGUF, measured after a load",
            ["model", "source"], registry=r)
        self.footprint_error_ratio = Gauge(
            "dormouse_model_footprint_prediction_error_ratio", "(predicted - measured) / measured for the last load",
            ["model"], registry=r)
