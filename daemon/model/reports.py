"""What /props shows of the last wake and the last sleep: plain dicts built
from what the supervisor and the worker reported."""

from __future__ import annotations

import time
from typing import Any

from daemon.model.supervisor import StartResult, StopResult


def wake_record(result: StartResult, reason: str, seconds: float) -> dict[str, Any]:
    phases = [{"name": "spawn", "seconds": result.spawn_seconds, "bytes": 0}]
    phases += [{"name": ph.name, "seconds": ph.seconds, "bytes": ph.bytes} for ph in result.ready.phases]
    return {
        "reason": reason,
        "at": time.time(),
        "seconds": seconds,
        "prespawned": result.prespawned,
        "worker_pid": result.worker.pid,
        "phases": phases,
    }


def sleep_record(result: StopResult, reason: str, seconds: float, memory_returned: dict[str, Any]) -> dict[str, Any]:
    report = result.report
    return {
        "reason": reason,
        "at": time.time(),
        "seconds": seconds,
        "worker_pid": result.pid,
        "clean": report is not None,  # False: it died during teardown or had to be killed
        "phases": [
            {"name": ph.name, "seconds": ph.seconds, "freed_bytes": ph.bytes, "skipped": ph.skipped}
            for ph in (report.phases if report else [])
        ],
        "worker_rss_before": report.rss_before if report else None,
        "devices_before": report.devices_before if report else [],
        "devices_after_teardown": report.devices_after if report else [],
        "memory_returned": memory_returned,
    }


def phase_seconds(record: dict[str, Any], digits: int = 4) -> dict[str, float]:
    return {ph["name"]: round(ph["seconds"], digits) for ph in record["phases"]}
