"""docs/upgrade.md's uninstall block removes exactly where the code and the unit put things:
a path renamed in the code (state_dir's default, the bundled copy, the config paths, the unit's
directories) without the doc fails here, so the uninstall notes cannot leave files behind."""

import re
from pathlib import Path

from config import Settings
from config.sources import SYSTEM_CONFIG, user_config
from daemon.model.files import shared_model_dir, state_dir

ROOT = Path(__file__).resolve().parents[2]


def _uninstall_paths() -> set[str]:
    doc = (ROOT / "docs" / "upgrade.md").read_text()
    block = re.search(r"## Uninstall\n\n```sh\n(.*?)```", doc, re.S).group(1)
    paths = set()
    for line in block.splitlines():
        command = line.split("#")[0].split()
        if "rm" in command:
            paths |= {word for word in command[command.index("rm") + 1:] if not word.startswith("-")}
    return paths


def _home_form(path: Path) -> str:
    return "~/" + str(path.relative_to(Path.home()))


def test_a_users_files_are_all_removed(monkeypatch):
    for name in ("STATE_DIRECTORY", "CACHE_DIRECTORY", "XDG_CACHE_HOME", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(name, raising=False)
    removed = _uninstall_paths()
    home_state = _home_form(state_dir(Settings()))
    assert home_state in removed
    assert _home_form(shared_model_dir()).startswith(home_state + "/")  # the bundled copy lies under it
    assert _home_form(user_config().parent) in removed


def test_the_services_files_are_all_removed():
    removed = _uninstall_paths()
    unit = (ROOT / "systemd" / "dormouse.service").read_text()
    assert "DynamicUser=yes" in unit  # so systemd keeps StateDirectory=/CacheDirectory= under /var/*/private
    for key, base in (("StateDirectory", "/var/lib/private"), ("CacheDirectory", "/var/cache/private")):
        (name,) = re.findall(rf"^{key}=(\S+)$", unit, re.M)
        assert f"{base}/{name}" in removed, key
    assert str(SYSTEM_CONFIG.parent) in removed
    (exec_start,) = re.findall(r"^ExecStart=(\S+)", unit, re.M)
    install_dir = exec_start.split("/.venv/")[0]
    assert install_dir in removed
    for unit_file in ("dormouse.service", "dormouse.socket"):
        assert f"/etc/systemd/system/{unit_file}" in removed
