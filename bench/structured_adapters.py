"""The three structured-output engines behind one small interface, for
bench/structured_engines.py: llama.cpp's GBNF sampler (fed by the daemon's own
daemon/grammar converter, as the worker uses it), llguidance and xgrammar.

Each engine compiles a JSON Schema into a matcher (or raises Refused with the
engine's reason); a matcher computes the allowed-token mask for the next
position, checks one token, and accepts a token. All three see the same 262k
token vocabulary, read from the bundled GGUF through llama-cpp-python.

The vocabulary is read once (token pieces for llguidance, raw token texts for
xgrammar) and cached under the system temp folder, so that the subprocesses of
the hostile-schema part do not each spend seconds on 262k ctypes calls.
"""

from __future__ import annotations

import ctypes
import json
import pickle
import tempfile
from pathlib import Path

import numpy as np

ENGINES = ("gbnf", "llguidance", "xgrammar")
EOS_IDS = (1, 106)  # Gemma 3's <eos> and <end_of_turn>: the ends a finished JSON may take


class Refused(Exception):
    """The engine will not compile this schema; the message is its reason."""


def load_model(model: str, vocab_only: bool = False, threads: int = 1):
    import llama_cpp

    return llama_cpp.Llama(model, n_ctx=1024, n_batch=256, n_threads=threads, n_threads_batch=threads,
                           vocab_only=vocab_only, verbose=False)


def vocab_of(llm):
    import llama_cpp

    return llama_cpp.llama_model_get_vocab(llm.model)


def _is_special(llama_cpp, vocab, token: int, text: bytes) -> bool:
    """As llguidance's llama.cpp bridge decides: control tokens, and user-defined ones spelled <...>."""
    attr = llama_cpp.llama_vocab_get_attr(vocab, token)
    return bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL or (
        attr & llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED and text.startswith(b"<") and text.endswith(b">")))


def vocabulary_tables(llm, model: str) -> dict:
    """{"pieces": [bytes] (llguidance: special ones prefixed 0xff), "texts": [bytes] (xgrammar's
    byte-fallback spelling, special ones empty)}, cached by model path and size."""
    import llama_cpp

    path = Path(model)
    cache = Path(tempfile.gettempdir()) / f"structured_vocab_{path.stem}_{path.stat().st_size}.pickle"
    if cache.exists():
        return pickle.loads(cache.read_bytes())
    vocab = vocab_of(llm)
    buffer = ctypes.create_string_buffer(16 * 1024 + 1)
    pieces, texts = [], []
    for token in range(llama_cpp.llama_vocab_n_tokens(vocab)):
        n = llama_cpp.llama_token_to_piece(vocab, token, buffer, 16 * 1024, 0, True)
        piece = bytes(buffer[:n])
        text = llama_cpp.llama_vocab_get_text(vocab, token)
        special = _is_special(llama_cpp, vocab, token, piece)
        pieces.append(b"\xff" + piece if special else piece)
        texts.append(b"" if special else text)
    tables = {"pieces": pieces, "texts": texts}
    cache.write_bytes(pickle.dumps(tables))
    return tables


def bits_to_bool(mask: np.ndarray, n_vocab: int) -> np.ndarray:
    """A 32-bit-word bitmask (bit i of word i//32 is token i) as one bool per token."""
    return np.unpackbits(mask.view(np.uint8), bitorder="little", count=n_vocab).view(bool)


# -- llama.cpp's GBNF engine, as the worker drives it ------------------------------------


class GbnfEngine:
    name = "gbnf"

    def __init__(self, llm) -> None:
        import llama_cpp

        self.llama = llama_cpp
        self.vocab = vocab_of(llm)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)

    def grammar_text(self, schema: dict) -> str:
        from daemon.grammar import GrammarRefused, grammar_for

        try:
            return grammar_for(json_schema=schema)
        except GrammarRefused as exc:
            raise Refused(exc.message) from None

    def compile(self, schema: dict | None = None, gbnf: str | None = None) -> "GbnfMatcher":
        text = gbnf if gbnf is not None else self.grammar_text(schema)
        sampler = self.llama.llama_sampler_init_grammar(self.vocab, text.encode(), b"root")
        if not sampler:
            raise Refused("llama.cpp could not parse the grammar")
        return GbnfMatcher(self, sampler)


