"""Import llama-cpp-python's ctypes bindings without its high-level layer.

`import llama_cpp` runs the package's __init__, which pulls in the high-level
`Llama` class, numpy and jinja2: about 26 MiB of RSS and 0.1 s that a worker
spawned ahead of time would carry while the daemon sleeps. The low-level
bindings (llama_cpp.llama_cpp, llama_cpp.mtmd_cpp) need none of that, so we
register a bare package object for `llama_cpp` and import the submodules
from its directory. Loading the shared libraries touches no device: that
happens at llama_backend_init().
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types


def _bare_package(name: str) -> None:
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError(f"{name} is not installed; install llama-cpp-python")
    package = types.ModuleType(name)
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    package.__file__ = spec.origin
    sys.modules[name] = package


_bare_package("llama_cpp")
llama = importlib.import_module("llama_cpp.llama_cpp")


def mtmd():
    """The multimodal (mtmd) bindings, imported only when a projector is used."""
    return importlib.import_module("llama_cpp.mtmd_cpp")


def fill_sequence(batch, tokens, seq_id: int, first_pos: int, logits_from: int) -> None:
    """`tokens` into a llama_batch as one sequence from position `first_pos`; those from index `logits_from`
    on ask for logits (0: all, as embeddings read them; len(tokens) - 1: the last only; len(tokens): none)."""
    for i, token in enumerate(tokens):
        batch.token[i] = token
        batch.pos[i] = first_pos + i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq_id
        batch.logits[i] = i >= logits_from
    batch.n_tokens = len(tokens)
