"""A model by name, end to end: `dormouse serve` with `hf_repo` downloads the
GGUF from a stand-in hub (tests/fixtures/fake_hub.py, through HF_ENDPOINT)
into huggingface_hub's cache (HF_HOME when set, else state_dir/models), loads
it in a real worker and answers a completion; a second start finds it in the
cache with the hub gone. A [models.X] table names its model by `hf` too."""

from __future__ import annotations

import pytest

from tests.conftest import DaemonProcess
from tests.fixtures.fake_hub import FakeHub

pytestmark = pytest.mark.e2e

REPO = "test-org/tiny-llama-GGUF"


def test_serve_takes_a_model_by_name_from_the_hub_then_from_the_cache(tmp_path):
    from tests.fixtures.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny.gguf").read_bytes()
    config = tmp_path / "dormouse.toml"
    config.write_text(f'hf_repo = "{REPO}:q8_0"\nthreads = 2\nctx_size = 512\nparallel = 2\n')
    hf_home = tmp_path / "hf"
    with FakeHub() as hub:
        hub.add(REPO, {"README.md": b"# tiny", "tiny-llama-F32.gguf": model, "tiny-llama-Q8_0.gguf": model})
        d = DaemonProcess("--config", str(config), env={"HF_ENDPOINT": hub.url, "HF_HOME": str(hf_home)},
                          log_path=tmp_path / "daemon.log")
        try:
            d.wait_state("ready", timeout=300)
            answer = d.http.post("/completion", json={"prompt": "the dormouse", "n_predict": 4, "ignore_eos": True})
            assert answer.status_code == 200, answer.text
            assert answer.json()["tokens_predicted"] >= 1
            # the id is the file's name: the daemon serves the cache's snapshot path, not the blob's
            assert d.props()["id"] == "tiny-llama-Q8_0"
            assert hub.downloads() == [f"/{REPO}/resolve/main/tiny-llama-Q8_0.gguf"]
            # no terminal: the download's progress is in the log, as lines
            assert "dormouse: tiny-llama-Q8_0.gguf: 0 B of" in d.log() and "(100%" in d.log()
        finally:
            assert d.stop() == 0
    snapshot = hf_home / "hub" / "models--test-org--tiny-llama-GGUF" / "snapshots"
    assert [p.name for p in snapshot.glob("*/*.gguf")] == ["tiny-llama-Q8_0.gguf"]

    # The hub is gone: offline, the cache serves the same model.
    d = DaemonProcess("--config", str(config), env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(hf_home),
                                                    "HF_ENDPOINT": "http://127.0.0.1:9"},
                      log_path=tmp_path / "daemon-offline.log")
    try:
        d.wait_state("ready", timeout=300)
        answer = d.http.post("/completion", json={"prompt": "the", "n_predict": 2, "ignore_eos": True})
        assert answer.status_code == 200 and answer.json()["tokens_predicted"] >= 1
    finally:
        assert d.stop() == 0


def test_a_fleet_table_names_its_model_by_hf_and_serve_keeps_it_in_state_dir_models(tmp_path, monkeypatch):
    """No HF_HOME: the download goes into state_dir/models (what a systemd unit's StateDirectory holds), not the
    library's ~/.cache/huggingface; `[models.tiny] hf = ...` serves it under the table's id."""
    from tests.fixtures.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny.gguf").read_bytes()
    state = tmp_path / "state"
    config = tmp_path / "dormouse.toml"
    config.write_text(f'threads = 2\nctx_size = 512\nparallel = 2\nstate_dir = "{state}"\n'
                      f'[models.tiny]\nhf = "{REPO}:q8_0"\nllama_options = {{ n_ubatch = 64 }}\n')
    home = tmp_path / "home"
    for name in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)  # the daemon inherits this process's environment
    with FakeHub() as hub:
        hub.add(REPO, {"tiny-llama-F32.gguf": model, "tiny-llama-Q8_0.gguf": model})
        env = {"HF_ENDPOINT": hub.url, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
        d = DaemonProcess("--config", str(config), "--state-dir", str(state), env=env,
                          log_path=tmp_path / "daemon.log")
        try:
            d.wait_state("ready", timeout=300)
            answer = d.http.post("/v1/completions", json={"model": "tiny", "prompt": "the dormouse", "max_tokens": 3})
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == "tiny" and answer.json()["usage"]["completion_tokens"] >= 1
            assert hub.downloads() == [f"/{REPO}/resolve/main/tiny-llama-Q8_0.gguf"]
        finally:
            assert d.stop() == 0
    snapshot = state / "models" / "models--test-org--tiny-llama-GGUF" / "snapshots"
    assert [p.name for p in snapshot.glob("*/*.gguf")] == ["tiny-llama-Q8_0.gguf"]
    assert not list(home.glob(".cache/huggingface/hub/models--*"))
