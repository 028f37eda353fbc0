"""Pooled, normalized embeddings from a context made with embeddings on
(ModelSpec.embeddings; runtime.py sets the pooling type).

Each input is decoded as one sequence in one llama_decode (a pooled sequence
must sit in one micro-batch), on the sequence id of slot 0, which an
embeddings model never uses for anything else; its cache is cleared before
and after, so inputs never see each other.
"""

from __future__ import annotations

import ctypes
import math

from daemon.worker.errors import RequestError
from daemon.worker.llama_lib import llama


def embed(ctx: ctypes.c_void_p, batch, limit: int, n_embd: int, tokens: list[int]) -> list[float]:
    """The L2-normalized pooled embedding of one tokenized input of at most
    `limit` tokens (the batch size, and the context of one sequence)."""
    if not tokens:
        raise RequestError("it is empty")
    if len(tokens) > limit:
        raise RequestError(f"it has {len(tokens)} tokens; an embeddings model reads at most {limit} per input "
                           "(its batch_size, within ctx_size / parallel)", "context_length_exceeded")
    memory = llama.llama_get_memory(ctx)
    llama.llama_memory_seq_rm(memory, 0, -1, -1)
    for i, token in enumerate(tokens):
        batch.token[i] = token
        batch.pos[i] = i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = True
    batch.n_tokens = len(tokens)
    try:
        rc = llama.llama_decode(ctx, batch)
        if rc != 0:
            raise RequestError(f"llama_decode failed ({rc}) on an embeddings input", "decode_failed")
        pointer = llama.llama_get_embeddings_seq(ctx, 0)
        if not pointer:
            raise RequestError("the context returned no pooled embedding", "decode_failed")
        vector = [float(pointer[i]) for i in range(n_embd)]
    finally:
        llama.llama_memory_seq_rm(memory, 0, -1, -1)
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else vector
