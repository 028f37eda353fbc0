"""Dormouse settings: defaults < TOML file < DORMOUSE_* environment < CLI flags."""

from config.settings import ConfigError, Settings, load_settings

__all__ = ["ConfigError", "Settings", "load_settings"]
