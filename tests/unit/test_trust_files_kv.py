"""Issue 16, section 6: saved prompt-cache files cannot be turned against the daemon.

A file's checksum seals its header as well as its state, its name must be
the hash of the tokens it holds, files of the old format are deleted, and a
symbolic link at state_dir/kv or state_dir/kv/<model> is never followed (the
worker would otherwise read and delete files in the link's target).
"""

from __future__ import annotations

import os
import struct

import msgspec
import pytest

from daemon.model import kv_files
from daemon.model.kv_files import (FORMAT_VERSION, MAGIC, PREFIX, KvFileError, KvHeader, KvIndex, describe_dir,
                                   read_header, read_state, tokens_name, write_file)

MODEL = {"size": 1, "mtime_ns": 2, "head": "h" * 32}
LAYOUT = {"n_ctx_slot": 64, "n_layer": 2}
TOKENS_A = list(range(10, 30))
TOKENS_B = list(range(500, 520))


def header_for(tokens: list[int], state: bytes) -> KvHeader:
    # The lead's worker fills the checksum with the state's digest; write_file seals it.
    return KvHeader(FORMAT_VERSION, dict(MODEL), dict(LAYOUT), list(tokens), len(state), kv_files.checksum(state))


@pytest.fixture
def kv_dir(tmp_path):
    return tmp_path / "state" / "kv" / "model"


def raw_file(header: KvHeader, state: bytes, version: int = FORMAT_VERSION) -> bytes:
    body = msgspec.msgpack.encode(header)
    return PREFIX.pack(MAGIC, version, len(body)) + body + state


def restore(directory, tokens):
    """What the worker does after a wake: find the longest saved prefix, read its state."""
    index = KvIndex.scan(directory, MODEL, LAYOUT)
    entry = index.longest_prefix_of(tokens, 0)
    if entry is None:
        return index, None
    header, offset = read_header(entry.path)
    try:
        return index, read_state(entry.path, header, offset)
    except KvFileError as exc:
        index.reject(entry.path, exc.reason)
        return index, None


def test_a_file_round_trips_and_is_sealed_by_write_file(kv_dir):
    path = write_file(kv_dir, header_for(TOKENS_A, b"state of A"), b"state of A")
    assert path == kv_dir / tokens_name(TOKENS_A)
    header, offset = read_header(path)
    assert header.tokens == TOKENS_A and read_state(path, header, offset) == b"state of A"
    assert header.checksum == kv_files.seal(header, b"state of A")
    assert sorted(p.name for p in kv_dir.iterdir()) == [path.name]  # no temporary file left


def test_a_token_list_swapped_into_a_header_is_never_served(kv_dir):
    """The reproduction: B's file holds A's state under a header that names B's
    tokens (and keeps A's checksum). The daemon served A's cache for prompt B."""
    a = write_file(kv_dir, header_for(TOKENS_A, b"state of A"), b"state of A")
    header_a, _ = read_header(a)
    forged = msgspec.structs.replace(header_a, tokens=TOKENS_B)
    (kv_dir / tokens_name(TOKENS_B)).write_bytes(raw_file(forged, b"state of A"))
    a.unlink()
    index, state = restore(kv_dir, TOKENS_B + [1, 2, 3])
    assert state is None
    assert index.rejected == {"corrupt": 1} and not list(kv_dir.glob("*.kv"))


def test_a_file_renamed_to_another_prompts_name_is_rejected(kv_dir):
    a = write_file(kv_dir, header_for(TOKENS_A, b"state of A"), b"state of A")
    b = kv_dir / tokens_name(TOKENS_B)
    a.rename(b)
    with pytest.raises(KvFileError) as info:
        read_header(b)
    assert info.value.reason == "corrupt" and b.name in str(info.value)
    index = KvIndex.scan(kv_dir, MODEL, LAYOUT)
    assert index.entries == [] and index.rejected == {"corrupt": 1} and not b.exists()


@pytest.mark.parametrize("flip", ["model", "layout", "state_bytes_field", "state"])
def test_any_changed_byte_of_header_or_state_fails_the_seal(kv_dir, flip):
    state = b"state of A" * 10
    path = write_file(kv_dir, header_for(TOKENS_A, state), state)
    header, offset = read_header(path)
    if flip == "model":
        changed = raw_file(msgspec.structs.replace(header, model={**header.model, "size": 9}), state)
    elif flip == "layout":
        changed = raw_file(msgspec.structs.replace(header, layout={**header.layout, "n_layer": 3}), state)
    elif flip == "state_bytes_field":
        changed = raw_file(msgspec.structs.replace(header, state_bytes=len(state) - 1), state[:-1])
    else:
        changed = raw_file(header, state[:-1] + b"!")
    path.write_bytes(changed)
    with pytest.raises(KvFileError) as info:
        found, offset = read_header(path)
        read_state(path, found, offset)
    assert info.value.reason == "corrupt"


