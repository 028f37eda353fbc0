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
    assert "--parallel" in err and "got 0" in err  # llama-server's spelling, judged as llama-server judges it
    assert main(["check-config", "--max-queued", "-5"]) == 2  # a flag of Dormouse's own: the settings judge it
    err = capsys.readouterr().err
    assert "max_queued" in err and "command line --max-queued" in err


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


# -- the first five minutes (issue 30): --version, the human answer, --json, DORMOUSE_URL, pipes --------


def _props(**over) -> dict:
    """A /props answer as the daemon gives it, trimmed to what the summary reads, for a fleet of two."""
    body = {"id": "chat", "state": "ready", "model_path": "/m/chat.gguf", "failure": None, "tier": None,
            "total_slots": 4, "requests_waiting": 1, "sleep_idle_seconds": 300, "idle_seconds": 300,
            "idle_timer_remaining": 142.0, "last_sleep": None, "wake_prediction": None,
            "slots": [{"id": i, "is_processing": i < 3} for i in range(4)],
            "fleet": {"budget_bytes": 20 * 2**30, "planned_bytes": 3 * 2**30, "models": [
                {"id": "chat", "state": "ready", "tier": None, "default": True, "pinned": True,
                 "footprint_bytes": {"predicted": 900 * 2**20, "measured": 812 * 2**20}},
                {"id": "coder", "state": "sleeping", "tier": "light", "default": False, "pinned": False,
                 "footprint_bytes": {"predicted": 2 * 2**30, "measured": None}}]}}
    return {**body, **over}


def test_version(capsys):
    import pytest

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("dormouse ") and len(out.splitlines()) == 1


