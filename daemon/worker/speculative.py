"""Draft proposals for speculative decoding.

The draft model keeps its own KV cache per slot (same sequence ids as the
target, in the draft context). For a generating slot it first catches up
with the slot's history, then proposes up to draft_max tokens greedily,
stopping early when its own confidence falls under draft_p_min. The target
verifies the proposals (Engine._verify).
"""

from __future__ import annotations

import ctypes

from daemon.worker.llama_lib import llama
from daemon.worker.slot import Slot


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

    def propose(self, slot: Slot, history: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that the draft expects after `history`."""
        limit = min(limit, self.draft_max)
        if limit <= 0:
            return []
        cache = self.caches[slot.id]
        keep = 0
        for a, b in zip(cache, history):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(history) - 1)  # the last token is decoded again for its logits
        if keep < len(cache) and not llama.llama_memory_seq_rm(self.memory, slot.id, keep, -1):
            llama.llama_memory_seq_rm(self.memory, slot.id, -1, -1)
            keep = 0
        del cache[keep:]
        for start in range(keep, len(history), self.batch_size):
            if not self._decode(slot.id, cache, history[start:start + self.batch_size], start + self.batch_size >= len(history)):
                return []
        drafts: list[int] = []
        while True:
            token, p = self._best(self.last_index)
            if p < self.p_min:
                break
            drafts.append(token)
            if len(drafts) >= limit or not self._decode(slot.id, cache, [token], True):
                break
        return drafts if len(drafts) >= self.draft_min else []

    def _decode(self, seq: int, cache: list[int], tokens: list[int], logits_last: bool) -> bool:
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

    def close(self) -> None:
        llama.llama_batch_free(self.batch)
