"""`dormouse check-config` and `dormouse serve` argument handling, in-process."""

import json

from daemon.cli import main


def test_check_config_prints_effective_settings_with_secrets_masked(capsys, tmp_path):
    config = tmp_path / "d.toml"
    config.write_text('sleep_idle_seconds = 42\napi_key = "s3cret"\n')
    assert main(["check-config", "--config", str(config), "--port", "9001"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["sleep_idle_seconds"] == 42 and shown["port"] == 9001
    assert shown["api_key"] == "********" and "s3cret" not in json.dumps(shown)


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
