"""bench/llama_server_conformance.py's shim: the suite's llama-server command line goes through unchanged
except its model references, which all become the one local GGUF; the wget stand-in fetches nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.llama_server_conformance import _shims, table


def _run_shim(tmp_path, args: list[str]) -> list[str]:
    echo = tmp_path / "echo-args"
    echo.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    echo.chmod(0o755)
    shim_dir = _shims(tmp_path, "/models/local.gguf", str(echo))
    out = subprocess.run([str(shim_dir / "llama-server"), *args], capture_output=True, text=True, check=True)
    import json
    return json.loads(out.stdout)


def test_model_references_become_the_local_model_and_nothing_else_changes(tmp_path):
    got = _run_shim(tmp_path, ["--port", "8080", "--hf-repo", "ggml-org/models", "--hf-file", "x/y.gguf",
                               "--no-slots", "--alias", "tinyllama-2", "-md", "draft.gguf", "--model-url=http://u"])
    assert got == ["--port", "8080", "--no-slots", "--alias", "tinyllama-2", "--model-draft", "/models/local.gguf",
                   "--model", "/models/local.gguf"]


def test_a_router_command_line_gets_no_model(tmp_path):
    assert _run_shim(tmp_path, ["--port", "1", "--models-max", "2"]) == ["--port", "1", "--models-max", "2"]


def test_the_wget_stand_in_links_models_and_refuses_adapters(tmp_path, monkeypatch):
    shim_dir = _shims(tmp_path, "/models/local.gguf", None)
    monkeypatch.syspath_prepend(str(shim_dir))
    import importlib
    wget = importlib.import_module("wget")
    out = wget.download("https://huggingface.co/a/b/resolve/main/stories15M-q4_0.gguf", out=str(tmp_path / "m.gguf"))
    assert (tmp_path / "m.gguf").readlink().as_posix() == "/models/local.gguf" and out.endswith("m.gguf")
    for url in ("https://huggingface.co/ggml-org/stories15M_MOE/resolve/main/moe_shakespeare15M.gguf",
                "https://example.com/file.bin"):
        with pytest.raises(RuntimeError, match="not fetched"):
            wget.download(url, out=str(tmp_path / "x"))
    sys.modules.pop("wget", None)


def test_the_table_counts_each_outcome_per_file():
    text = table({"unit/test_a.py::t1": "passed", "unit/test_a.py::t2": "failed", "unit/test_b.py::t": "skipped"})
    assert "test_a.py                                1     1     0     0      2" in text
    assert text.splitlines()[-1].split() == ["TOTAL", "1", "1", "0", "1", "3"]
