"""Faults lose nothing and never serve a wrong answer (issue 26).

A real daemon on the bundled model (cache_deterministic, greedy, one slot,
small chunks so that short prompts are saved) is hurt while it writes its
state directory, then started again where it was killed:

- kill -9 of the worker, of the daemon, and of both, at a seeded random point
  of a prompt-cache save at sleep, a tier write (the disk writer thread
  writing a RAM entry), a sleep, a wake and a restore;
- ENOSPC, EIO and EROFS on every write below the state directory, switched
  on mid-run by an LD_PRELOAD shim (tests/fixtures/faultfs.c, compiled here
  with cc: root ignores chmod, and a container cannot mount), and a state
  directory read-only from the start;
- torn files left behind: a kv file cut at random offsets, header-only,
  garbage under a valid name, zero length, a flipped byte, a temporary file;
  wake_history.json, footprints.json and the lock file cut, emptied, garbage.

After each fault the daemon serves; every answer is compared, token for
token with its log-probabilities, to a fresh read (a daemon without a prompt
cache, cache_prompt false); no file it keeps is half-read (every remaining
kv file seals, no temporary file outlives a scan); a log line and a metric
name the fault. `pytest -s` prints the matrix; `python -m bench.faults
--rounds N` runs the same scenarios longer.
"""

from __future__ import annotations

import random

import pytest

from tests.fixtures import faults as F

pytestmark = pytest.mark.reliability

SEED = 26


@pytest.fixture(scope="module")
def matrix():
    m = F.Matrix()
    yield m
    print(m.report())


@pytest.fixture(scope="module")
def texts():
    return F.prompts(SEED, conversations=2, turns=3)


@pytest.fixture(scope="module")
def refs(bundled_model, tmp_path_factory, texts):
    return F.references(bundled_model, tmp_path_factory.mktemp("reference"),
                        [t for turns in texts.values() for t in turns])


@pytest.fixture(scope="module")
def shim_library(tmp_path_factory):
    library, why = F.build_shim(tmp_path_factory.mktemp("faultfs"))
    if library is None:
        pytest.skip(why)
    return library


def harness(bundled_model, tmp_path, refs, matrix, texts, seed, env=None):
    h = F.Harness(bundled_model, tmp_path, refs, matrix, seed, env=env)
    h.start()
    return h, F.Scenarios(h, texts)


def judge(matrix: F.Matrix, faults: list[str]) -> None:
    rows = [matrix.rows[f] for f in faults if f in matrix.rows]
    assert sum(r.wrong for r in rows) == 0, matrix.report()
    assert sum(r.lost for r in rows) == 0, matrix.report()
    mine = [f for f in matrix.failures if f.split(":", 1)[0] in faults or any(f.startswith(x) for x in faults)]
    assert not mine, "\n".join(mine) + matrix.report()


def test_kill_minus_9_at_random_points_of_save_tier_write_sleep_wake_restore(bundled_model, tmp_path, refs, matrix,
                                                                               texts):
    h, s = harness(bundled_model, tmp_path, refs, matrix, texts, SEED)
    rng = random.Random(SEED)
    done = []
    try:
        s.calibrate()
        for point in F.KILL_POINTS:
            for target in ("worker", rng.choice(["daemon", "daemon and worker"])):
                s.kill(point, target)
                done.append(f"kill -9 {target}: {point}")
        assert not h.orphans, h.orphans
    finally:
        h.stop()
    assert sum(matrix.rows[f].injected for f in done if f in matrix.rows) >= len(done) - 2  # a few may miss
    judge(matrix, done)


def test_enospc_eio_and_a_read_only_state_directory(bundled_model, tmp_path, refs, matrix, texts, shim_library):
    shim = F.FaultShim(shim_library, tmp_path / "state", tmp_path)
    h, s = harness(bundled_model, tmp_path, refs, matrix, texts, SEED + 1, env=shim.env())
    rng = random.Random(SEED + 1)
    done = []
    try:
        for mode in F.MODES:
            s.write_errors(shim, mode)
            done.append(f"{mode} on every write")
        mode = rng.choice(F.MODES)
        s.write_errors(shim, mode, at_random_point=True)
        done.append(f"{mode} on every write (from a random point of a sleep)")
        s.read_only_at_start(shim)
        done.append("EROFS from the start")
    finally:
        shim.off()
        h.stop()
    assert all(matrix.rows[f].injected for f in done), matrix.report()
    judge(matrix, done)


def test_torn_and_truncated_files_are_rejected_counted_and_never_loaded(bundled_model, tmp_path, refs, matrix, texts):
    h, s = harness(bundled_model, tmp_path, refs, matrix, texts, SEED + 2)
    rng = random.Random(SEED + 2)
    done = []
    try:
        # Found at load (cut, header only, garbage, empty) and at restore (a flipped byte): each the
        # only file that could serve the next turn, the others beside it under names of their own.
        for cases in (["cut in the state", "cut in the prefix", "cut in the header", "header only", "zero length",
                       "garbage after a valid prefix"], ["one flipped byte"], ["garbage with a valid name"]):
            s.torn_kv(cases)
            done.append("torn kv file: " + ", ".join(cases))
        lock = F.torn_lock(rng)
        for i, (case, _) in enumerate(F.torn_json(rng, b'{"version": 1, "samples": []}')[:1]):
            history, footprints = (
                (h.state / name).read_bytes() if (h.state / name).exists() else b"{}"
                for name in ("wake_history.json", "footprints.json"))
            torn_history = dict(F.torn_json(rng, history))[case]
            torn_footprints = dict(F.torn_json(rng, footprints))[case]
            s.torn_state_files(f"{case}; lock {lock[i][0]}", torn_history, torn_footprints, lock[i][1])
            done.append(f"torn state files: {case}; lock {lock[i][0]}")
    finally:
        h.stop()
    judge(matrix, done)
