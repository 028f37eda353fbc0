"""Structured output in the worker: llguidance's tokenizer for the loaded
model, and one matcher per request (SamplerChain drives it; sampling.py).

The HTTP layer (daemon/grammar) hands over llguidance's own grammar text,
already checked without a vocabulary. Here it meets the vocabulary: an
`LLMatcher` over the worker's one `LLTokenizer`.

The tokenizer is llguidance's token trie over the model's 262k token pieces
(Gemma 3): ~2-3.5 s and ~120 MiB to build, so it is built once per model file
and only when a first request asks for structured output. A worker that never
serves one (and every wake tier) pays nothing for it. It is built on a thread
of its own: the request that asked waits in the queue (`startable`) while the
other slots go on decoding. Reading the 262k pieces (Python over ctypes, ~60%
of the build) shares the interpreter with the decode thread; llguidance's own
constructor (`LLTokenizer.from_llamacpp`, Rust) holds the GIL for its whole
run (~1.4 s at 262k tokens on the 2-core box, more under load), and that
part still holds up the decode thread: its binding gives no way to release it.

The tokenizer is kept for as long as the model file is the same (path, size,
modification time): a drowsy wake (new contexts, the same weights) and a
reload of the same file in this process reuse it. Its tokenize callback never
holds a vocabulary pointer of its own: it goes through `_tokenize`, which
calls llama.cpp with the vocabulary attached now, so a freed vocabulary is
never reached through it.

llguidance's `llamacpp.lltokenizer_from_vocab` does the same, but imports the
`llama_cpp` package, which the worker keeps bare (llama_lib.py), so the
pieces are read here through the low-level bindings.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

from daemon.worker.errors import RequestError
from daemon.worker.llama_lib import llama

_PIECE_BYTES = 16 * 1024
WAIT_SECONDS = 0.02  # with only structured requests waiting for the build, a step waits this long (not a spin)


class BuildStopped(Exception):
    """The vocabulary was detached (the engine closed) while its pieces were being read."""


class _Tokenizers:
    """The LLTokenizer of the loaded model, built on a thread at first use (one per worker: one model)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._vocab = 0  # the vocabulary attached now: the one _tokenize calls and a build reads
        self._key: tuple | None = None  # the model file the tokenizer is (being) built for
        self._tokenizer = None
        self._thread: threading.Thread | None = None
        self._done = threading.Event()  # set when no build is in flight (built, failed or stopped)
        self._done.set()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.gate = threading.Event()  # a build waits for it before reading (tests hold a build in flight)
        self.gate.set()
        self.ends: frozenset[int] = frozenset()  # the vocabulary's end-of-generation tokens
        self.builds = 0  # builds started in this process (tests count them)
        self.build_seconds: float | None = None  # how long the last build took (tests, the bench)
        self.build_parts: dict[str, float] = {}  # ... and its two parts (build_tokenizer)

    def attach(self, vocab: ctypes.c_void_p, model_file: str | None = None) -> None:
        """The model's vocabulary, from now on what the tokenize callback and a
        build use. A tokenizer built for the same model file is kept; with no
        file (a bare vocabulary), only for the same vocabulary."""
        key = _file_identity(model_file) if model_file else ("vocab", _address(vocab))
        self.detach()  # a build in flight reads the old vocabulary: stopped before anything changes
        with self._lock:
            self._vocab = _address(vocab)
            if key != self._key:
                self._key, self._tokenizer, self._error = key, None, None

    def detach(self) -> None:
        """The vocabulary is about to be freed: stop a build that is reading it, and call it no more."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            self._stop.set()
            self.gate.set()
            thread.join()
        with self._lock:
            self._vocab = 0

    def ready(self, vocab: ctypes.c_void_p) -> bool:
        """Whether the tokenizer is there (or its build failed, which get() reports); if not, its build is started."""
        with self._lock:
            if self._vocab != _address(vocab):
                pass
            elif self._tokenizer is not None or self._error is not None:
                return True
            elif self._thread is None:
                self._start()
                return False
            else:
                return False
        self.attach(vocab)
        return self.ready(vocab)

    def wait(self, seconds: float) -> None:
        self._done.wait(seconds)

    def get(self, vocab: ctypes.c_void_p):
        """The tokenizer, waiting for its build (started here if need be). Raises the build's error."""
        while not self.ready(vocab):
            self._done.wait()
        with self._lock:
            if self._error is not None:
                # kept: a build fails the same way for the same vocabulary, and a retry per request would stall
                # every slot again (llguidance's constructor holds the GIL); another model file clears it (attach)
                raise self._error
            return self._tokenizer

    def _start(self) -> None:
        """Called with the lock held."""
        self._stop.clear()
        self._done.clear()
        self.builds += 1
        self._thread = threading.Thread(target=self._build, args=(self._vocab, self._key), name="llguidance-tokenizer",
                                        daemon=True)
        try:
            self._thread.start()
        except RuntimeError as exc:  # no thread to be had: the waiting request gets the error, nothing waits forever
            self._thread, self._error = None, exc
            self._done.set()

    def _build(self, vocab: int, key: tuple) -> None:
        started = time.perf_counter()
        tokenizer, ends, error = None, frozenset(), None
        try:
            self.gate.wait()
            tokenizer, ends = build_tokenizer(ctypes.c_void_p(vocab), self._stop, self.build_parts)
        except BuildStopped:
            pass
        except Exception as exc:  # noqa: BLE001 - reported to the request that waits for it
            error = exc
        with self._lock:
            if self._key == key and not self._stop.is_set():
                self._tokenizer, self._error = tokenizer, error
                if tokenizer is not None:
                    self.ends, self.build_seconds = ends, time.perf_counter() - started
            self._thread = None
            self._done.set()


