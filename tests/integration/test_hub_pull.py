"""A model by name against a stand-in hub (tests/fixtures/fake_hub.py): what is
downloaded, what is refused and how it is said, the cache reused offline, and
huggingface_hub's environment (HF_ENDPOINT, HF_HOME, HF_TOKEN, HF_HUB_OFFLINE)
honoured by `dormouse pull` and by `hf_repo` at start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.model.download_progress import line_progress
from daemon.model.hub import HubError, pull
from tests.conftest import ROOT
from tests.fixtures.fake_hub import FakeHub

REPO = "test-org/tiny-GGUF"


@pytest.fixture(scope="module")
def real_gguf(tmp_path_factory) -> dict[str, bytes]:
    """Real GGUF files (the tiny llama twice, a projector): the start checks more than the magic."""
    from tests.fixtures.projector import write_projector
    from tests.fixtures.tiny_model import write_tiny_model

    folder = tmp_path_factory.mktemp("gguf")
    return {"q4": write_tiny_model(folder / "q4.gguf", seed=0).read_bytes(),
            "q8": write_tiny_model(folder / "q8.gguf", seed=1).read_bytes(),
            "mmproj": write_projector(folder / "mmproj.gguf", text_embd=64).read_bytes()}


@pytest.fixture
def hub(real_gguf):
    Q4, Q8, MMPROJ = real_gguf["q4"], real_gguf["q8"], real_gguf["mmproj"]
    with FakeHub() as hub:
        hub.add(REPO, {"README.md": b"# tiny", "tiny-Q4_K_M.gguf": Q4, "tiny-Q8_0.gguf": Q8,
                       "mmproj-tiny-f16.gguf": MMPROJ})
        hub.add("test-org/safetensors-only", {"config.json": b"{}", "model.safetensors": b"\0" * 64})
        hub.add("test-org/private-GGUF", {"p-Q4_K_M.gguf": Q4}, token="hf_secret")
        hub.add("test-org/gated-GGUF", {"g-Q4_K_M.gguf": Q4}, token="hf_secret", gated=True)
        yield hub


def test_pull_by_tag_downloads_that_quant_and_the_projector(hub, real_gguf, tmp_path):
    lines: list[str] = []
    pulled = pull(f"{REPO}:q8_0", endpoint=hub.url, cache_dir=tmp_path, progress=line_progress(lines.append))
    assert pulled.model.name == "tiny-Q8_0.gguf" and pulled.model.read_bytes() == real_gguf["q8"]
    assert pulled.mmproj is not None and pulled.mmproj.read_bytes() == real_gguf["mmproj"]
    # huggingface_hub's own cache layout: a snapshot link to a content-addressed blob
    assert pulled.model.is_relative_to(tmp_path / "models--test-org--tiny-GGUF" / "snapshots")
    assert pulled.model.is_symlink() and pulled.model.resolve().parent.name == "blobs"
    assert hub.downloads() == [f"/{REPO}/resolve/main/tiny-Q8_0.gguf", f"/{REPO}/resolve/main/mmproj-tiny-f16.gguf"]
    size = f"{len(real_gguf['q8']) / 1000:.1f} KB"
    assert f"tiny-Q8_0.gguf: 0 B of {size} (0%)" in lines
    assert any(line.startswith(f"tiny-Q8_0.gguf: {size} of {size} (100%") for line in lines)


def test_pull_without_tag_takes_q4_k_m(hub, real_gguf, tmp_path):
    pulled = pull(REPO, endpoint=hub.url, cache_dir=tmp_path, with_mmproj=False)
    assert pulled.model.name == "tiny-Q4_K_M.gguf" and pulled.model.read_bytes() == real_gguf["q4"]
    assert pulled.mmproj is None and hub.downloads() == [f"/{REPO}/resolve/main/tiny-Q4_K_M.gguf"]


def test_a_dropped_download_resumes_where_it_stopped(hub, real_gguf, tmp_path, monkeypatch):
    """The link drops midway through the file: huggingface_hub asks for the rest only (a Range
    request from the last whole piece it wrote) and the file is whole, byte for byte. (It resumes
    within a pull; a pull that was killed starts its file over: huggingface_hub 1.x+ writes each
    download to a file of its own, so that two processes never append to one.)"""
    from huggingface_hub import constants

    piece = 64 * 1024  # huggingface_hub writes in pieces of 10 MB: smaller ones so the tiny file has several
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", piece)
    whole = real_gguf["q4"]
    half = len(whole) // 2
    hub.add("test-org/flaky-GGUF", {"f-Q4_K_M.gguf": whole}, cut_at=half)
    pulled = pull("test-org/flaky-GGUF", endpoint=hub.url, cache_dir=tmp_path, with_mmproj=False)
    assert pulled.model.read_bytes() == whole
    assert hub.downloads() == ["/test-org/flaky-GGUF/resolve/main/f-Q4_K_M.gguf"] * 2
    ((path, start),) = hub.resumed_from
    assert path == "/test-org/flaky-GGUF/resolve/main/f-Q4_K_M.gguf" and half - piece < start <= half
    assert not list(tmp_path.rglob("*.incomplete"))


def test_an_unmatched_tag_lists_the_quants_and_downloads_nothing(hub, tmp_path):
    with pytest.raises(HubError, match=r"no GGUF file for the quant tag 'Q5_K_S'; available: Q4_K_M, Q8_0"):
        pull(f"{REPO}:Q5_K_S", endpoint=hub.url, cache_dir=tmp_path)
    assert hub.downloads() == []


def test_a_missing_repository_and_one_without_gguf_say_so(hub, tmp_path):
    with pytest.raises(HubError, match="repository test-org/nothing-here was not found at http://127.0.0.1"):
        pull("test-org/nothing-here", endpoint=hub.url, cache_dir=tmp_path)
    with pytest.raises(HubError, match="holds no GGUF model file .*model.safetensors"):
        pull("test-org/safetensors-only", endpoint=hub.url, cache_dir=tmp_path)


def test_a_private_repository_needs_hf_token_and_gets_it(hub, real_gguf, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "no-saved-login"))  # no token file of this machine's user
    with pytest.raises(HubError, match="HF_TOKEN"):
        pull("test-org/private-GGUF", endpoint=hub.url, cache_dir=tmp_path)
    with pytest.raises(HubError, match="is gated: accept its terms"):
        pull("test-org/gated-GGUF", endpoint=hub.url, cache_dir=tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    pulled = pull("test-org/private-GGUF", endpoint=hub.url, cache_dir=tmp_path)
    assert pulled.model.read_bytes() == real_gguf["q4"]
    assert hub.requests[-1] == ("GET", "/test-org/private-GGUF/resolve/main/p-Q4_K_M.gguf", "Bearer hf_secret")


def test_offline_and_unreachable_use_the_cache(hub, tmp_path):
    first = pull(f"{REPO}:Q8_0", endpoint=hub.url, cache_dir=tmp_path)
    asked = len(hub.requests)
    again = pull(f"{REPO}:Q8_0", endpoint=hub.url, cache_dir=tmp_path, offline=True)
    assert again.model == first.model and again.mmproj == first.mmproj and again.from_cache_only
    assert len(hub.requests) == asked  # the hub was not asked
    # a hub that cannot be reached: the cache too, as llama-server does
    closed = "http://127.0.0.1:9"
    assert pull(f"{REPO}:Q8_0", endpoint=closed, cache_dir=tmp_path).model == first.model
    # what the cache lacks is named with what it has
    with pytest.raises(HubError, match=r"quant tag 'Q4_K_M'; available: Q8_0 .*listed from the cache .*HF_HUB_OFFLINE"):
        pull(f"{REPO}:Q4_K_M", endpoint=hub.url, cache_dir=tmp_path, offline=True)
    with pytest.raises(HubError, match=r"cannot reach the hub at http://127.0.0.1:9 .* test-org/x is not in the cache"):
        pull("test-org/x", endpoint=closed, cache_dir=tmp_path)


@pytest.mark.parametrize("spec, hf_file", [
    ("../../etc/passwd", None), ("test-org/../tiny-GGUF", None), ("a" * 100_000, None), ("test-org/tiny-GGUF/x", None),
    (REPO, "../../../etc/passwd.gguf"), (REPO, "/tiny-Q8_0.gguf"), (REPO, "x" * 5000 + ".gguf"),
])
def test_hostile_names_are_refused_before_any_request(hub, tmp_path, spec, hf_file):
    with pytest.raises(HubError):
        pull(spec, hf_file, endpoint=hub.url, cache_dir=tmp_path)
    assert hub.requests == []


def test_the_pull_command_refuses_hostile_input_in_one_line(hub, capsys):
    from daemon.pull import main

    for argv in (["x" * 100_000], ["test-org/../x"], [REPO, "--hf-file", "../../etc/passwd.gguf"],
                 [REPO, "--hf-file", "y" * 100_000 + ".gguf"]):
        assert main(argv) == 1
        out = capsys.readouterr()
        assert out.out == "" and out.err.count("\n") == 1 and len(out.err) < 600, out.err[:600]
    assert hub.requests == []


def test_a_listing_with_names_that_leave_the_repository_is_not_followed(hub, real_gguf, tmp_path):
    hub.add("evil/listing-GGUF", {"../../escape-Q4_K_M.gguf": real_gguf["q4"], "/abs-Q4_K_M.gguf": real_gguf["q4"],
                                  "ok-Q8_0.gguf": real_gguf["q8"]})
    pulled = pull("evil/listing-GGUF", endpoint=hub.url, cache_dir=tmp_path)
    assert pulled.model.name == "ok-Q8_0.gguf" and pulled.model.is_relative_to(tmp_path)
    assert hub.downloads() == ["/evil/listing-GGUF/resolve/main/ok-Q8_0.gguf"]
    assert not (tmp_path.parent / "escape-Q4_K_M.gguf").exists()


def _dormouse(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "DORMOUSE_"))}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env={**clean, **env}, capture_output=True, text=True,
                          timeout=300)


def test_the_pull_command_honours_the_hub_environment(hub, real_gguf, tmp_path):
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf")}
    done = _dormouse("-m", "daemon.pull", f"{REPO}:Q8_0", env=env)
    assert done.returncode == 0, done.stderr
    snapshot = tmp_path / "hf" / "hub" / "models--test-org--tiny-GGUF" / "snapshots"
    model_line, mmproj_line = done.stdout.splitlines()
    assert model_line.startswith(f"model: {snapshot}/") and model_line.endswith("/tiny-Q8_0.gguf")
    assert mmproj_line.startswith(f"mmproj: {snapshot}/") and mmproj_line.endswith("/mmproj-tiny-f16.gguf")
    size = f"{len(real_gguf['q8']) / 1000:.1f} KB"
    assert f"dormouse: tiny-Q8_0.gguf: {size} of {size} (100%" in done.stderr  # no terminal: progress lines
    asked = len(hub.requests)

    offline = _dormouse("-m", "daemon.pull", f"{REPO}:Q8_0", env={**env, "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout == done.stdout and "from the cache" in offline.stderr
    bare = _dormouse("-m", "daemon.pull", f"{REPO}:Q8_0", "--no-mmproj", env={**env, "HF_HUB_OFFLINE": "1"})
    assert bare.returncode == 0 and bare.stdout == model_line + "\n"
    assert len(hub.requests) == asked

    missing = _dormouse("-m", "daemon.pull", "test-org/nothing-here", env=env)
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.count("\n") == 1 and "was not found" in missing.stderr and "Traceback" not in missing.stderr


def test_check_config_says_what_hf_repo_would_download_and_fetches_nothing(hub, real_gguf, tmp_path):
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "DORMOUSE_STATE_DIR": str(tmp_path / "state")}
    config = _config(tmp_path, f'hf_repo = "{REPO}:Q8_0"')
    done = _dormouse("-m", "daemon", "check-config", "--config", config, env=env)
    assert done.returncode == 0, done.stderr
    size = len(real_gguf["q8"]) + len(real_gguf["mmproj"])
    assert (f"would download {REPO}:Q8_0 ({size} bytes: tiny-Q8_0.gguf, mmproj-tiny-f16.gguf) into "
            f"{tmp_path / 'hf' / 'hub'}") in done.stderr
    assert hub.downloads() == []
    assert _dormouse("-m", "daemon.pull", f"{REPO}:Q8_0", env=env).returncode == 0
    found = _dormouse("-m", "daemon", "check-config", "--config", config, env=env)
    snapshot = tmp_path / "hf" / "hub" / "models--test-org--tiny-GGUF" / "snapshots"
    assert f"found in the cache at {snapshot}/" in found.stderr
    assert f'"mmproj": "{snapshot}/' in found.stdout  # the repository's projector, as llama-server's -hf


@pytest.mark.parametrize("lines, expected", [
    ('hf_repo = "test-org/tiny-GGUF"\nmodel = "/models/x.gguf"', "model and hf_repo are both set"),
    ('hf_file = "tiny-Q8_0.gguf"', "hf_file names a file of the repository hf_repo, and hf_repo is not set"),
    ('hf_repo = "test-org/nothing-here"', "repository test-org/nothing-here was not found"),
    ('hf_repo = "test-org/tiny-GGUF:Q3_K_L"', "available: Q4_K_M, Q8_0"),
    ('hf_repo = "test-org/tiny-GGUF"\nhf_file = "../secrets.gguf"', "is not a relative path inside the repository"),
    ('hf_repo = "../../etc"', "is not a repository"),
    ('hf_repo = 12', "hf_repo"),
    (f'hf_repo = "{"x" * 300}"', "hf_repo"),
])
def test_a_bad_hf_repo_fails_the_start_with_one_line(hub, tmp_path, lines, expected):
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "DORMOUSE_STATE_DIR": str(tmp_path / "state")}
    done = _dormouse("-m", "daemon", "check-config", "--config", _config(tmp_path, lines), env=env)
    assert done.returncode == 2, done.stdout
    assert expected in done.stderr and "Traceback" not in done.stderr
    assert hub.downloads() == []


def _config(tmp_path: Path, lines: str) -> str:
    path = tmp_path / "dormouse.toml"
    path.write_text(lines + "\n")
    return str(path)
