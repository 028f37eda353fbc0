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

    from daemon.fleet.metrics import FleetMetrics
    from daemon.metrics import Metrics

    dashboard = json.loads((Path(__file__).parents[2] / "docs" / "grafana-dashboard.json").read_text())
    registry = Metrics().registry
    FleetMetrics(registry)
    known = {m.name for m in registry.collect()}
    used = {re.sub(r"_(bucket|sum|count|total)$", "", name)
            for panel in dashboard["panels"] for target in panel["targets"]
            for name in re.findall(r"dormouse_[a-z_]+", target["expr"])}
    assert used and used <= known | {n.removesuffix("_total") for n in known}, used - known


# -- access and image limits: every new key with its hostile input ----------------


def _load(tmp_path, toml: str = "", env: dict | None = None, monkeypatch=None):
    path = tmp_path / "d.toml"
    path.write_text(toml)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    return load_settings(path)


def test_access_and_image_defaults():
    s = load_settings()
    assert s.allowed_hosts == [] and s.metrics_key is None
    assert s.max_image_pixels == 4096 * 4096 and s.max_images_per_request == 8


@pytest.mark.parametrize(
    "toml,env,expected",
    [
        ('allowed_hosts = ["LocalHost", "dormouse.lan.", "[::1]", "0:0::1", "10.0.0.7"]', {},
         ["localhost", "dormouse.lan", "::1", "::1", "10.0.0.7"]),
        ("", {"DORMOUSE_ALLOWED_HOSTS": "localhost, Dormouse.lan ,"}, ["localhost", "dormouse.lan"]),
        ("", {"DORMOUSE_ALLOWED_HOSTS": '["localhost", "::1"]'}, ["localhost", "::1"]),
        ("", {"DORMOUSE_ALLOWED_HOSTS": ""}, []),
    ],
)
def test_allowed_hosts_are_normalised(tmp_path, monkeypatch, toml, env, expected):
    assert _load(tmp_path, toml, env, monkeypatch).allowed_hosts == expected


def test_a_shared_kv_pool_gives_a_slot_the_whole_context_and_a_table_may_turn_it_off(tmp_path, monkeypatch):
    settings = _load(tmp_path, "ctx_size = 4096\nparallel = 4\nkv_unified = true\n[models.a]\n[models.b]\n"
                               "kv_unified = false\ncache_deterministic = true\n", {}, monkeypatch)
    assert settings.slot_context == 4096 and settings.model_copy(update={"kv_unified": False}).slot_context == 1024
    assert settings.models["a"].kv_unified is None and settings.models["b"].overrides()["kv_unified"] is False


@pytest.mark.parametrize(
    "toml,env,expected,table",
    [
        ('tags = ["chat", " small ", "chat"]\n[models.m]\n', {}, ["chat", "small"], None),
        ("[models.m]\ntags = []\n", {"DORMOUSE_TAGS": "chat, fim,,small"}, ["chat", "fim", "small"], []),
        ('[models.m]\ntags = ["code"]\n', {"DORMOUSE_TAGS": '["a b", "c"]'}, ["a b", "c"], ["code"]),
        ('tags = ["\ue0b0 powerline", "\U0001fae8", "caf\u00e9"]\n[models.m]\n', {},  # private use, new emoji
         ["\ue0b0 powerline", "\U0001fae8", "caf\u00e9"], None),
    ],
)
def test_tags_are_kept_once_in_order_and_a_table_replaces_them(tmp_path, monkeypatch, toml, env, expected, table):
    settings = _load(tmp_path, toml, env, monkeypatch)
    assert settings.tags == expected and settings.models["m"].tags == table


