"""How much disk `make serve`'s environment takes beside `make test`'s.

Measured on an installed test environment (.venv), without building anything:
the distributions each install pulls in (pyproject's dependencies, and with
the `test` extra, followed through their own requirements and markers) and
the bytes of the files each one's RECORD lists. pip, setuptools and the
interpreter's links are in both and counted in both.

    .venv/bin/python -m bench.venv_size

prints both sizes and their ratio, and the largest distributions only the
test install has. With --install it also builds `make serve`'s environment
afresh in a temporary directory, as the Makefile does (`python -m venv`, pip
upgraded, `pip install -e .`), and prints how long that took and what the new
venv holds on disk:

    .venv/bin/python -m bench.venv_size --install

That install is timed with pip's cache as this machine has it: after a first
`make serve`, llama-cpp-python's wheel is in the cache and nothing is
compiled; the first build compiles llama.cpp (about 3.5 minutes on 2 cores)
and is not what this measures. The other distributions come from the index
(or pip's HTTP cache) as they would for `make serve`.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from packaging.requirements import Requirement

BASE = ("pip", "setuptools")  # every venv has them


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def _installed() -> dict[str, metadata.Distribution]:
    return {_name(d.metadata["Name"]): d for d in metadata.distributions()}


def closure(root: str, extras: tuple[str, ...], installed: dict[str, metadata.Distribution]) -> set[str]:
    """The distributions `root[extras]` needs, as installed here."""
    seen: set[str] = set()
    todo = [(_name(root), extras)]
    while todo:
        name, wanted = todo.pop()
        if name in seen and not wanted:
            continue
        seen.add(name)
        dist = installed.get(name)
        if dist is None:
            continue
        for line in dist.requires or []:
            req = Requirement(line)
            environments = [{"extra": e} for e in wanted] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(env) for env in environments):
                if _name(req.name) not in seen or req.extras:
                    todo.append((_name(req.name), tuple(req.extras)))
    return {n for n in seen if n in installed}


def size(dist: metadata.Distribution) -> int:
    total = 0
    for file in dist.files or []:
        path = Path(dist.locate_file(file))
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


ROOT = Path(__file__).resolve().parent.parent


def measure() -> tuple[set[str], set[str], dict[str, int]]:
    """(the runtime's distributions, the test install's, bytes of each), as installed here."""
    installed = _installed()
    runtime = closure("dormouse", (), installed) | set(BASE)
    test = closure("dormouse", ("test",), installed) | set(BASE)
    return runtime, test, {name: size(installed[name]) for name in test | runtime if name in installed}


def disk_bytes(directory: Path) -> int:
    """Bytes of the regular files under `directory` (links not followed, each file once)."""
    total, seen = 0, set()
    for root, _, files in os.walk(directory):
        for name in files:
            st = os.lstat(os.path.join(root, name))
            if (st.st_dev, st.st_ino) not in seen and not os.path.islink(os.path.join(root, name)):
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def timed_install(python: str = sys.executable) -> tuple[float, int, bool]:
    """`make serve`'s environment built afresh in a temporary directory: (seconds, bytes on disk,
    whether llama-cpp-python came from pip's wheel cache rather than a compile)."""
    with tempfile.TemporaryDirectory(prefix="dormouse-venv-") as tmp:
        venv = Path(tmp) / "venv"
        pip = [str(venv / "bin" / "python"), "-m", "pip"]
        start = time.monotonic()
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        subprocess.run([*pip, "install", "--quiet", "--upgrade", "pip"], check=True)
        # The Makefile's CMAKE_ARGS, so that a compile (no cached wheel) is the one `make serve` does.
        env = {**os.environ, "CMAKE_ARGS": os.environ.get("CMAKE_ARGS", "-DGGML_NATIVE=OFF")}
        proc = subprocess.run([*pip, "install", "-v", "-e", str(ROOT)], env=env, capture_output=True, text=True)
        seconds = time.monotonic() - start
        if proc.returncode != 0:
            raise SystemExit(f"pip install failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        compiled = "Building wheel for llama-cpp-python" in proc.stdout + proc.stderr
        return seconds, disk_bytes(venv), not compiled


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.venv_size", description=__doc__.splitlines()[0])
    parser.add_argument("--install", action="store_true",
                        help="also time a fresh install of make serve's venv and measure it on disk")
    args = parser.parse_args(argv)
    runtime, test, sizes = measure()
    run_bytes = sum(sizes[n] for n in runtime if n in sizes)
    test_bytes = sum(sizes[n] for n in test if n in sizes)
    print(f"runtime install (make serve): {len(runtime)} distributions, {run_bytes / 2**20:.0f} MiB")
    print(f"test install    (make test):  {len(test)} distributions, {test_bytes / 2**20:.0f} MiB")
    print(f"ratio test/runtime: {test_bytes / run_bytes:.2f}")
    print("largest only in the test install:")
    for name in sorted(test - runtime, key=lambda n: -sizes.get(n, 0))[:8]:
        print(f"  {name:28} {sizes.get(name, 0) / 2**20:7.1f} MiB")
    print("largest in the runtime:")
    for name in sorted(runtime, key=lambda n: -sizes.get(n, 0))[:6]:
        print(f"  {name:28} {sizes.get(name, 0) / 2**20:7.1f} MiB")
    if args.install:
        seconds, on_disk, cached = timed_install()
        how = "llama-cpp-python's wheel from pip's cache" if cached else "llama.cpp compiled"
        print(f"fresh install of make serve's venv: {seconds:.0f} s ({how}), {on_disk / 2**20:.0f} MiB on disk")


if __name__ == "__main__":
    main()
