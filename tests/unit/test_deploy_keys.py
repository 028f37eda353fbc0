"""admin_key is required whenever host is not a loopback address: the daemon
refuses to start open to the network (POST /sleep, /wake and /models/load
would be anyone's), with a message that says what to set, and exits 2."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from config import ConfigError, load_settings
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_dormouse_environment(monkeypatch):
    for name in [n for n in os.environ if n.startswith("DORMOUSE_")]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.53", "::1", "[::1]", "localhost", "LOCALHOST.",
                                  "::ffff:127.0.0.1"])
def test_loopback_needs_no_admin_key(host):
    assert load_settings(cli={"host": host}).admin_key is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.0.0.5", "192.168.1.20", "fe80::1", "dormouse.internal",
                                  "localhost.example.com"])
def test_any_other_host_needs_an_admin_key(host):
    with pytest.raises(ConfigError) as refused:
        load_settings(cli={"host": host})
    message = str(refused.value)
    assert f"admin_key is required when host is {host!r}, not a loopback address" in message
    assert "DORMOUSE_ADMIN_KEY" in message and "--admin-key" in message


@pytest.mark.parametrize("where", ["cli", "env", "toml"])
def test_an_admin_key_from_any_layer_lets_it_bind_off_loopback(where, tmp_path, monkeypatch):
    cli, config = {"host": "0.0.0.0"}, None
    if where == "cli":
        cli["admin_key"] = "s3cret"
    elif where == "env":
        monkeypatch.setenv("DORMOUSE_ADMIN_KEY", "s3cret")
    else:
        config = tmp_path / "dormouse.toml"
        config.write_text('admin_key = "s3cret"\n')
    assert load_settings(config, cli).admin_key.get_secret_value() == "s3cret"


def test_the_host_from_the_environment_or_the_file_is_checked_too(tmp_path, monkeypatch):
    monkeypatch.setenv("DORMOUSE_HOST", "0.0.0.0")
    with pytest.raises(ConfigError, match="admin_key is required"):
        load_settings()
    monkeypatch.delenv("DORMOUSE_HOST")
    config = tmp_path / "dormouse.toml"
    config.write_text('host = "::"\n')
    with pytest.raises(ConfigError, match="admin_key is required"):
        load_settings(config)


def test_an_empty_admin_key_is_no_key():
    # An empty DORMOUSE_ADMIN_KEY (a Secret key left blank) must not pass for one.
    with pytest.raises(ConfigError, match="admin_key is required"):
        load_settings(cli={"host": "0.0.0.0", "admin_key": ""})


def test_an_api_key_alone_is_not_enough():
    # The API key opens /sleep and /wake only when no admin key is set; off
    # loopback the operator's hands get a key of their own.
    with pytest.raises(ConfigError, match="admin_key is required"):
        load_settings(cli={"host": "0.0.0.0", "api_key": "client-key"})


def daemon(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DORMOUSE_")}
    return subprocess.run([sys.executable, "-m", "daemon", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**clean, **(env or {})})


def test_serve_refuses_an_open_bind_and_exits_2():
    port = free_port()
    done = daemon("serve", "--host", "0.0.0.0", "--port", str(port))
    assert done.returncode == 2, done.stderr
    assert "admin_key is required when host is '0.0.0.0'" in done.stderr
    with socket.socket() as probe:  # it never bound
        assert probe.connect_ex(("127.0.0.1", port)) != 0


def test_check_config_says_the_same():
    refused = daemon("check-config", "--host", "0.0.0.0")
    assert refused.returncode == 2 and "admin_key is required" in refused.stderr
    accepted = daemon("check-config", "--host", "0.0.0.0", env={"DORMOUSE_ADMIN_KEY": "s3cret"})
    assert accepted.returncode == 0, accepted.stderr
    assert '"admin_key": "********"' in accepted.stdout  # and it is never printed


def test_several_addresses_are_loopback_only_when_each_one_is():
    """llama-server's --host 127.0.0.1,::1: every address is served; off loopback, any one of them, needs the key."""
    settings = load_settings(cli={"host": " 127.0.0.1, ::1 ,127.0.0.1"})
    assert settings.hosts == ["127.0.0.1", "::1"] and settings.host == "127.0.0.1,::1"
    with pytest.raises(ConfigError, match="admin_key is required when host is '0.0.0.0'"):
        load_settings(cli={"host": "127.0.0.1,0.0.0.0"})
    assert load_settings(cli={"host": "127.0.0.1,0.0.0.0", "admin_key": "k"}).hosts == ["127.0.0.1", "0.0.0.0"]
    assert load_settings(cli={"host": ",127.0.0.1, ,"}).hosts == ["127.0.0.1"]  # empty parts are no address
    for hostile in (",".join(f"127.0.0.{i}" for i in range(1, 18)), "x" * 2000, ",", " "):  # "": every interface
        with pytest.raises(ConfigError):
            load_settings(cli={"host": hostile})
