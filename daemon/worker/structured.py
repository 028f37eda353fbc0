"""Structured output in the worker: llguidance's tokenizer for the loaded
model, and one matcher per request (SamplerChain drives it; sampling.py).

The HTTP layer (daemon/grammar) hands over llguidance's own grammar text,
already checked without a vocabulary. Here it meets the vocabulary: an
`LLMatcher` over the worker's one `LLTokenizer`.

The tokenizer is llguidance's token trie over the model's 262k token pieces
(Gemma 3): seconds and ~100 MiB to build, so it is built once per worker and
only when a first request asks for structured output. A worker that never
serves one (and every wake tier) pays nothing for it.

llguidance's `llamacpp.lltokenizer_from_vocab` does the same, but imports the
`llama_cpp` package, which the worker keeps bare (llama_lib.py), so the
pieces are read here through the low-level bindings.
"""

from __future__ import annotations

import ctypes
import threading
import time

from daemon.worker.errors import RequestError
from daemon.worker.llama_lib import llama

_PIECE_BYTES = 16 * 1024


class _Tokenizers:
    """The LLTokenizer of the loaded vocabulary, built on first use (one per worker: one model)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._vocab = None
        self._tokenizer = None
        self.ends: frozenset[int] = frozenset()  # the vocabulary's end-of-generation tokens
        self.build_seconds: float | None = None  # how long the build took (the worker's log, the bench)

    def get(self, vocab: ctypes.c_void_p):
        with self._lock:
            if self._tokenizer is None or self._vocab != _address(vocab):
                started = time.perf_counter()
                self._tokenizer, self.ends = build_tokenizer(vocab)
                self._vocab = _address(vocab)
                self.build_seconds = time.perf_counter() - started
            return self._tokenizer


def _address(vocab) -> int:
    return ctypes.cast(vocab, ctypes.c_void_p).value or 0


def build_tokenizer(vocab: ctypes.c_void_p):
    """llguidance's tokenizer for this vocabulary: every token's piece (control
    tokens, and user-defined ones spelled <...>, marked special with a 0xff
    prefix, as llguidance's own llama.cpp bridge marks them), the model's
    end-of-generation tokens as its ends, llama.cpp's tokenizer for its
    tokenize calls. Returns (tokenizer, the end-of-generation tokens)."""
    from llguidance import LLTokenizer

    n_tokens = llama.llama_vocab_n_tokens(vocab)
    buffer = ctypes.create_string_buffer(_PIECE_BYTES + 1)
    pieces: list[bytes] = []
    ends: list[int] = []
    control = llama.LLAMA_TOKEN_ATTR_CONTROL
    user_defined = llama.LLAMA_TOKEN_ATTR_USER_DEFINED
    for token in range(n_tokens):
        n = llama.llama_token_to_piece(vocab, token, buffer, _PIECE_BYTES, 0, True)
        piece = bytes(buffer[:max(n, 0)])
        attr = llama.llama_vocab_get_attr(vocab, token)
        if attr & control or (attr & user_defined and piece.startswith(b"<") and piece.endswith(b">")):
            piece = b"\xff" + piece
        pieces.append(piece)
        if llama.llama_vocab_is_eog(vocab, token):
            ends.append(token)
    if not ends:
        ends = [llama.llama_vocab_eos(vocab)]
    tokenize = ctypes.cast(llama._lib.llama_tokenize, ctypes.c_void_p).value
    tokenizer = LLTokenizer.from_llamacpp(tokens=pieces, vocab_ptr=vocab, tokenize_fptr=tokenize, eos_token=ends)
    return tokenizer, frozenset(ends)


tokenizers = _Tokenizers()


class GrammarDeadEnd(RequestError):
    """The grammar allows no token at this position (or llguidance stopped at one of its own limits)."""


class Matcher:
    """One request's llguidance matcher and the bitmask its slow path fills."""

    def __init__(self, matcher, n_vocab: int, ends: frozenset[int]) -> None:
        self._matcher = matcher
        self.n_vocab = n_vocab
        self.ends = ends
        self._mask = None  # int32 words, one bit per token: made on the first refusal

    @classmethod
    def compile(cls, grammar: str, vocab: ctypes.c_void_p, n_vocab: int) -> "Matcher":
        """The matcher for this grammar, its first mask computed: a grammar that
        llguidance refuses, or that hits one of its limits at the first token,
        is this request's error here (a 400), not a dead end at token 1."""
        from llguidance import LLMatcher, LLParserLimits

        tokenizer = tokenizers.get(vocab)
        limits = LLParserLimits(verbose_errors=False)  # its errors go to the client: no grammar dump
        matcher = cls(LLMatcher(tokenizer, grammar, log_level=0, limits=limits), n_vocab, tokenizers.ends)
        matcher.first_mask()
        return matcher

    def first_mask(self) -> None:
        self._check()
        mask = self.mask()
        self._check()
        if not mask.any():
            raise GrammarDeadEnd("the grammar allows no token at the start of the output", "invalid_grammar")

    def fork(self) -> "Matcher":
        """A copy for another choice of the same request (n > 1), before either has accepted a token."""
        return Matcher(self._matcher.deep_copy(), self.n_vocab, self.ends)

    def allows(self, token: int) -> bool:
        if token in self.ends:  # validate_tokens counts no end token, even where the grammar is complete
            return self._matcher.is_accepting()
        return self._matcher.validate_tokens([token]) == 1

    def mask(self):
        """The allowed tokens as one bool per token of the model's vocabulary."""
        import numpy as np

        words = (self.n_vocab + 31) // 32
        if self._mask is None:
            self._mask = np.zeros(words, dtype=np.int32)
        self._matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, words * 4)
        self._check()
        return np.unpackbits(self._mask.view(np.uint8), bitorder="little", count=self.n_vocab).view(bool)

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            self._check()
            raise GrammarDeadEnd("the grammar refused the sampled token", "invalid_grammar")

    def _check(self) -> None:
        if self._matcher.is_error():
            reason = self._matcher.get_error().split("<non-verbose/>")[0].strip()
            raise GrammarDeadEnd(f"structured output stopped: {reason}", "invalid_grammar")
