#!/usr/bin/env python3
"""Write deploy/k8s/keys.env: the daemons' api_key and admin_key, generated here once.

    python3 deploy/k8s/make_keys.py          # before the first `kubectl apply -k deploy/k8s`
    python3 deploy/k8s/make_keys.py --rotate # new keys (apply again: the pods restart with them)

kustomization.yaml's secretGenerator turns the file into the Secret the
StatefulSet reads (DORMOUSE_API_KEY, DORMOUSE_ADMIN_KEY); `kubectl apply -k`
fails while it is missing, so no replica ever starts with a key that
someone else has. The file is git-ignored: keep it where you keep secrets
(clients need api_key; admin_key is for `dormouse sleep|wake`, POST /sleep,
/wake, /models/load). Standard library only.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

KEYS_FILE = Path(__file__).resolve().parent / "keys.env"
KEYS = ("api_key", "admin_key")
KEY_BYTES = 32  # 256 bits; token_urlsafe gives 43 characters that an HTTP header carries as they are


def new_keys() -> dict[str, str]:
    return {name: secrets.token_urlsafe(KEY_BYTES) for name in KEYS}


def write_keys(path: Path, keys: dict[str, str]) -> None:
    """Atomically, readable by its owner only."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("".join(f"{name}={value}\n" for name, value in keys.items()))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=KEYS_FILE)
    parser.add_argument("--rotate", action="store_true", help="replace existing keys")
    args = parser.parse_args(argv)
    if args.output.exists() and not args.rotate:
        print(f"{args.output} exists: keeping its keys (--rotate to replace them)", file=sys.stderr)
        return 0
    write_keys(args.output, new_keys())
    print(f"wrote {', '.join(KEYS)} to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
