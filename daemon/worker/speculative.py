"""Draft proposals for speculative decoding.

The draft model keeps its own KV cache per slot (same sequence ids as the
target, in the draft context). Before it may propose, it must hold the slot's
history; it reads what it lacks one chunk (batch_size tokens) per engine step
(catch_up), exactly as the target reads a prompt, so no engine step is longer
than one chunk whatever the history (a long prompt, a prompt restored from
the RAM or disk cache): the worker stays responsive and its neighbours keep
their pace. A slot whose draft is a chunk or more behind generates without
drafts meanwhile (the same single-token verification as a proposal the draft
declines, so greedy output does not change). Once within a chunk, it proposes
up to draft_max tokens greedily, stopping early when its own confidence falls
under draft_p_min. The target verifies the proposals (Engine._speculate).
"""

from __future__ import annotations

import ctypes
import sys

from daemon.worker.llama_lib import llama
from daemon.worker.slot import Slot, common_prefix


class Speculator:
    def __init__(self, ctx: ctypes.c_void_p, model: ctypes.c_void_p, n_slots: int, batch_size: int,
                 draft_max: int, draft_min: int, p_min: float) -> None:
        import numpy  # only a worker with a draft model pays for numpy

        self.np = numpy
        self.ctx = ctx
        self.memory = llama.llama_get_memory(ctx)
        self.n_vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(model))
        self.batch_size = batch_size
        self.batch = llama.llama_batch_init(batch_size, 0, 1)
        self.draft_max = draft_max
        self.draft_min = draft_min
        self.p_min = p_min
        self.caches: list[list[int]] = [[] for _ in range(n_slots)]  # tokens in the draft KV, per slot
        self.off: list[object | None] = [None] * n_slots  # the job for which the draft failed to decode: no drafts
        self.chunks: list[int] = [0] * n_slots  # catch-up chunks read since the slot's draft last caught up
        self.chunk_tokens: list[int] = [0] * n_slots  # ... and their tokens
        self.chunk_job: list[object | None] = [None] * n_slots  # ... for this job
        self.chunks_total = 0  # catch-up chunks, ever (bench/liveness.py, tests)
        self.catch_ups_total = 0  # catch-ups completed (a slot's draft within a chunk again after chunks)

    # -- catching up, one chunk per step --

    def usable(self, slot: Slot) -> bool:
        return slot.job is None or self.off[slot.id] is not slot.job

    def behind(self, slot: Slot, history: list[int]) -> int:
        """Tokens of `history` that the slot's draft does not hold (0 when it is off for this job)."""
        if not self.usable(slot):
            return 0
        return len(history) - common_prefix(self.caches[slot.id], history)

    def lags(self, slot: Slot, history: list[int]) -> bool:
        """A chunk or more behind: it catches up (catch_up) before it proposes again."""
        return self.behind(slot, history) >= self.batch_size

    def catch_up(self, slot: Slot, history: list[int]) -> int:
        """Read the next chunk (at most batch_size tokens, no logits) of `history` that the
        draft lacks; the number of tokens read."""
        if not self.usable(slot):
            return 0
        keep = self._trim(slot, history)
        tokens = history[keep:keep + self.batch_size]
        if not tokens:
            return 0
        if self.chunk_job[slot.id] is not slot.job:  # counted per job
            self.chunk_job[slot.id] = slot.job
            self.chunks[slot.id] = self.chunk_tokens[slot.id] = 0
        if not self._decode(slot, tokens, False):
            return 0
        self.chunks[slot.id] += 1
        self.chunk_tokens[slot.id] += len(tokens)
        self.chunks_total += 1
        return len(tokens)

    def _trim(self, slot: Slot, history: list[int], limit: int | None = None) -> int:
        """Drop what the draft holds past its common prefix with `history` (at most `limit`
        kept); the tokens kept."""
        cache = self.caches[slot.id]
        keep = common_prefix(cache, history)
        if limit is not None:
            keep = min(keep, limit)
        if keep < len(cache) and not llama.llama_memory_seq_rm(self.memory, slot.id, keep, -1):
            llama.llama_memory_seq_rm(self.memory, slot.id, -1, -1)
            keep = 0
        del cache[keep:]
        return keep

    # -- proposing --

    def propose(self, slot: Slot, history: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that the draft expects after `history`; none while the draft is
        more than a chunk behind (the engine gives it catch_up chunks meanwhile)."""
        limit = min(limit, self.draft_max)
        if limit <= 0 or not self.usable(slot):
            return []
        keep = self._trim(slot, history, len(history) - 1)  # the last token is decoded again for its logits
        if len(history) - keep > self.batch_size:
            return []  # never more than one chunk in a step
        if self.chunks[slot.id] and self.chunk_job[slot.id] is slot.job:
            self._caught_up(slot, len(history))
        if not self._decode(slot, history[keep:], True):
            return []
        drafts: list[int] = []
        while True:
            token, p = self._best(self.last_index)
            if p < self.p_min:
                break
            drafts.append(token)
            if len(drafts) >= limit or not self._decode(slot, [token], True):
                break
        return drafts if len(drafts) >= self.draft_min else []

    def _caught_up(self, slot: Slot, n_history: int) -> None:
        """Said once per catch-up on the worker's stderr (the daemon's log): how it was read."""
        self.catch_ups_total += 1
        sys.stderr.write(f"draft caught up on slot {slot.id}: {self.chunk_tokens[slot.id]} tokens in "
                         f"{self.chunks[slot.id]} chunks of at most {self.batch_size} (history {n_history})\n")
        sys.stderr.flush()
        self.chunks[slot.id] = self.chunk_tokens[slot.id] = 0

    def _decode(self, slot: Slot, tokens: list[int], logits_last: bool) -> bool:
        seq = slot.id
        cache = self.caches[seq]
        b = self.batch
        for i, token in enumerate(tokens):
            b.token[i] = token
            b.pos[i] = len(cache)
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits_last and i == len(tokens) - 1
            cache.append(token)
        b.n_tokens = len(tokens)
        self.last_index = len(tokens) - 1
        if llama.llama_decode(self.ctx, b) != 0:
            llama.llama_memory_seq_rm(self.memory, seq, -1, -1)
            cache.clear()
            self.off[seq] = slot.job  # no drafts for this job (an image placeholder, a full draft context)
            self.chunks[seq] = self.chunk_tokens[seq] = 0
            return False
        return True

    def _best(self, index: int) -> tuple[int, float]:
        logits = self.np.ctypeslib.as_array(llama.llama_get_logits_ith(self.ctx, index), (self.n_vocab,))
        top = int(logits.argmax())
        shifted = logits - logits[top]
        return top, float(1.0 / self.np.exp(shifted).sum())

    def forget(self, slot: Slot) -> None:
        llama.llama_memory_seq_rm(self.memory, slot.id, -1, -1)
        self.caches[slot.id].clear()
        self.off[slot.id] = None
        self.chunks[slot.id] = self.chunk_tokens[slot.id] = 0

    def close(self) -> None:
        llama.llama_batch_free(self.batch)
