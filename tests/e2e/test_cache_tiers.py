"""The prompt cache's tiers (issue 18), on the real model: three conversations
taking turns on one slot each come back with their cache from RAM, and after
a daemon restart from disk, with the greedy answers of a daemon that keeps
each conversation on a slot of its own (a restored state is the slot's own
bytes, so the rest of the prompt is read exactly as the live slot reads it)."""

from __future__ import annotations

import pytest

from tests.metrics_text import value

pytestmark = pytest.mark.e2e

TOPICS = ("the mill by the river", "the lighthouse on the cape", "the orchard behind the school")


def opening(topic: str) -> str:
    return " ".join(f"Line {i}: a short note about {topic}, its keeper and the weather on day {i}." for i in range(20))


def chat(d, messages):
    r = d.http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 10, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"], body.get("timings", {})


def turns(d, conversations, question):
    out = []
    for messages in conversations:
        messages.append({"role": "user", "content": question})
        answer, usage, _ = chat(d, messages)
        messages.append({"role": "assistant", "content": answer})
        out.append((answer, usage))
    return out


def test_three_conversations_on_one_slot_come_back_from_ram_then_from_disk_after_a_restart(start_daemon, tmp_path):
    common = ("--sleep-idle-seconds", "-1")  # the same context per slot in both daemons: 2048
    env = {"DORMOUSE_KV_CACHE_MIN_TOKENS": "64"}
    # The reference: a slot per conversation, no other tier.
    reference = start_daemon("--parallel", "3", "--ctx-size", "6144", *common, "--state-dir", str(tmp_path / "ref"),
                             env={**env, "DORMOUSE_PROMPT_CACHE_RAM_BYTES": "0", "DORMOUSE_KV_CACHE_DISK_BYTES": "0"})
    reference.wait_state("ready")
    ref_convs = [[{"role": "user", "content": opening(t)}] for t in TOPICS]
    for messages in ref_convs:
        answer, _, _ = chat(reference, messages)
        messages.append({"role": "assistant", "content": answer})
    ref2 = turns(reference, ref_convs, "Who keeps it?")
    ref3 = turns(reference, ref_convs, "And what was the weather?")
    reference.stop()

    state = tmp_path / "tiers"
    d = start_daemon("--parallel", "1", "--ctx-size", "2048", *common, "--state-dir", str(state), env=env)
    d.wait_state("ready")
    convs = [[{"role": "user", "content": opening(t)}] for t in TOPICS]
    first = []
    for messages in convs:
        answer, usage, _ = chat(d, messages)
        messages.append({"role": "assistant", "content": answer})
        first.append(usage)
    second = turns(d, convs, "Who keeps it?")
    for (answer, usage), (ref_answer, ref_usage), before in zip(second, ref2, first):
        assert usage["prompt_tokens_details"]["cached_tokens"] >= before["prompt_tokens"]  # came back, on one slot
        assert usage["prompt_tokens_details"]["cached_tokens"] == ref_usage["prompt_tokens_details"]["cached_tokens"]
        assert answer == ref_answer
    metrics = d.http.get("/metrics").text
    assert value(metrics, "dormouse_prompt_cache_hits_total", tier="ram") >= 2  # the two whose slot went to another
    tiers = d.props()["kv_cache"]["tiers"]
    assert tiers["ram"]["entries"] >= 2 and 0 < tiers["ram"]["bytes"] <= tiers["ram"]["budget_bytes"]

    # A restart: the RAM tier is gone, the disk tier has every conversation.
    d.stop()
    d = start_daemon("--parallel", "1", "--ctx-size", "2048", *common, "--state-dir", str(state), env=env)
    d.wait_state("ready")
    assert d.props()["kv_cache"]["files"] >= 3
    third = turns(d, convs, "And what was the weather?")
    for (answer, usage), (ref_answer, ref_usage), (_, before) in zip(third, ref3, second):
        assert usage["prompt_tokens_details"]["cached_tokens"] >= before["prompt_tokens"]
        assert answer == ref_answer
    metrics = d.http.get("/metrics").text
    assert value(metrics, "dormouse_prompt_cache_hits_total", tier="disk") >= 1
    assert value(metrics, "dormouse_prompt_cache_rejected_files_total", reason="corrupt") == 0


def test_a_ram_budget_of_one_byte_keeps_nothing_in_ram_and_answers_do_not_change(start_daemon, tmp_path):
    d = start_daemon("--parallel", "1", "--ctx-size", "2048", "--sleep-idle-seconds", "-1",
                     "--state-dir", str(tmp_path / "s"),
                     env={"DORMOUSE_KV_CACHE_MIN_TOKENS": "64", "DORMOUSE_PROMPT_CACHE_RAM_BYTES": "1"})
    d.wait_state("ready")
    a = [{"role": "user", "content": opening(TOPICS[0])}]
    b = [{"role": "user", "content": opening(TOPICS[1])}]
    first, _, _ = chat(d, a)
    chat(d, b)  # takes the slot: a's prefix cannot go to RAM, it goes to disk
    again, usage, _ = chat(d, a)
    assert again == first
    tiers = d.props()["kv_cache"]["tiers"]
    assert tiers["ram"]["bytes"] == 0 and tiers["ram"]["entries"] == 0
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0  # from the disk tier


