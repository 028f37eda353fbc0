"""docs/reference/metrics.md, generated from the families the daemon registers.

Dormouse's own families are read from the objects that define them
(daemon/metrics.py's MetricFamilies and daemon/fleet/metrics.py's
FleetMetrics, built on a fresh registry as daemon/server.py builds them), and
only those the registry holds: the per-request detail kept outside it is not
on /metrics under its own name. The names other tools read
(`metrics_compat`, daemon/metrics_compat.py) are read from a scrape of one
model with every kind turned on. A family added anywhere shows up here;
tests/unit/test_docs_reference.py fails until the page is written again:

    python -m daemon.metrics_reference --write
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from daemon.config_reference import cell
from daemon.fleet.metrics import FleetMetrics
from daemon.metrics import MetricFamilies, Metrics

PAGE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "metrics.md"
REGENERATE = "python -m daemon.metrics_reference --write"
# Each kind of `metrics_compat` and how its names begin.
COMPAT_KINDS = {"llamacpp": "llamacpp:", "vllm": "vllm:", "otel": "gen_ai_"}
NO_SAMPLES = "labels come with the first request"
# What a histogram's or a summary's samples add to its labels: not labels one filters by.
SAMPLE_LABELS = {"le", "quantile"}


@dataclass(frozen=True)
class Family:
    name: str  # as a query spells it: a counter with its _total
    kind: str
    labels: tuple[str, ...]
    help: str
    # A compat family built from per-request detail has no series (so no labels to read) before a request.
    sampled: bool = True


def exposed_name(name: str, kind: str) -> str:
    return f"{name}_total" if kind == "counter" else name


def own_families() -> list[Family]:
    """Every family of Dormouse's own on /metrics, sorted by name."""
    registry = CollectorRegistry()
    families = MetricFamilies(registry)
    fleet = FleetMetrics(registry)
    registered = {metric.name for metric in registry.collect()}
    found: dict[str, Family] = {}
    for holder in (families, fleet):
        for metric in vars(holder).values():
            if isinstance(metric, MetricWrapperBase) and metric._name in registered:
                name = exposed_name(metric._name, metric._type)
                found[name] = Family(name, metric._type, tuple(metric._labelnames), metric._documentation)
    return sorted(found.values(), key=lambda f: f.name)


def compat_families() -> dict[str, list[Family]]:
    """The families each `metrics_compat` kind adds, read from a scrape of one model."""
    families = MetricFamilies(CollectorRegistry())
    Metrics(families, "chat")
    out: dict[str, list[Family]] = {}
    for kind, prefix in COMPAT_KINDS.items():
        body, _ = families.render([kind])
        listed: list[Family] = []
        for family in text_string_to_metric_families(body.decode()):
            if not family.name.startswith(prefix):
                continue  # Dormouse's own, rendered before them
            labels = dict.fromkeys(label for sample in family.samples for label in sample.labels
                                   if label not in SAMPLE_LABELS)
            listed.append(Family(exposed_name(family.name, family.type), family.type, tuple(labels),
                                 family.documentation, sampled=bool(family.samples)))
        out[kind] = sorted(listed, key=lambda f: f.name)
    return out


def table(families: list[Family]) -> list[str]:
    rows = ["| name | type | labels | help |", "| --- | --- | --- | --- |"]
    for f in families:
        labels = ", ".join(f"`{label}`" for label in f.labels) or ("-" if f.sampled else NO_SAMPLES)
        rows.append(f"| `{f.name}` | {f.kind} | {labels} | {cell(f.help)} |")
    return rows


def render() -> str:
    compat = compat_families()
    lines = [
        "# Metrics reference",
        "",
        f"Generated from the code by `{REGENERATE}`; "
        "`tests/unit/test_docs_reference.py` fails when this page and the code differ. "
        "How to scrape them, and what they are for, is in [Operations](../operations.md#metrics).",
        "",
        "Every series is in base units (seconds, bytes). A histogram's series are its name with "
        "`_bucket` (and the `le` label), `_sum` and `_count`.",
        "",
        "## Dormouse's own",
        "",
        *table(own_families()),
    ]
    for kind in COMPAT_KINDS:
        lines += [
            "",
            f"## `metrics_compat = [\"{kind}\"]`",
            "",
            f"Added after Dormouse's own series when `metrics_compat` names `{kind}`, derived from them at "
            "scrape time. The labels are those of a daemon serving one model"
            + (" (with several models, each series also carries a `model` label)." if kind == "llamacpp" else "."),
            "",
            *table(compat[kind]),
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m daemon.metrics_reference", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {PAGE.name} (default: print it)")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        PAGE.parent.mkdir(parents=True, exist_ok=True)
        PAGE.write_text(text)
        print(f"wrote {PAGE}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
