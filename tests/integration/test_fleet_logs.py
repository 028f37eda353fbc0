"""A fleet's log lines say which model they are about.

With several models, "wake.done", "sleep.done" and "state" lines come from
one controller per model; without the model's id an operator reading the log
(or a test checking that loads never overlapped) cannot tell whose wake took
4 s or which model went to sleep. The fleet's own lines (fleet.admit,
fleet.evict) already carry `model`. Fake workers: real processes and
protocol, no llama.cpp."""

from __future__ import annotations

import json

from tests.conftest import DaemonProcess
from tests.fixtures.fleet import write_toml
from tests.fixtures.tiny_model import write_tiny_model


def test_per_model_log_lines_carry_the_model_id(tmp_path):
    gguf = tmp_path / "m.gguf"
    write_tiny_model(gguf)  # the fake worker never loads it; the daemon checks its header and size
    toml = write_toml(tmp_path / "fleet.toml", {"one": {"path": str(gguf)}, "two": {"path": str(gguf)}},
                      memory_budget="1GiB", sleep_idle_seconds=-1, spawn_ahead=False,
                      state_dir=str(tmp_path / "state"), worker_module="tests.fakes.fake_worker")
    d = DaemonProcess("--config", str(toml), "--log-level", "info", log_path=tmp_path / "daemon.log")
    try:
        d.wait_state("ready")
        r = d.http.post("/v1/completions", json={"model": "two", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert d.http.post("/models/unload", json={"model": "two"}).status_code == 200
    finally:
        assert d.stop() == 0
    lines = [json.loads(line[line.index("{"):]) for line in d.log().splitlines() if "{" in line]
    per_model = [line for line in lines if line.get("event") in ("wake.done", "sleep.done", "state")]
    assert {line.get("event") for line in per_model} == {"wake.done", "sleep.done", "state"}
    unnamed = [line for line in per_model if line.get("model") not in ("one", "two")]
    assert not unnamed, f"{len(unnamed)} of {len(per_model)} per-model lines name no model, e.g. {unnamed[:2]}"
    woke = {line["model"] for line in per_model if line["event"] == "wake.done"}
    assert woke == {"one", "two"}
