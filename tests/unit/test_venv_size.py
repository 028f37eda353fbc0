"""README's venv figures (issue 30: "the venv of `make serve` is measured in
README (size, install time) beside the test venv") against what
bench/venv_size.py measures here, so that the README fails a test when the
dependencies grow away from it. The install time is not re-measured here (a
fresh install takes the network and half a minute); README must state it and
name the command that prints it."""

import os
import re

import pytest

from bench import venv_size
from tests.conftest import ROOT

TOLERANCE = 0.15  # versions move a little between installs; a new heavy dependency moves it more


def readme_row(prefix: str) -> list[str]:
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith(f"| {prefix}"):
            return [cell.strip() for cell in line.strip("|").split("|")]
    raise AssertionError(f"README has no venv table row starting {prefix!r}")


def mib(cell: str) -> int:
    found = re.match(r"(\d+) MiB", cell)
    assert found, f"no size in MiB at the start of {cell!r}"
    return int(found.group(1))


def test_readme_states_both_sizes_the_install_time_and_the_command():
    serve, test = readme_row("`make serve`"), readme_row("`make test`")
    assert mib(serve[1]) < mib(test[1])
    assert re.search(r"~?\d+(\.\d+)? min", serve[2]) and "compiles llama.cpp" in serve[2], serve[2]
    assert re.search(r"\d+ s once", serve[2]), serve[2]  # the cached install
    assert "python -m bench.venv_size --install" in (ROOT / "README.md").read_text()


def test_readme_sizes_are_what_bench_venv_size_measures():
    runtime, test, sizes = venv_size.measure()
    if "pytest" not in test or "dormouse" not in runtime:
        pytest.skip("this environment is not an editable install with the test extra")
    measured = {"`make serve`": sum(sizes.get(n, 0) for n in runtime) / 2**20,
                "`make test`": sum(sizes.get(n, 0) for n in test) / 2**20}
    for row, now in measured.items():
        stated = mib(readme_row(row)[1])
        assert abs(stated - now) <= TOLERANCE * now, \
            f"README says {stated} MiB for {row}, python -m bench.venv_size measures {now:.0f} MiB: update README"


def test_disk_bytes_counts_a_hard_linked_file_once_and_no_link(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 1000)
    os.link(tmp_path / "a", tmp_path / "b")
    (tmp_path / "c").symlink_to(tmp_path / "a")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "d").write_bytes(b"y" * 24)
    assert venv_size.disk_bytes(tmp_path) == 1024
