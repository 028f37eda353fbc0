"""Every file the daemon reads back from its state directory is checked before use
(wake_history.json, footprints.json): bounded, regular, JSON without NaN or Infinity,
the expected shape, finite numbers in sane ranges. A file that fails is set aside
(renamed to *.bad) with a log line naming it and why, and the reader starts empty."""

from __future__ import annotations

import json
import math
import os

import pytest

from daemon.model.footprint_store import FootprintStore
from daemon.model.wake_prediction import MAX_SAMPLES, WakeHistory

SAMPLE = {"model": "m", "tier": "deep", "bytes": 1 << 30, "cold_bytes": 0, "seconds": 0.6, "weights_seconds": 0.5,
          "at": 1.0}


class Log:
    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict]] = []

    def warning(self, event, **fields):
        self.warnings.append((event, fields))


def history(*samples, raw: str | None = None) -> str:
    return raw if raw is not None else json.dumps({"version": 1, "samples": list(samples)})


HOSTILE_HISTORIES = {
    "infinity": history(raw=json.dumps({"version": 1, "samples": [SAMPLE]}).replace("0.6", "Infinity")),
    "minus infinity": history(raw=json.dumps({"version": 1, "samples": [SAMPLE]}).replace("0.5", "-Infinity")),
    "nan": history(raw=json.dumps({"version": 1, "samples": [SAMPLE]}).replace("0.5", "NaN")),
    "negative bytes": history({**SAMPLE, "bytes": -1}),
    "negative seconds": history({**SAMPLE, "seconds": -2.0, "weights_seconds": -3.0}),
    "zero seconds": history({**SAMPLE, "seconds": 0.0, "weights_seconds": 0.0}),
    "cold above bytes": history({**SAMPLE, "cold_bytes": 2 << 30}),
    "absurd bytes": history({**SAMPLE, "bytes": 10 ** 30}),
    "absurd seconds": history({**SAMPLE, "seconds": 1e300, "weights_seconds": 1.0}),
    "weights above total": history({**SAMPLE, "weights_seconds": 5.0}),
    "float bytes": history({**SAMPLE, "bytes": 1e9}),
    "bool bytes": history({**SAMPLE, "bytes": True, "cold_bytes": False}),
    "string seconds": history({**SAMPLE, "seconds": "0.6"}),
    "unknown tier": history({**SAMPLE, "tier": "hibernate"}),
    "long model": history({**SAMPLE, "model": "m" * 10_000}),
    "not an object": history("x"),
    "samples not a list": history(raw='{"version": 1, "samples": {"a": 1}}'),
    "top not an object": history(raw="[1, 2, 3]"),
    "too many samples": history(*[SAMPLE] * (MAX_SAMPLES + 1)),
    "nested": history(raw="[" * 100_000),
    "not utf-8": history(raw="\udcff"),
    "not json": history(raw="{not json"),
    "empty": history(raw=""),
    "huge": history(raw=json.dumps({"version": 1, "samples": [SAMPLE], "pad": "x" * (2 << 20)})),
}


@pytest.mark.parametrize("name", list(HOSTILE_HISTORIES))
def test_a_hostile_wake_history_is_set_aside_with_a_log_line(tmp_path, name):
    path = tmp_path / "wake_history.json"
    path.write_bytes(HOSTILE_HISTORIES[name].encode("utf-8", "surrogateescape"))
    log = Log()
    h = WakeHistory(tmp_path, log)
    assert h.samples == []
    assert not path.exists() and (tmp_path / "wake_history.json.bad").exists()
    assert [event for event, _ in log.warnings] == ["wake_history.set_aside"]
    fields = log.warnings[0][1]
    assert fields["path"] == str(path) and fields["error"] and fields["moved_to"].endswith(".bad")
    for tier in ("drowsy", "light", "deep"):
        prediction = h.predict("m", tier, 1 << 30, 1 << 29)
        assert math.isfinite(prediction.seconds) and prediction.seconds >= 0 and prediction.basis == "default"
    h.record("m", "deep", 1 << 30, 0, 0.6, 0.5)  # and the next wake starts a good file
    assert len(WakeHistory(tmp_path, log).samples) == 1


def test_a_good_wake_history_is_read_as_written(tmp_path):
    (tmp_path / "wake_history.json").write_text(history(SAMPLE, {**SAMPLE, "tier": "drowsy", "bytes": 0}))
    log = Log()
    assert len(WakeHistory(tmp_path, log).samples) == 2 and log.warnings == []


def test_a_fifo_as_wake_history_does_not_hang_and_is_set_aside(tmp_path):
    os.mkfifo(tmp_path / "wake_history.json")
    log = Log()
    assert WakeHistory(tmp_path, log).samples == []
    assert (tmp_path / "wake_history.json.bad").exists() and log.warnings


def test_a_sample_that_could_not_be_read_back_is_not_recorded(tmp_path):
    h = WakeHistory(tmp_path, Log())
    h.record("m", "deep", 1 << 30, 0, float("inf"), 0.5)
    h.record("m", "deep", 1 << 30, 0, -1.0, 0.0)
    h.record("m", "deep", 1 << 30, 0, float("nan"), 0.0)
    assert h.samples == [] and not (tmp_path / "wake_history.json").exists()


HOSTILE_FOOTPRINTS = {
    "infinity": '{"version": 1, "entries": {"k": {"model": Infinity}}}',
    "nan": '{"version": 1, "entries": {"k": {"model": NaN}}}',
    "absurd": json.dumps({"version": 1, "entries": {"k": {"model": 10 ** 30}}}),
    "too many components": json.dumps({"version": 1, "entries": {"k": {f"c{i}": 1 for i in range(100)}}}),
    "long key": json.dumps({"version": 1, "entries": {"k" * 10_000: {"model": 1}}}),
    "bool": json.dumps({"version": 1, "entries": {"k": {"model": True}}}),
    "huge": json.dumps({"version": 1, "entries": {}, "pad": "x" * (5 << 20)}),
}


@pytest.mark.parametrize("name", list(HOSTILE_FOOTPRINTS))
def test_a_hostile_footprints_file_is_set_aside_with_a_log_line(tmp_path, name):
    path = tmp_path / "footprints.json"
    path.write_text(HOSTILE_FOOTPRINTS[name])
    log = Log()
    store = FootprintStore(tmp_path, logger=log)
    assert store.get("k") is None
    assert not path.exists() and (tmp_path / "footprints.json.bad").read_text() == HOSTILE_FOOTPRINTS[name]
    assert len(log.warnings) == 1 and log.warnings[0][1]["path"] == str(path)
    store.put("k", {"model": 5})
    assert FootprintStore(tmp_path).get("k") == {"model": 5}
