"""`dormouse status|sleep|wake --model` against a real daemon process serving
a fleet (fake workers; the GGUF paths are real, as the daemon checks them)."""

import json
import subprocess
import sys

from tests.conftest import ROOT, DaemonProcess


def test_cli_shows_every_model_and_drives_one(tmp_path, bundled_model):
    config = tmp_path / "fleet.toml"
    config.write_text(f'memory_budget = "64GiB"\n[models.chat]\npath = "{bundled_model}"\n'
                      f'[models.coder]\npath = "{bundled_model}"\naliases = ["code"]\n')
    d = DaemonProcess("--config", str(config), "--sleep-idle-seconds", "-1", "--state-dir", str(tmp_path),
                      env={"DORMOUSE_WORKER_MODULE": "tests.fakes.fake_worker"}, log_path=tmp_path / "d.log")
    try:
        d.wait_state("ready")

        def cli(*args):
            done = subprocess.run([sys.executable, "-m", "daemon", *args, "--json", "--url", d.url], cwd=ROOT,
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            return json.loads(done.stdout)

        status = cli("status")
        assert status["id"] == "chat" and status["state"] == "ready"
        assert {m["id"]: m["status"] for m in status["fleet"]["models"]} == {"chat": "loaded", "coder": "sleeping"}
        assert status["fleet"]["budget_bytes"] == 64 * 2**30
        woke = cli("wake", "--model", "code")  # an alias
        assert woke["model"] == "coder" and woke["state"] == "ready"
        assert cli("status", "--model", "coder")["state"] == "ready"
        slept = cli("sleep", "--model", "coder")
        assert slept["model"] == "coder" and slept["state"] == "sleeping"
        assert {m["id"]: m["status"] for m in cli("status")["fleet"]["models"]}["chat"] == "loaded"
    finally:
        d.stop()