def test_slot_save_erase_restore_brings_the_conversation_back(start_daemon, tmp_path):
    slots = tmp_path / "slots"
    d = start_daemon("--parallel", "1", "--ctx-size", "2048", "--sleep-idle-seconds", "-1",
                     "--state-dir", str(tmp_path / "s"),
                     env={"DORMOUSE_SLOT_SAVE_PATH": str(slots), "DORMOUSE_PROMPT_CACHE_RAM_BYTES": "0",
                          "DORMOUSE_KV_CACHE_DISK_BYTES": "0"})
    d.wait_state("ready")
    conv = [{"role": "user", "content": opening(TOPICS[2])}]
    answer, usage, _ = chat(d, conv)
    saved = d.http.post("/slots/0?action=save", json={"filename": "orchard.bin"}).json()
    assert saved["id_slot"] == 0 and saved["n_saved"] >= usage["prompt_tokens"] and saved["n_written"] > 0
    assert d.http.post("/slots/0?action=erase", json={}).json()["n_erased"] == saved["n_saved"]
    conv += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Who keeps it?"}]
    restored = d.http.post("/slots/0?action=restore", json={"filename": "orchard.bin"}).json()
    assert restored["n_restored"] == saved["n_saved"] and restored["n_read"] == saved["n_written"]
    _, usage2, _ = chat(d, conv)
    assert usage2["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"]
    # A file that is not there, or was tampered with, is a 400 and nothing is loaded.
    r = d.http.post("/slots/0?action=restore", json={"filename": "absent.bin"})
    assert r.status_code == 400, r.text
    path = next(slots.rglob("orchard.bin"))
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    r = d.http.post("/slots/0?action=restore", json={"filename": "orchard.bin"})
    assert r.status_code == 400 and "checksum" in r.json()["error"]["message"]
    r = d.http.post("/slots/0?action=save", json={"filename": "../escape"})
    assert r.status_code == 400 and not (tmp_path / "escape").exists()


def test_slot_files_keep_their_scope(start_daemon, tmp_path):
    """POST /slots/{id}?action=save|restore never moves one key's prompt into another's scope:
    another key cannot save (nor learn the length of) what a slot holds for someone else, and
    a file restored by another key than the one that saved it serves no request."""
    d = start_daemon("--parallel", "1", "--ctx-size", "2048", "--sleep-idle-seconds", "-1",
                     "--state-dir", str(tmp_path / "s"),
                     env={"DORMOUSE_SLOT_SAVE_PATH": str(tmp_path / "slots"), "DORMOUSE_PROMPT_CACHE_RAM_BYTES": "0",
                          "DORMOUSE_KV_CACHE_DISK_BYTES": "0", "DORMOUSE_API_KEYS": "alice:key-a,bob:key-b"})
    d.wait_state("ready")
    alice, bob = ({"Authorization": f"Bearer {key}"} for key in ("key-a", "key-b"))

    def chat_as(who, messages):
        r = d.http.post("/v1/chat/completions", headers=who,
                        json={"messages": messages, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        return body["usage"]["prompt_tokens_details"]["cached_tokens"], body["choices"][0]["message"]["content"]

    conv = [{"role": "user", "content": opening(TOPICS[0])}]
    _, answer = chat_as(alice, conv)
    # The next turn extends what the file holds (on Gemma a restored window is extended, never cut back).
    conv += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Who keeps it?"}]
    r = d.http.post("/slots/0?action=save", json={"filename": "a.bin"}, headers=bob)
    assert r.status_code == 400 and "holds nothing" in r.json()["error"]["message"], r.text
    assert d.http.post("/slots/0?action=save", json={"filename": "a.bin"}, headers=alice).status_code == 200
    # Bob restores Alice's file: the slot then serves nobody, Bob reads his prompt from 0.
    assert d.http.post("/slots/0?action=restore", json={"filename": "a.bin"}, headers=bob).status_code == 200
    assert chat_as(bob, conv)[0] == 0
    # Restored by Alice, it is hers again.
    assert d.http.post("/slots/0?action=restore", json={"filename": "a.bin"}, headers=alice).status_code == 200
    assert chat_as(alice, conv)[0] > 0


def test_a_ram_restore_survives_the_stash_that_pushes_its_own_entry_out(start_daemon, tmp_path):
    # One slot, a RAM tier that holds one conversation: the returning one's entry is found, then the
    # slot's other conversation is stashed before the restore and pushes it out of the tier. The
    # restore holds its blocks from the lookup on (it took the worker down: a KeyError on the gone entry).
    d = start_daemon("--parallel", "1", "--ctx-size", "512", "--sleep-idle-seconds", "-1",
                     "--state-dir", str(tmp_path / "s"),
                     env={"DORMOUSE_KV_CACHE_MIN_TOKENS": "64", "DORMOUSE_PROMPT_CACHE_RAM_BYTES": "3MB",
                          "DORMOUSE_KV_CACHE_DISK_BYTES": "0"})
    d.wait_state("ready")
    mill = " ".join(f"Line {i}: a short note about {TOPICS[0]}, its keeper and the weather on day {i}." for i in range(4))
    other = " ".join(f"Line {i}: a short note about {TOPICS[1]}, its keeper and the weather on day {i}." for i in range(4))
    for prompt in (mill, other):
        assert d.http.post("/completion", json={"prompt": prompt, "n_predict": 1}).status_code == 200
    r = d.http.post("/completion", json={"prompt": mill + " Line 4: and then", "n_predict": 1})
    assert r.status_code == 200, r.text
    assert r.json()["tokens_cached"] >= 64 and r.json()["timings"]["cache_tier"] == "ram"
    assert d.http.get("/health").json()["state"] == "ready"
