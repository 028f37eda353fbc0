"""`llama_options`: llama.cpp's own tuning knobs, passed to the worker by field name.

A key is a field of llama.cpp's `llama_context_params` or `llama_model_params`
(llama-server's -fa, -ub, -ctk, --rope-*, -sm, ... arrive here through
daemon/llama_server_args.py); the worker (daemon/worker/runtime.py) sets it on
the main model's params. This module is plain Python so that the daemon checks
the names and types at startup, never loading llama.cpp; a unit test compares
the table with llama-cpp-python's ctypes structures.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator

INT32 = (-(2**31), 2**31 - 1)
UINT32 = (0, 2**32 - 1)

# field -> (which params struct, C type). Only fields a value can be given for:
# pointers and callbacks (devices, tensor_split, cb_eval, ...) are not here.
LLAMA_PARAM_FIELDS: dict[str, tuple[str, str]] = {
    "n_ubatch": ("context", "uint"),
    "n_threads_batch": ("context", "int"),
    "rope_scaling_type": ("context", "int"),
    "flash_attn_type": ("context", "int"),
    "rope_freq_base": ("context", "float"),
    "rope_freq_scale": ("context", "float"),
    "yarn_ext_factor": ("context", "float"),
    "yarn_attn_factor": ("context", "float"),
    "yarn_beta_fast": ("context", "float"),
    "yarn_beta_slow": ("context", "float"),
    "yarn_orig_ctx": ("context", "uint"),
    "defrag_thold": ("context", "float"),
    "type_k": ("context", "int"),
    "type_v": ("context", "int"),
    "offload_kqv": ("context", "bool"),
    "op_offload": ("context", "bool"),
    "split_mode": ("model", "int"),
    "main_gpu": ("model", "int"),
    "lazy_mode": ("model", "int"),
    "check_tensors": ("model", "bool"),
    "no_host": ("model", "bool"),
}

# Fields the worker sets itself: a value here would break what it rests on.
WORKER_OWNED: dict[str, str] = {
    "n_ctx": "set from ctx_size (-c)",
    "n_batch": "sized by the worker from batch_size, parallel and the draft (one decode's capacity)",
    "n_seq_max": "one sequence per slot: set from parallel (-np)",
    "n_rs_seq": "one sequence per slot: set from parallel (-np)",
    "n_outputs_max": "the worker reserves logit rows for one token per slot (514 MiB of compute buffer otherwise)",
    "n_outputs_max_per_seq": "the worker reserves logit rows for one token per slot",
    "n_threads": "set from threads (-t)",
    "kv_unified": "set from kv_unified (-kvu): one KV stream per slot, or one pool they share",
    "swa_full": "kept on: a live slot must never lose sliding-window positions the prompt cache counts on",
    "embeddings": "set from embeddings (--embeddings)",
    "pooling_type": "set from pooling (--pooling)",
    "attention_type": "follows embeddings and pooling",
    "ctx_type": "the worker creates a plain context",
    "no_perf": "the worker keeps its own timings",
    "n_gpu_layers": "set from n_gpu_layers (-ngl)",
    "load_mode": "set from load_mode (-lm)",
    "use_extra_bufts": "set from cpu_repack (--repack)",
    "vocab_only": "the worker must load the weights",
    "no_alloc": "the worker must load the weights",
    "load_mtp": "the worker does not drive multi-token-prediction heads",
}

# Names for the enum-valued fields, as llama-server spells them.
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
ROPE_SCALING = {"none": 0, "linear": 1, "yarn": 2}
SPLIT_MODES = {"none": 0, "layer": 1, "row": 2, "tensor": 3}
LAZY_MODES = {"off": 0, "auto": 1, "on": 2}
KV_CACHE_TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "iq4_nl": 20, "q5_0": 6,
                  "q5_1": 7}  # llama-server's kv_cache_types, by ggml_type id

MAX_OPTIONS = 64


def check_llama_options(options: Any) -> dict[str, bool | int | float]:
    """The options, checked: known, settable fields with values of their C type; else one ValueError."""
    if not isinstance(options, dict):
        raise ValueError("must be a table of llama.cpp parameter names and values")
    if len(options) > MAX_OPTIONS:
        raise ValueError(f"at most {MAX_OPTIONS} options, got {len(options)}")
    checked: dict[str, bool | int | float] = {}
    for name, value in options.items():
        checked[name] = _check_one(name, value)
    return checked


def _check_one(name: Any, value: Any) -> bool | int | float:
    if not isinstance(name, str):
        raise ValueError(f"{name!r} is not a parameter name")
    if name in WORKER_OWNED:
        raise ValueError(f"{name[:64]}: the worker sets it ({WORKER_OWNED[name]})")
    if name not in LLAMA_PARAM_FIELDS:
        raise ValueError(f"{name[:64]!r} is not a llama.cpp context or model parameter Dormouse can set; "
                         f"known: {', '.join(sorted(LLAMA_PARAM_FIELDS))}")
    kind = LLAMA_PARAM_FIELDS[name][1]
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{name}: must be true or false, not {_shown(value)}")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or abs(value) > 3.4e38:
            raise ValueError(f"{name}: must be a finite number, not {_shown(value)}")
        return float(value)
    low, high = INT32 if kind == "int" else UINT32
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}: must be an integer from {low} to {high}, not {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    return repr(value)[:40]


# The settings field's type: config/settings.py's `llama_options`.
LlamaOptions = Annotated[dict[str, Any], AfterValidator(check_llama_options)]
