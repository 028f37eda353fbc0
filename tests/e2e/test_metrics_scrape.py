"""A real daemon's /metrics after a sleep and a wake (issue 30): the idle-slots
gauge counts the woken worker's slots before any request has run on them, and
the scrape lists no `_created` series."""

import shutil
import subprocess

import pytest

from tests.metrics_text import value

pytestmark = pytest.mark.e2e

PARALLEL = 2


def slots(d, state: str) -> float:
    return value(d.http.get("/metrics").text, "dormouse_slots", state=state)


def test_the_idle_slots_gauge_counts_the_slots_after_a_wake(start_daemon):
    d = start_daemon("--parallel", str(PARALLEL), "--sleep-idle-seconds", "-1")
    d.wait_state("ready", timeout=180)
    assert slots(d, "idle") == PARALLEL  # the first load: no request has run yet

    assert d.http.post("/sleep").status_code == 200
    d.wait_state("sleeping")
    assert slots(d, "idle") == 0  # no worker: no slot of any state
    assert sum(slots(d, s) for s in ("started", "processing_prompt", "generating")) == 0

    assert d.http.post("/wake").status_code == 200
    d.wait_state("ready", timeout=120)
    # The woken worker reports its slots only when one changes: the gauge must not wait for that.
    assert slots(d, "idle") == PARALLEL, d.http.get("/metrics").text
    assert len(d.props()["slots"]) == PARALLEL


def test_a_scrape_of_a_woken_daemon_has_no_created_series_and_passes_promtool(start_daemon):
    d = start_daemon("--sleep-idle-seconds", "-1")
    d.wait_state("ready", timeout=180)
    assert d.http.post("/sleep").status_code == 200
    d.wait_state("sleeping")
    assert d.http.post("/wake").status_code == 200
    d.wait_state("ready", timeout=120)
    text = d.http.get("/metrics").text
    assert value(text, "dormouse_wakes_total") == 1  # the counters a `_created` would follow are there
    assert "_created" not in text
    assert "dormouse_kv_cache" not in text  # the prompt cache is one family, dormouse_prompt_cache_*
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), proc.stdout + proc.stderr
