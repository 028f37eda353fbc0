"""A llama.cpp sampler chain per request, in llama-server's order:
logit bias, penalties, top-k, top-p, min-p, temperature, then the final draw
(greedy at temperature 0, else a seeded distribution).

Every number is bounded to what it means before it reaches llama.cpp:
llama.cpp allocates the penalty window (`repeat_last_n` tokens) up front and
the logit-bias sampler scans its entries for every sampled token, so an
unbounded value costs memory or time on the one decode thread that every
slot shares."""

from __future__ import annotations

import ctypes
import secrets

from daemon.protocol import SamplingParams
from daemon.worker.errors import RequestError
from daemon.worker.llama_lib import llama


def penalty_window(repeat_last_n: int, n_ctx_slot: int) -> int:
    """-1 means the slot's context (as llama-server); nothing looks further back than that."""
    return n_ctx_slot if repeat_last_n < 0 else min(repeat_last_n, n_ctx_slot)


def check_logit_bias(logit_bias: dict[int, float], n_vocab: int) -> None:
    bad = sorted(t for t in logit_bias if not 0 <= t < n_vocab)
    if bad:
        raise RequestError(f"logit_bias has token ids outside the vocabulary (0..{n_vocab - 1}): {bad[:5]}")


class SamplerChain:
    def __init__(self, params: SamplingParams, n_vocab: int, n_ctx_slot: int) -> None:
        check_logit_bias(params.logit_bias, n_vocab)
        self.seed = params.seed if params.seed is not None else secrets.randbits(32)
        chain = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())
        if chain is None:
            raise RuntimeError("llama_sampler_chain_init failed")
        self._chain = chain
        add = lambda sampler: llama.llama_sampler_chain_add(chain, sampler)  # noqa: E731

        if params.logit_bias:
            biases = (llama.llama_logit_bias * len(params.logit_bias))()
            for entry, (token, bias) in zip(biases, params.logit_bias.items()):
                entry.token, entry.bias = int(token), float(bias)
            add(llama.llama_sampler_init_logit_bias(n_vocab, len(params.logit_bias), biases))
        if params.repeat_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
            add(
                llama.llama_sampler_init_penalties(
                    n_vocab,
                    penalty_window(params.repeat_last_n, n_ctx_slot),
                    params.repeat_penalty,
                    params.frequency_penalty,
                    params.presence_penalty,
                )
            )
        if params.temperature <= 0.0:
            add(llama.llama_sampler_init_greedy())
            return
        if params.top_k > 0:
            add(llama.llama_sampler_init_top_k(min(params.top_k, n_vocab)))
        if params.top_p < 1.0:
            add(llama.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0.0:
            add(llama.llama_sampler_init_min_p(params.min_p, 1))
        add(llama.llama_sampler_init_temp(params.temperature))
        add(llama.llama_sampler_init_dist(self.seed & 0xFFFFFFFF))

    def sample(self, ctx: ctypes.c_void_p, batch_index: int) -> int:
        """Draw from the logits at batch_index and accept the token."""
        return llama.llama_sampler_sample(self._chain, ctx, batch_index)

    def accept(self, token: int) -> None:
        llama.llama_sampler_accept(self._chain, token)

    def free(self) -> None:
        if self._chain is not None:
            llama.llama_sampler_free(self._chain)
            self._chain = None
