"""Issue 30's surprises while running, on real daemon processes with the fake worker:
a reload names the keys it cannot apply; a load says when it begins and how long it
took; a read-only state directory is said once at start and by check-config."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import DaemonProcess

ROOT = Path(__file__).resolve().parents[2]
FAKE = {"DORMOUSE_WORKER_MODULE": "tests.fakes.fake_worker"}


def events(d: DaemonProcess) -> list[dict]:
    return [json.loads(line) for line in d.log().splitlines() if line.startswith("{")]


def wait_event(d: DaemonProcess, name: str, count: int = 1, timeout: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in events(d) if e["event"] == name]
        if len(found) >= count:
            return found
        time.sleep(0.05)
    raise AssertionError(f"no {name} in the log:\n{d.log()[-3000:]}")


def test_reload_names_what_needs_a_restart_and_a_load_is_logged_at_both_ends(tmp_path, bundled_model):
    config = tmp_path / "d.toml"
    config.write_text(f'model = "{bundled_model}"\nctx_size = 4096\nsleep_idle_seconds = -1\n')
    d = DaemonProcess("--config", str(config), "--log-level", "info", env=FAKE, log_path=tmp_path / "d.log")
    try:
        d.wait_state("ready")
        (begin,) = wait_event(d, "load.begin")
        (done,) = wait_event(d, "wake.done")
        assert begin["file"] == done["file"] == str(Path(bundled_model).resolve())
        assert begin["bytes"] == os.path.getsize(bundled_model) and begin["device"] in ("CPU", "GPU")
        assert isinstance(done["seconds"], float) and done["seconds"] > 0
        assert events(d).index(begin) < events(d).index(done)

        config.write_text(f'model = "{bundled_model}"\nctx_size = 8192\nparallel = 2\nsleep_idle_seconds = 30\n')
        d.proc.send_signal(signal.SIGHUP)
        (warning,) = wait_event(d, "reload.needs_restart")
        assert warning["level"] == "warning" and warning["keys"] == ["ctx_size", "parallel"]
        assert "needs a restart" in warning["error"]
        assert d.props()["sleep_idle_seconds"] == 30  # what a reload can apply, it applied
        assert d.props()["n_ctx"] == 4096  # and the rest waits for a restart, as the warning says

        config.write_text(f'model = "{bundled_model}"\nctx_size = 4096\nsleep_idle_seconds = 40\n')
        d.proc.send_signal(signal.SIGHUP)
        wait_event(d, "reload.done", count=2)
        assert len([e for e in events(d) if e["event"] == "reload.needs_restart"]) == 1  # nothing skipped now
    finally:
        d.stop()


def test_a_long_load_says_it_is_still_reading(tmp_path, bundled_model):
    """Between load.begin and wake.done of a load longer than load_progress.FIRST_AFTER, a
    load.progress line says the seconds so far, the prediction and the bytes left to read."""
    from daemon.model.load_progress import FIRST_AFTER

    d = DaemonProcess("--model", bundled_model, "--log-level", "info", "--sleep-idle-seconds", "-1",
                      env={**FAKE, "FAKE_LOAD_SECONDS": str(FIRST_AFTER + 1.5)}, log_path=tmp_path / "d.log")
    try:
        d.wait_state("ready", timeout=60)
        (done,) = wait_event(d, "wake.done")
        logged = events(d)
        begin = next(e for e in logged if e["event"] == "load.begin")
        progress = [e for e in logged if e["event"] == "load.progress"]
        assert progress, "no load.progress line during a load of more than FIRST_AFTER seconds"
        assert logged.index(begin) < logged.index(progress[0]) and logged.index(progress[-1]) < logged.index(done)
        assert progress[0]["seconds"] >= FIRST_AFTER - 0.5 and progress[0]["bytes_from_disk_left"] >= 0
    finally:
        d.stop()


def _in_a_read_only_mount(command: str, directory: Path) -> subprocess.CompletedProcess:
    """command under `unshare`: a private mount namespace where `directory` is a read-only tmpfs."""
    if not shutil.which("unshare"):
        pytest.skip("unshare is not installed")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode:
        pytest.skip("user and mount namespaces are not available here")
    directory.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o ro tmpfs "{directory}" && {command}'],
                          capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, **FAKE})


def test_a_read_only_state_dir_is_said_once_at_start_and_by_check_config(tmp_path, bundled_model):
    state = tmp_path / "ro-state"
    python = sys.executable
    check = _in_a_read_only_mount(f'{python} -m daemon check-config --model "{bundled_model}" --state-dir "{state}"',
                                  state)
    assert check.returncode == 0, check.stderr
    shown = json.loads(check.stdout)
    assert "read-only file system" in shown["state_dir"]["warning"]
    assert "warning: state directory" in check.stderr and "prompt cache's disk tier" in check.stderr

    # The daemon: started, asked once, stopped. One warning line names the losses; it still serves.
    script = (f"import subprocess, sys, time, httpx, signal, os\n"
              f"p = subprocess.Popen([{python!r}, '-m', 'daemon', 'serve', '--model', {bundled_model!r}, "
              f"'--state-dir', {str(state)!r}, '--port', '0', '--log-format', 'json', '--log-level', 'info'], "
              f"stderr=subprocess.PIPE, text=True)\n"
              f"lines = []\n"
              f"for line in p.stderr:\n"
              f"    lines.append(line)\n"
              f"    if '\"state\"' in line and '\"ready\"' in line: break\n"
              f"p.send_signal(signal.SIGTERM)\n"
              f"lines += p.stderr.read().splitlines(True)\n"
              f"print(''.join(lines)); sys.exit(p.wait())\n")
    (tmp_path / "run.py").write_text(script)
    served = _in_a_read_only_mount(f'{python} "{tmp_path / "run.py"}"', state)
    assert served.returncode == 0, served.stdout + served.stderr
    logged = [json.loads(line) for line in served.stdout.splitlines() if line.startswith("{")]
    warnings = [e for e in logged if e["level"] == "warning" and e["event"].startswith("state_dir.")]
    assert [e["event"] for e in warnings] == ["state_dir.read_only"], warnings
    assert "read-only file system" in warnings[0]["error"] and "wake-time history" in warnings[0]["error"]
    assert any(e["event"] == "state" and e.get("after") == "ready" for e in logged)
