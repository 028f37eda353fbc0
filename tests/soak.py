"""How many rounds the long loops run: `make test` sizes them to keep the whole
suite near 20 minutes on 2 cores; `make soak` (DORMOUSE_SOAK=1) runs each at its
long count. Both are counts, never wall time; every assertion is the same at
both sizes, and each loop's short count still covers every kind of step it has
(each test says how)."""

from __future__ import annotations

import os

SOAK = os.environ.get("DORMOUSE_SOAK", "") not in ("", "0")


def rounds(short: int, long: int) -> int:
    """`short` in `make test`, `long` under DORMOUSE_SOAK=1."""
    return long if SOAK else short
