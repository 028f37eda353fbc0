"""The one rule for what a cached sequence may keep (daemon/worker/reuse.py),
checked against a model of llama.cpp's cache: which positions a sliding
window holds, and which cells a fresh read would have computed the same way
(issue 16, sections 1 and 2)."""

from __future__ import annotations

import random

from daemon.worker.reuse import ReuseRule
from daemon.worker.slot import Slot, choose_slot


def attended(rule: ReuseRule, position: int) -> range:
    """The positions a token at `position` reads in the window layers (llama_hparams::is_masked_swa)."""
    if rule.n_swa <= 0:
        return range(0, position)
    if rule.chunked_window:
        return range((position // rule.n_swa) * rule.n_swa, position)
    return range(max(0, position - rule.n_swa + 1), position)


def test_a_window_with_a_hole_is_never_kept():
    """Gemma 3: a restored 818-token slot holds positions 306.. in its window
    layers; a prompt sharing its 4-token chat header must be read from 0."""
    rule = ReuseRule(chunk=512, n_swa=512)
    assert rule.keepable(shared=4, n_prompt=30, exact=0, pos_min=306, n_held=818) == 0
    assert rule.keepable(shared=818, n_prompt=900, exact=0, pos_min=306, n_held=818) == 818  # its next turn goes on
    assert rule.keepable(shared=4, n_prompt=30, exact=0, pos_min=0, n_held=818) == 4  # a live slot holds all of it


def test_random_keeps_only_ever_read_held_positions():
    rng = random.Random(16)
    for _ in range(5000):
        rule = ReuseRule(chunk=rng.choice([1, 7, 64, 512]), n_swa=rng.choice([0, 1, 16, 512, 4096]),
                         chunked_window=rng.random() < 0.2, recurrent=rng.random() < 0.1,
                         deterministic=rng.random() < 0.5)
        n_cache = rng.randint(0, 3000)
        pos_min = -1 if n_cache == 0 else rng.randint(0, n_cache - 1)
        shared = rng.randint(0, n_cache)
        n_prompt = rng.randint(max(1, shared), shared + 500)
        exact = rng.randint(0, n_cache) // rule.chunk * rule.chunk
        keep = rule.keepable(shared, n_prompt, exact, pos_min, n_cache)
        assert 0 <= keep <= min(shared, n_prompt - 1)
        if keep and rule.recurrent:
            assert keep == n_cache  # a snapshot is extended whole or not at all
        elif keep:
            # Every position the decode after them reads is held.
            needed = attended(rule, keep)
            assert pos_min <= (needed.start if needed else keep)  # an empty window needs nothing before keep
            if rule.deterministic:  # whole chunks from 0, each one decoded as a fresh read decodes it
                assert keep % rule.chunk == 0 and keep <= exact


def test_exactness_follows_the_chunks_of_a_fresh_read():
    rule = ReuseRule(chunk=512, deterministic=True)
    # A fresh read of 1300 tokens: chunks [0,512) [512,1024) exact, the partial [1024,1300) is not.
    assert rule.exact_after_read(kept=0, exact_before=0, n_read=1300) == 1024
    # A turn that kept 1024 exact tokens and read on to 2100.
    assert rule.exact_after_read(kept=1024, exact_before=1024, n_read=2100) == 2048
    # Reuse that stopped off a chunk boundary (the non-deterministic mode) makes nothing after it exact.
    assert rule.exact_after_read(kept=700, exact_before=1024, n_read=2100) == 512
    # A mid-prompt cancel: what was read in whole chunks stays exact.
    assert rule.exact_after_read(kept=0, exact_before=0, n_read=512) == 512


def test_deterministic_keeps_stop_at_an_exact_chunk_boundary():
    rule = ReuseRule(chunk=128, n_swa=512, deterministic=True)
    assert rule.keepable(shared=1000, n_prompt=1100, exact=896, pos_min=0, n_held=1100) == 896
    assert rule.keepable(shared=1000, n_prompt=1100, exact=1024, pos_min=0, n_held=1100) == 896  # 1000 rounded down
    assert rule.keepable(shared=1000, n_prompt=1100, exact=0, pos_min=0, n_held=1100) == 0  # generated cells: never
    assert rule.keepable(shared=1000, n_prompt=1000, exact=1024, pos_min=0, n_held=1100) == 896  # the last is read again


def test_a_saved_state_holds_only_its_last_window():
    rule = ReuseRule(chunk=512, n_swa=512)
    assert rule.lowest_saved(818) == 306
    # A saved 818-token state continues at 818 (and re-reads 817 for its logits), nothing shorter.
    assert rule.keepable(818, 900, 0, rule.lowest_saved(818), 818) == 818
    assert rule.keepable(818, 818, 0, rule.lowest_saved(818), 818) == 817
    assert rule.keepable(700, 900, 0, rule.lowest_saved(818), 818) == 0
    assert ReuseRule(chunk=512).lowest_saved(818) == 0  # full attention: everything


def test_the_slot_choice_counts_what_a_slot_may_keep_not_what_it_shares():
    """A long conversation whose window lost the shared header keeps nothing
    for an unrelated prompt, so that prompt takes the empty slot and the
    conversation keeps its cache."""
    long, empty = Slot(0), Slot(1)
    long.cache, long.last_used = [2, 105, 35, 1, *range(100, 900)], 5.0
    prompt = [2, 105, 35, 1, 7, 8, 9, 10, 11, 12]
    rule = ReuseRule(chunk=512, n_swa=512)
    pos_min = {0: 306, 1: -1}
    chosen = choose_slot([long, empty], prompt,
                         lambda s: rule.keepable(s.common_prefix(prompt), len(prompt), s.exact, pos_min[s.id],
                                                 len(s.cache)))
    assert chosen is empty


def test_a_recurrent_state_is_extended_whole_or_read_again():
    """Mamba/RWKV (and hybrid models): llama.cpp's pos_min is the snapshot's last position."""
    rule = ReuseRule(chunk=512, recurrent=True)
    assert rule.keepable(shared=300, n_prompt=400, exact=0, pos_min=299, n_held=300) == 300
    assert rule.keepable(shared=300, n_prompt=300, exact=0, pos_min=299, n_held=300) == 0  # would need 299
    assert rule.keepable(shared=200, n_prompt=400, exact=0, pos_min=299, n_held=300) == 0  # an edit
    assert rule.lowest_saved(300) == 299


def test_the_deterministic_mode_saves_only_what_a_restore_puts_back_exactly():
    """A restore of a state without its first positions puts its cells
    elsewhere than a fresh read, and llama.cpp's attention then splits its
    sums across threads at other places: only states that hold position 0
    are saved (the window's worth on Gemma 3)."""
    rule = ReuseRule(chunk=128, n_swa=512, deterministic=True)
    assert rule.savable(1024) == 512
    assert rule.savable(384) == 384
    assert rule.lowest_saved(rule.savable(1024)) == 0
    assert ReuseRule(chunk=128, deterministic=True).savable(1024) == 1024  # full attention: all of it


def test_a_recurrent_model_keeps_checkpoints_one_token_before_a_prompts_end():
    """A recurrent state cannot be cut back, so a regenerate (which re-reads the
    last token for its logits) needs the state one token before the prompt's
    end; a window can be cut back to it, so its checkpoint is the prompt's end.
    The tiers keep each checkpoint: a longer state never stands in for it."""
    recurrent, window = ReuseRule(chunk=512, recurrent=True), ReuseRule(chunk=512, n_swa=512)
    assert recurrent.checkpoints and window.checkpoints
    assert not ReuseRule(chunk=512).checkpoints  # full attention: any saved state can be cut back
    assert not ReuseRule(chunk=512, recurrent=True, deterministic=True).checkpoints
    assert recurrent.prompt_end_checkpoint(840) == 839 and window.prompt_end_checkpoint(840) == 840
    assert ReuseRule(chunk=512).prompt_end_checkpoint(840) == 0
    for n in (839, 799, 2):
        assert not recurrent.replaces(n)
    at = recurrent.prompt_end_checkpoint(840)
    assert recurrent.keepable(shared=840, n_prompt=840, exact=0, pos_min=recurrent.lowest_saved(at), n_held=at) == 839
    at = window.prompt_end_checkpoint(840)
    assert window.keepable(shared=840, n_prompt=840, exact=0, pos_min=window.lowest_saved(at), n_held=at) == 839


def test_random_prompts_restore_the_best_recurrent_checkpoint_at_or_below_the_common_prefix():
    """The engine's choice (Engine.reuse_plan, best_indexed): each checkpoint judged
    by the rule as a state of its length; the best is the longest at or below
    both the shared prefix and the prompt less its last token, never past it."""
    rule = ReuseRule(chunk=512, recurrent=True)
    rng = random.Random(26)
    for _ in range(2000):
        held = sorted(rng.sample(range(1, 3000), rng.randint(1, 6)))
        n_prompt, shared = rng.randint(1, 3000), rng.randint(0, 3000)
        shared = min(shared, n_prompt)
        kept = max((rule.keepable(min(shared, n), n_prompt, 0, rule.lowest_saved(n), n) for n in held), default=0)
        fits = [n for n in held if n <= shared and n <= n_prompt - 1]
        assert kept == max(fits, default=0), (held, n_prompt, shared)
        if kept:
            assert rule.lowest_saved(kept) == kept - 1  # the restored snapshot's one position
