"""Models by name where the daemon keeps them, against a stand-in hub (tests/fixtures/fake_hub.py):

- `pull` and `serve` download into state_dir/models (huggingface_hub's cache layout there), so a systemd unit
  needs nothing but its StateDirectory; HF_HUB_CACHE or HF_HOME set explicitly wins;
- check-config's path (model_plans(fetch=False)) downloads nothing: it says what would be downloaded, and how
  much, or where the cache holds it; offline, that the cache lacks it;
- a [models.X] table's `hf` resolves like the top-level hf_repo;
- Ollama's /api/pull answered by pull_for_api: Ollama's progress objects, from the same cache."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from config import Settings
from daemon.fleet.plans import model_plans
from daemon.model.files import ModelFileError
from daemon.model.hub import hub_cache_dir, lookup, pull_for_api
from tests.conftest import ROOT
from tests.fixtures.fake_hub import FakeHub

REPO = "test-org/tiny-GGUF"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, bytes]:
    from tests.fixtures.projector import write_projector
    from tests.fixtures.tiny_model import write_tiny_model

    folder = tmp_path_factory.mktemp("gguf")
    return {"tiny-Q4_K_M.gguf": write_tiny_model(folder / "q4.gguf", seed=0).read_bytes(),
            "tiny-Q8_0.gguf": write_tiny_model(folder / "q8.gguf", seed=1).read_bytes(),
            "mmproj-tiny-f16.gguf": write_projector(folder / "mmproj.gguf", text_embd=64).read_bytes()}


@pytest.fixture
def hub(files, monkeypatch):
    for name in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    with FakeHub() as hub:
        hub.add(REPO, {"README.md": b"# tiny", **files})
        # HF_ENDPOINT as the library reads it at import (this process imported it long ago): both names
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.url)
        monkeypatch.setattr("huggingface_hub.constants.HUGGINGFACE_CO_URL_TEMPLATE",
                            hub.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
        yield hub


def _asked(hub: FakeHub) -> list[tuple[str, str, str | None]]:
    """The requests about repositories (huggingface_hub also fetches its agent registry from the endpoint)."""
    return [r for r in hub.requests if r[1] != "/api/agent-harnesses"]


def test_the_cache_is_state_dir_models_unless_hf_home_or_hf_hub_cache_is_set(tmp_path, monkeypatch):
    for name in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    assert hub_cache_dir(tmp_path / "state") == tmp_path / "state" / "models"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache_dir(tmp_path / "state") == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    assert hub_cache_dir(tmp_path / "state") == tmp_path / "hub-cache"
    monkeypatch.setenv("HF_HUB_CACHE", "")  # empty: not set
    assert hub_cache_dir(tmp_path / "state") == tmp_path / "hf" / "hub"


def _dormouse(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "DORMOUSE_", "XDG_CONFIG"))}
    return subprocess.run([sys.executable, "-m", "daemon", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**clean, "XDG_CONFIG_HOME": env.pop("XDG_CONFIG_HOME"), **env}, timeout=300)


def test_pull_then_serve_agree_on_state_dir_models(hub, files, tmp_path):
    env = {"HF_ENDPOINT": hub.url, "XDG_CONFIG_HOME": str(tmp_path / "no-config"), "HOME": str(tmp_path / "home")}
    state = tmp_path / "state"
    done = _dormouse("pull", f"{REPO}:Q8_0", "--state-dir", str(state), env=dict(env))
    assert done.returncode == 0, done.stderr
    snapshots = state / "models" / "models--test-org--tiny-GGUF" / "snapshots"
    assert done.stdout.startswith(f"model: {snapshots}/") and "/tiny-Q8_0.gguf\n" in done.stdout
    assert not (tmp_path / "home" / ".cache" / "huggingface").exists()  # nothing in the library's default cache
    # DORMOUSE_STATE_DIR is found the same way serve finds it; the hub is not asked for the file again
    asked = len(hub.downloads())
    again = _dormouse("pull", f"{REPO}:Q8_0", env={**env, "DORMOUSE_STATE_DIR": str(state)})
    assert again.returncode == 0 and again.stdout == done.stdout and len(hub.downloads()) == asked
    # serve's path: the same file from the cache, offline, nothing downloaded
    offline = _dormouse("check-config", "--hf-repo", f"{REPO}:Q8_0", "--state-dir", str(state),
                        env={**env, "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 0, offline.stderr
    assert f'"path": "{snapshots}/' in offline.stdout and len(hub.downloads()) == asked


def test_pull_refuses_a_bad_state_dir_setting_in_one_line(hub, tmp_path):
    env = {"HF_ENDPOINT": hub.url, "XDG_CONFIG_HOME": str(tmp_path / "no-config")}
    done = _dormouse("pull", REPO, "--config", str(tmp_path / "absent.toml"), env=dict(env))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "does not exist" in done.stderr
    assert _asked(hub) == []
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for state in (str(a_file), str(tmp_path / ("x" * 100_000))):
        done = _dormouse("pull", REPO, "--state-dir", state, env=dict(env))
        assert done.returncode == 1 and done.stdout == "" and "Traceback" not in done.stderr
        assert done.stderr.count("\n") == 1 and len(done.stderr) < 600 and "failed" in done.stderr
    assert hub.downloads() == []


def test_check_config_downloads_nothing_and_says_how_much_it_would(hub, files, tmp_path):
    settings = Settings(hf_repo=f"{REPO}:q8_0", state_dir=tmp_path / "state")
    plan, = model_plans(settings, fetch=False)
    size = len(files["tiny-Q8_0.gguf"]) + len(files["mmproj-tiny-f16.gguf"])
    cache = tmp_path / "state" / "models"
    assert plan.hub == (f"would download {REPO}:q8_0 ({size} bytes: tiny-Q8_0.gguf, mmproj-tiny-f16.gguf) "
                        f"into {cache}")
    assert hub.downloads() == [] and not plan.files_present
    assert plan.id == "tiny-Q8_0" and plan.model_path.endswith("/tiny-Q8_0.gguf")  # where it will be
    assert [m for m, _, _ in _asked(hub)].count("HEAD") == 2  # the sizes: a HEAD each, no GET of a file

    pulled, = model_plans(Settings(hf_repo=f"{REPO}:q8_0", state_dir=tmp_path / "state"))  # serve's path
    assert pulled.model_path == plan.model_path and pulled.files_present and pulled.hub is None
    asked = len(_asked(hub))
    found, = model_plans(Settings(hf_repo=f"{REPO}:q8_0", state_dir=tmp_path / "state"), fetch=False)
    assert found.hub == (f"found in the cache at {plan.model_path} (projector "
                         f"{Path(plan.model_path).parent / 'mmproj-tiny-f16.gguf'})")
    assert str(found.settings.mmproj).endswith("mmproj-tiny-f16.gguf")  # as serve sets it
    assert [(m, p.split("/")[2]) for m, p, _ in _asked(hub)[asked:]] == [("GET", "models")]  # the listing alone


def test_check_config_offline_says_what_the_cache_lacks(hub, tmp_path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(ModelFileError, match=r"HF_HUB_OFFLINE is set, and test-org/tiny-GGUF is not in the cache "
                                             rf"{tmp_path}/state/models"):
        model_plans(Settings(hf_repo=REPO, state_dir=tmp_path / "state"), fetch=False)
    assert _asked(hub) == []


def test_a_table_with_hf_resolves_in_the_fleet(hub, files, tmp_path):
    from tests.fixtures.tiny_model import write_tiny_model

    local = write_tiny_model(tmp_path / "local.gguf")
    settings = Settings(state_dir=tmp_path / "state", models={
        "chat": {"hf": f"hf.co/{REPO}:Q4_K_M"}, "local": {"path": local, "ctx_size": 256}})
    plans = {plan.id: plan for plan in model_plans(settings, fetch=False)}
    assert plans["chat"].hub.startswith(f"would download {REPO}:Q4_K_M (") and plans["local"].hub is None
    assert hub.downloads() == []
    plans = {plan.id: plan for plan in model_plans(settings)}
    assert Path(plans["chat"].model_path).read_bytes() == files["tiny-Q4_K_M.gguf"]
    assert plans["chat"].settings.mmproj is not None and plans["local"].settings.mmproj is None
    assert hub.downloads() == [f"/{REPO}/resolve/main/tiny-Q4_K_M.gguf", f"/{REPO}/resolve/main/mmproj-tiny-f16.gguf"]
    with pytest.raises(ModelFileError, match=r"^\[models.chat\]: hf_repo .*no GGUF file for the quant tag 'Q2_K'"):
        model_plans(Settings(state_dir=tmp_path / "state", models={"chat": {"hf": f"{REPO}:Q2_K"}}), fetch=False)


def test_lookup_of_hostile_names_asks_nothing(hub, tmp_path):
    from daemon.model.hub import HubError

    for spec, hf_file in (("../../etc", None), ("x" * 100_000, None), (12, None), (REPO, "../../../x.gguf")):
        with pytest.raises(HubError):
            lookup(spec, hf_file, cache_dir=tmp_path)
    assert _asked(hub) == []


# -- Ollama's /api/pull --

def test_pull_for_api_streams_ollamas_progress_then_success(hub, files, tmp_path):
    settings = Settings(state_dir=tmp_path / "state")
    events = list(pull_for_api(f"hf.co/{REPO}:Q8_0", settings))
    assert events[0] == {"status": "pulling manifest"}
    assert [e["status"] for e in events[-3:]] == ["verifying sha256 digest", "writing manifest", "success"]
    layers = events[1:-3]
    for name in ("tiny-Q8_0.gguf", "mmproj-tiny-f16.gguf"):
        digest = hashlib.sha256(files[name]).hexdigest()
        mine = [e for e in layers if e.get("digest") == f"sha256:{digest}"]
        assert mine and all(e["status"] == f"pulling {digest[:12]}" and e["total"] == len(files[name]) for e in mine)
        done = [e["completed"] for e in mine]
        assert done == sorted(done) and done[-1] == len(files[name])
    assert set().union(*map(set, events)) <= {"status", "digest", "total", "completed"}
    # the same cache as serve: serve's path now finds it without a download
    asked = len(hub.downloads())
    plan, = model_plans(Settings(hf_repo=f"{REPO}:Q8_0", state_dir=tmp_path / "state"))
    assert len(hub.downloads()) == asked and Path(plan.model_path).read_bytes() == files["tiny-Q8_0.gguf"]
    # pulled again (":latest" is Ollama's "no tag": the default quant, Q4_K_M here), the cached projector
    # answers at once, complete
    again = list(pull_for_api(f"hf.co/{REPO}:latest", settings))
    assert again[-1] == {"status": "success"}
    assert hub.downloads()[asked:] == [f"/{REPO}/resolve/main/tiny-Q4_K_M.gguf"]


@pytest.mark.parametrize("name, needle", [
    ("llama3.2", "is not a repository"), ("test-org/absent-GGUF", "was not found"), (None, "as text"),
    ({"model": "x"}, "as text"), ("x" * 100_000, "characters long"), (f"{REPO}:Q2_K", "available: Q4_K_M, Q8_0"),
])
def test_pull_for_api_ends_a_failure_with_one_error_object(hub, tmp_path, name, needle):
    events = list(pull_for_api(name, Settings(state_dir=tmp_path / "state")))
    assert events[0] == {"status": "pulling manifest"} and list(events[-1]) == ["error"]
    assert needle in events[-1]["error"] and len(events[-1]["error"]) < 600 and len(events) == 2
    assert hub.downloads() == []


def test_pull_for_api_stops_the_download_when_the_reader_leaves(hub, tmp_path, monkeypatch):
    big = b"GGUF" + os.urandom(6 * 2**20)
    # a slow link (1 MiB pieces, 0.5 s apart) read in 1 MiB chunks: the download is mid-way when the reader leaves
    hub.add("test-org/big-GGUF", {"big-Q4_K_M.gguf": big}, chunk_delay=0.5)
    monkeypatch.setattr("huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE", 2**20)
    stream = pull_for_api("test-org/big-GGUF", Settings(state_dir=tmp_path / "state"))
    assert next(stream) == {"status": "pulling manifest"}
    first = next(stream)
    assert first["total"] == len(big) and first["completed"] < len(big)
    stream.close()  # the client went away
    hub.repos["test-org/big-GGUF"].chunk_delay = 0
    cache = tmp_path / "state" / "models" / "models--test-org--big-GGUF"
    for _ in range(400):  # the thread stops at its next chunk
        if not any(t.name == "ollama-pull" for t in threading.enumerate()):
            break
        time.sleep(0.05)
    assert not any(t.name == "ollama-pull" for t in threading.enumerate())
    # it stopped, not finished: nothing in the snapshot, and huggingface_hub removed its partial file
    assert not list(cache.glob("snapshots/*/big-Q4_K_M.gguf")) and not list(cache.glob("blobs/*"))
    events = list(pull_for_api("test-org/big-GGUF", Settings(state_dir=tmp_path / "state")))  # again: complete
    assert events[-1] == {"status": "success"}
    assert next(cache.glob("snapshots/*/big-Q4_K_M.gguf")).read_bytes() == big
