"""Prompt-cache checkpoints (issue 26): tokens a prompt keeps from the cache
when users come back to a conversation after a sleep, an eviction of its slot
to the RAM tier (parallel = 1, the slot given to another prompt) and a daemon
restart, on the bundled model (Gemma 3: 15 of 18 layers keep a 512-token
window, so a saved state can be extended, never cut back), on the tiny
full-attention llama and on the tiny Mamba and Jamba (a recurrent state: one
snapshot after its last position, never cut back either; the Jamba is a
hybrid, a Mamba layer beside an attention layer); plus the bytes the
checkpoints add.

A conversation: a first prompt of ~800 tokens (answered), then its next turn
(the first prompt, 40 more tokens). Then, per situation:
- regenerate: the same next turn again (a retry);
- edit: the next turn with its last 40 tokens replaced (the last message edited).
Each row prints the prompt, the tokens kept, and the best a checkpoint allows
(a regenerate re-reads the last token for its logits; an edit keeps up to the
turn boundary; on a recurrent model, up to the checkpoint one token before
the first prompt's end, as the state at the boundary itself includes the
answer).

    .venv/bin/python -m bench.cache_checkpoints [--model PATH] [--tiny] [--recurrent] [--skip-bundled]
"""

from __future__ import annotations

import argparse
import random
import tempfile

from bench.common import Daemon, bundled_model, table

FIRST = 800
TURN = 40


def conversation(vocab: range, seed: int) -> tuple[list[int], list[int], object]:
    rng = random.Random(seed)
    first = [rng.choice(vocab) for _ in range(FIRST)]
    turn = first + [rng.choice(vocab) for _ in range(TURN)]
    return first, turn, lambda: first + [rng.choice(vocab) for _ in range(TURN)]  # an edit never sent before


def ask(d: Daemon, tokens: list[int]) -> int:
    r = d.http.post("/completion", json={"prompt": tokens, "n_predict": 8, "temperature": 0})
    r.raise_for_status()
    return r.json()["tokens_cached"]


def start(model: str, state: str, min_tokens: int) -> Daemon:
    d = Daemon("--parallel", "1", "--ctx-size", "4096", "--sleep-idle-seconds", "-1", "--state-dir", state,
               model=model, env={"DORMOUSE_KV_CACHE_MIN_TOKENS": str(min_tokens)})
    d.wait_state("ready")
    return d


def checkpoint_bytes(d: Daemon) -> tuple[int, int]:
    ram = d.props().get("kv_cache", {}).get("tiers", {}).get("ram", {})
    return ram.get("checkpoints", 0), ram.get("checkpoint_bytes", 0)


def measure(model: str, vocab: range, label: str, recurrent: bool = False) -> list[list[object]]:
    rows = []
    first, turn, edit = conversation(vocab, 26)
    n_edit = FIRST + TURN
    boundary = FIRST - 1 if recurrent else FIRST  # the best an edit can keep
    with tempfile.TemporaryDirectory() as state:
        d = start(model, state, 64)
        try:
            ask(d, first)
            ask(d, turn)  # the turn boundary (800) and the prompt's end (840) are checkpoints now
            # after a sleep
            d.http.post("/sleep").raise_for_status()
            rows.append([label, "regenerate after a sleep", len(turn), ask(d, turn), len(turn) - 1])
            d.http.post("/sleep").raise_for_status()
            rows.append([label, "edit after a sleep", n_edit, ask(d, edit()), boundary])
            # after an eviction to RAM: the only slot given to another prompt
            ask(d, turn)
            ask(d, list(reversed(first))[:300])
            rows.append([label, "regenerate after an eviction to RAM", len(turn), ask(d, turn), len(turn) - 1])
            ask(d, list(reversed(first))[:300])
            rows.append([label, "edit after an eviction to RAM", n_edit, ask(d, edit()), boundary])
            # The checkpoints this worker (woken after the last sleep) put in the RAM tier at the evictions.
            count, size = checkpoint_bytes(d)
            ask(d, turn)
        finally:
            d.stop()
        d = start(model, state, 64)  # a restart: the disk tier only
        try:
            rows.append([label, "regenerate after a restart", len(turn), ask(d, turn), len(turn) - 1])
        finally:
            d.stop()
        d = start(model, state, 64)
        try:
            rows.append([label, "edit after a restart", n_edit, ask(d, edit()), boundary])
        finally:
            d.stop()
    for row in rows:
        row.append(f"{100 * row[3] / row[4]:.0f}%")
    rows.append([label, f"checkpoints stashed at the evictions: {count}, own bytes each", "",
                 size // count if count else 0, "", ""])
    rows.append([label, "checkpoint bytes of the conversation (RAM tier, and again on disk)", "", size, "", ""])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--tiny", action="store_true", help="also the tiny full-attention llama")
    parser.add_argument("--recurrent", action="store_true",
                        help="also the tiny Mamba (recurrent) and the tiny Jamba (hybrid)")
    parser.add_argument("--skip-bundled", action="store_true", help="the tiny models only")
    args = parser.parse_args()
    rows = [] if args.skip_bundled else measure(args.model or bundled_model(), range(1000, 20000), "gemma-3-270m")
    if args.tiny:
        from tests.fixtures.tiny_model import write_tiny_model

        with tempfile.TemporaryDirectory() as tmp:
            rows += measure(str(write_tiny_model(f"{tmp}/tiny-llama.gguf")), range(3, 300), "tiny llama")
    if args.recurrent:
        from tests.fixtures.tiny_recurrent_model import write_tiny_hybrid_model, write_tiny_recurrent_model

        with tempfile.TemporaryDirectory() as tmp:
            model = str(write_tiny_recurrent_model(f"{tmp}/tiny-mamba.gguf"))
            rows += measure(model, range(3, 300), "tiny mamba", recurrent=True)
            model = str(write_tiny_hybrid_model(f"{tmp}/tiny-jamba.gguf"))
            rows += measure(model, range(3, 300), "tiny jamba", recurrent=True)
    print(table(["model", "situation", "prompt", "from cache", "best possible", "share"], rows))


if __name__ == "__main__":
    main()
