"""The structured path's sampling (daemon/worker/sampling.py) draws the same
tokens as it did before its first draw moved into llama.cpp
(`llama_sampler_sample`): two chains of the same seed, one sampled by the
slow path as it was (bench/structured_sampling.py's `sample_before`), one by
`SamplerChain.sample`, over a few hundred seeded random logits written into a
real context of the bundled model (262k candidates), with a grammar that
refuses a third of the vocabulary, so both the first draw and the masked
redraw are compared. Where both drew over numpy candidates, the arrays the
chain left are byte-identical, and so are the log-probabilities."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.e2e

DRAWS = 300
HOT = 64
CHAINS = {
    "greedy": {"temperature": 0.0},
    "default": {},
    "hot, min-p only": {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.1},
    "logit bias, a ban among them": {"logit_bias": {5: 4.0, 6: float("-inf"), 7: -2.0}},
    "top logprobs": {"logprobs": 3},
    "greedy, post-sampling": {"temperature": 0.0, "logprobs": 2, "post_sampling_probs": True},
    "penalties": {"repeat_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.2, "repeat_last_n": 16},
    "post-sampling": {"logprobs": 4, "post_sampling_probs": True},
}


class RefusesMultiplesOfThree:
    """A grammar that allows token t unless t % 3 == 0; it counts refusals and takes every token it is given."""

    def __init__(self, n_vocab: int) -> None:
        self.allowed = np.arange(n_vocab) % 3 != 0
        self.refused = 0
        self.accepted: list[int] = []

    def allows(self, token: int) -> bool:
        ok = bool(self.allowed[token])
        self.refused += not ok
        return ok

    def mask(self):
        return self.allowed

    def accept(self, token: int) -> None:
        assert self.allowed[token], token
        self.accepted.append(token)


@pytest.fixture(scope="module")
def model(bundled_model):
    from bench.structured_sampling import Model

    loaded = Model(bundled_model)
    yield loaded
    loaded.close()


@pytest.mark.parametrize("name", list(CHAINS))
def test_same_tokens_candidates_and_logprobs_as_before(model, name):
    from bench.structured_sampling import chain_for, sample_before

    before = chain_for(model, CHAINS[name], RefusesMultiplesOfThree(model.n_vocab))
    after = chain_for(model, CHAINS[name], RefusesMultiplesOfThree(model.n_vocab))
    rng = np.random.default_rng(sum(map(ord, name)))
    logits = model.logits()
    compared_arrays = 0
    try:
        for _ in range(DRAWS):
            logits[:] = rng.normal(0.0, 3.0, model.n_vocab).astype(np.float32)
            logits[:HOT] += 12.0  # most draws among a few tokens: they repeat, so penalties and their history matter
            refused_before = after._grammar.refused
            token_before = sample_before(before, model.ctx, -1)
            token_after = after.sample(model.ctx, -1)
            assert token_after == token_before
            assert after.last_logprobs == before.last_logprobs
            if not after._first_draw_in_c or after._grammar.refused > refused_before:  # both drew over numpy
                size = int(before._drawn.size)
                assert int(after._drawn.size) == size and int(after._drawn.selected) == int(before._drawn.selected)
                assert after._candidates[:size].tobytes() == before._candidates[:size].tobytes()
                compared_arrays += 1
        assert after._grammar.accepted == before._grammar.accepted
        assert after._grammar.refused == before._grammar.refused > 0  # the masked redraw was compared too
        assert compared_arrays > 0
        assert len(set(after._grammar.accepted)) > (1 if after.greedy else 20)  # the logits really changed
    finally:
        before.free()
        after.free()


def test_first_draw_in_c_only_where_nothing_can_tell(model):
    """Penalties remember the tokens they accept and post-sampling reads the candidates: those keep the numpy draw."""
    from bench.structured_sampling import chain_for

    expected = {"greedy": True, "default": True, "hot, min-p only": True, "logit bias, a ban among them": True,
                "top logprobs": True, "greedy, post-sampling": True, "penalties": False, "post-sampling": False}
    for name, overrides in CHAINS.items():
        chain = chain_for(model, overrides)
        try:
            assert chain._first_draw_in_c is expected[name], name
        finally:
            chain.free()
