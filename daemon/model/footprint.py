"""A model's memory footprint before its first load, predicted from its GGUF files.

The fleet admits models by memory. Before a model has ever loaded, its
footprint is this prediction; after a load, the bytes the worker measured
(per component, the same names as here) replace it. Components follow the
worker's load phases: model (weights), context (KV cache + output buffer +
compute buffer), draft_model, draft_context, mmproj. Each is the sum over
devices, as the worker measures it; where the bytes sit is the planner's
question, not this module's.

The context is sized as the worker creates it (daemon/worker/runtime.py)
with llama.cpp's defaults for what the worker leaves alone: one KV stream
per slot (kv_unified false), full-size sliding-window caches (swa_full
true), flash attention on (auto resolves to on for CPU and CUDA).

A load measures what it holds then, not what it grows to: a context's
output buffer grows to the most outputs one decode asked for, a projector's
compute buffer to the largest image, and the prompt cache's save and
restore hold a slot's state in the worker only while they run. So after a
load the fleet counts `counted()`: the measured weights, and for everything
that grows the larger of prediction and measurement.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Mapping

from daemon.protocol import VERIFY_GROUP
from daemon.model.gguf_header import (GGML_TYPE_IDS, GGML_TYPES, GgufError, GgufHeader, SkippedArray, ggml_row_bytes,
                                      read_header)

# Cache types llama.cpp accepts for --cache-type-k/-v.
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")

# llama.cpp pads the context, each stream's cells and the sliding-window cache to 256 cells.
CELL_PAD = 256
F32 = 4
F16 = 2

# Which layers use a sliding window when the GGUF does not say (llama.cpp's
# set_swa_pattern(n) per architecture: layer il slides unless il % n == n - 1).
# An architecture with a window but not listed here is sized as if every layer
# kept the full context: an over-estimate, never an under-estimate.
SWA_PERIOD_BY_ARCH = {"gemma2": 2, "gemma3": 6, "gemma3n": 5, "gemma-embedding": 6, "cohere2": 4, "llama4": 4,
                      "gpt-oss": 2, "exaone4": 4}


# A sleep's save and a wake's restore hold one slot's state twice in the
# worker (daemon/worker/kv_cache.py): llama.cpp writes it into a ctypes
# buffer that is copied into Python bytes, or the bytes read from the file
# are copied into a ctypes buffer for llama.cpp.
KV_TRANSFER_COPIES = 2
# Per cell of a saved sequence: its position, its count of sequence ids and one id.
SAVED_CELL_META = 12
SAVED_STATE_OVERHEAD = 4096  # per-stream and per-layer headers, a few hundred bytes in fact


@dataclass(frozen=True)
class Footprint:
    model: int
    context: int
    draft_model: int = 0
    draft_context: int = 0
    mmproj: int = 0
    kv_transfer: int = 0  # host memory the prompt cache's save or restore holds for one slot

    @property
    def total(self) -> int:
        return sum(self.components().values())

    def components(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_components(cls, components: Mapping[str, int]) -> Footprint:
        """A measured footprint from the worker's per-phase bytes. Bytes of other
        phases (the warm-up's decode grows the output buffer) are the context's."""
        names = {f.name for f in fields(cls)}
        extra = sum(int(size) for name, size in components.items() if name not in names)
        footprint = cls(**{name: int(components.get(name, 0)) for name in names})
        return replace(footprint, context=footprint.context + extra)


# What llama.cpp grows after the load that measured it (see the module's doc).
# Weights do not grow, and their measurement is exact.
GROWS_AFTER_LOAD = ("context", "draft_context", "mmproj", "kv_transfer")
WEIGHTS = ("model", "draft_model")


def counted(predicted: Footprint | None, measured: Mapping[str, int]) -> Footprint:
    """What the fleet counts for a model after a load: the measured weights (the
    prediction's where a part was not measured), and for each buffer that grows
    after the load the larger of predicted and measured."""
    seen = Footprint.from_components(measured)
    if predicted is None:
        return seen
    weights = {name: getattr(seen, name) or getattr(predicted, name) for name in WEIGHTS}
    growing = {name: max(getattr(seen, name), getattr(predicted, name)) for name in GROWS_AFTER_LOAD}
    return Footprint(**weights, **growing)


# A stored measurement further than this from today's prediction (either way)
# is not one of the files and settings its key names. What is stored is a
# counted() figure, so an honest one differs from the prediction only where
# the weights were measured (exact; the prediction is their tensor bytes) or
# a buffer grew past its prediction: the compute buffers are within 0.3 % of
# the fit on CPU (tests/unit/test_footprint.py), a backend the fit never saw
# may differ by some tens of percent of them, a small part of the whole. A
# factor of 2 is far outside those and far inside a corrupted or planted
# value (10^12 bytes for a 350 MB model). Where a value is refused, the
# prediction stands, and the next load measures again.
PLAUSIBLE_FACTOR = 2


def plausible(measured: Mapping[str, int], predicted_total: int, budget: int | None = None) -> bool:
    """Whether a stored measurement may stand for the model: near the prediction
    and, when a budget is given, able to fit in it (one that cannot fit would
    keep the model from ever loading, so from ever being measured again)."""
    total = sum(measured.values())
    near = predicted_total / PLAUSIBLE_FACTOR <= total <= predicted_total * PLAUSIBLE_FACTOR
    return near and (budget is None or total <= budget)


@dataclass(frozen=True)
class LayerCache:
    k_width: int  # elements per cell (key_length x KV heads); 0 for a layer without attention
    v_width: int
    sliding: bool


@dataclass(frozen=True)
class ModelShape:
    """What sizing a context needs from a model's metadata."""

    n_embd: int
    n_ff: int  # widest feed-forward activation per token (experts used x expert width for MoE)
    n_vocab: int
    n_swa: int  # sliding window in tokens; 0 for none
    layers: tuple[LayerCache, ...]


def predict(model_path: str | Path, *, ctx_size: int, parallel: int, cache_type_k: str = "f16",
            cache_type_v: str = "f16", model_draft: str | Path | None = None, mmproj: str | Path | None = None,
            n_gpu_layers: int = -1, batch_size: int = 512, draft_max: int = 16, swa_full: bool = True,
            embeddings: bool = False, prompt_cache: bool = True, kv_unified: bool = False) -> Footprint:
    """Predict what loading this configuration holds at its peak, in bytes. Raises
    GgufError for a file that is not a sound GGUF or lacks what sizing needs,
    ValueError for a bad setting.

    n_gpu_layers moves bytes between devices without changing the sums, so it does
    not change the prediction; it is accepted so that callers pass the whole setting.
    prompt_cache: slots are saved at sleep and restored after a wake
    (kv_cache_disk_bytes > 0, the default); counted on the host even when the KV
    cache is on a GPU, an over-estimate there of a few MB per 1k tokens of slot.
    kv_unified: the slots share one stream of ctx_size cells, and one slot may fill it.
    """
    del n_gpu_layers
    if ctx_size < 1 or parallel < 1 or batch_size < 1:
        raise ValueError(f"ctx_size ({ctx_size}), parallel ({parallel}) and batch_size ({batch_size}) must be positive")
    type_k, type_v = _cache_type(cache_type_k), _cache_type(cache_type_v)
    header = read_header(model_path)
    shape = shape_of(header)
    context = dict(ctx_size=ctx_size, parallel=parallel, batch_size=batch_size, type_k=type_k, type_v=type_v,
                   swa_full=swa_full, kv_unified=kv_unified)
    # The worker's main context is created allowing logits for every drafted token
    # plus one per slot (llama.cpp reserves its compute graph for that many), but
    # asks for at most one per slot, or one verification group, per decode.
    if embeddings:
        # An embeddings context reads an input in one decode with every token an
        # output (runtime.py): its graph and output buffer have room for a batch of them.
        main = context_bytes(shape, **context, n_outputs_max=batch_size, output_rows=batch_size)
    else:
        main = context_bytes(shape, **context,
                             n_outputs_max=max(parallel, VERIFY_GROUP) if model_draft else parallel,
                             output_rows=max(parallel, VERIFY_GROUP) if model_draft else parallel)
    footprint = Footprint(model=weight_bytes(header), context=main)
    if prompt_cache and not embeddings:  # an embeddings model keeps no prompt in its slots
        slot_cells, _, _ = _cells(ctx_size, _streams(parallel, kv_unified), batch_size, shape.n_swa, swa_full)  # a full slot
        state = saved_state_bytes(shape, slot_cells, type_k=type_k, type_v=type_v)
        footprint = replace(footprint, kv_transfer=KV_TRANSFER_COPIES * state)
    if model_draft:
        draft = read_header(model_draft)
        draft_context = context_bytes(shape_of(draft), **context, n_outputs_max=parallel, output_rows=parallel)
        footprint = replace(footprint, draft_model=weight_bytes(draft), draft_context=draft_context)
    if mmproj:
        projector = read_header(mmproj)
        footprint = replace(footprint, mmproj=projector.tensor_bytes + projector_compute_bytes(projector, shape.n_embd))
    return footprint


def _cache_type(name: str) -> int:
    if name.lower() not in CACHE_TYPES:
        raise ValueError(f"unknown KV cache type {name!r} (one of {', '.join(CACHE_TYPES)})")
    return GGML_TYPE_IDS[name.upper()]


# -- weights --

_SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


def weight_bytes(header: GgufHeader) -> int:
    """Tensor bytes of the model, across all parts of a split GGUF (llama.cpp's
    `<prefix>-00001-of-0000N.gguf` naming; the first part holds the metadata)."""
    count = _int(header, "split.count", 1)
    if count <= 1:
        return header.tensor_bytes
    match = _SPLIT_NAME.match(header.path.name)
    if match is None or int(match["count"]) != count:
        raise GgufError(f"{header.path}: split.count is {count} but the name is not <prefix>-NNNNN-of-{count:05d}.gguf")
    total = header.tensor_bytes
    for index in range(1, count + 1):
        part = header.path.with_name(f"{match['prefix']}-{index:05d}-of-{count:05d}.gguf")
        if part.name != header.path.name:
            total += read_header(part).tensor_bytes
    return total


# -- the model's shape, from its metadata --

def _value(header: GgufHeader, key: str, default: object = None) -> object:
    return header.metadata.get(key, default)


def _int(header: GgufHeader, key: str, default: int | None = None) -> int:
    value = _value(header, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GgufError(f"{header.path}: {key} is {value!r}, expected a non-negative integer")
    return value


def _per_layer(header: GgufHeader, key: str, n_layer: int, default: int) -> tuple[int, ...]:
    """A hyperparameter that is one integer or one per layer."""
    value = _value(header, key, default)
    if isinstance(value, tuple):
        if len(value) != n_layer or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
            raise GgufError(f"{header.path}: {key} is not {n_layer} non-negative integers")
        return value
    return (_int(header, key, default),) * n_layer


def _vocab_size(header: GgufHeader) -> int:
    tokens = _value(header, "tokenizer.ggml.tokens")
    if isinstance(tokens, SkippedArray):
        return tokens.length
    if isinstance(tokens, tuple):
        return len(tokens)
    for tensor in header.tensors:  # no vocabulary in the metadata: the output matrix is n_embd x n_vocab
        if tensor.name in ("output.weight", "token_embd.weight") and len(tensor.dims) == 2:
            return tensor.dims[1]
    raise GgufError(f"{header.path}: no tokenizer.ggml.tokens and no token_embd.weight; cannot size the logits")


def _sliding_layers(header: GgufHeader, arch: str, n_layer: int, n_swa: int) -> tuple[bool, ...]:
    if n_swa == 0:
        return (False,) * n_layer
    pattern = _value(header, f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, tuple) and len(pattern) == n_layer:  # one flag per layer
        return tuple(bool(flag) for flag in pattern)
    period = pattern if isinstance(pattern, int) and not isinstance(pattern, bool) else SWA_PERIOD_BY_ARCH.get(arch)
    if period is None:
        return (False,) * n_layer
    return tuple(period == 0 or il % period < period - 1 for il in range(n_layer))


def shape_of(header: GgufHeader) -> ModelShape:
    arch = _value(header, "general.architecture")
    if not isinstance(arch, str) or not arch:
        raise GgufError(f"{header.path}: no general.architecture")
    n_layer = _int(header, f"{arch}.block_count")
    if n_layer > 4096:
        raise GgufError(f"{header.path}: {arch}.block_count {n_layer} is not a real model")
    n_embd = _int(header, f"{arch}.embedding_length")
    heads = _per_layer(header, f"{arch}.attention.head_count", n_layer, 0)
    kv_heads = _per_layer(header, f"{arch}.attention.head_count_kv", n_layer, 0)
    if f"{arch}.attention.head_count_kv" not in header.metadata:
        kv_heads = heads  # llama.cpp's default: no grouped-query attention
    head_width = n_embd // max(heads) if max(heads, default=0) else 0
    key_length = _int(header, f"{arch}.attention.key_length", head_width)
    value_length = _int(header, f"{arch}.attention.value_length", head_width)
    n_swa = _int(header, f"{arch}.attention.sliding_window", 0)
    sliding = _sliding_layers(header, arch, n_layer, n_swa)
    layers = tuple(LayerCache(key_length * kv_heads[il], value_length * kv_heads[il], sliding[il])
                   for il in range(n_layer))
    n_ff = max(_per_layer(header, f"{arch}.feed_forward_length", n_layer, 0), default=0)
    expert_ff = _int(header, f"{arch}.expert_feed_forward_length", 0) * _int(header, f"{arch}.expert_used_count", 0)
    return ModelShape(n_embd, max(n_ff, expert_ff), _vocab_size(header), n_swa, layers)


# -- the context --

def _pad(n: int, to: int = CELL_PAD) -> int:
    return -(-n // to) * to


def _streams(parallel: int, kv_unified: bool) -> int:
    return 1 if kv_unified else parallel  # one KV stream per sequence, or one the sequences share


def _cells(ctx_size: int, streams: int, batch_size: int, n_swa: int, swa_full: bool) -> tuple[int, int, int]:
    """Cells per stream for full and for sliding layers, and the ubatch, as llama.cpp sizes them."""
    # n_ctx padded to 256, then n_ctx/n_stream cells per stream, padded again.
    cells = _pad(_pad(ctx_size) // streams)
    n_ubatch = min(batch_size, ctx_size)
    # llama_kv_cache_iswa: a sliding layer keeps min(cells, n_swa + n_ubatch) cells
    # per stream (padded to 256) unless swa_full, the default, gives it all of them.
    swa_cells = cells if swa_full else min(cells, _pad(n_swa + n_ubatch))
    return cells, swa_cells, n_ubatch


def kv_cache_bytes(shape: ModelShape, *, ctx_size: int, parallel: int, batch_size: int, type_k: int, type_v: int,
                   swa_full: bool, kv_unified: bool = False) -> int:
    streams = _streams(parallel, kv_unified)
    cells, swa_cells, _ = _cells(ctx_size, streams, batch_size, shape.n_swa, swa_full)
    total = 0
    for layer in shape.layers:
        cell_bytes = ggml_row_bytes(type_k, layer.k_width) + ggml_row_bytes(type_v, layer.v_width)
        total += streams * (swa_cells if layer.sliding else cells) * cell_bytes
    return total


def context_bytes(shape: ModelShape, *, ctx_size: int, parallel: int, batch_size: int, n_outputs_max: int,
                  output_rows: int, type_k: int, type_v: int, swa_full: bool, kv_unified: bool = False) -> int:
    """KV cache + output buffer + compute buffer of one llama.cpp context.

    output_rows: logits rows the output buffer holds (llama.cpp starts it at one
    per sequence and grows it to the most outputs one decode asked for).
    n_outputs_max: the most outputs the context allows, which its graph reserves.
    """
    kv = kv_cache_bytes(shape, ctx_size=ctx_size, parallel=parallel, batch_size=batch_size, type_k=type_k,
                        type_v=type_v, swa_full=swa_full, kv_unified=kv_unified)
    outputs = output_rows * shape.n_vocab * F32
    cells, swa_cells, n_ubatch = _cells(ctx_size, _streams(parallel, kv_unified), batch_size, shape.n_swa, swa_full)
    quantized = any(GGML_TYPES[t][1] > 1 for t in (type_k, type_v))
    return kv + outputs + compute_buffer_bytes(shape, cells=cells, swa_cells=swa_cells, n_ubatch=n_ubatch,
                                               n_outputs=min(n_outputs_max, n_ubatch), quantized_cache=quantized)


def compute_buffer_bytes(shape: ModelShape, *, cells: int, swa_cells: int, n_ubatch: int, n_outputs: int,
                         quantized_cache: bool = False) -> int:
    """The scheduler's buffer for the largest graph it reserves: the peak of what is
    live at once, either inside a layer or at the output head.

    Calibrated on Gemma 3 270M on CPU (tests/unit/test_footprint.py has the
    measurements): 22 contexts of ubatch 128..2048, 512..8192 cells per stream,
    1..68 outputs, full and windowed sliding layers, f16/q8_0/q4_0 caches, all
    within 0.3 % of
      layer peak = ubatch x 4 B x (4 n_ff + n_embd + widest K row)   activations
                 + ubatch x 4 B x widest K row, if the cache is quantized
                 + ubatch x 2 B x cells, once per attention kind     f16 KQ masks
      head peak  = 4 B x (outputs x n_vocab + (ubatch + outputs) x n_embd)
    The per-token terms are a fit on one architecture; the masks and the head
    are what llama.cpp allocates (flash attention's f16 masks are freed before
    the head). A CUDA build's buffers were not measured.
    """
    widest_k = max((layer.k_width for layer in shape.layers), default=0)
    kinds = {layer.sliding for layer in shape.layers if layer.k_width}
    masks = n_ubatch * F16 * sum(swa_cells if sliding else cells for sliding in kinds)
    per_token = 4 * shape.n_ff + shape.n_embd + widest_k + (widest_k if quantized_cache else 0)
    layer_peak = n_ubatch * F32 * per_token + masks
    head_peak = F32 * (n_outputs * shape.n_vocab + (n_ubatch + n_outputs) * shape.n_embd)
    return max(layer_peak, head_peak)


def saved_state_bytes(shape: ModelShape, tokens: int, *, type_k: int, type_v: int) -> int:
    """What llama_state_seq_get_data writes for a slot holding `tokens`: every
    cell in each full-attention layer, the last window in a sliding one
    (llama.cpp keeps no more of it), and each cell's position and sequence id.

    Measured on Gemma 3 270M (1000 to 3000 tokens, ubatch 128 and 512, 1 and 4
    slots): 3 x n x 1 KiB + 15 x 512 x 1 KiB + 12 B per cell, plus 472 bytes."""
    window = min(tokens, shape.n_swa) if shape.n_swa else tokens
    total = SAVED_STATE_OVERHEAD
    kinds = set()
    for layer in shape.layers:
        held = window if layer.sliding else tokens
        total += held * (ggml_row_bytes(type_k, layer.k_width) + ggml_row_bytes(type_v, layer.v_width))
        kinds.add(layer.sliding)
    return total + SAVED_CELL_META * sum(window if sliding else tokens for sliding in kinds)


# -- the multimodal projector --

PROJECTOR_GRAPH_SLACK = 64 * 1024

def projector_compute_bytes(header: GgufHeader, text_embd: int) -> int:
    """The compute buffer mtmd reserves for one image at the projector's own
    resolution (its warm-up does, at load), on CPU with flash attention (what
    mtmd picks there): the peak of what is live at once, per image position,
      start = 3 x patch^2 x (4 B image + 2 B f16 patches)
      layer = 4 B x (3 x patch^2 + max(5 x width, 3 x width + ffn))
      end   = 4 B x (2 x width + first projection width + text embedding width)
    plus 64 KiB for the graph's small tensors (positions). Fitted on 20
    llava-style ("mlp") projectors measured here (widths 32..1024, ffn
    64..4096, 16..1024 positions, 1..4 blocks): never under, up to 45 % over
    (tiny shapes; one-block projectors, whose only block llava skips, more). Other
    projector types, dynamic resolutions and GPU backends were not measured:
    their measurement after a load counts where it is larger (counted()).
    A projector without a vision encoder (audio) is not predicted (0)."""
    image = _int(header, "clip.vision.image_size", 0)
    patch = _int(header, "clip.vision.patch_size", 0)
    if not image or not patch:
        return 0
    width = _int(header, "clip.vision.embedding_length", 0)
    ffn = _int(header, "clip.vision.feed_forward_length", 0)
    first_projection = next((t.dims[1] for t in header.tensors if t.name == "mm.0.weight" and len(t.dims) == 2),
                            text_embd)
    positions = (image // patch) ** 2
    pixels = 3 * patch * patch
    start = pixels * (F32 + F16)
    layer = F32 * (pixels + max(5 * width, 3 * width + ffn))
    end = F32 * (2 * width + first_projection + text_embd)
    return positions * max(start, layer, end) + PROJECTOR_GRAPH_SLACK
