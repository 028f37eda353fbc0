"""--models-dir (llama-server's router layout) read as [models.ID] tables: files, folders with a
projector, split models; every ambiguity refused with the file named; a config table wins."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from config.models_dir import models_in_dir
from config.settings import Settings


def touch(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF")
    return path


def test_llama_servers_layout_becomes_one_table_per_model(tmp_path):
    plain = touch(tmp_path / "llama-3.2-1b-Q4_K_M.gguf")
    weights = touch(tmp_path / "gemma-3-4b-it-Q8_0" / "gemma-3-4b-it-Q8_0.gguf")
    projector = touch(tmp_path / "gemma-3-4b-it-Q8_0" / "mmproj-F16.gguf")
    first = touch(tmp_path / "Kimi-K2" / "Kimi-K2-UD-IQ1_S-00001-of-00003.gguf")
    for i in (2, 3):
        touch(tmp_path / "Kimi-K2" / f"Kimi-K2-UD-IQ1_S-0000{i}-of-00003.gguf")
    touch(tmp_path / "README.md")
    touch(tmp_path / ".hidden.gguf")
    touch(tmp_path / "mmproj-stray.gguf")  # a projector beside the files is no model
    (tmp_path / "empty").mkdir()
    assert models_in_dir(tmp_path) == {
        "Kimi-K2": {"path": str(first)},
        "gemma-3-4b-it-Q8_0": {"path": str(weights), "mmproj": str(projector)},
        "llama-3.2-1b-Q4_K_M": {"path": str(plain)},
    }


@pytest.mark.parametrize("layout, named", [
    (["two/a.gguf", "two/b.gguf"], "a.gguf, b.gguf"),
    (["proj/x.gguf", "proj/mmproj-a.gguf", "proj/mmproj-b.gguf"], "mmproj-a.gguf"),
    (["only/mmproj-a.gguf"], "no .gguf but projectors"),
    (["has space.gguf"], "'has space'"),
    (["-dash.gguf"], "'-dash'"),
    ([], "holds no .gguf model"),
])
def test_an_ambiguous_or_unusable_layout_is_refused_naming_it(tmp_path, layout, named):
    for name in layout:
        touch(tmp_path / name)
    with pytest.raises(ValueError) as refused:
        models_in_dir(tmp_path)
    assert named in str(refused.value) and "models_dir" in str(refused.value)


def test_a_missing_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        models_in_dir(tmp_path / "nope")


def test_settings_read_the_directory_and_a_config_table_wins(tmp_path):
    touch(tmp_path / "a.gguf")
    touch(tmp_path / "b.gguf")
    settings = Settings(models_dir=tmp_path, models={"b": {"path": "/elsewhere/b.gguf", "ctx_size": 1024}})
    assert list(settings.models) == ["b", "a"]  # the config's tables first: the first is the default model
    assert str(settings.models["a"].path) == str(tmp_path / "a.gguf")
    assert str(settings.models["b"].path) == "/elsewhere/b.gguf" and settings.models["b"].ctx_size == 1024
    with pytest.raises(ValidationError, match="models_dir"):
        Settings(models_dir=tmp_path / "nope")


def test_a_folder_it_may_not_read_a_wrong_type_a_clash_or_a_foreign_name_is_one_config_line(tmp_path):
    import os

    from config import ConfigError, load_settings

    touch(tmp_path / "a.gguf")
    touch(tmp_path / "a" / "a.gguf")
    with pytest.raises(ValueError, match="both a file and a folder are named 'a'"):
        models_in_dir(tmp_path)
    (tmp_path / "a" / "a.gguf").unlink()
    (tmp_path / "a").rmdir()
    with pytest.raises(ConfigError, match="models_dir: expects a directory"):
        load_settings(None, {"models_dir": 5})
    if os.name == "posix" and os.geteuid() != 0:  # root reads any folder
        locked = tmp_path / "lost+found"
        locked.mkdir(mode=0o000)
        with pytest.raises(ConfigError, match="models_dir: cannot read"):
            load_settings(None, {"models_dir": str(tmp_path)})
        locked.chmod(0o700)
    folder = tmp_path / "latin"
    touch(folder / os.fsdecode(b"caf\xe9.gguf"))
    with pytest.raises(ValueError, match="not UTF-8"):
        models_in_dir(tmp_path)


def test_an_unreadable_directory_is_a_config_error_not_a_traceback(tmp_path, monkeypatch):
    from pathlib import Path

    from config import ConfigError, load_settings

    touch(tmp_path / "a.gguf")

    def refuse(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "iterdir", refuse)  # as for a lost+found the daemon's user may not read
    with pytest.raises(ConfigError, match="models_dir: cannot read .*Permission denied"):
        load_settings(None, {"models_dir": str(tmp_path)})


@pytest.mark.parametrize("key, value", [("models_max", -1), ("models_max", 65), ("models_max", "two"),
                                        ("models_max", 10**30), ("models_autoload", "maybe"),
                                        ("slots_endpoint", [True]), ("status_page", "sometimes")])
def test_the_router_settings_refuse_what_they_cannot_mean_by_name(key, value):
    from config import ConfigError, load_settings

    with pytest.raises(ConfigError, match=key):
        load_settings(None, {key: value})
