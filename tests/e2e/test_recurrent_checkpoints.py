"""Prompt-cache checkpoints on recurrent models (issue 26), on a real Mamba
and a real Jamba (a hybrid: a Mamba layer and an attention layer) that
llama.cpp loads (tests/fixtures/tiny_recurrent_model.py).

A recurrent state is one snapshot after its last position: llama.cpp cannot
cut it back (llama_memory_recurrent::seq_rm refuses a partial cut), so a
state saved after a prompt and its answer serves neither a regenerate of the
prompt nor an edit of its end. The worker keeps checkpoints of the state one
token before each prompt's end (a regenerate re-reads the last token for its
logits), at each turn boundary and every N prompt tokens, in the slot, the
RAM tier and the disk tier; a lookup restores the best one at or below the
common prefix. Each answer equals the same prompt read with cache_prompt
false (greedy).
"""

from __future__ import annotations

import random

import pytest

from tests.metrics_text import value

pytestmark = pytest.mark.e2e

FIRST = 800  # the first prompt's tokens
TURN = 40  # the next turn's
VOCAB = range(3, 300)  # the tiny vocabulary's byte tokens and pieces: no control token


@pytest.fixture(scope="module")
def tiny_recurrent_model(tmp_path_factory) -> str:
    from tests.fixtures.tiny_recurrent_model import write_tiny_recurrent_model

    return str(write_tiny_recurrent_model(tmp_path_factory.mktemp("mamba") / "tiny-mamba.gguf"))


@pytest.fixture(scope="module", params=["mamba", "jamba"])
def recurrent_or_hybrid(request, tmp_path_factory) -> str:
    """The Mamba, or the Jamba: its attention cells are cut back to a checkpoint, its recurrent state replaced."""
    from tests.fixtures import tiny_recurrent_model as tiny

    write = tiny.write_tiny_hybrid_model if request.param == "jamba" else tiny.write_tiny_recurrent_model
    return str(write(tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}.gguf"))


class Conversation:
    """A daemon on the tiny Mamba, and every (prompt, answer) it gave, to be checked against fresh reads."""

    def __init__(self, start_daemon, model: str, state: str) -> None:
        self.start = lambda: start_daemon("--model", model, "--parallel", "1", "--ctx-size", "4096",
                                          "--sleep-idle-seconds", "-1", "--state-dir", state,
                                          env={"DORMOUSE_KV_CACHE_MIN_TOKENS": "16"})
        self.d = self.start()
        self.d.wait_state("ready")
        self.answers: list[tuple[list[int], str]] = []

    def ask(self, tokens: list[int], cache: bool = True) -> tuple[str, int]:
        r = self.d.http.post("/completion", json={"prompt": tokens, "n_predict": 8, "temperature": 0,
                                                  "cache_prompt": cache})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tokens_evaluated"] == len(tokens)
        if cache:
            self.answers.append((tokens, body["content"]))
        return body["content"], body["tokens_cached"]

    def cached(self, tokens: list[int]) -> int:
        return self.ask(tokens)[1]

    def restart(self) -> None:
        self.d.stop()
        self.d = self.start()
        self.d.wait_state("ready")

    def sleep(self) -> None:
        assert self.d.http.post("/sleep").status_code == 200

    def hits(self, tier: str) -> float:
        return value(self.d.http.get("/metrics").text, "dormouse_prompt_cache_hits_total", tier=tier)

    def check_answers(self) -> None:
        """Every answer given equals the same prompt read from 0 (cache_prompt false)."""
        for tokens, answer in self.answers:
            fresh, kept = self.ask(tokens, cache=False)
            assert kept == 0
            assert fresh == answer, (len(tokens), fresh, answer)


def prompts(seed: int) -> tuple[list[int], list[int], object]:
    rng = random.Random(seed)
    first = [rng.choice(VOCAB) for _ in range(FIRST)]
    turn = first + [rng.choice(VOCAB) for _ in range(TURN)]
    return first, turn, lambda: first + [rng.choice(VOCAB) for _ in range(TURN)]  # the last message edited


def test_regenerate_and_edit_keep_the_prompt_live_after_an_eviction_and_after_a_sleep(
        start_daemon, tmp_path, recurrent_or_hybrid):
    c = Conversation(start_daemon, recurrent_or_hybrid, str(tmp_path / "state"))
    first, turn, edit = prompts(26)
    assert c.cached(first) == 0
    # The slot holds the first prompt and its answer: a state past the turn boundary, which only
    # the checkpoint one token before the first prompt's end can serve.
    assert c.cached(turn) == FIRST - 1
    assert c.cached(turn) == len(turn) - 1  # a regenerate, live
    assert c.cached(edit()) == FIRST - 1  # the last message edited, live

    c.cached(list(reversed(first))[:300])  # the only slot given to another prompt: its checkpoints go to RAM
    assert c.cached(turn) == len(turn) - 1
    c.cached(list(reversed(first))[:300])
    assert c.cached(edit()) == FIRST - 1
    assert c.hits("ram") >= 2

    c.sleep()  # the RAM tier is gone with the worker: the disk tier
    assert c.cached(turn) == len(turn) - 1
    c.sleep()
    cached = c.cached(edit())
    assert cached == FIRST - 1 and cached >= 0.9 * (len(turn) - TURN)
    assert c.hits("disk") >= 2
    c.check_answers()


def test_after_a_restart_a_regenerate_and_an_edit_come_back_from_disk(start_daemon, tmp_path, recurrent_or_hybrid):
    c = Conversation(start_daemon, recurrent_or_hybrid, str(tmp_path / "state"))
    first, turn, edit = prompts(27)
    c.cached(first)
    c.cached(turn)
    c.restart()
    assert c.cached(turn) == len(turn) - 1
    c.restart()
    assert c.cached(edit()) == FIRST - 1
    assert c.hits("disk") >= 1
    c.check_answers()


def test_checkpoints_every_n_tokens_serve_an_edit_inside_a_long_prompt(start_daemon, tmp_path, tiny_recurrent_model):
    """cache_checkpoint_every (1024 by default): an edit at 1,500 of a 2,000-token prompt keeps the
    state at the last chunk boundary past 1,024 tokens at or below 1,500, after a sleep too."""
    c = Conversation(start_daemon, tiny_recurrent_model, str(tmp_path / "state"))
    rng = random.Random(28)
    long = [rng.choice(VOCAB) for _ in range(2000)]
    c.cached(long)
    edited = long[:1500] + [rng.choice(VOCAB) for _ in range(100)]
    kept = c.cached(edited)
    assert 1024 <= kept <= 1500, kept
    c.sleep()
    assert c.cached(long[:1500] + [rng.choice(VOCAB) for _ in range(100)]) == kept
    c.check_answers()