def _address(vocab) -> int:
    return ctypes.cast(vocab, ctypes.c_void_p).value or 0


def _file_identity(path: str) -> tuple:
    try:
        stat = os.stat(path)
    except OSError:
        return ("file", path, None)
    return ("file", os.path.realpath(path), stat.st_size, stat.st_mtime_ns)


_TOKENIZE_TYPE = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32,
                                  ctypes.POINTER(ctypes.c_int32), ctypes.c_int32, ctypes.c_bool, ctypes.c_bool)


@_TOKENIZE_TYPE
def _tokenize(_vocab, text, length, tokens, capacity, add_special, parse_special) -> int:
    """llguidance's tokenize callback (llama_tokenize's signature): the vocabulary
    attached now, not the pointer it was built with. None attached: no tokens."""
    vocab = tokenizers._vocab
    if not vocab:
        return 0
    return llama.llama_tokenize(ctypes.c_void_p(vocab), ctypes.cast(text, ctypes.c_char_p), length, tokens, capacity,
                                add_special, parse_special)


_TOKENIZE_ADDRESS = ctypes.cast(_tokenize, ctypes.c_void_p).value  # the callback object lives with the module


def build_tokenizer(vocab: ctypes.c_void_p, stop: threading.Event | None = None, parts: dict | None = None):
    """llguidance's tokenizer for this vocabulary: every token's piece (control
    tokens, and user-defined ones spelled <...>, marked special with a 0xff
    prefix, as llguidance's own llama.cpp bridge marks them), the model's
    end-of-generation tokens as its ends, llama.cpp's tokenizer (through
    _tokenize) for its tokenize calls. Returns (tokenizer, the
    end-of-generation tokens). Raises BuildStopped when `stop` is set. `parts`
    gets the seconds of each part: "pieces_s" (Python, shares the GIL) and
    "constructor_s" (llguidance's, holds it)."""
    from llguidance import LLTokenizer

    started = time.perf_counter()
    n_tokens = llama.llama_vocab_n_tokens(vocab)
    buffer = ctypes.create_string_buffer(_PIECE_BYTES + 1)
    pieces: list[bytes] = []
    ends: list[int] = []
    control = llama.LLAMA_TOKEN_ATTR_CONTROL
    user_defined = llama.LLAMA_TOKEN_ATTR_USER_DEFINED
    for token in range(n_tokens):
        if stop is not None and token % 4096 == 0 and stop.is_set():
            raise BuildStopped()
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
    read = time.perf_counter()
    tokenizer = LLTokenizer.from_llamacpp(tokens=pieces, vocab_ptr=_address(vocab), tokenize_fptr=_TOKENIZE_ADDRESS,
                                          eos_token=ends)
    if parts is not None:
        parts.update(pieces_s=read - started, constructor_s=time.perf_counter() - read)
    return tokenizer, frozenset(ends)


tokenizers = _Tokenizers()


def startable(queue, vocab: ctypes.c_void_p, idle: bool):
    """The first queued request that can start now: one with a grammar waits
    (in the queue, where a cancel finds it) while the tokenizer builds off the
    decode thread, and the requests behind it pass it. None: nothing can. With
    nothing else to step (idle), wait a moment for the build rather than spin."""
    for msg in queue:
        if msg.params.grammar is None or tokenizers.ready(vocab):
            return msg
    if idle:
        tokenizers.wait(WAIT_SECONDS)
    return None


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
