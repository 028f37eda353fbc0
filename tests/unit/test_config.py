import pytest

from config import ConfigError, load_settings


def test_layers_defaults_toml_env_cli(tmp_path, monkeypatch):
    toml = tmp_path / "d.toml"
    toml.write_text("port = 9000\nsleep_idle_seconds = 10\nparallel = 2\n")
    monkeypatch.setenv("DORMOUSE_SLEEP_IDLE_SECONDS", "20")
    monkeypatch.setenv("DORMOUSE_PARALLEL", "3")
    s = load_settings(toml, {"parallel": 5})
    assert s.port == 9000  # toml over default
    assert s.sleep_idle_seconds == 20  # env over toml
    assert s.parallel == 5  # cli over env
    assert s.host == "127.0.0.1"  # default


@pytest.mark.parametrize(
    "toml,env,cli,needle",
    [
        ("bogus = 1\n", {}, {}, "bogus: Extra inputs are not permitted (from config file"),
        ("", {"DORMOUSE_PORT": "http"}, {}, "port: Input should be a valid integer"),
        ("", {}, {"sleep_idle_seconds": -5}, "(from command line --sleep-idle-seconds)"),
        ("parallel = 0\n", {}, {}, "parallel: Input should be greater than or equal to 1 (from config file"),
    ],
)
def test_errors_name_key_and_source(tmp_path, monkeypatch, toml, env, cli, needle):
    path = tmp_path / "d.toml"
    path.write_text(toml)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as info:
        load_settings(path, cli)
    assert needle in str(info.value)


def test_missing_and_broken_config_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("port = = 3")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_settings(bad)


def test_example_config_is_valid():
    from pathlib import Path

    example = Path(__file__).parents[2] / "config" / "dormouse.example.toml"
    s = load_settings(example)
    assert s.sleep_idle_seconds == 300 and s.model is None


def test_grafana_dashboard_queries_only_metrics_that_exist():
    import json
    import re
    from pathlib import Path

    from daemon.metrics import Metrics

    dashboard = json.loads((Path(__file__).parents[2] / "docs" / "grafana-dashboard.json").read_text())
    known = {m.name for m in Metrics().registry.collect()}
    used = {re.sub(r"_(bucket|sum|count|total)$", "", name)
            for panel in dashboard["panels"] for target in panel["targets"]
            for name in re.findall(r"dormouse_[a-z_]+", target["expr"])}
    assert used and used <= known | {n.removesuffix("_total") for n in known}, used - known
