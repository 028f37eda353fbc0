"""The two structured-output engines behind one small interface, for
bench/structured_engines.py:

- llguidance as the daemon runs it: `daemon.grammar.grammar_for` (the HTTP
  layer's checks and limits, then llguidance's grammar text) compiled by the
  worker's own `Matcher` over the worker's tokenizer
  (daemon/worker/structured.py);
- llama.cpp's GBNF grammar sampler, the baseline, fed by llama-cpp-python's
  JSON Schema converter (`llama_cpp.llama_grammar.json_schema_to_gbnf`, a
  port of llama.cpp's json_schema_to_grammar.py: what `LlamaGrammar` uses).
  The daemon's own GBNF converter was deleted with the move to llguidance.

Each engine compiles a JSON Schema into a matcher (or raises Refused with the
engine's reason); a matcher computes the allowed-token mask for the next
position, checks one token, and accepts a token. Both see the same 262k
token vocabulary of the bundled GGUF.
"""

from __future__ import annotations

import ctypes
import json

import numpy as np

ENGINES = ("llguidance", "gbnf")
EOS_IDS = (1, 106)  # Gemma 3's <eos> and <end_of_turn>: the ends a finished JSON may take


class Refused(Exception):
    """The engine will not compile this schema; the message is its reason."""


def load_model(model: str, vocab_only: bool = False, threads: int = 1):
    import llama_cpp  # the whole package, before any daemon.worker import registers a bare one

    return llama_cpp.Llama(model, n_ctx=1024, n_batch=256, n_threads=threads, n_threads_batch=threads,
                           vocab_only=vocab_only, verbose=False)


def vocab_of(llm):
    import llama_cpp

    return llama_cpp.llama_model_get_vocab(llm.model)


def bits_to_bool(mask: np.ndarray, n_vocab: int) -> np.ndarray:
    """A 32-bit-word bitmask (bit i of word i//32 is token i) as one bool per token."""
    return np.unpackbits(mask.view(np.uint8), bitorder="little", count=n_vocab).view(bool)


# -- llguidance, the daemon's path ---------------------------------------------------------


class LlguidanceEngine:
    name = "llguidance"

    def __init__(self, llm, model: str) -> None:
        from daemon.worker.structured import tokenizers

        self.vocab = vocab_of(llm)
        self.n_vocab = llm.n_vocab()
        tokenizers.attach(self.vocab, model)
        tokenizers.get(self.vocab)  # built here, once: the setup table times it

    def grammar_text(self, schema: dict | None = None, **fields) -> str:
        """The HTTP layer's grammar for a json_schema (or other request fields): its refusal is Refused."""
        from daemon.grammar import GrammarRefused, grammar_for

        try:
            grammar = grammar_for(json_schema=schema, **fields) if schema is not None else grammar_for(**fields)
        except GrammarRefused as exc:
            raise Refused(exc.message) from None
        if grammar is None:
            raise Refused("nothing to constrain")
        return grammar

    def compile(self, schema: dict | None = None, grammar: str | None = None) -> "LlguidanceMatcher":
        from daemon.worker.structured import GrammarDeadEnd, Matcher

        text = grammar if grammar is not None else self.grammar_text(schema)
        try:
            return LlguidanceMatcher(Matcher.compile(text, self.vocab, self.n_vocab))
        except GrammarDeadEnd as exc:
            raise Refused(str(exc)) from None


class LlguidanceMatcher:
    """The worker's Matcher; fill() is its bitmask alone (no unpacking onto the vocabulary)."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.words = np.zeros((matcher.n_vocab + 31) // 32, dtype=np.int32)
        self._error = ""

    def fill(self) -> np.ndarray:
        self.matcher._matcher.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
        return self.words

    def mask(self) -> np.ndarray:
        return self.matcher.mask()

    def allows(self, token: int) -> bool:
        return self.matcher.allows(token)

    def accept(self, token: int) -> bool:
        from daemon.worker.structured import GrammarDeadEnd

        try:
            self.matcher.accept(token)
            return True
        except GrammarDeadEnd as exc:
            self._error = str(exc)
            return False

    def complete(self) -> bool:
        return any(self.matcher.allows(t) for t in self.matcher.ends)

    def error(self) -> str:
        inner = self.matcher._matcher
        return self._error or (inner.get_error() if inner.is_error() else "")

    def free(self) -> None:
        pass


# -- llama.cpp's GBNF engine, the baseline -------------------------------------------------


class GbnfEngine:
    name = "gbnf"

    def __init__(self, llm, model: str = "") -> None:
        import llama_cpp

        self.llama = llama_cpp
        self.vocab = vocab_of(llm)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)

    def grammar_text(self, schema: dict) -> str:
        from llama_cpp.llama_grammar import json_schema_to_gbnf

        try:
            return json_schema_to_gbnf(json.dumps(schema))
        except Exception as exc:  # noqa: BLE001 - the converter raises ValueError, AssertionError, KeyError...
            raise Refused(f"{type(exc).__name__}: {str(exc)[:200]}") from None

    def compile(self, schema: dict | None = None, grammar: str | None = None) -> "GbnfMatcher":
        text = grammar if grammar is not None else self.grammar_text(schema)
        sampler = self.llama.llama_sampler_init_grammar(self.vocab, text.encode(), b"root")
        if not sampler:
            raise Refused("llama.cpp could not parse the grammar")
        return GbnfMatcher(self, sampler)


class GbnfMatcher:
    def __init__(self, engine: GbnfEngine, sampler) -> None:
        self.llama = engine.llama
        self.sampler = sampler
        n = engine.n_vocab
        self.candidates = np.empty(n, dtype=[("id", np.int32), ("logit", np.float32), ("p", np.float32)])
        self.ids = np.arange(n, dtype=np.int32)

    def mask(self) -> np.ndarray:
        """Allowed tokens: the grammar applied to every candidate (llama-server's slow path)."""
        cand = self.candidates
        cand["id"] = self.ids
        cand["logit"] = 0.0
        cand["p"] = 0.0
        array = self.llama.llama_token_data_array(
            cand.ctypes.data_as(ctypes.POINTER(self.llama.llama_token_data)), len(cand), -1, False)
        self.llama.llama_sampler_apply(self.sampler, ctypes.byref(array))
        return cand["logit"] != -np.inf

    fill = mask

    def allows(self, token: int) -> bool:
        """One candidate through the grammar (llama-server's fast path)."""
        one = (self.llama.llama_token_data * 1)(self.llama.llama_token_data(token, 0.0, 0.0))
        array = self.llama.llama_token_data_array(one, 1, -1, False)
        self.llama.llama_sampler_apply(self.sampler, ctypes.byref(array))
        return one[0].logit != -np.inf

    def accept(self, token: int) -> bool:
        # Accepting a token the grammar refuses makes llama.cpp throw across the C API: check first.
        if not self.allows(token):
            return False
        self.llama.llama_sampler_accept(self.sampler, token)
        return True

    def complete(self) -> bool:
        return any(self.allows(t) for t in EOS_IDS)

    def error(self) -> str:
        return ""

    def free(self) -> None:
        if self.sampler:
            self.llama.llama_sampler_free(self.sampler)
            self.sampler = None


def make_engine(name: str, llm, model: str):
    return LlguidanceEngine(llm, model) if name == "llguidance" else GbnfEngine(llm, model)