def test_files_of_the_old_format_are_deleted_at_the_scan(kv_dir):
    assert FORMAT_VERSION >= 2  # 1's checksum covered the state only
    kv_dir.mkdir(parents=True)
    old = KvHeader(1, dict(MODEL), dict(LAYOUT), TOKENS_A, 5, kv_files.checksum(b"state"))
    path = kv_dir / tokens_name(TOKENS_A)
    path.write_bytes(raw_file(old, b"state", version=1))
    index = KvIndex.scan(kv_dir, MODEL, LAYOUT)
    assert index.entries == [] and index.rejected == {"version": 1} and not path.exists()


def test_token_ids_outside_int32_are_corrupt_not_a_crash(kv_dir):
    kv_dir.mkdir(parents=True)
    header = KvHeader(FORMAT_VERSION, dict(MODEL), dict(LAYOUT), [2**40], 1, "")
    path = kv_dir / ("0" * 32 + ".kv")
    path.write_bytes(raw_file(header, b"x"))
    index = KvIndex.scan(kv_dir, MODEL, LAYOUT)
    assert index.rejected == {"corrupt": 1} and not path.exists()


def test_a_file_replaced_between_header_and_state_is_not_read(kv_dir):
    path = write_file(kv_dir, header_for(TOKENS_A, b"first"), b"first")
    header, offset = read_header(path)
    write_file(kv_dir, msgspec.structs.replace(header_for(TOKENS_A, b"other"), layout={"n_ctx_slot": 64}), b"other")
    with pytest.raises(KvFileError, match="changed since"):
        read_state(path, header, offset)


# -- links --


def victim_files(target):
    """Someone else's files that a save's clean-up would match: *.kv and .*.tmp."""
    target.mkdir(parents=True, exist_ok=True)
    (target / "theirs.kv").write_bytes(b"not ours")
    (target / ".theirs.tmp").write_bytes(b"not ours either")
    return sorted(p.name for p in target.iterdir())


@pytest.mark.parametrize("linked", ["model directory", "kv directory"])
def test_a_symlinked_directory_is_refused_and_nothing_in_its_target_is_touched(tmp_path, linked):
    state = tmp_path / "state"
    elsewhere = tmp_path / "someone-else"
    if linked == "model directory":
        (state / "kv").mkdir(parents=True)
        (state / "kv" / "model").symlink_to(elsewhere, target_is_directory=True)
        before = victim_files(elsewhere)
    else:
        state.mkdir()
        (state / "kv").symlink_to(elsewhere, target_is_directory=True)
        before = victim_files(elsewhere / "model")
    directory = state / "kv" / "model"
    target = elsewhere if linked == "model directory" else elsewhere / "model"

    with pytest.raises(OSError) as info:  # the worker serves without saved prompts (engine.py catches OSError)
        KvIndex.scan(directory, MODEL, LAYOUT)
    assert isinstance(info.value, kv_files.UnsafeDirectory) and "symbolic link" in str(info.value)
    with pytest.raises(OSError):
        write_file(directory, header_for(TOKENS_A, b"s"), b"s")
    with pytest.raises(KvFileError) as read:
        read_header(directory / "theirs.kv")
    assert read.value.reason == "unreadable"
    assert describe_dir(directory) == {"files": 0, "bytes": 0, "prefixes": []}
    KvIndex(directory, MODEL, LAYOUT).reject(directory / "theirs.kv", "corrupt")
    assert KvIndex(directory, MODEL, LAYOUT).keep_within(0) == 0
    assert sorted(p.name for p in target.iterdir()) == before


def test_an_index_whose_directory_became_a_link_deletes_nothing_there(tmp_path):
    directory = tmp_path / "state" / "kv" / "model"
    write_file(directory, header_for(TOKENS_A, b"s" * 100), b"s" * 100)
    index = KvIndex.scan(directory, MODEL, LAYOUT)
    assert len(index.entries) == 1
    elsewhere = tmp_path / "someone-else"
    victim_files(elsewhere)
    (elsewhere / tokens_name(TOKENS_A)).write_bytes(b"theirs, under the name of our entry")
    before = sorted(p.name for p in elsewhere.iterdir())
    os.rename(directory, tmp_path / "moved")
    directory.symlink_to(elsewhere, target_is_directory=True)
    assert index.keep_within(0) == 0  # over budget: it would delete its entry's name in the target
    with pytest.raises(OSError):
        index.touch(index.entries[0])
    index.reject(index.entries[0].path, "corrupt")
    with pytest.raises(OSError):
        index.add(directory / tokens_name(TOKENS_A), TOKENS_A, 100, 0)
    assert sorted(p.name for p in elsewhere.iterdir()) == before


