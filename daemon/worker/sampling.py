"""A llama.cpp sampler chain per request, in llama-server's order:
logit bias, penalties, top-k, top-p, min-p, temperature, then the final draw
(greedy at temperature 0, else a seeded distribution).

A grammar (structured output, forced tool calls) is an llguidance matcher
(structured.py), used as llama-server's common_sampler uses its grammar: draw
from the chain first, and only when the grammar refuses that token, draw
again with the grammar's mask over the whole vocabulary (the refused
candidates' logits set to -inf before the chain). Checking one token costs
microseconds; a mask costs ~0.06 ms in llguidance, but unpacking it onto 262k
logits (Gemma 3's vocabulary) in numpy costs 1-2 ms, so only refusals pay it.
The first draw is llama.cpp's own (`llama_sampler_sample`, as a plain
request's) unless the chain has penalties, whose accept of a refused token
could not be undone, or post_sampling_probs needs the candidates: then it is
the same chain over a numpy candidate array (bench/structured_sampling.py
measures both).
Either way the token is one the grammar allows, or the request ends with an
error (GrammarDeadEnd, also when llguidance stops at one of its own limits).

Log-probabilities are the model's own (a log-softmax of the raw logits, before
bias, penalties, temperature and truncation), as OpenAI's are; with
post_sampling_probs they are those of the distribution the chain drew from
(after truncation and temperature, renormalized), as llama-server's
`post_sampling_probs`: that needs the chain's candidates, so the slow path.

logit_bias keys that are text (llama-server's) are tokenized here, without
special tokens, and each of their tokens gets the bias; a bias of -inf bans.

Every number is bounded to what it means before it reaches llama.cpp:
llama.cpp allocates the penalty window (`repeat_last_n` tokens) up front and
the logit-bias sampler scans its entries for every sampled token, so an
unbounded value costs memory or time on the one decode thread that every
slot shares."""

from __future__ import annotations

import ctypes
import math
import secrets
from collections.abc import Sequence
from itertools import islice

from daemon.protocol import SamplingParams
from daemon.worker.errors import RequestError
from daemon.worker.llama_lib import llama
from daemon.worker.structured import GrammarDeadEnd, Matcher

__all__ = ["GrammarDeadEnd", "SamplerChain"]


def penalty_window(repeat_last_n: int, n_ctx_slot: int) -> int:
    """-1 means the slot's context (as llama-server); nothing looks further back than that."""
    return n_ctx_slot if repeat_last_n < 0 else min(repeat_last_n, n_ctx_slot)


def check_logit_bias(logit_bias: dict[int, float], n_vocab: int) -> None:
    bad = sorted(t for t in logit_bias if not 0 <= t < n_vocab)
    if bad:
        raise RequestError(f"logit_bias has token ids outside the vocabulary (0..{n_vocab - 1}): {bad[:5]}")


def text_tokens(vocab: ctypes.c_void_p, text: str) -> list[int]:
    """A text's tokens as llama-server reads a logit_bias key: no BOS, special tokens not parsed."""
    data = text.encode("utf-8")
    capacity = len(data) + 8  # a token is at least one byte; the schema bounds the text
    buf = (llama.llama_token * capacity)()
    n = llama.llama_tokenize(vocab, data, len(data), buf, capacity, False, False)
    return list(buf[:max(n, 0)])


def resolved_logit_bias(params: SamplingParams, n_vocab: int, vocab: ctypes.c_void_p | None) -> dict[int, float]:
    """Token id -> bias, the text keys' tokens included; biases of one token add up (as llama.cpp applies each)."""
    check_logit_bias(params.logit_bias, n_vocab)
    if not params.logit_bias_text:
        return params.logit_bias
    if vocab is None:  # pragma: no cover - every engine call site passes its vocabulary
        raise RequestError("logit_bias text keys need the model's vocabulary")
    biases = dict(params.logit_bias)
    for text, bias in params.logit_bias_text:
        tokens = text_tokens(vocab, text)
        if not tokens:
            raise RequestError(f"logit_bias: the text {text[:32]!r} has no tokens in this model's vocabulary")
        for token in tokens:
            biases[token] = biases.get(token, 0.0) + bias
    return biases


