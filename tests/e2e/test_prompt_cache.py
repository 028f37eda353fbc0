"""The prompt cache survives sleep (issue 11), on the real model: a long
conversation resumes after a sleep without re-reading its prompt, with the
same greedy answer as a full re-read; files that do not match, are cut short
or fail their checksum are deleted and counted, and the request still
succeeds."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import pytest

from daemon.model.kv_files import KvHeader, read_header, read_state, write_file
from tests.metrics_text import value

pytestmark = pytest.mark.e2e

STORY = " ".join(f"Note {i}: the river passes the mill at dawn, and the baker sells rye bread to the miller."
                 for i in range(100))  # ~2000 tokens with the chat template


def chat(d, messages, max_tokens=12):
    r = d.http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]


def kv_dir(d, state: Path) -> Path:
    return state / "kv" / d.props()["id"]


def sleep(d) -> dict:
    r = d.http.post("/sleep")
    assert r.status_code == 200, r.text
    return r.json()["last_sleep"]


def test_a_long_conversation_resumes_after_sleep_with_the_same_answer(start_daemon, tmp_path):
    state = tmp_path / "state"
    d = start_daemon("--parallel", "1", "--ctx-size", "4096", "--sleep-idle-seconds", "-1", "--state-dir", str(state))
    d.wait_state("ready")
    turn1 = [{"role": "user", "content": STORY + " What does the baker sell?"}]
    answer1, usage1 = chat(d, turn1)
    assert usage1["prompt_tokens"] > 1800
    report = sleep(d)
    names = [phase["name"] for phase in report["phases"]]
    assert names[:2] == ["kv_save", "draft_context"]  # saved before the teardown begins
    kv_save = report["phases"][0]
    assert kv_save["freed_bytes"] > 0  # bytes written
    assert d.props()["kv_cache"]["files"] >= 1  # known to the daemon while asleep (and the window's checkpoints)

    turn2 = turn1 + [{"role": "assistant", "content": answer1}, {"role": "user", "content": "And who buys it?"}]
    restored, usage2 = chat(d, turn2)
    cached = usage2["prompt_tokens_details"]["cached_tokens"]
    saved_prefix = d.props()["kv_cache"]["prefixes"][0]
    print(f"\nprompt {usage2['prompt_tokens']} tokens, {cached} restored from the {saved_prefix}-token saved prefix; "
          f"kv_save {kv_save['seconds']:.3f}s {kv_save['freed_bytes']} bytes "
          f"({kv_save['freed_bytes'] / saved_prefix:.0f} bytes/token)")
    assert cached >= usage1["prompt_tokens"]  # at least the first turn came back from disk
    metrics = d.http.get("/metrics").text
    restored_hits = sum(value(metrics, "dormouse_prompt_cache_hits_total", tier=t) for t in ("ram", "disk"))
    assert restored_hits == 1
    assert sum(value(metrics, "dormouse_prompt_cache_tokens_total", tier=t) for t in ("ram", "disk")) == cached
    assert value(metrics, "dormouse_prompt_cache_saved_bytes_total") >= kv_save["freed_bytes"]

    # The same turn with nothing saved: a full re-read gives the same greedy answer.
    sleep(d)  # (saves this turn's prompt and its checkpoints: removed below, while the model sleeps)
    shutil.rmtree(kv_dir(d, state))
    reread, usage3 = chat(d, turn2)
    assert usage3["prompt_tokens_details"]["cached_tokens"] == 0
    assert reread == restored


def test_bad_files_are_deleted_counted_and_never_trusted(start_daemon, tmp_path):
    state = tmp_path / "state"
    env = {"DORMOUSE_KV_CACHE_MIN_TOKENS": "16"}
    d = start_daemon("--parallel", "1", "--ctx-size", "2048", "--sleep-idle-seconds", "-1", "--state-dir", str(state),
                     env=env)
    d.wait_state("ready")
    turn1 = [{"role": "user", "content": STORY[:1500] + " Who sells bread?"}]
    answer1, _ = chat(d, turn1)
    turn2 = turn1 + [{"role": "assistant", "content": answer1}, {"role": "user", "content": "To whom?"}]
    sleep(d)
    directory = kv_dir(d, state)
    (saved,) = list(directory.glob("*.kv"))
    name, pristine = saved.name, saved.read_bytes()  # turn 1 and its answer: a prefix of turn 2

    def only(content: bytes) -> Path:
        """Sleep, then leave nothing in the directory but `content` as the saved prefix."""
        sleep(d)
        for path in directory.glob("*.kv"):
            path.unlink()
        (directory / name).write_bytes(content)
        return directory / name

    def rejected(reason: str) -> float:
        return value(d.http.get("/metrics").text, "dormouse_prompt_cache_rejected_files_total", reason=reason)

    # The reference: turn 2 read in full (nothing saved).
    saved.unlink()
    reference, usage = chat(d, turn2)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    # The pristine file restores (the control for the cases below).
    only(pristine)
    answer, usage = chat(d, turn2)
    assert usage["prompt_tokens_details"]["cached_tokens"] > 100 and answer == reference

    # A corrupted state (found at restore): a full re-read, the same answer, the file gone.
    corrupted = bytearray(pristine)
    corrupted[-100] ^= 0xFF
    path = only(bytes(corrupted))
    answer, usage = chat(d, turn2)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0 and answer == reference
    assert not path.exists() and rejected("corrupt") == 1

    # A truncated file (found at load).
    path = only(pristine[:-10])
    answer, usage = chat(d, turn2)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0 and answer == reference
    assert not path.exists() and rejected("truncated") == 1

    # A file saved for another model file (its fingerprint differs).
    path = only(pristine)
    header, offset = read_header(path)
    state_bytes = read_state(path, header, offset)
    path.unlink()
    write_file(directory, msgspec.structs.replace(header, model={**header.model, "head": "0" * 32}), state_bytes)
    answer, usage = chat(d, turn2)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0 and answer == reference
    assert not path.exists() and rejected("other_model") == 1


def test_a_disk_budget_of_one_byte_keeps_nothing_and_requests_still_succeed(start_daemon, tmp_path):
    state = tmp_path / "state"
    env = {"DORMOUSE_KV_CACHE_MIN_TOKENS": "16", "DORMOUSE_KV_CACHE_DISK_BYTES": "1"}
    d = start_daemon("--parallel", "1", "--ctx-size", "2048", "--sleep-idle-seconds", "-1", "--state-dir", str(state),
                     env=env)
    d.wait_state("ready")
    prompt = [{"role": "user", "content": STORY[:1500] + " Who sells bread?"}]
    first, _ = chat(d, prompt)
    sleep(d)
    assert not list(kv_dir(d, state).glob("*.kv"))
    assert d.props()["kv_cache"]["files"] == 0
    answer, usage = chat(d, prompt)
    assert answer == first and usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_saving_can_be_turned_off(start_daemon, tmp_path):
    state = tmp_path / "state"
    env = {"DORMOUSE_KV_CACHE_MIN_TOKENS": "16", "DORMOUSE_KV_CACHE_DISK_BYTES": "0"}
    d = start_daemon("--parallel", "1", "--ctx-size", "2048", "--sleep-idle-seconds", "-1", "--state-dir", str(state),
                     env=env)
    d.wait_state("ready")
    chat(d, [{"role": "user", "content": STORY[:1500]}], max_tokens=2)
    first = sleep(d)["phases"][0]
    # Disk saving is off; the RAM tier (on) lists its flush as a kv_save step that wrote nothing.
    assert first["name"] == "kv_save" and first["skipped"] and first["freed_bytes"] == 0
    assert not kv_dir(d, state).exists()


def test_header_round_trip(tmp_path):
    header = KvHeader(1, {"size": 1}, {"n_ctx_slot": 8}, [1, 2, 3], 4, "x" * 32)
    from daemon.model.kv_files import checksum

    header = msgspec.structs.replace(header, checksum=checksum(b"abcd"))
    path = write_file(tmp_path, header, b"abcd")
    got, offset = read_header(path)
    from daemon.model import kv_files

    sealed = msgspec.structs.replace(header, checksum=kv_files.seal(header, b"abcd"))  # covers the header too
    assert got == sealed and read_state(path, got, offset) == b"abcd"
