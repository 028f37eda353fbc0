"""Issue 16, section 6, with the real worker: a symbolic link at
state_dir/kv/<model id> made the worker delete other people's *.kv and
.*.tmp files in the link's target. Now the worker refuses the directory,
says why in the daemon's log, and serves without saved prompts: requests,
sleeps and wakes go on, and the target is untouched."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

PROMPT = [{"role": "user", "content": " ".join(f"Line {i}: the dormouse sleeps in the teapot." for i in range(20))}]


def chat(d) -> dict:
    r = d.http.post("/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_symlinked_model_directory_turns_the_cache_off_and_touches_nothing(start_daemon, tmp_path, bundled_model):
    state = tmp_path / "state"
    theirs = tmp_path / "someone-else"
    theirs.mkdir()
    (theirs / "notes.kv").write_bytes(b"theirs")
    (theirs / ".draft.tmp").write_bytes(b"theirs too")
    (state / "kv").mkdir(parents=True)
    (state / "kv" / Path(bundled_model).stem).symlink_to(theirs, target_is_directory=True)

    d = start_daemon("--parallel", "1", "--ctx-size", "2048", "--sleep-idle-seconds", "-1", "--state-dir", str(state),
                     env={"DORMOUSE_KV_CACHE_MIN_TOKENS": "16"})
    d.wait_state("ready")
    assert d.props()["id"] == Path(bundled_model).stem
    first = chat(d)
    assert d.http.post("/sleep").status_code == 200  # a save would write through the link
    again = chat(d)  # a wake: a new worker scans the directory again
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert sorted(p.name for p in theirs.iterdir()) == [".draft.tmp", "notes.kv"]
    assert "symbolic link" in d.log() and "saved prompt caches" in d.log()
