"""pooling none's bound (daemon/worker/embedding_queue.py): the count of an answer's numbers stops at the
bound, so a request of many inputs costs at most the bound's worth of tokenizing in the worker's step."""

from __future__ import annotations

import pytest

from daemon import protocol as p
from daemon.worker.embedding_queue import MAX_TOKEN_VECTOR_FLOATS, EmbeddingQueue
from daemon.worker.errors import RequestError

N_EMBD, LIMIT = 1000, 512


class Counting(EmbeddingQueue):
    """The mixin with the engine's parts it reads: a tokenizer that counts its calls."""

    n_embd = N_EMBD

    def __init__(self) -> None:
        self.tokenized = 0

    def _embedding_limit(self) -> int:
        return LIMIT

    def prompt_tokens_within(self, text: str, limit: int, what: str = "prompt") -> list[int]:
        self.tokenized += 1
        return [1] * min(len(text.split()), limit)


def query(inputs: list) -> p.Query:
    return p.Query("r1", "embed", inputs=inputs)


def test_the_count_stops_at_the_bound():
    engine = Counting()
    inputs = ["word " * LIMIT] * 256  # 256 x 512 tokens x 1000 numbers: 32 times the bound
    with pytest.raises(RequestError, match="more than the"):
        engine._check_token_vectors(query(inputs))
    needed = MAX_TOKEN_VECTOR_FLOATS // (LIMIT * N_EMBD) + 1  # the inputs that cross the bound
    assert engine.tokenized == needed < len(inputs)


def test_inputs_within_the_bound_are_all_counted_and_pass():
    engine = Counting()
    inputs = ["word " * 10] * 100 + [[5] * 20]  # 1,020 tokens x 1000: a quarter of the bound
    engine._check_token_vectors(query(inputs))
    assert engine.tokenized == 100
