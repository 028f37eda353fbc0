"""Issue 16, section 6: one daemon per state directory.

Two daemons on one state_dir rewrote each other's saved prompt caches and
footprints. The second now refuses to start, naming the first's pid; a lock
file left by a dead daemon does not block. Real daemon processes, fake
workers.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from daemon.state_lock import LOCK_NAME, StateDirInUse, StateDirLock
from tests.conftest import DaemonProcess

FAKE = {"DORMOUSE_WORKER_MODULE": "tests.fakes.fake_worker"}


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_second_lock_on_the_directory_names_the_holder(tmp_path):
    with StateDirLock(tmp_path / "state") as held:
        assert (tmp_path / "state" / LOCK_NAME).read_text() == f"{os.getpid()}\n"
        with pytest.raises(StateDirInUse) as info:
            StateDirLock(tmp_path / "state").acquire()
        assert info.value.pid == os.getpid()
        assert f"pid {os.getpid()}" in str(info.value) and str(tmp_path / "state") in str(info.value)
        assert held.path.exists()
    StateDirLock(tmp_path / "state").acquire().release()  # released: free again


def test_a_stale_lock_file_of_a_dead_process_does_not_block(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / LOCK_NAME).write_text(f"{dead_pid()}\n")
    with StateDirLock(state):
        assert (state / LOCK_NAME).read_text() == f"{os.getpid()}\n"


def test_a_lock_held_by_another_process_is_refused_until_it_exits(tmp_path):
    state = tmp_path / "state"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from daemon.state_lock import StateDirLock; "
                               f"StateDirLock({str(state)!r}).acquire(); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StateDirInUse) as info:
            StateDirLock(state).acquire()
        assert info.value.pid == holder.pid
    finally:
        holder.kill()
        holder.wait()
    StateDirLock(state).acquire().release()  # the kernel dropped the dead holder's lock


def test_a_symlink_planted_as_the_lock_file_is_not_followed(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (state / LOCK_NAME).symlink_to(victim)
    with pytest.raises(OSError):
        StateDirLock(state).acquire()
    assert victim.read_text() == "keep me"


def test_a_second_daemon_on_the_same_state_dir_exits_naming_the_first(tmp_path, bundled_model):
    state = tmp_path / "state"
    args = ("--model", bundled_model, "--sleep-idle-seconds", "-1", "--state-dir", str(state))
    first = DaemonProcess(*args, env=FAKE, log_path=tmp_path / "first.log")
    second = None
    try:
        first.wait_state("ready")
        second = DaemonProcess(*args, env=FAKE, log_path=tmp_path / "second.log")
        assert second.proc.wait(60) == 1
        log = second.log()
        assert "state_dir.in_use" in log and f"pid {first.pid}" in log and str(state) in log
        assert first.http.get("/health").json()["state"] == "ready"  # the first serves on
    finally:
        first.stop()
        if second is not None:
            second.stop()
    third = DaemonProcess(*args, env=FAKE, log_path=tmp_path / "third.log")
    try:
        third.wait_state("ready")  # the first's exit released the directory
    finally:
        third.stop()


def test_daemons_with_their_own_state_dirs_run_side_by_side(tmp_path, bundled_model):
    daemons = [DaemonProcess("--model", bundled_model, "--sleep-idle-seconds", "-1", "--state-dir",
                             str(tmp_path / f"state{i}"), env=FAKE, log_path=tmp_path / f"d{i}.log") for i in range(2)]
    try:
        for d in daemons:
            d.wait_state("ready")
    finally:
        for d in daemons:
            d.stop()
