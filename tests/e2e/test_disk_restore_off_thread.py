"""A disk-tier restore is read and checked off the decode thread (issue 26,
tier speed): while a saved prompt's file is read (held in flight here by the
reader's gate), the decode loop keeps generating the other slot's tokens, one
per step; only llama_state_seq_set_data runs on the decode thread once the
read is done. A file changed on disk is still rejected there, never served;
a request cancelled while its read is in flight frees its slot.

The real engine and the bundled model in this process (no daemon): steps
and tokens are counted, never timed."""

from __future__ import annotations

import pytest

from daemon import protocol as p

pytestmark = pytest.mark.e2e

SAVED = [2, *range(1000, 1300)]  # a 301-token prompt saved to disk (ids the vocabulary holds)
OTHER = [2, *range(3000, 3100)]  # the other stream's prompt


@pytest.fixture(scope="module")
def engine(bundled_model, tmp_path_factory):
    from daemon.worker.engine import Engine
    from daemon.worker.runtime import Runtime

    state = tmp_path_factory.mktemp("off-thread")
    spec = p.ModelSpec(model=bundled_model, ctx_size=2048, parallel=2, threads=2, kv_dir=str(state / "kv" / "m"),
                       kv_disk_bytes=2**30, prompt_cache_ram_bytes=0, kv_min_tokens=64)
    runtime = Runtime(spec)
    runtime.load()
    messages: list = []
    eng = Engine(runtime, messages.append)
    eng.messages = messages
    yield eng
    eng.close()


def run(engine, request_id: str, prompt: list[int], max_tokens: int, **params) -> p.Done:
    engine.submit(p.Submit(request_id, p.SamplingParams(max_tokens=max_tokens, temperature=0, **params),
                           prompt=prompt))
    while engine.busy:
        engine.step()
    return done_of(engine, request_id)


def done_of(engine, request_id: str) -> p.Done:
    found = [m for m in engine.messages if isinstance(m, p.Done) and m.request_id == request_id]
    assert len(found) == 1, found
    return found[0]


def save_to_disk_and_forget(engine, prompt: list[int]) -> None:
    """The prompt's state written to the disk tier, and no slot holding it."""
    from daemon.worker.llama_lib import llama

    run(engine, f"save-{len(engine.messages)}", prompt, 1)
    cache = engine.saved
    for slot in engine.slots:
        if slot.cache[:len(prompt)] == prompt:
            cache.stash(slot, 0)
            cache.writes.join()
            llama.llama_memory_seq_rm(engine.memory, slot.id, -1, -1)
            slot.truncate(0)
    assert cache.disk.best(prompt + [7], "")[1] >= len(prompt) - 1


def test_the_decode_loop_steps_the_other_stream_while_a_disk_read_is_in_flight(engine):
    save_to_disk_and_forget(engine, SAVED)
    reader = engine.saved.reader
    reads_before = reader.reads
    engine.submit(p.Submit("other", p.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                           prompt=OTHER))
    while not any(s.job is not None and s.job.n_generated > 0 for s in engine.slots):
        engine.step()
    other = next(s for s in engine.slots if s.job is not None)
    reader.gate.clear()  # the read of the saved file is held in flight
    try:
        engine.submit(p.Submit("restore", p.SamplingParams(max_tokens=2, temperature=0), prompt=SAVED + [5, 6, 7]))
        generated = other.job.n_generated
        for _ in range(20):
            engine.step()
        assert [item[1].request_id for item in engine.restoring] == ["restore"]
        waiting = engine.restoring[0][4]
        assert waiting is not other and waiting.reserved_for is not None and waiting.job is None
        assert other.job.n_generated == generated + 20  # one token per step: never held up by the read
        assert reader.reads == reads_before  # nothing read yet: the gate held it
    finally:
        reader.gate.set()
    while engine.busy:
        engine.step()
    done = done_of(engine, "restore")
    assert done.cache_tier == "disk" and done.kv_lookup == "hit" and done.kv_rejected is None
    assert done.cached_tokens >= len(SAVED) - 1 and reader.reads == reads_before + 1
    assert waiting.reserved_for is None and not engine.restoring


def test_a_file_changed_on_disk_is_rejected_by_the_reader_and_the_prompt_read_in_full(engine):
    save_to_disk_and_forget(engine, SAVED)
    entry, _ = engine.saved.disk.best(SAVED + [7], "")
    with open(entry.path, "r+b") as f:  # one bit of the state flipped, the size kept
        f.seek(-100, 2)
        byte = f.read(1)
        f.seek(-100, 2)
        f.write(bytes([byte[0] ^ 1]))
    rejected_before = dict(engine.saved.disk.index.rejected)
    done = run(engine, "flipped", SAVED + [8], 2)
    assert done.kv_rejected == "corrupt" and done.cache_tier != "disk" and done.cached_tokens < 64
    assert engine.saved.disk.index.rejected.get("corrupt", 0) == rejected_before.get("corrupt", 0) + 1
    assert not entry.path.exists()


def test_a_restore_cancelled_while_its_read_is_in_flight_frees_its_slot(engine):
    save_to_disk_and_forget(engine, SAVED)
    reader = engine.saved.reader
    reader.gate.clear()
    try:
        engine.submit(p.Submit("gone", p.SamplingParams(max_tokens=2, temperature=0), prompt=SAVED + [4]))
        engine.step()
        assert [item[1].request_id for item in engine.restoring] == ["gone"]
        engine.cancel("gone")
        assert not engine.restoring and all(s.reserved_for is None for s in engine.slots)
        assert done_of(engine, "gone").finish_reason == "cancelled"
    finally:
        reader.gate.set()
    assert run(engine, "after", OTHER + [1], 2).finish_reason in ("stop", "length")
