"""The documentation site builds with warnings as errors (`mkdocs build --strict`), as CI runs it:
a broken link or anchor, a page left out of nav, a bad mkdocs.yml fails here."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def needs_mkdocs(test):
    """CI runs `mkdocs build --strict` here: mkdocs and mkdocs-material are in the `test` extra, so a
    missing one is an install step lost, a failure (never a quiet skip)."""
    @functools.wraps(test)  # pytest reads the test's own signature (its fixtures) through __wrapped__
    def checked(*args, **kwargs):
        missing = [name for name in ("mkdocs", "material") if importlib.util.find_spec(name) is None]
        assert not missing, f"{missing} not installed: the `test` extra carries them (make test)"
        return test(*args, **kwargs)
    return checked


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@needs_mkdocs
def test_the_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    result = _build(ROOT / "mkdocs.yml", site)
    assert result.returncode == 0, result.stdout + result.stderr
    for page in ("index.html", "getting-started/index.html", "reference/configuration/index.html",
                 "reference/metrics/index.html", "design/index.html", "upgrade/index.html"):
        assert (site / page).is_file(), page
    # the generated reference made it into the site as a table, not as text
    reference = (site / "reference/configuration/index.html").read_text()
    assert "<table>" in reference and "DORMOUSE_SLEEP_IDLE_SECONDS" in reference


@needs_mkdocs
def test_a_broken_link_fails_the_build(tmp_path):
    """--strict is real: the same site with one link to a page that does not exist does not build."""
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    (docs / "index.md").write_text((docs / "index.md").read_text() + "\n[gone](no-such-page.md)\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text((ROOT / "mkdocs.yml").read_text().replace("docs_dir: docs", f"docs_dir: {docs}"))
    result = _build(config, tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-page.md" in result.stdout + result.stderr


def test_every_page_under_docs_is_in_nav():
    """A page outside nav is unreachable from the site; the build only warns on those it sees."""
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:", 1)[1]
    listed = set(re.findall(r"([\w./-]+\.md)\s*$", nav, re.M))
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert pages == listed, (pages - listed, listed - pages)


def test_the_design_lives_in_the_repository():
    design = (ROOT / "docs" / "design.md").read_text()
    for section in ("## Server states", "## Worker protocol", "## Teardown order"):
        assert section in design
    for page in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        assert "shared/DESIGN.md" not in page.read_text(), page


def test_the_readme_is_short_and_points_into_the_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 120
    for command in ("make serve", "make test", "apt install python3-venv", "dormouse pull ggml-org/gemma-3-1b-it-GGUF",
                    "--hf-repo ggml-org/gemma-3-1b-it-GGUF", "dormouse status", "-XPOST localhost:8080/sleep"):
        assert command in readme, command
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target


def test_the_readme_names_every_system_package_a_fresh_debian_needs():
    """The packages the Dockerfile's build stage installs on a bare Debian (the proof that they
    suffice) are all on README's apt line, and curl, which README's examples run."""
    readme = (ROOT / "README.md").read_text()
    (apt_line,) = [line for line in readme.splitlines() if line.startswith("sudo apt install ")]
    named = set(apt_line.split("#")[0].split()[3:])
    dockerfile = (ROOT / "Dockerfile").read_text()
    (build_stage,) = [stage for stage in dockerfile.split("\nFROM ") if stage.split("\n")[0].endswith(" AS build")]
    installed = set(re.search(r"apt-get install -y --no-install-recommends ([^\\&]+)", build_stage).group(1).split())
    assert installed - {"python3"} <= named, installed - named  # python3 itself comes with Debian
    assert "curl" in named and "curl " in readme.split(apt_line)[1]
    assert "PYTHON=" in readme  # another interpreter than python3


def _readme_commands() -> list[list[str]]:
    """Each `.venv/bin/dormouse ...` line of README's shell blocks, as its argv (comments dropped)."""
    readme = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", readme, re.S):
        for line in block.splitlines():
            if line.startswith(".venv/bin/dormouse "):
                commands.append(shlex.split(line, comments=True)[1:])
    return commands


def test_the_readme_dormouse_commands_mean_what_it_says():
    """Every dormouse command README shows parses as written, and the chat model's name reaches hf_repo."""
    from daemon.cli import _parser
    from daemon.llama_server_args import translate

    commands = _readme_commands()
    assert {argv[0] for argv in commands} >= {"pull", "serve", "status"}
    for argv in commands:
        if argv[0] == "serve":
            translation = translate(argv[1:], {})
            _parser().parse_args([argv[0], *translation.rest])
            assert translation.serve_settings()["hf_repo"] == "ggml-org/gemma-3-1b-it-GGUF"
        else:
            _parser().parse_args(argv)
    # llama-server's spelling, which README names beside --hf-repo, means the same
    assert translate(["-hf", "ggml-org/gemma-3-1b-it-GGUF"], {}).serve_settings()["hf_repo"] == \
        "ggml-org/gemma-3-1b-it-GGUF"


def test_make_docs_installs_the_docs_extra_and_not_the_test_tools(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    plan = subprocess.run(["make", "--no-print-directory", "-n", "docs"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60).stdout
    assert "pip install --quiet -e '.[docs]'" in plan and "[test]" not in plan
    assert "mkdocs serve --strict" in plan
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("docs", "test"):  # make test builds the site too, so the test extra carries mkdocs
        assert {"mkdocs", "mkdocs-material"} <= {re.split(r"[<>=\[ ]", r, maxsplit=1)[0] for r in extras[extra]}
