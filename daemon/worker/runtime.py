"""The llama.cpp objects a worker holds, loaded in phases and torn down in order.

Load: backend, model, draft model, projector, context, draft context, warm-up.
Sleep (DESIGN's order): draft context, draft model, context, model, projector,
backend. Each phase is timed and its bytes (llama.cpp's own buffer sizes)
recorded; absent components are reported as skipped, so a sleep report always
lists the six steps in the same order.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

from config.llama_options import LLAMA_PARAM_FIELDS, check_llama_options
from daemon.protocol import ModelSpec, Phase
from daemon.worker.llama_lib import llama, mtmd
from daemon.worker.memory import BufferLedger

TEARDOWN_ORDER = ("draft_context", "draft_model", "context", "model", "mmproj", "backend")
POOLING = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}  # llama_pooling_type; rank: a reranker's head
# llama.cpp's llama_load_mode: how the weights are read (auto: mmap where every device supports it).
LOAD_MODES = {"auto": -1, "none": 0, "mmap": 1, "mlock": 2, "mmap+mlock": 3, "direct_io": 4}



# llama.cpp keeps the address of its log callback for the life of the process, so the ctypes
# trampoline it calls is made once, here, and never freed: a callback owned by a Runtime would be
# freed with it, and the next line llama.cpp logs (from another Runtime, or any model loaded in
# this process) would jump into freed memory: a segfault. It writes to the Runtime that set it.
_log_sink: "weakref.ref[Runtime] | None" = None


def _dispatch_llama_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    sink = _log_sink() if _log_sink is not None else None
    if sink is not None:
        sink._on_llama_log(level, text, user_data)
    elif level >= 3:  # nobody listening: warnings and errors still reach stderr
        sys.stderr.write(text.decode("utf-8", errors="replace"))


_LLAMA_LOG = llama.llama_log_callback(_dispatch_llama_log)


class LoadError(RuntimeError):
    """A component could not be loaded; the message says which and why."""


@dataclass
class Runtime:
    spec: ModelSpec
    on_progress: Callable[[str, float], None] = lambda phase, seconds: None
    ledger: BufferLedger = field(default_factory=BufferLedger)
    phases: list[Phase] = field(default_factory=list)

    backend_up: bool = False
    model: ctypes.c_void_p | None = None
    vocab: ctypes.c_void_p | None = None
    ctx: ctypes.c_void_p | None = None
    draft_model: ctypes.c_void_p | None = None
    draft_ctx: ctypes.c_void_p | None = None
    mmproj: ctypes.c_void_p | None = None
    devices_before: list[dict[str, object]] = field(default_factory=list)
    devices_after: list[dict[str, object]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.threads = self.spec.threads or os.cpu_count() or 1
        self._log_tail = ""
        self._last_level = 2
        global _log_sink
        _log_sink = weakref.ref(self)  # the newest Runtime hears llama.cpp (a worker holds one)
        llama.llama_log_set(_LLAMA_LOG, None)

    # -- logging: llama.cpp and ggml write through this, fds 1 and 2 stay ours --

    def _on_llama_log(self, level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        line = text.decode("utf-8", errors="replace")
        self.ledger.observe(line)
        if level == 5:  # GGML_LOG_LEVEL_CONT continues the previous message (e.g. load progress dots)
            level = self._last_level
        self._last_level = level
        if level >= 3 or os.environ.get("DORMOUSE_WORKER_VERBOSE"):  # 3 = warn, 4 = error
            sys.stderr.write(line)
        if level >= 4:
            self._log_tail = (self._log_tail + line)[-2000:]

    def _last_error(self) -> str:
        tail = self._log_tail.strip().splitlines()
        return tail[-1] if tail else "no detail from llama.cpp"

    # -- phases --

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        self.ledger.component = name
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        self.phases.append(Phase(name, seconds, self.ledger.total(name)))
        self.on_progress(name, seconds)
        self.ledger.component = "other"

    def load(self) -> list[Phase]:
        spec = self.spec
        with self._phase("backend"):
            llama.llama_backend_init()
            self.backend_up = True
        with self._phase("model"):
            self.model = self._load_model(spec.model, "model")
            self.vocab = llama.llama_model_get_vocab(self.model)
        if spec.model_draft:
            with self._phase("draft_model"):
                self.draft_model = self._load_model(spec.model_draft, "draft model")
        if spec.mmproj:
            with self._phase("mmproj"):
                self.mmproj = self._load_mmproj(spec.mmproj)
        with self._phase("context"):
            self.ctx = self._new_context(self.model, spec.ctx_size, spec.parallel, spec.outputs_max(), "context")
        if self.draft_model is not None:
            with self._phase("draft_context"):
                self.draft_ctx = self._new_context(self.draft_model, spec.ctx_size, spec.parallel, spec.parallel, "draft context")
        return self.phases

    def _load_model(self, path: str, what: str) -> ctypes.c_void_p:
        params = llama.llama_model_default_params()
        params.n_gpu_layers = 999 if self.spec.n_gpu_layers < 0 else self.spec.n_gpu_layers
        # The CPU "repack" buffers switch matmul kernels with the batch size, so a
        # token's logits depend on what it was batched with (up to 0.4 apart for
        # Gemma 3): greedy output would change with the prompt cache and with the
        # other slots. Off by default; measured no slower here (bench/throughput.py).
        params.use_extra_bufts = self.spec.cpu_repack
        params.load_mode = LOAD_MODES[self.spec.load_mode]
        if what == "model":
            self._apply_llama_options(params, "model")
        model = llama.llama_model_load_from_file(os.fsencode(path), params)
        if not model:
            raise LoadError(f"cannot load {what} {path}: {self._last_error()}")
        return model

    def _new_context(self, model: ctypes.c_void_p, n_ctx: int, n_seq: int, n_outputs: int, what: str) -> ctypes.c_void_p:
        params = llama.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = self.spec.step_capacity()
        params.n_ubatch = self.spec.batch_size
        params.n_seq_max = n_seq
        # Logits are read for at most one token per slot (plus drafted ones);
        # the default reserves a vocab-wide row per batch token (514 MiB of
        # compute buffer for Gemma 3 instead of 20).
        params.n_outputs_max = n_outputs
        params.n_threads = self.threads
        params.n_threads_batch = self.threads
        params.no_perf = True
        # Set, not left to llama.cpp's defaults, because the prompt cache's rule
        # (reuse.py) rests on them: one KV stream per slot unless kv_unified asks
        # for a shared pool (a slot's cells then interleave with the others',
        # which only the deterministic mode cannot have: the settings refuse the
        # two together) and a full-size window cache (a live slot never loses
        # window positions; only a restored one lacks them). The draft context
        # follows the target's: a slot grows as far in both.
        if self.spec.kv_unified and self.spec.cache_deterministic:
            raise LoadError("kv_unified and cache_deterministic cannot both be true")
        params.kv_unified = self.spec.kv_unified
        params.swa_full = True
        if model is self.model:
            self._apply_llama_options(params, "context")
        if self.spec.embeddings and model is self.model:
            # A pooled sequence must sit in one micro-batch: an input is read in
            # one decode of at most batch_size tokens, and every token is an output.
            params.embeddings = True
            params.pooling_type = POOLING[self.spec.pooling]
            params.n_batch = params.n_ubatch = self.spec.batch_size
            params.n_outputs_max = self.spec.batch_size
        ctx = llama.llama_init_from_model(model, params)
        if not ctx:
            raise LoadError(f"cannot create {what} (n_ctx={n_ctx}): {self._last_error()}")
        return ctx

    def _apply_llama_options(self, params: ctypes.Structure, struct: str) -> None:
        """llama_options (llama-server's -fa, -ub, -ctk, --rope-*, -sm, ...) on the main model's params.
        The daemon checked them at startup; a spec from elsewhere is checked again here, so a bad name
        or value is a LoadError that names it, never a crash inside llama.cpp."""
        try:
            options = check_llama_options(self.spec.llama_options)
        except ValueError as exc:
            raise LoadError(f"llama_options: {exc}") from None
        if struct == "context" and self.spec.embeddings and "n_ubatch" in options:
            raise LoadError("llama_options: n_ubatch (-ub) cannot be set on an embeddings model: a pooled input "
                            "must sit in one micro-batch, of batch_size (-b) tokens")
        for name, value in options.items():
            if LLAMA_PARAM_FIELDS[name][0] == struct:
                setattr(params, name, value)

    def _load_mmproj(self, path: str) -> ctypes.c_void_p:
        lib = mtmd()
        params = lib.mtmd_context_params_default()
        params.use_gpu = self.spec.n_gpu_layers != 0
        params.n_threads = self.threads
        params.print_timings = False
        if hasattr(lib, "mtmd_helper_log_set"):
            lib.mtmd_helper_log_set(_LLAMA_LOG, None)
        ctx = lib.mtmd_init_from_file(os.fsencode(path), self.model, params)
        if not ctx:
            raise LoadError(f"cannot load projector {path}: {self._last_error()}")
        return ctx

    # -- the drowsy tier: contexts go, weights stay --

    def free_contexts(self) -> list[Phase]:
        """Free the draft context, then the main context (DESIGN's order); the models stay."""
        report = []
        for name, attr in (("draft_context", "draft_ctx"), ("context", "ctx")):
            start = time.perf_counter()
            held = self._free(attr, llama.llama_free)
            report.append(Phase(name, time.perf_counter() - start, self.ledger.forget(name), skipped=not held))
        return report

    def create_contexts(self) -> list[Phase]:
        """The contexts load() creates, again (after free_contexts); returns these phases."""
        spec = self.spec
        self.phases = []
        with self._phase("context"):
            self.ctx = self._new_context(self.model, spec.ctx_size, spec.parallel, spec.outputs_max(), "context")
        if self.draft_model is not None:
            with self._phase("draft_context"):
                self.draft_ctx = self._new_context(self.draft_model, spec.ctx_size, spec.parallel, spec.parallel, "draft context")
        return self.phases

    # -- teardown --

    def teardown(self) -> list[Phase]:
        """Free everything in DESIGN's order; every step is reported, skipped or not."""
        steps: dict[str, Callable[[], bool]] = {
            "draft_context": lambda: self._free("draft_ctx", llama.llama_free),
            "draft_model": lambda: self._free("draft_model", llama.llama_model_free),
            "context": lambda: self._free("ctx", llama.llama_free),
            "model": lambda: self._free("model", llama.llama_model_free),
            "mmproj": lambda: self._free("mmproj", lambda c: mtmd().mtmd_free(c)),
            "backend": self._free_backend,
        }
        from daemon.worker.devices import device_memory

        self.devices_before = device_memory() if self.backend_up else []
        report = []
        for name in TEARDOWN_ORDER:
            if name == "backend":
                self.devices_after = device_memory() if self.backend_up else []
            start = time.perf_counter()
            held = steps[name]()
            freed = self.ledger.forget(name)
            report.append(Phase(name, time.perf_counter() - start, freed, skipped=not held))
        return report

    def _free(self, attr: str, free: Callable[[ctypes.c_void_p], None]) -> bool:
        handle = getattr(self, attr)
        if not handle:
            return False
        free(handle)
        setattr(self, attr, None)
        return True

    def _free_backend(self) -> bool:
        if not self.backend_up:
            return False
        llama.llama_backend_free()
        self.backend_up = False
        return True

    # -- model facts --

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = llama.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            llama.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    def describe(self) -> dict[str, object]:
        buf = ctypes.create_string_buffer(256)
        llama.llama_model_desc(self.model, buf, len(buf))
        return {
            "path": self.spec.model,
            "description": buf.value.decode(errors="replace"),
            "architecture": self.meta("general.architecture"),
            "name": self.meta("general.name"),
            "n_params": llama.llama_model_n_params(self.model),
            "size_bytes": llama.llama_model_size(self.model),
            "n_ctx_train": llama.llama_model_n_ctx_train(self.model),
            "n_vocab": llama.llama_vocab_n_tokens(self.vocab),
            "n_embd": llama.llama_model_n_embd(self.model),
            "draft": self.spec.model_draft,
            "mmproj": self.spec.mmproj,
        }