def test_a_symlinked_file_is_rejected_and_only_the_link_goes(kv_dir, tmp_path):
    real = write_file(kv_dir, header_for(TOKENS_A, b"s"), b"s")
    outside = tmp_path / "outside.kv"
    outside.write_bytes(real.read_bytes())
    real.unlink()
    real.symlink_to(outside)
    index = KvIndex.scan(kv_dir, MODEL, LAYOUT)
    assert index.entries == [] and index.rejected == {"unreadable": 1}
    assert not real.is_symlink() and outside.exists()


def test_a_fifo_named_like_a_file_does_not_block(kv_dir):
    kv_dir.mkdir(parents=True)
    os.mkfifo(kv_dir / ("f" * 32 + ".kv"))
    index = KvIndex.scan(kv_dir, MODEL, LAYOUT)
    assert index.entries == [] and index.rejected == {"corrupt": 1}


def test_leftover_temporary_files_of_a_killed_save_are_deleted_in_our_own_directory(kv_dir):
    write_file(kv_dir, header_for(TOKENS_A, b"s"), b"s")
    (kv_dir / f".{tokens_name(TOKENS_B)}.123.tmp").write_bytes(b"half")
    index = KvIndex.scan(kv_dir, MODEL, LAYOUT)
    assert [e.tokens for e in index.entries] == [TOKENS_A]
    assert sorted(p.name for p in kv_dir.iterdir()) == [tokens_name(TOKENS_A)]


def test_the_prefix_struct_is_what_the_docstring_says():
    assert PREFIX.format == "<4sII" and struct.calcsize(PREFIX.format) == 12


# -- issue 26, tier speed: format 3 (xxh3-128), one open into a reused buffer, a seal checked once --

def sealed_file(kv_dir, tokens, state: bytes, version: int):
    """A file as a daemon of `version` wrote it (format 2: blake2b, format 3: xxh3-128)."""
    header = KvHeader(version, dict(MODEL), dict(LAYOUT), list(tokens), len(state), "")
    header = msgspec.structs.replace(header, checksum=kv_files.seal(header, state, version))
    kv_dir.mkdir(parents=True, exist_ok=True)
    path = kv_dir / tokens_name(tokens)
    path.write_bytes(raw_file(header, state, version=version))
    return path


def settle(path) -> None:
    """The file's timestamps moved past SETTLED_NS, as for any file not written this instant."""
    past = os.stat(path).st_mtime_ns - 2 * kv_files.SETTLED_NS
    os.utime(path, ns=(past, past))  # (the ctime stays now: VerifiedSeals waits for it too)


def test_files_are_written_in_format_3_and_format_2_files_still_read(kv_dir):
    import hashlib

    import numpy as np

    assert FORMAT_VERSION == 3
    path = write_file(kv_dir, header_for(TOKENS_A, b"new state"), b"new state")
    assert PREFIX.unpack(path.read_bytes()[:PREFIX.size])[1] == 3
    header, state = kv_files.read_sealed(path)
    assert header.tokens == TOKENS_A and state.tobytes() == b"new state"
    assert kv_files.seal(header, b"new state", 3) != kv_files.seal(header, b"new state", 2)  # two algorithms
    old = sealed_file(kv_dir, TOKENS_B, b"old state", 2)
    header, state = kv_files.read_sealed(old, np.zeros(64, np.uint8))
    assert state.tobytes() == b"old state" and len(header.checksum) == len(hashlib.blake2b(digest_size=16).hexdigest())
    assert read_state(old, *read_header(old)) == b"old state"
    index = KvIndex.scan(kv_dir, MODEL, LAYOUT)
    assert len(index.entries) == 2 and index.rejected == {}


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("where", ["header", "state", "last byte"])
def test_read_sealed_rejects_a_flipped_bit_in_either_format(kv_dir, version, where):
    state = bytes(range(256)) * 4
    path = sealed_file(kv_dir, TOKENS_A, state, version)
    raw = bytearray(path.read_bytes())
    at = {"header": PREFIX.size + 40, "state": len(raw) - len(state) + 100, "last byte": len(raw) - 1}[where]
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(KvFileError) as info:
        kv_files.read_sealed(path)
    assert info.value.reason == "corrupt"


