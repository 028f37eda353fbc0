"""Faults lose nothing and never serve a wrong answer (issue 26), the long run:
the scenarios of tests/reliability/test_faults.py, each round every one of them.

- kill -9 of the worker, of the daemon, and of both (as systemd's cgroup
  would), at a seeded random point of a save at sleep, a tier write, a sleep,
  a wake and a restore;
- ENOSPC, EIO and EROFS on every write of the state directory (an LD_PRELOAD
  shim, tests/fixtures/faultfs.c, built here with cc), from the start of a
  turn and from a random point of a sleep, and a state directory read-only
  from the daemon's start;
- torn files: each kind of torn kv file alone (found at load or at restore),
  a temporary file left behind, and wake_history.json, footprints.json and
  the lock file cut, emptied, garbage, of the wrong shape.

Each answer is compared token for token, with its log-probabilities, to a
fresh read (a daemon without a prompt cache). Prints the matrix in markdown.

    .venv/bin/python -m bench.faults [--rounds 3] [--seed 26] [--work DIR]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.common import bundled_model
from tests.fixtures import faults as F


def kills(model: str, work: Path, refs, matrix: F.Matrix, texts, seed: int) -> list[str]:
    h = F.Harness(model, work, refs, matrix, seed)
    h.start()
    s = F.Scenarios(h, texts)
    try:
        s.calibrate()
        for point in F.KILL_POINTS:
            for target in F.KILL_TARGETS:
                s.kill(point, target)
    finally:
        h.stop()
    return h.orphans


def write_errors(model: str, work: Path, refs, matrix: F.Matrix, texts, seed: int, library: Path) -> None:
    shim = F.FaultShim(library, work / "state", work)
    h = F.Harness(model, work, refs, matrix, seed, env=shim.env())
    h.start()
    s = F.Scenarios(h, texts)
    try:
        s.calibrate()
        for mode in F.MODES:
            s.write_errors(shim, mode)
            s.write_errors(shim, mode, at_random_point=True)
        s.read_only_at_start(shim)
    finally:
        shim.off()
        h.stop()


def torn(model: str, work: Path, refs, matrix: F.Matrix, texts, seed: int) -> None:
    h = F.Harness(model, work, refs, matrix, seed)
    h.start()
    s = F.Scenarios(h, texts)
    rng = random.Random(seed)
    try:
        for case in F.KV_CASES:
            s.torn_kv([case])
        locks = F.torn_lock(rng)
        for i, (case, _) in enumerate(F.torn_json(rng, b"{}")):
            state = h.state
            history = (state / "wake_history.json").read_bytes() if (state / "wake_history.json").exists() else b"{}"
            footprints = (state / "footprints.json").read_bytes() if (state / "footprints.json").exists() else b"{}"
            lock_case, lock = locks[i % len(locks)]
            s.torn_state_files(f"{case}; lock {lock_case}", dict(F.torn_json(rng, history))[case],
                               dict(F.torn_json(rng, footprints))[case], lock)
    finally:
        h.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="every scenario this many times (default 3)")
    parser.add_argument("--seed", type=int, default=26)
    parser.add_argument("--work", type=Path,
                        help="keep the daemons' logs and state here (default: a temporary directory, removed)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="dormouse-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    model = bundled_model()
    texts = F.prompts(args.seed, conversations=3, turns=3)
    library, why = F.build_shim(work / "faultfs")
    if library is None:
        print(f"ENOSPC/EIO/EROFS skipped: {why}", file=sys.stderr)
    (work / "reference").mkdir(parents=True, exist_ok=True)
    refs = F.references(model, work / "reference", [t for turns in texts.values() for t in turns])
    matrix = F.Matrix()
    orphans: list[str] = []
    for round_ in range(args.rounds):
        seed = args.seed * 1000 + round_
        for name, run in (("kills", lambda w: orphans.extend(kills(model, w, refs, matrix, texts, seed))),
                          ("write errors", lambda w: library and write_errors(model, w, refs, matrix, texts, seed,
                                                                               library)),
                          ("torn files", lambda w: torn(model, w, refs, matrix, texts, seed))):
            directory = work / f"round{round_}" / name.replace(" ", "_")
            directory.mkdir(parents=True, exist_ok=True)
            print(f"round {round_ + 1}/{args.rounds}: {name} ...", file=sys.stderr, flush=True)
            run(directory)
            if not args.work:
                shutil.rmtree(directory, ignore_errors=True)
    total = matrix.total()
    print(f"\n{args.rounds} round(s), seed {args.seed}, {time.monotonic() - started:.0f} s on {os.cpu_count()} cores")
    print(matrix.report())
    if orphans:
        print("\nworkers that outlived their killed daemon:\n" + "\n".join(orphans))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if total.wrong or total.lost or orphans else 0


if __name__ == "__main__":
    sys.exit(main())
