"""`dormouse check-config` and `dormouse serve` argument handling, in-process."""

import json

from daemon.cli import main


def test_check_config_prints_effective_settings_with_secrets_masked(capsys, tmp_path):
    config = tmp_path / "d.toml"
    config.write_text('sleep_idle_seconds = 42\napi_key = "s3cret"\n')
    assert main(["check-config", "--config", str(config), "--port", "9001"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["settings"]["sleep_idle_seconds"] == 42 and shown["settings"]["port"] == 9001
    assert shown["settings"]["api_key"] == "********" and "s3cret" not in json.dumps(shown)
    assert shown["stop_budget_seconds"] == 55


def test_check_config_shows_the_fleet_with_predicted_footprints_and_the_budget(capsys, tmp_path, bundled_model):
    config = tmp_path / "fleet.toml"
    config.write_text(f'''memory_budget = "2GiB"
[models.small]
path = "{bundled_model}"
ctx_size = 1024
aliases = ["gpt-4o-mini"]
[models.big]
path = "{bundled_model}"
ctx_size = 8192
pinned = true
''')
    assert main(["check-config", "--config", str(config)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["memory_budget"] == {"bytes": 2 * 2**30, "from": "memory_budget setting"}
    small, big = shown["models"]["small"], shown["models"]["big"]
    assert small["default"] and small["aliases"] == ["gpt-4o-mini"] and big["pinned"] and big["loads_at_start"]
    assert small["predicted_bytes"]["model"] == big["predicted_bytes"]["model"] > 200 * 2**20
    assert big["predicted_bytes"]["context"] > small["predicted_bytes"]["context"]  # its context is 8x longer


def test_check_config_refuses_a_fleet_model_that_can_never_fit(capsys, tmp_path, bundled_model):
    config = tmp_path / "fleet.toml"
    config.write_text(f'memory_budget = "100MiB"\n[models.a]\npath = "{bundled_model}"\n')
    assert main(["check-config", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "model a needs" in err and "104857600" in err


def test_check_config_errors_exit_2_naming_key_and_source(capsys, tmp_path):
    assert main(["check-config", "--parallel", "0"]) == 2
    err = capsys.readouterr().err
    assert "parallel" in err and "command line --parallel" in err


def test_check_config_checks_model_files(capsys, tmp_path):
    bad = tmp_path / "m.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 16)
    assert main(["check-config", "--model", str(bad)]) == 2
    assert "is not a GGUF file" in capsys.readouterr().err


def test_serve_refuses_a_missing_model_before_binding(capsys, tmp_path):
    assert main(["serve", "--model", str(tmp_path / "absent.gguf")]) == 2
    assert "does not exist" in capsys.readouterr().err


class _Recorder:
    """A stand-in daemon on a free port that records what the CLI sends."""

    def __init__(self, status: int = 200, body: bytes = b'{"state": "sleeping"}') -> None:
        import http.server
        import threading

        recorder = self
        self.seen: list[dict] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                recorder.seen.append({"method": self.command, "path": self.path, "headers": dict(self.headers),
                                      "body": self.rfile.read(length)})
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_sleep_and_wake_send_a_json_body_and_the_right_key(monkeypatch, capsys):
    """The daemon refuses a POST body not declared JSON (urllib would declare a form)."""
    monkeypatch.delenv("DORMOUSE_ADMIN_KEY", raising=False)
    monkeypatch.delenv("DORMOUSE_API_KEY", raising=False)
    daemon = _Recorder()
    try:
        assert main(["sleep", "--url", daemon.url, "--admin-key", "adm", "--api-key", "api"]) == 0
        assert main(["wake", "--url", daemon.url, "--api-key", "api"]) == 0  # no admin key: the API key stands in
        assert main(["status", "--url", daemon.url, "--admin-key", "adm", "--api-key", "api"]) == 0
        assert main(["status", "--url", daemon.url, "--admin-key", "adm"]) == 0
        sleep, wake, status, status_admin = daemon.seen
        for post in (sleep, wake):
            assert post["method"] == "POST" and post["headers"]["Content-Type"] == "application/json"
            assert post["body"] == b"{}"
        assert sleep["headers"]["Authorization"] == "Bearer adm" and wake["headers"]["Authorization"] == "Bearer api"
        assert status["method"] == "GET" and status["path"] == "/props" and "Content-Type" not in status["headers"]
        assert status["headers"]["Authorization"] == "Bearer api"  # /props takes the API key first
        assert status_admin["headers"]["Authorization"] == "Bearer adm"
    finally:
        daemon.close()


def test_an_error_that_is_not_the_daemons_json_is_reported_not_raised(capsys):
    daemon = _Recorder(status=502, body=b"<html>bad gateway</html>")
    try:
        assert main(["wake", "--url", daemon.url]) == 1
        assert "wake refused (502)" in capsys.readouterr().err
    finally:
        daemon.close()
