"""config/dormouse.example.toml says it lists every key: it must, and each shown value must load.

Uncommenting every `# key = value` and `# [table]` line gives a TOML file that
load_settings reads: an unknown or misspelt key there fails (extra="forbid"),
and a setting the file lacks fails the coverage test.
"""

import re
import tomllib
from pathlib import Path

from config import Settings, load_settings

EXAMPLE = Path(__file__).parents[2] / "config" / "dormouse.example.toml"
COMMENTED_SETTING = re.compile(r"^#\s?(\[[A-Za-z0-9_.]+\]|[a-z_]+\s*=.*)$")


def uncommented(text: str) -> str:
    return "\n".join(m.group(1) if (m := COMMENTED_SETTING.match(line)) else line for line in text.splitlines())


def test_every_setting_appears_in_the_example():
    shown = tomllib.loads(uncommented(EXAMPLE.read_text()))
    missing = sorted(set(Settings.model_fields) - set(shown))
    assert not missing, f"config/dormouse.example.toml lacks {missing}: add each, commented, with one line of why"


def test_every_key_in_the_example_is_a_setting_and_its_value_loads(tmp_path):
    every_key = tmp_path / "every.toml"
    # models_dir is read when the settings are: the example's directory, here with one model in it.
    (tmp_path / "srv").mkdir()
    (tmp_path / "srv" / "small.gguf").write_bytes(b"GGUF")
    text = uncommented(EXAMPLE.read_text())
    assert 'models_dir = "/srv/models"' in text
    every_key.write_text(text.replace('models_dir = "/srv/models"', f'models_dir = "{tmp_path / "srv"}"'))
    settings = load_settings(every_key)  # ConfigError names an unknown key or a bad value
    assert set(settings.models) == {"chat", "coder", "small"} and settings.models["coder"].ctx_size == 16384
    assert settings.api_keys["alice"].get_secret_value() == "change-me-alice"


def test_the_example_as_shipped_is_the_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # no default config file either
    monkeypatch.setattr("config.sources.SYSTEM_CONFIG", tmp_path / "absent.toml")
    monkeypatch.delenv("DORMOUSE_CONFIG", raising=False)
    assert load_settings(EXAMPLE).public_dict() == load_settings(None).public_dict()


def test_the_uncommenting_is_not_vacuous():
    # A line that looks like a setting but is prose would hide a missing key: there are at least
    # as many commented settings as fields, and prose lines stay comments.
    text = EXAMPLE.read_text()
    assert sum(1 for line in text.splitlines() if COMMENTED_SETTING.match(line)) >= len(Settings.model_fields)
    assert uncommented("# Several models: one table each\n# port = 1") == "# Several models: one table each\nport = 1"