@pytest.mark.parametrize(
    "toml,env,needle",
    [
        ("allowed_hosts = 5", {}, "allowed_hosts: Input should be a valid list (from config file"),
        ('allowed_hosts = ["localhost:8080"]', {}, "is not a host name (give names without port or scheme)"),
        ('allowed_hosts = ["http://localhost"]', {}, "is not a host name"),
        ('allowed_hosts = ["*.example.com"]', {}, "no port, scheme or wildcard"),
        ('allowed_hosts = [""]', {}, "is not a host name"),
        ('allowed_hosts = ["a b"]', {}, "is not a host name"),
        ('allowed_hosts = ["h\u00e9te"]', {}, "is not a host name"),
        (f'allowed_hosts = ["{"a" * 300}"]', {}, "is not a host name"),
        ("allowed_hosts = [" + ", ".join(f'"h{i}"' for i in range(257)) + "]", {}, "at most 256 items"),
        ("", {"DORMOUSE_ALLOWED_HOSTS": "[not json"}, "neither a JSON list nor names separated by commas"),
        ("", {"DORMOUSE_ALLOWED_HOSTS": "localhost:80"}, "(from environment DORMOUSE_ALLOWED_HOSTS)"),
        ('metrics_key = ""', {}, "metrics_key: Value error, must not be empty"),
        ('metrics_key = "has space"', {}, "visible ASCII"),
        ('metrics_key = "cl\u00e9"', {}, "visible ASCII"),
        (f'metrics_key = "{"k" * 5000}"', {}, "visible ASCII"),
        ("metrics_key = 5", {}, "metrics_key: Input should be a valid string"),
        ("max_image_pixels = 0", {}, "max_image_pixels: Input should be greater than or equal to 1"),
        ("max_image_pixels = -1", {}, "greater than or equal to 1"),
        ("max_image_pixels = 1099511627776", {}, "less than or equal to 1073741824"),
        ("max_image_pixels = 1e400", {}, "max_image_pixels"),
        ("max_image_pixels = 3.5", {}, "max_image_pixels"),
        ('max_image_pixels = "many"', {}, "max_image_pixels: Input should be a valid integer"),
        ("max_image_pixels = true", {}, "must be an integer, not a boolean"),
        ("max_images_per_request = -1", {}, "max_images_per_request: Input should be greater than or equal to 0"),
        ("max_images_per_request = 1000000000", {}, "less than or equal to 1024"),
        ("max_images_per_request = false", {}, "not a boolean"),
        ("", {"DORMOUSE_MAX_IMAGES_PER_REQUEST": "lots"}, "(from environment DORMOUSE_MAX_IMAGES_PER_REQUEST)"),
        ('tags = ["a,b"]', {}, "tags: Value error, tag 'a,b' must be 1-64 characters, no comma"),
        ('tags = ["  "]', {}, "must be 1-64 characters"),
        ('tags = ["bell\\u0007"]', {}, "no control or format character"),
        ('tags = ["next\\u0085line"]', {}, "no control or format character"),  # C1
        ('tags = ["evil\\u202egnp"]', {}, "no control or format character"),  # right-to-left override
        ('tags = ["zero\\u200bwidth"]', {}, "no control or format character"),
        (f'tags = ["{"t" * 65}"]', {}, "must be 1-64 characters"),
        ("tags = [" + ", ".join(f'"t{i}"' for i in range(33)) + "]", {}, "tags: List should have at most 32 items"),
        ("tags = [5]", {}, "tags.0: Input should be a valid string"),
        ("tags = true", {}, "tags: Input should be a valid list"),
        ('[models.m]\ntags = ["x\\ny"]', {}, "models.m.tags: Value error, tag 'x\\ny'"),
        ("", {"DORMOUSE_TAGS": "[not json"}, "neither a JSON list nor names separated by commas"),
        ("kv_unified = true\ncache_deterministic = true", {}, "kv_unified and cache_deterministic cannot both"),
        ("kv_unified = true\n[models.m]\ncache_deterministic = true", {}, "[models.m]: kv_unified and cache_det"),
        ("cache_deterministic = true\n[models.m]\nkv_unified = true", {}, "[models.m]: kv_unified and cache_det"),
        ("kv_unified = 2", {}, "kv_unified: Input should be a valid boolean"),
    ],
)
def test_hostile_access_image_tag_and_pool_settings_name_the_key(tmp_path, monkeypatch, toml, env, needle):
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, toml, env, monkeypatch)
    assert needle in str(info.value)


def test_metrics_key_is_masked_and_limits_are_kept(tmp_path):
    s = _load(tmp_path, 'metrics_key = "m-123"\nmax_image_pixels = 100\nmax_images_per_request = 0\n')
    shown = s.public_dict()
    assert shown["metrics_key"] == "********" and "m-123" not in str(shown)
    assert s.metrics_key.get_secret_value() == "m-123"
    assert (s.max_image_pixels, s.max_images_per_request) == (100, 0)
