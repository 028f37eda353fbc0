"""Where the settings come from (config/sources.py), a top-level model that no table serves,
and which changed keys a reload cannot apply (config/reloadable.py)."""

import pytest

from config import ConfigError, load_settings
from config.reloadable import needs_restart
from config.sources import environment_used, find_config_file


@pytest.fixture
def homes(tmp_path, monkeypatch):
    """A user config directory and a system path of the test's own, no DORMOUSE_* variables."""
    for name in [n for n in __import__("os").environ if n.upper().startswith("DORMOUSE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    system = tmp_path / "etc" / "dormouse.toml"
    monkeypatch.setattr("config.sources.SYSTEM_CONFIG", system)
    user = tmp_path / "xdg" / "dormouse" / "dormouse.toml"
    return user, system


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_default_paths_user_first_then_system_then_none(homes, tmp_path, monkeypatch):
    user, system = homes
    assert find_config_file(None).path is None and load_settings().port == 8080
    _write(system, "port = 9002\n")
    assert load_settings().port == 9002 and find_config_file(None).how == "default path"
    _write(user, "port = 9001\n")
    assert load_settings().port == 9001  # the user's over the system's
    monkeypatch.setenv("DORMOUSE_CONFIG", str(_write(tmp_path / "env.toml", "port = 9003\n")))
    assert load_settings().port == 9003 and find_config_file(None).how == "DORMOUSE_CONFIG"
    assert load_settings(_write(tmp_path / "flag.toml", "port = 9004\n")).port == 9004  # --config first of all


def test_a_default_path_that_is_a_directory_is_passed_over(homes):
    user, system = homes
    user.mkdir(parents=True)  # ~/.config/dormouse/dormouse.toml/ : not a file
    _write(system, "port = 9002\n")
    assert load_settings().port == 9002


def test_a_broken_default_file_is_named_with_where_it_came_from(homes):
    _, system = homes
    _write(system, "port = = 1\n")
    with pytest.raises(ConfigError, match=r"dormouse.toml \(from default path\) cannot be read"):
        load_settings()


def test_a_missing_dormouse_config_names_the_variable(homes, tmp_path, monkeypatch):
    monkeypatch.setenv("DORMOUSE_CONFIG", str(tmp_path / "nope.toml"))
    with pytest.raises(ConfigError, match=r"nope.toml \(from DORMOUSE_CONFIG\) does not exist"):
        load_settings()


def test_environment_used_names_settings_others_and_misspellings(homes, monkeypatch):
    monkeypatch.setenv("DORMOUSE_PORT", "9000")
    monkeypatch.setenv("DORMOUSE_URL", "localhost:9000")
    monkeypatch.setenv("DORMOUSE_SLEEP_IDLE", "5")  # misspelt: silently ignored by the settings
    used = environment_used({"port", "sleep_idle_seconds"})
    assert used["DORMOUSE_PORT"] == "port" and "status" in used["DORMOUSE_URL"]
    assert used["DORMOUSE_SLEEP_IDLE"].startswith("IGNORED")


# -- a top-level model beside [models.ID] tables ---------------------------------


def test_a_top_level_model_no_table_serves_is_refused_naming_where_to_move_it(homes, tmp_path):
    config = _write(tmp_path / "d.toml", 'model = "/models/first.gguf"\n[models.second]\npath = "/models/b.gguf"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(config)
    message = str(info.value)
    assert "\n" not in message
    assert "model = '/models/first.gguf'" in message and f"config file {config}" in message
    assert '[models.first] path = "/models/first.gguf"' in message


def test_the_same_from_the_command_line_names_the_flag(homes, tmp_path):
    config = _write(tmp_path / "d.toml", '[models.a]\npath = "/m/a.gguf"\n')
    with pytest.raises(ConfigError, match="from command line --model"):
        load_settings(config, {"model": "/m/x y.gguf"})


def test_a_top_level_model_a_table_inherits_is_fine(homes, tmp_path):
    config = _write(tmp_path / "d.toml", 'model = "/m/a.gguf"\n[models.a]\nctx_size = 1024\n'
                                         '[models.b]\npath = "/m/b.gguf"\n')
    assert str(load_settings(config).model) == "/m/a.gguf"  # [models.a] serves it
    alone = _write(tmp_path / "one.toml", 'model = "/m/a.gguf"\n')
    assert str(load_settings(alone).model) == "/m/a.gguf"  # no tables: a fleet of one


# -- a reload's skipped keys ------------------------------------------------------


def test_needs_restart_names_each_changed_key_a_reload_cannot_apply(homes, tmp_path):
    before = load_settings(_write(tmp_path / "a.toml", 'ctx_size = 4096\napi_key = "k1"\nsleep_idle_seconds = 5\n'
                                                        '[models.chat]\nparallel = 2\n[models.old]\nctx_size = 64\n'))
    after = load_settings(_write(tmp_path / "b.toml", 'ctx_size = 8192\napi_key = "k2"\nsleep_idle_seconds = 9\n'
                                                       'log_level = "debug"\n[models.chat]\nparallel = 3\n'
                                                       'sleep_idle_seconds = 1\n[models.new]\nctx_size = 64\n'))
    assert needs_restart(before, after) == ["api_key", "ctx_size", "models.chat.parallel", "models.new (added)",
                                            "models.old (removed)"]
    assert needs_restart(before, before) == []
