"""Where the settings come from: which TOML file, which DORMOUSE_* variables.

The file: --config, else $DORMOUSE_CONFIG, else the first that exists of the
user's (~/.config/dormouse/dormouse.toml, or under $XDG_CONFIG_HOME) and the
system's (/etc/dormouse/dormouse.toml). The user's comes first so that a user
can try a setting without root, as git and pip read theirs over the system's;
a daemon under systemd (a dynamic user, HOME=/var/lib/dormouse) has no
user file and reads the system's. No file at all: the defaults.

`dormouse check-config` prints what was read (config_sources), so that nobody
has to guess which file or which stray variable set a value.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ENV_PREFIX = "DORMOUSE_"
SYSTEM_CONFIG = Path("/etc/dormouse/dormouse.toml")
# DORMOUSE_* variables read by something other than the settings schema.
NOT_SETTINGS = {
    "DORMOUSE_CONFIG": "the config file",
    "DORMOUSE_URL": "the daemon that status, sleep and wake talk to",
}


def user_config() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "dormouse" / "dormouse.toml"


def default_config_paths() -> list[Path]:
    """Where a config file is looked for when neither --config nor $DORMOUSE_CONFIG names one, first first."""
    return [user_config(), SYSTEM_CONFIG]


@dataclass(frozen=True)
class ConfigFile:
    path: Path | None  # None: no file, the defaults
    how: str  # "--config", "DORMOUSE_CONFIG", "default path", or "none found"


def find_config_file(config_file: str | Path | None) -> ConfigFile:
    if config_file:
        return ConfigFile(Path(config_file), "--config")
    named = os.environ.get(ENV_PREFIX + "CONFIG")
    if named:
        return ConfigFile(Path(named), "DORMOUSE_CONFIG")
    for candidate in default_config_paths():
        try:
            if candidate.is_file():
                return ConfigFile(candidate, "default path")
        except OSError:  # a directory we may not search: as absent
            continue
    return ConfigFile(None, "none found (looked for " + ", ".join(map(str, default_config_paths())) + ")")


def environment_used(setting_names: set[str]) -> dict[str, str]:
    """Each DORMOUSE_* variable set here, and what it sets: a setting's name, what else reads it, or
    that nothing does (a misspelt variable is otherwise ignored without a word)."""
    out = {}
    for name in sorted(os.environ):
        if not name.upper().startswith(ENV_PREFIX):  # pydantic-settings matches without case
            continue
        key = name[len(ENV_PREFIX):].lower()
        if key in setting_names:
            out[name] = key
        elif name.upper() in NOT_SETTINGS:
            out[name] = NOT_SETTINGS[name.upper()]
        else:
            out[name] = "IGNORED: not a setting (misspelt?)"
    return out
