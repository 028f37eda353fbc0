"""How many of a prompt's tokens a sequence may keep: the one rule that live
reuse, a restore from the saved prompt cache and the saving at sleep go
through. Pure arithmetic; the engine asks llama.cpp for `pos_min`.

Three things can make cached cells unfit for a prompt that shares them:

- Cells that llama.cpp no longer holds. Sliding-window layers (Gemma 2/3,
  Mistral's SWA, gpt-oss) need only the last window of positions, and a saved
  sequence state carries only that window. After trimming a sequence to `k`
  tokens, the next decode (position `k`) reads positions `k - n_swa + 1 .. k-1`
  in those layers; if llama.cpp holds none below `pos_min`, the window has a
  hole and the answer is garbage. Then the prompt is read from 0.

- A recurrent state (Mamba, RWKV; the recurrent half of a hybrid model) is
  one snapshot after its last position: it cannot be trimmed, only extended.

- Cells computed differently from a fresh read (the `deterministic` mode).
  llama.cpp's CPU kernels take other paths for other batch sizes, so a cell
  decoded as the 7th token of a partial chunk, or one at a time while
  generating, holds other bits than the same token read in a full prompt
  chunk. A prompt read from 0 is decoded in chunks [0, B), [B, 2B), ...; if
  reuse stops at a multiple of B and every reused cell was itself decoded in
  such a chunk, the rest of the prompt is decoded in exactly the chunks a
  fresh read uses. `exact` counts a sequence's leading cells that were
  decoded that way and sit where a fresh read puts them: a restored state
  that lacks its first positions lands in other cells, which changes how
  llama.cpp's attention splits its sums across threads, so its cells are
  not exact.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReuseRule:
    chunk: int  # tokens in a prompt chunk (batch_size)
    n_swa: int = 0  # the sliding window of the model's SWA layers; 0: the model has none
    chunked_window: bool = False  # Llama 4's chunked attention: a window restarts every n_swa positions
    recurrent: bool = False  # a recurrent or hybrid model: its state can be extended, never trimmed
    deterministic: bool = False  # reuse only whole chunks counted from 0 that were read as such

    def keepable(self, shared: int, n_prompt: int, exact: int, pos_min: int, n_held: int) -> int:
        """Of a prompt of `n_prompt` tokens whose first `shared` tokens a
        sequence of `n_held` tokens holds (`exact` of them decoded as a fresh
        read decodes them; llama.cpp's lowest position for it is `pos_min`,
        -1 when empty), how many may stay in the cache; the rest is decoded."""
        keep = min(shared, n_prompt - 1)  # the last prompt token is decoded again for its logits
        if self.deterministic:
            keep = min(keep, exact)
            keep -= keep % self.chunk
        if keep <= 0 or pos_min < 0:
            return 0
        if self.recurrent:
            return keep if keep == n_held else 0  # all of it, or nothing
        return keep if pos_min <= self.lowest_needed(keep) else 0

    def lowest_needed(self, keep: int) -> int:
        """The lowest position the decode after `keep` kept tokens attends to."""
        if self.n_swa <= 0:
            return 0  # full attention: every position from 0
        if self.chunked_window:
            return (keep // self.n_swa) * self.n_swa
        return max(0, keep - self.n_swa + 1)  # standard window: p1 - p0 < n_swa (llama_hparams::is_masked_swa)

    def lowest_saved(self, n: int) -> int:
        """The lowest position a saved state of n tokens holds: llama.cpp's
        llama_state_seq_get_data leaves out the cells its window masks for
        position n - 1; a recurrent state is its last position."""
        if self.recurrent:
            return max(0, n - 1)
        if self.n_swa <= 0 or n <= 0:
            return 0
        if self.chunked_window:
            return ((n - 1) // self.n_swa) * self.n_swa
        return max(0, n - self.n_swa)

    def replaces(self, n: int) -> bool:
        """Whether a saved state of n tokens may stand in for every shorter
        entry that is a prefix of it: only when it can be cut back anywhere
        (full attention, or a window that still holds position 0). A window
        or recurrent state serves only its own length (and the regenerate
        of it), so the shorter entry (a checkpoint) must be kept."""
        return self.lowest_saved(n) == 0

    @property
    def checkpoints(self) -> bool:
        """Whether the tiers keep checkpoints of the window or of the recurrent
        state: a model with sliding-window layers or recurrent ones, outside
        the deterministic mode (a restored window lands in other cells than a
        fresh read's, so it is never exact). A recurrent checkpoint is the
        state after its n tokens (kv_cache.restore_checkpoint puts it back in
        place of the slot's, then cuts a hybrid's attention cells to n)."""
        return (self.n_swa > 0 or self.recurrent) and not self.deterministic

    def prompt_end_checkpoint(self, n_prompt: int) -> int:
        """Where the prompt's-end checkpoint is taken (0: none): a window can
        be cut back to n - 1 for a regenerate, which re-reads the last token
        for its logits; a recurrent state cannot, so its checkpoint is taken
        one token before the end (the engine reads the last token alone)."""
        if not self.checkpoints:
            return 0
        return n_prompt - 1 if self.recurrent else n_prompt

    def savable(self, exact: int) -> int:
        """How many leading tokens the deterministic mode saves of a sequence
        with `exact` exact cells: a restore is exact only when it holds every
        position from 0 (see the module's note), so on a model with a window,
        no more than the window."""
        if self.n_swa > 0 and not self.recurrent:
            exact = min(exact, self.n_swa)
        return exact - exact % self.chunk

    def exact_after_read(self, kept: int, exact_before: int, n_read: int) -> int:
        """The sequence's `exact` once its prompt is decoded up to `n_read`,
        having kept `kept` tokens: chunks decoded from an exact chunk boundary
        are exact, except a last partial one."""
        if kept % self.chunk == 0 and kept <= exact_before:
            return n_read - n_read % self.chunk
        held = min(exact_before, kept)
        return held - held % self.chunk
