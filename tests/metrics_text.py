"""Reading Prometheus text in tests: a series is found by its name and a
subset of its labels (every per-model series also carries `model`)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str, name: str, **labels: str) -> list[float]:
    found = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == str(v) for k, v in labels.items()):
                found.append(sample.value)
    return found


def value(text: str, name: str, **labels: str) -> float:
    """The sum over the matching series; 0 when there is none (a counter never incremented)."""
    return sum(samples(text, name, **labels))
