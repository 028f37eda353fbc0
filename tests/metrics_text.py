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


def selector(name: str, labels: dict[str, str]) -> str:
    """A sample as a PromQL series selector: name{label="value", ...}."""
    def quoted(text: str) -> str:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'

    inner = ",".join(f"{key}={quoted(val)}" for key, val in sorted(labels.items()))
    return f"{name}{{{inner}}}" if inner else name


def series(texts: list[str], skip_created: bool = True) -> dict[str, list[float | None]]:
    """Several scrapes as series: each sample's selector -> its value in each
    scrape, None where that scrape lacks it (a series born later)."""
    found: dict[str, list[float | None]] = {}
    for i, text in enumerate(texts):
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if skip_created and sample.name.endswith("_created"):
                    continue
                found.setdefault(selector(sample.name, sample.labels), [None] * len(texts))[i] = sample.value
    return found