@pytest.mark.parametrize("cut", [1, 100, 1023])
def test_read_sealed_rejects_a_torn_file_and_never_returns_part_of_it(kv_dir, cut):
    import numpy as np

    path = sealed_file(kv_dir, TOKENS_A, bytes(1024), 3)
    path.write_bytes(path.read_bytes()[:-cut])
    out = np.full(4096, 7, np.uint8)
    with pytest.raises(KvFileError) as info:
        kv_files.read_sealed(path, out)
    assert info.value.reason == "truncated"


@pytest.mark.parametrize("claimed", [2**62, -1, "many"])
def test_a_header_claiming_a_hostile_state_size_is_refused_without_allocating_it(kv_dir, claimed):
    import numpy as np

    kv_dir.mkdir(parents=True)
    path = kv_dir / tokens_name(TOKENS_A)
    body = msgspec.msgpack.encode({"version": 3, "model": MODEL, "layout": LAYOUT, "tokens": TOKENS_A,
                                   "state_bytes": claimed, "checksum": ""})
    path.write_bytes(PREFIX.pack(MAGIC, 3, len(body)) + body + b"x" * 10)
    with pytest.raises(KvFileError) as info:
        kv_files.read_sealed(path, np.empty(16, np.uint8))
    assert info.value.reason in ("truncated", "corrupt")


def test_read_sealed_fills_the_callers_buffer_when_it_is_large_enough(kv_dir):
    import numpy as np

    path = sealed_file(kv_dir, TOKENS_A, b"abcdefgh" * 8, 3)
    buffer = np.zeros(1000, np.uint8)
    _, state = kv_files.read_sealed(path, buffer)
    assert np.shares_memory(state, buffer) and state.tobytes() == b"abcdefgh" * 8
    _, larger = kv_files.read_sealed(path, np.zeros(10, np.uint8))  # too small: a buffer of its own
    assert larger.tobytes() == b"abcdefgh" * 8


def test_a_seal_is_checked_once_per_identity_and_again_after_any_change(kv_dir, monkeypatch):
    state = b"s" * 4096
    path = sealed_file(kv_dir, TOKENS_A, state, 3)
    settle(path)
    calls = []
    real_seal = kv_files.seal
    monkeypatch.setattr(kv_files, "seal", lambda *a, **kw: calls.append(1) or real_seal(*a, **kw))
    verified = kv_files.VerifiedSeals()
    monkeypatch.setattr(kv_files.time, "time_ns", lambda: os.stat(path).st_ctime_ns + 2 * kv_files.SETTLED_NS)
    kv_files.read_sealed(path, verified=verified)
    kv_files.read_sealed(path, verified=verified)
    assert len(calls) == 1  # the same file, unchanged: hashed once
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 1  # a bit flipped in place: same size, same inode
    with open(path, "r+b") as f:
        f.write(bytes(raw))
    settle(path)  # even with its mtime set back, the ctime moved
    with pytest.raises(KvFileError) as info:
        kv_files.read_sealed(path, verified=verified)
    assert info.value.reason == "corrupt" and len(calls) == 2


def test_a_file_changed_within_its_clock_tick_is_never_remembered_as_checked(kv_dir, monkeypatch):
    path = sealed_file(kv_dir, TOKENS_A, b"t" * 64, 3)
    verified = kv_files.VerifiedSeals()
    monkeypatch.setattr(kv_files.time, "time_ns", lambda: os.stat(path).st_ctime_ns + kv_files.SETTLED_NS // 2)
    kv_files.read_sealed(path, verified=verified)
    assert not verified.held  # a write in the same tick could leave the same timestamps: check it next time too


def test_verified_seals_are_bounded():
    verified = kv_files.VerifiedSeals(limit=3)
    for i in range(10):
        verified.add((1, i, 10, 0, 0), now_ns=10 * kv_files.SETTLED_NS)
    assert len(verified.held) == 3 and (1, 9, 10, 0, 0) in verified and (1, 0, 10, 0, 0) not in verified


def test_a_restored_files_mtime_moves_at_most_once_a_touch_interval(kv_dir):
    path = write_file(kv_dir, header_for(TOKENS_A, b"abc"), b"abc")
    past = os.stat(path).st_mtime_ns - int(2 * kv_files.TOUCH_SECONDS * 1e9)
    os.utime(path, ns=(past, past))  # last used two touch intervals ago
    index = KvIndex.scan(kv_dir, MODEL, LAYOUT)
    entry = index.entries[0]
    before = os.stat(path).st_mtime_ns
    index.touch(entry)  # last used long ago: the mtime moves (a restart orders by it)
    moved = os.stat(path).st_mtime_ns
    assert moved > before
    index.touch(entry)  # again at once: in memory only (a utime would change the ctime VerifiedSeals knows)
    assert os.stat(path).st_mtime_ns == moved and entry.used_at >= moved / 1e9 - 1
