"""daemon/worker/shared_tier.py without llama.cpp: two replicas' views of one
shared directory (two SharedPrompts, as two workers on two hosts would hold),
files written by one found by the other, the same entry written by both at
once, a directory that disappears and comes back, hostile files planted in
it, and the budget kept with two writers."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from daemon.model import kv_files as kv
from daemon.worker import shared_tier
from daemon.worker.reuse import ReuseRule
from daemon.worker.shared_tier import SharedPrompts, directory_key

LAYOUT = {"n_ctx_slot": 4096, "n_layer": 2, "type_k": 1, "type_v": 1}
RULE = ReuseRule(chunk=512)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def model(tmp_path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + os.urandom(4096))
    return path


def replica(base: Path, model: Path, budget: int = 2**30, clock=None) -> SharedPrompts:
    return SharedPrompts(base, str(model), LAYOUT, RULE, budget, clock=clock or Clock())


def state(n: int, fill: int) -> np.ndarray:
    return np.full(n, fill, np.uint8)


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_a_file_one_replica_writes_the_other_restores(tmp_path, model):
    base = tmp_path / "shared"
    base.mkdir()
    clock_b = Clock()
    a, b = replica(base, model), replica(base, model, clock=clock_b)
    assert a.write(tokens(300), state(1000, 7)) > 0
    clock_b.now += shared_tier.REFRESH_SECONDS  # b lists the directory again
    entry, n = b.best(tokens(300) + [9, 9, 9])
    assert entry is not None and n == 300  # the whole entry: the prompt goes on past it
    got, reason = b.read(entry)
    assert reason is None and bytes(got) == bytes(state(1000, 7))
    assert b.summary()["entries"] == 1 and b.summary()["reachable"] == 1
    # Addressed by the model's content and the layout, not its mtime: another copy of the file shares it.
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(model.read_bytes())
    os.utime(copy, (1, 1))
    assert replica(base, copy).best(tokens(300) + [1])[0] is not None
    # Another layout is another directory: nothing to find, nothing deleted.
    other = SharedPrompts(base, str(model), {**LAYOUT, "type_k": 8}, RULE, 2**30)
    assert other.best(tokens(300) + [1]) == (None, 0) and other.directory != a.directory
    assert a.directory.parent.parent == base and a.directory.name == directory_key(a.model, LAYOUT)


def test_two_replicas_write_the_same_entry_at_once(tmp_path, model):
    base = tmp_path / "shared"
    base.mkdir()
    writers = [replica(base, model) for _ in range(8)]
    start = threading.Barrier(len(writers))
    written = [-1] * len(writers)

    def write(r: SharedPrompts, fill: int) -> None:
        start.wait()
        written[fill] = r.write(tokens(500), state(200_000, fill))

    threads = [threading.Thread(target=write, args=(r, i)) for i, r in enumerate(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    names = os.listdir(writers[0].directory)
    assert [n for n in names if n.endswith(".tmp")] == []  # no temporary file left behind
    assert len([n for n in names if n.endswith(kv.SUFFIX)]) == 1
    # Each writer wrote, or found the entry already there (another's rename landed before its check):
    # a busy machine orders the threads either way, and both are right.
    assert -1 not in written and all(r.counts["write_errors"] == 0 for r in writers)
    assert all(w > 0 or r.holds(tokens(500), "") for w, r in zip(written, writers))
    reader = replica(base, model)
    entry, _ = reader.best(tokens(500) + [1])
    got, reason = reader.read(entry)
    assert reason is None and len(set(bytes(got))) == 1  # one writer's whole file, sealed, never a mix


def test_a_directory_that_disappears_is_unreachable_then_back(tmp_path, model):
    base = tmp_path / "shared"
    base.mkdir()
    clock = Clock()
    r = replica(base, model, clock=clock)
    assert r.write(tokens(300), state(100, 1)) > 0
    for path in sorted(base.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    base.rmdir()
    clock.now += 1
    assert r.best(tokens(300) + [1]) == (None, 0)  # a miss, not an error
    assert r.write(tokens(400), state(100, 2)) == 0 and not base.exists()  # never created here
    summary = r.summary()
    assert summary["reachable"] == 0 and summary["unreachable"] == 1 and summary["entries"] == 0
    base.mkdir()  # mounted again
    clock.now += shared_tier.RETRY_SECONDS
    assert r.write(tokens(400), state(100, 2)) > 0 and r.summary()["reachable"] == 1


def test_hostile_files_in_the_shared_directory(tmp_path, model):
    base = tmp_path / "shared"
    base.mkdir()
    clock = Clock()
    r = replica(base, model, clock=clock)
    assert r.write(tokens(300), state(100, 1)) > 0
    (path,) = r.directory.glob("*.kv")
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # one state byte flipped: the seal fails
    path.write_bytes(bytes(raw))
    (r.directory / ("0" * 32 + kv.SUFFIX)).write_bytes(b"not a prompt cache")  # garbage under a .kv name
    (r.directory / ("1" * 32 + kv.SUFFIX)).symlink_to("/etc/passwd")  # a link: never followed
    fresh = Path(r.directory / ".x.tmp")
    fresh.write_bytes(b"another writer, mid-write")  # young: left alone
    reader = replica(base, model)
    entry, _ = reader.best(tokens(300) + [1])
    got, reason = reader.read(entry)
    assert got is None and reason == "corrupt" and not path.exists()  # deleted: broken for every replica
    assert not (r.directory / ("0" * 32 + kv.SUFFIX)).exists()
    assert fresh.exists() and Path("/etc/passwd").exists()
    assert reader.best(tokens(300) + [1]) == (None, 0)


def test_a_shared_directory_behind_a_link_is_refused(tmp_path, model):
    base = tmp_path / "shared"
    base.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (base / "kv").symlink_to(elsewhere)  # the daemon's own level may not be a link
    r = replica(base, model)
    assert r.write(tokens(300), state(100, 1)) == 0
    assert list(elsewhere.iterdir()) == [] and r.summary()["reachable"] == 0


def test_two_writers_keep_one_budget(tmp_path, model):
    """Each writer keeps the budget over the whole listing (its own files and the other's)."""
    base = tmp_path / "shared"
    base.mkdir()
    size = 2091  # a file of 300 tokens and 1,000 state bytes (its header holds the tokens)
    a, b = replica(base, model, budget=5 * size), replica(base, model, budget=5 * size)
    for i in range(10):
        (a if i % 2 else b).write(tokens(300, start=1000 * i), state(1000, i))
        files = list(a.directory.glob("*.kv"))
        assert sum(f.stat().st_size for f in files) <= 5 * size, i  # after every write, whoever wrote it
    assert len(files) == 5 and {f.stat().st_size for f in files} == {size}
    assert a.counts["evictions"] + b.counts["evictions"] == 5


def test_a_million_files_are_read_in_steps(tmp_path, model, monkeypatch):
    """A refresh reads at most MAX_NEW_HEADERS new headers: the cost of a lookup is bounded whatever
    the directory holds (here 50 files, 20 a step)."""
    monkeypatch.setattr(shared_tier, "MAX_NEW_HEADERS", 20)
    base = tmp_path / "shared"
    base.mkdir()
    writer = replica(base, model)
    for i in range(50):
        writer.write(tokens(300, start=1000 * i), state(10, 1))
    clock = Clock()
    reader = replica(base, model, clock=clock)
    seen = [reader.summary()["entries"]]
    for _ in range(3):
        clock.now += shared_tier.REFRESH_SECONDS
        reader.refresh()
        seen.append(reader.summary()["entries"])
    assert seen == [20, 40, 50, 50]