class SamplerChain:
    def __init__(self, params: SamplingParams, n_vocab: int, n_ctx_slot: int, vocab: ctypes.c_void_p | None = None,
                 grammar_of: "SamplerChain | None" = None, eog: Sequence[int] = (), prompt: Sequence[int] = ()) -> None:
        """prompt: the prompt's tokens, whose last repeat_last_n the penalties count as they count the answer's
        (llama-server accepts every prompt token into its sampler; placeholders of images, -1, are skipped).
        grammar_of: another request's chain whose grammar has accepted
        nothing yet (the first choice, at the fork of n choices): its matcher
        copied rather than compiled again. eog: the model's end-of-generation
        tokens, which ignore_eos never draws (llama-server biases them to -inf), unless a grammar
        constrains the answer: its end is the grammar's to say, which an end token banned would turn into
        an error after the whole answer."""
        logit_bias = resolved_logit_bias(params, n_vocab, vocab)
        if params.ignore_eos and eog and params.grammar is None:  # a grammar says itself when the answer ends
            logit_bias = {**logit_bias, **dict.fromkeys(eog, -math.inf)}
        self.n_vocab = n_vocab
        self.top_logprobs = params.logprobs
        self.post_sampling = params.post_sampling_probs and params.logprobs is not None
        self.greedy = params.temperature <= 0.0
        self.last_logprobs: tuple[float, list[tuple[int, float]]] | None = None  # (chosen, top) of the last draw
        self._grammar: Matcher | None = None
        self._candidates = None  # numpy records shared with llama.cpp, made on the first slow-path draw
        if params.grammar is not None and grammar_of is not None and grammar_of._grammar is not None:
            self._grammar = grammar_of._grammar.fork()
        elif params.grammar is not None:
            if vocab is None:  # pragma: no cover - every engine call site passes its vocabulary
                raise RequestError("a grammar needs the model's vocabulary", "invalid_grammar")
            self._grammar = Matcher.compile(params.grammar, vocab, n_vocab)
        self.seed = params.seed if params.seed is not None else secrets.randbits(32)
        chain = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())
        if chain is None:
            raise RuntimeError("llama_sampler_chain_init failed")
        self._chain = chain
        add = lambda sampler: llama.llama_sampler_chain_add(chain, sampler)  # noqa: E731

        if logit_bias:
            biases = (llama.llama_logit_bias * len(logit_bias))()
            for entry, (token, bias) in zip(biases, logit_bias.items()):
                entry.token, entry.bias = int(token), float(bias)
            add(llama.llama_sampler_init_logit_bias(n_vocab, len(logit_bias), biases))
        penalized = params.repeat_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
        # llama_sampler_sample accepts the token it draws; every sampler but the penalties ignores an accept, so
        # only without them may a grammar's first draw be that one call (the same token and chain state as the
        # draw over our own candidates), and only where nothing reads the candidates the chain left.
        self._first_draw_in_c = not penalized and not (self.post_sampling and not self.greedy)
        if penalized:
            window = penalty_window(params.repeat_last_n, n_ctx_slot)
            add(
                llama.llama_sampler_init_penalties(
                    n_vocab,
                    window,
                    params.repeat_penalty,
                    params.frequency_penalty,
                    params.presence_penalty,
                )
            )
            # Only the penalties keep what they accept, and only the last `window` of it: accepting those
            # tokens into the penalties alone gives the state llama-server's accept of the whole prompt does.
            penalties = llama.llama_sampler_chain_get(chain, llama.llama_sampler_chain_n(chain) - 1)
            for token in reversed(list(islice((t for t in reversed(prompt) if t >= 0), window))):
                llama.llama_sampler_accept(penalties, token)  # ~1 us each: the window, not the prompt, is walked
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
        if self._grammar is None and not (self.post_sampling and not self.greedy):
            token = llama.llama_sampler_sample(self._chain, ctx, batch_index)  # all in C, the token accepted
            if self.post_sampling:  # greedy: a point mass on its token
                self.last_logprobs = self._post_sampling_at(None, token)
            elif self.top_logprobs is not None:  # the model's own: read from the logits, which the draw left alone
                import numpy as np

                logits = np.ctypeslib.as_array(llama.llama_get_logits_ith(ctx, batch_index), shape=(self.n_vocab,))
                self.last_logprobs = _log_softmax_at(np, logits, token, self.top_logprobs)
            return token
        import numpy as np  # only requests with a grammar or post-sampling probabilities pay for this path

        def logits():  # read only where a numpy draw or the model's own log-probabilities need them
            return np.ctypeslib.as_array(llama.llama_get_logits_ith(ctx, batch_index), shape=(self.n_vocab,))

        if self._first_draw_in_c:  # the common case: the grammar takes the token a plain request would draw
            token = llama.llama_sampler_sample(self._chain, ctx, batch_index)  # accepted: a no-op for this chain
            accepted = True
        else:
            token, accepted = self._draw(logits(), with_grammar=False), False
        if self._grammar is not None and not self._grammar.allows(token):
            token, accepted = self._draw(logits(), with_grammar=True), False
        if self.post_sampling:
            self.last_logprobs = self._post_sampling_at(np, token)
        elif self.top_logprobs is not None:
            self.last_logprobs = _log_softmax_at(np, logits(), token, self.top_logprobs)
        if not accepted:
            llama.llama_sampler_accept(self._chain, token)
        if self._grammar is not None:
            self._grammar.accept(token)
        return token

    def _draw(self, logits, with_grammar: bool) -> int:
        """The chain over every candidate (the grammar's mask first when asked), as llama_sampler_sample does."""
        import numpy as np

        if self._candidates is None:
            self._candidates = np.empty(self.n_vocab, dtype=[("id", np.int32), ("logit", np.float32), ("p", np.float32)])
            self._ids = np.arange(self.n_vocab, dtype=np.int32)
            self._candidates_pointer = self._candidates.ctypes.data_as(ctypes.POINTER(llama.llama_token_data))
        cand = self._candidates
        # again at every draw: samplers sort and cut the array in place. Three column writes measured as fast as
        # a memmove of a pristine template plus the logits column (memory-bound either way, ~0.4 ms for 262k).
        cand["id"] = self._ids
        cand["logit"] = logits
        cand["p"] = 0.0
        if with_grammar:
            cand["logit"][~self._grammar.mask()] = -np.inf
        array = llama.llama_token_data_array(self._candidates_pointer, self.n_vocab, -1, False)
        llama.llama_sampler_apply(self._chain, ctypes.byref(array))
        if not 0 <= array.selected < array.size:
            raise GrammarDeadEnd("the sampler selected no token", "invalid_grammar")
        self._drawn = array  # what the chain left: the distribution post-sampling probabilities are read from
        chosen = array.data[array.selected]
        if with_grammar and chosen.logit == float("-inf"):
            raise GrammarDeadEnd("the grammar allows no token at this point of the output", "invalid_grammar")
        return int(chosen.id)

    def _post_sampling_at(self, np, token: int) -> tuple[float, list[tuple[int, float]]]:
        """log p(token) and the most likely candidates with theirs, under the
        distribution the chain drew from: the candidates it kept, their logits
        after bias, penalties and temperature, renormalized. Greedy draws from
        a point mass on its token. Candidates of probability 0 are left out,
        as llama-server does."""
        top = self.top_logprobs or 0
        if self.greedy:
            return 0.0, [(token, 0.0)][:top]
        array = self._drawn
        size = int(array.size)
        if ctypes.addressof(array.data.contents) == self._candidates.ctypes.data:
            kept = self._candidates[:size]
        else:  # pragma: no cover - llama.cpp's samplers sort and cut in place
            kept = np.ctypeslib.as_array(array.data, shape=(size,))
        values = kept["logit"].astype(np.float64)
        probs = np.exp(values - values.max())
        probs /= probs.sum()
        ids = kept["id"]
        where = np.flatnonzero(ids == token)
        chosen = float(probs[where[0]]) if where.size else 0.0
        best: list[tuple[int, float]] = []
        if top > 0:
            order = np.argpartition(-probs, top - 1)[:top] if size > top else np.arange(size)
            order = order[np.argsort(-probs[order], kind="stable")]
            best = [(int(ids[i]), float(np.log(probs[i]))) for i in order if probs[i] > 0.0]
        return (float(np.log(chosen)) if chosen > 0.0 else float("-inf")), best

    def free(self) -> None:
        if self._chain is not None:
            llama.llama_sampler_free(self._chain)
            self._chain = None
        self._grammar = None  # llguidance's matcher is freed with its last reference


def _log_softmax_at(np, logits, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """log p(token) and the `top` most likely tokens with theirs, from raw logits."""
    values = logits.astype(np.float64)
    peak = values.max()
    log_total = peak + np.log(np.exp(values - peak).sum())
    best: list[tuple[int, float]] = []
    if top > 0:
        ids = np.argpartition(-values, top - 1)[:top]
        ids = ids[np.argsort(-values[ids], kind="stable")]
        best = [(int(i), float(values[i] - log_total)) for i in ids]
    return float(values[token] - log_total), best