class GbnfMatcher:
    def __init__(self, engine: GbnfEngine, sampler) -> None:
        self.engine = engine
        self.llama = engine.llama
        self.sampler = sampler
        n = engine.n_vocab
        self.candidates = np.empty(n, dtype=[("id", np.int32), ("logit", np.float32), ("p", np.float32)])
        self.ids = np.arange(n, dtype=np.int32)

    def mask(self) -> np.ndarray:
        """Allowed tokens: the grammar applied to every candidate (the worker's slow path)."""
        cand = self.candidates
        cand["id"] = self.ids
        cand["logit"] = 0.0
        cand["p"] = 0.0
        array = self.llama.llama_token_data_array(
            cand.ctypes.data_as(ctypes.POINTER(self.llama.llama_token_data)), len(cand), -1, False)
        self.llama.llama_sampler_apply(self.sampler, ctypes.byref(array))
        return cand["logit"] != -np.inf

    def allows(self, token: int) -> bool:
        """One candidate through the grammar (the worker's fast path)."""
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

    def free(self) -> None:
        if self.sampler:
            self.llama.llama_sampler_free(self.sampler)
            self.sampler = None


# -- llguidance --------------------------------------------------------------------------


class LlguidanceEngine:
    name = "llguidance"

    def __init__(self, llm, tables: dict) -> None:
        import llama_cpp
        import llguidance

        self.llg = llguidance
        vocab = vocab_of(llm)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        tokenize = ctypes.cast(llama_cpp.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
        self.tokenizer = llguidance.LLTokenizer.from_llamacpp(
            tokens=tables["pieces"], vocab_ptr=vocab, tokenize_fptr=tokenize, eos_token=list(EOS_IDS), slices=None)

    def compile(self, schema: dict) -> "LlguidanceMatcher":
        try:
            grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        except ValueError as exc:
            raise Refused(str(exc)) from None
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise Refused(matcher.get_error())
        return LlguidanceMatcher(matcher, self.n_vocab)


class LlguidanceMatcher:
    def __init__(self, matcher, n_vocab: int) -> None:
        self.matcher = matcher
        self.n_vocab = n_vocab
        self.words = np.zeros((n_vocab + 31) // 32, dtype=np.int32)

    def fill(self) -> np.ndarray:
        self.matcher.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
        return self.words

    def mask(self) -> np.ndarray:
        return bits_to_bool(self.fill(), self.n_vocab)

    def allows(self, token: int) -> bool:
        return self.matcher.validate_tokens([token]) == 1

    def accept(self, token: int) -> bool:
        return self.matcher.consume_token(token) and not self.matcher.is_error()

    def complete(self) -> bool:
        return self.matcher.is_accepting()

    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""

    def free(self) -> None:
        pass


# -- xgrammar ----------------------------------------------------------------------------


class XgrammarEngine:
    name = "xgrammar"

    def __init__(self, llm, tables: dict) -> None:
        import llama_cpp
        import xgrammar

        self.xgr = xgrammar
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(vocab_of(llm))
        info = xgrammar.TokenizerInfo(tables["texts"], xgrammar.VocabType.BYTE_FALLBACK, vocab_size=self.n_vocab,
                                      stop_token_ids=list(EOS_IDS))
        # No cache: every compile is measured as a first request would pay it.
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema: dict) -> "XgrammarMatcher":
        try:
            compiled = self.compiler.compile_json_schema(json.dumps(schema))
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses of its own
            raise Refused(f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}") from None
        return XgrammarMatcher(self.xgr.GrammarMatcher(compiled), self.n_vocab)


class XgrammarMatcher:
    def __init__(self, matcher, n_vocab: int) -> None:
        import torch

        self.matcher = matcher
        self.n_vocab = n_vocab
        self.tensor = torch.zeros((1, (n_vocab + 31) // 32), dtype=torch.int32)
        self.words = self.tensor.numpy()[0]  # the same memory

    def fill(self) -> np.ndarray:
        self.matcher.fill_next_token_bitmask(self.tensor)
        return self.words

    def mask(self) -> np.ndarray:
        return bits_to_bool(self.fill(), self.n_vocab)

    def allows(self, token: int) -> bool:
        # xgrammar has no one-token check: accept (it refuses without moving) and roll back.
        if not self.matcher.accept_token(token):
            return False
        self.matcher.rollback(1)
        return True

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def complete(self) -> bool:
        return self.matcher.is_completed()

    def free(self) -> None:
        pass


def make_engine(name: str, llm, model: str):
    if name == "gbnf":
        return GbnfEngine(llm)
    tables = vocabulary_tables(llm, model)
    return LlguidanceEngine(llm, tables) if name == "llguidance" else XgrammarEngine(llm, tables)
