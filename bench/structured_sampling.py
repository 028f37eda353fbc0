"""The structured path's sampling cost per token, beside the plain fast path,
on the bundled model's 262k-token vocabulary, in one run.

    .venv/bin/python -m bench.structured_sampling [--rounds 15] [--draws 20]

A request with a grammar (or post_sampling_probs) goes through
`SamplerChain.sample`'s slow path; a plain one is one `llama_sampler_sample`
call. Three columns per chain, interleaved round by round over the same logits
(one decoded prompt, so the forward pass is not in the figure):

- plain: `llama_sampler_sample` on the chain (the fast path);
- before: the slow path as it was (`sample_before`, kept here): the chain
  over a numpy candidate array filled with the 262k logits at every token;
- after: the worker's `SamplerChain.sample` as it is now.

The grammar is a stand-in that allows every token (the common case: the
grammar takes the token the chain drew), so the figure is the sampling alone;
llguidance's one-token check (~0.006 ms, bench/structured_engines.py) comes on
top of both columns. A refusal's masked redraw is the same in both.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import numpy as np

from bench.common import bundled_model, table

CHAINS = {
    "greedy": {"temperature": 0.0},
    "default (top-k 40, top-p 0.95, min-p 0.05, temp 0.8)": {},
    "default + repeat_penalty 1.1": {"repeat_penalty": 1.1},
    "default + post_sampling_probs, 5 logprobs": {"post_sampling_probs": True, "logprobs": 5},
}


class AllowAll:
    """A grammar that takes every token: the slow path's common case, without llguidance's cost."""

    def allows(self, token: int) -> bool:
        return True

    def accept(self, token: int) -> None:
        pass


def draw_before(chain, logits, with_grammar: bool) -> int:
    """SamplerChain._draw as it was before the C first draw: candidates filled and the chain applied in numpy."""
    from daemon.worker.llama_lib import llama
    from daemon.worker.sampling import GrammarDeadEnd

    if chain._candidates is None:
        chain._candidates = np.empty(chain.n_vocab, dtype=[("id", np.int32), ("logit", np.float32), ("p", np.float32)])
        chain._ids = np.arange(chain.n_vocab, dtype=np.int32)
    cand = chain._candidates
    cand["id"] = chain._ids
    cand["logit"] = logits
    cand["p"] = 0.0
    if with_grammar:
        cand["logit"][~chain._grammar.mask()] = -np.inf
    array = llama.llama_token_data_array(
        cand.ctypes.data_as(ctypes.POINTER(llama.llama_token_data)), chain.n_vocab, -1, False)
    llama.llama_sampler_apply(chain._chain, ctypes.byref(array))
    if not 0 <= array.selected < array.size:
        raise GrammarDeadEnd("the sampler selected no token", "invalid_grammar")
    chain._drawn = array
    chosen = array.data[array.selected]
    if with_grammar and chosen.logit == float("-inf"):
        raise GrammarDeadEnd("the grammar allows no token at this point of the output", "invalid_grammar")
    return int(chosen.id)


def sample_before(chain, ctx, batch_index: int) -> int:
    """SamplerChain.sample's slow path as it was: every token drawn over the numpy candidates."""
    from daemon.worker import sampling
    from daemon.worker.llama_lib import llama

    pointer = llama.llama_get_logits_ith(ctx, batch_index)
    logits = np.ctypeslib.as_array(pointer, shape=(chain.n_vocab,))
    token = draw_before(chain, logits, with_grammar=False)
    if chain._grammar is not None and not chain._grammar.allows(token):
        token = draw_before(chain, logits, with_grammar=True)
    if chain.post_sampling:
        chain.last_logprobs = chain._post_sampling_at(np, token)
    elif chain.top_logprobs is not None:
        chain.last_logprobs = sampling._log_softmax_at(np, logits, token, chain.top_logprobs)
    llama.llama_sampler_accept(chain._chain, token)
    if chain._grammar is not None:
        chain._grammar.accept(token)
    return token


class Model:
    """The bundled model, one context, one short prompt decoded: logits at index -1 to sample from."""

    def __init__(self, path: str) -> None:
        from daemon.worker.llama_lib import llama

        llama.llama_backend_init()
        self.model = llama.llama_model_load_from_file(path.encode(), llama.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"could not load {path}")
        self.vocab = llama.llama_model_get_vocab(self.model)
        self.n_vocab = llama.llama_vocab_n_tokens(self.vocab)
        params = llama.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_threads, params.n_threads_batch = 256, 64, 1, 1
        self.ctx = llama.llama_init_from_model(self.model, params)
        prompt = (llama.llama_token * 4)(2, 3000, 3001, 3002)
        if llama.llama_decode(self.ctx, llama.llama_batch_get_one(prompt, 4)) != 0:
            raise RuntimeError("decode failed")

    def logits(self) -> np.ndarray:
        """The context's own logits buffer at index -1 (writable: the unit test puts its own there)."""
        from daemon.worker.llama_lib import llama

        return np.ctypeslib.as_array(llama.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,))

    def close(self) -> None:
        from daemon.worker.llama_lib import llama

        llama.llama_free(self.ctx)
        llama.llama_model_free(self.model)


def chain_for(model: Model, overrides: dict, grammar=None):
    from daemon.protocol import SamplingParams
    from daemon.worker.sampling import SamplerChain

    chain = SamplerChain(SamplingParams(seed=7, **overrides), model.n_vocab, 256, model.vocab)
    chain._grammar = grammar
    return chain


def measure(model: Model, overrides: dict, rounds: int, draws: int) -> dict[str, float]:
    """Median ms per token of each column, the columns interleaved within each round."""
    from daemon.worker.llama_lib import llama

    plain = chain_for(model, overrides)
    before = chain_for(model, overrides, AllowAll())
    after = chain_for(model, overrides, AllowAll())
    columns = {
        "plain": lambda: llama.llama_sampler_sample(plain._chain, model.ctx, -1),
        "before": lambda: sample_before(before, model.ctx, -1),
        "after": lambda: after.sample(model.ctx, -1),
    }
    times: dict[str, list[float]] = {name: [] for name in columns}
    for _ in range(rounds):
        for name, draw in columns.items():
            start = time.perf_counter()
            for _ in range(draws):
                draw()
            times[name].append((time.perf_counter() - start) / draws * 1000)
    for chain in (plain, before, after):
        chain.free()
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--draws", type=int, default=20)
    args = parser.parse_args()
    model = Model(bundled_model())
    rows = []
    for name, overrides in CHAINS.items():
        ms = measure(model, overrides, max(args.rounds, 1), max(args.draws, 1))
        rows.append([name, f"{ms['plain']:.3f}", f"{ms['before']:.3f}", f"{ms['after']:.3f}",
                     f"{ms['before'] / ms['plain']:.2f}x", f"{ms['after'] / ms['plain']:.2f}x"])
    print(f"sampling ms per token, {model.n_vocab} candidates (median of {args.rounds} rounds of {args.draws}):")
    print(table(["chain", "plain (C)", "slow path before", "slow path after", "before / plain", "after / plain"],
                rows))
    model.close()


if __name__ == "__main__":
    main()