def test_status_prints_a_short_summary_and_json_on_request(monkeypatch, capsys):
    monkeypatch.delenv("DORMOUSE_URL", raising=False)
    daemon = _Recorder(body=json.dumps(_props()).encode())
    try:
        assert main(["status", "--url", daemon.url]) == 0
        out = capsys.readouterr().out
        assert "{" not in out and len(out.splitlines()) <= 10, out
        assert "chat (default)" in out and "state    ready" in out
        assert "3/4 busy, 1 waiting" in out and "after 5 min idle (2 min 22 s left)" in out
        assert "812.0 MiB measured" in out and "20.0 GiB budget" in out
        assert "coder" in out and "sleeping (light tier)" in out and "2.0 GiB predicted" in out
        assert main(["status", "--url", daemon.url, "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == _props()  # the daemon's own JSON, whole
    finally:
        daemon.close()


def test_status_of_a_sleeping_model_says_why(monkeypatch, capsys):
    import time

    body = _props(state="sleeping", tier="deep", last_sleep={"reason": "idle", "at": time.time() - 30},
                  wake_prediction={"seconds": 2.5})
    daemon = _Recorder(body=json.dumps(body).encode())
    try:
        assert main(["status", "--url", daemon.url]) == 0
        out = capsys.readouterr().out
        assert "sleeping (deep tier)" in out and "why      idle, 3" in out and "about 2.5 s" in out
        assert "busy" not in out  # a sleeping model's slots are not shown as if they served
    finally:
        daemon.close()


def test_sleep_and_wake_answer_in_one_line_per_model(monkeypatch, capsys):
    fleet = {"ok": False, "models": {"chat": {"ok": True, "model": "chat", "state": "sleeping", "tier": "deep"},
                                     "coder": {"ok": False, "model": "coder", "message": "busy", "state": "ready"}}}
    daemon = _Recorder(body=json.dumps(fleet).encode())
    try:
        assert main(["sleep", "--url", daemon.url]) == 1  # one model did not sleep: not a success
        out = capsys.readouterr().out.splitlines()
        assert out == ["chat: sleeping (deep tier)", "coder: not put to sleep: busy"]
    finally:
        daemon.close()
    daemon = _Recorder(body=json.dumps({"ok": True, "model": "chat", "state": "ready", "message": "woken",
                                        "last_wake": {"seconds": 1.25}}).encode())
    try:
        assert main(["wake", "--url", daemon.url]) == 0
        assert capsys.readouterr().out == "chat: ready (woke in 1.2 s)\n"
    finally:
        daemon.close()


def test_the_url_comes_from_dormouse_url_and_may_have_no_scheme(monkeypatch, capsys):
    daemon = _Recorder()
    port = daemon.url.rsplit(":", 1)[1]
    try:
        monkeypatch.setenv("DORMOUSE_URL", f"127.0.0.1:{port}")
        assert main(["status"]) == 0
        monkeypatch.setenv("DORMOUSE_URL", "http://127.0.0.1:1")  # --url wins over the variable
        assert main(["status", "--url", f"localhost:{port}"]) == 0
        assert main(["status", "--url", port]) == 0  # a bare port: on 127.0.0.1
        assert len(daemon.seen) == 3
    finally:
        daemon.close()


def test_hostile_urls_are_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.delenv("DORMOUSE_URL", raising=False)
    for url in ("ftp://h:1", "http://h:99999", "http://h:port", "h:1?x=1", "http:// spaced:1", "http://:80",
                "x" * 5000, "http://h:-1"):
        assert main(["status", "--url", url]) == 2, url
        err = capsys.readouterr().err
        assert err.startswith("dormouse: ") and err.count("\n") == 1 and "Traceback" not in err, err


def test_a_daemon_that_is_down_is_one_line_and_exit_1(monkeypatch, capsys):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for command in ("status", "sleep", "wake"):
        assert main([command, "--url", f"127.0.0.1:{port}"]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"dormouse: cannot reach the daemon at http://127.0.0.1:{port}") and err.count("\n") == 1


def test_an_answer_that_is_not_json_is_one_line(capsys):
    for body in (b"<html>ok</html>", b"[1, 2]", b"\xff\xfe"):
        daemon = _Recorder(body=body)
        try:
            assert main(["status", "--url", daemon.url]) == 1
            assert "not Dormouse's JSON" in capsys.readouterr().err
        finally:
            daemon.close()


def test_no_traceback_when_piped_into_head(tmp_path):
    """`dormouse status --json | head -1`: head leaves after one line, the rest meets a closed pipe."""
    import subprocess
    import sys
    from pathlib import Path

    big = _props(padding=["x" * 100] * 20000)  # 2 MB: far more than a pipe holds
    daemon = _Recorder(body=json.dumps(big).encode())
    try:
        for extra in (["--json"], []):
            command = f"{sys.executable} -m daemon status --url {daemon.url} {' '.join(extra)} | head -c 10"
            proc = subprocess.run(command, shell=True, capture_output=True, text=True, cwd=Path(__file__).parents[2],
                                  timeout=120)
            assert len(proc.stdout) == 10 and "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr
    finally:
        daemon.close()


def test_check_config_names_the_file_and_variables_it_read(capsys, tmp_path, monkeypatch):
    config = tmp_path / "d.toml"
    config.write_text("sleep_idle_seconds = 42\n")
    monkeypatch.setenv("DORMOUSE_CONFIG", str(config))
    monkeypatch.setenv("DORMOUSE_PORT", "9009")
    monkeypatch.setenv("DORMOUSE_ADMIN_KEY", "adm-secret")
    monkeypatch.setenv("DORMOUSE_SLEEP_IDLE", "1")  # misspelt
    assert main(["check-config"]) == 0
    captured = capsys.readouterr()
    shown = json.loads(captured.out)
    assert shown["read"]["config_file"] == str(config) and shown["read"]["config_file_from"] == "DORMOUSE_CONFIG"
    assert shown["read"]["environment"]["DORMOUSE_PORT"] == "port"
    assert shown["settings"]["port"] == 9009 and shown["settings"]["sleep_idle_seconds"] == 42
    assert shown["settings"]["admin_key"] == "********" and "adm-secret" not in captured.out + captured.err
    assert "DORMOUSE_SLEEP_IDLE is not a setting" in captured.err


def test_check_config_names_the_default_path_it_read_or_where_it_looked(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("DORMOUSE_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # the user's config directory, first of the defaults
    assert main(["check-config"]) == 0
    read = json.loads(capsys.readouterr().out)["read"]
    assert read["config_file"] is None and read["config_file_from"].startswith("none found (looked for ")
    assert str(tmp_path / "dormouse" / "dormouse.toml") in read["config_file_from"]
    assert "/etc/dormouse/dormouse.toml" in read["config_file_from"]
    (tmp_path / "dormouse").mkdir()
    (tmp_path / "dormouse" / "dormouse.toml").write_text("sleep_idle_seconds = 7\n")
    assert main(["check-config"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["read"]["config_file"] == str(tmp_path / "dormouse" / "dormouse.toml")
    assert shown["read"]["config_file_from"] == "default path" and shown["settings"]["sleep_idle_seconds"] == 7


def test_check_config_refuses_a_truncated_gguf_in_one_line(capsys, tmp_path):
    from tests.fixtures.tiny_model import write_tiny_model

    whole = tmp_path / "tiny.gguf"
    write_tiny_model(whole)
    assert main(["check-config", "--model", str(whole)]) == 0
    capsys.readouterr()
    data = whole.read_bytes()
    for keep in (len(data) - 1, len(data) // 2, 64, 30):  # cut in the tensors, the header, the metadata
        cut = tmp_path / f"cut{keep}.gguf"
        cut.write_bytes(data[:keep])
        assert main(["check-config", "--model", str(cut)]) == 2, keep
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(cut) in err and "fetch it again" in err, err
        assert any(word in err for word in ("truncated", "past", "more bytes", "cannot fit")), err


def test_check_config_and_serve_refuse_a_truncated_fleet_model_naming_its_table(capsys, tmp_path, bundled_model):
    from tests.fixtures.tiny_model import write_tiny_model

    tiny = tmp_path / "tiny.gguf"
    write_tiny_model(tiny)
    tiny.write_bytes(tiny.read_bytes()[:-4096])
    config = tmp_path / "fleet.toml"
    config.write_text(f'[models.ok]\npath = "{bundled_model}"\n[models.cut]\npath = "{tiny}"\n')
    for command in ("check-config", "serve"):
        assert main([command, "--config", str(config)]) == 2
        assert capsys.readouterr().err.startswith("dormouse: [models.cut]: model file ")


def test_check_config_warns_of_a_state_dir_that_cannot_be_written(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    from tests.fixtures.tiny_model import write_tiny_model

    model = tmp_path / "tiny.gguf"
    write_tiny_model(model)
    assert main(["check-config", "--model", str(model), "--state-dir", str(blocker / "state")]) == 0
    captured = capsys.readouterr()
    shown = json.loads(captured.out)
    assert "prompt cache's disk tier" in shown["state_dir"]["warning"]
    assert "warning: state directory" in captured.err and "is not a directory" in captured.err
    assert main(["check-config", "--model", str(model), "--state-dir", str(tmp_path / "fine")]) == 0
    assert json.loads(capsys.readouterr().out)["state_dir"]["warning"] is None


def test_vertex_ais_variables_set_the_port_over_the_command_line_and_the_prediction_routes(capsys, monkeypatch,
                                                                                         bundled_model):
    monkeypatch.setenv("AIP_MODE", "PREDICTION")
    monkeypatch.setenv("AIP_HTTP_PORT", "9123")
    monkeypatch.setenv("AIP_HEALTH_ROUTE", "hz")
    assert main(["check-config", "--model", bundled_model, "--port", "9001"]) == 0
    out = capsys.readouterr()
    shown = json.loads(out.out)["settings"]
    assert (shown["port"], shown["predict_route"], shown["predict_health_route"]) == (9123, "/predict", "/hz")
    assert "AIP_HTTP_PORT, over --port" in out.err
    monkeypatch.setenv("AIP_HTTP_PORT", "port")
    assert main(["check-config", "--model", bundled_model]) == 2
    assert "AIP_HTTP_PORT 'port' is not a TCP port" in capsys.readouterr().err
