"""SIGTERM must end within systemd's TimeoutStopSec, whatever the worker does:
the unit's budget covers the daemon's own bounds (drain, cancel grace,
teardown, HTTP close), so systemd never has to SIGKILL a daemon mid-teardown."""

import re
from pathlib import Path

from config import Settings
from daemon.server import stop_budget

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "dormouse.service"


def unit_timeout_stop_seconds() -> float:
    match = re.search(r"^TimeoutStopSec=(\d+)s?$", UNIT.read_text(), re.MULTILINE)
    assert match, "the unit sets TimeoutStopSec"
    return float(match.group(1))


def test_default_stop_budget_fits_the_unit():
    budget = stop_budget(Settings())
    assert budget <= unit_timeout_stop_seconds(), f"daemon may take {budget}s, the unit allows {unit_timeout_stop_seconds()}s"


def test_raising_the_drain_raises_the_budget():
    # The budget is derived from the settings, not a constant that could drift from them.
    assert stop_budget(Settings(shutdown_timeout=100)) > unit_timeout_stop_seconds()


def test_the_drain_grace_counts_only_with_an_agent_and_still_fits():
    plain, behind_haproxy = stop_budget(Settings()), stop_budget(Settings(agent_port=8081))
    assert behind_haproxy == plain + Settings().drain_grace_seconds
    assert behind_haproxy <= unit_timeout_stop_seconds()
