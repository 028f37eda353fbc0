"""How much disk `make serve`'s environment takes beside `make test`'s.

Measured on an installed test environment (.venv), without building anything:
the distributions each install pulls in (pyproject's dependencies, and with
the `test` extra, followed through their own requirements and markers) and
the bytes of the files each one's RECORD lists. pip, setuptools and the
interpreter's links are in both and counted in both.

    .venv/bin/python -m bench.venv_size

prints both sizes and their ratio, and the largest distributions only the
test install has.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
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


def main() -> None:
    installed = _installed()
    runtime = closure("dormouse", (), installed) | set(BASE)
    test = closure("dormouse", ("test",), installed) | set(BASE)
    sizes = {name: size(installed[name]) for name in test | runtime if name in installed}
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


if __name__ == "__main__":
    main()
