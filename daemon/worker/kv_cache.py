"""The moves of a slot's state in and out of llama.cpp that every tier shares
(daemon/worker/prompt_cache.py holds the tiers together; the disk tier is
daemon/worker/disk_tier.py).

Uses llama.cpp's per-sequence state API (llama_state_seq_get_data /
_set_data): a slot is one sequence, so its cells travel alone, whatever the
other slots hold. The file format and the index are daemon/model/kv_files.py.
"""

from __future__ import annotations

import ctypes
from importlib import metadata

import numpy as np

from daemon.worker import prompt_blocks as blocks
from daemon.worker.llama_lib import llama
from daemon.worker.reuse import ReuseRule
from daemon.worker.slot import Checkpoint, Slot, common_prefix

PARTIAL = llama.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY  # the window caches (or recurrent state) alone
NO_ROOM = "no_room"  # a restore the shared KV pool had no cells for: a miss, not a rejected file


def context_layout(ctx: ctypes.c_void_p, model: ctypes.c_void_p, rule: ReuseRule) -> dict[str, object]:
    """What decides whether saved KV bytes mean the same thing in a new context,
    and whether they were decoded as a fresh read decodes them (the chunk size
    of the deterministic mode; 0: saved without that promise)."""
    params = llama.llama_context_default_params()  # the worker keeps llama.cpp's cache types and SWA mode
    return {
        "exact_chunk": rule.chunk if rule.deterministic else 0,
        "llama_cpp": metadata.version("llama_cpp_python"),
        "n_ctx_slot": llama.llama_n_ctx_seq(ctx),
        "n_layer": llama.llama_model_n_layer(model),
        "n_embd": llama.llama_model_n_embd(model),
        "type_k": int(params.type_k),
        "type_v": int(params.type_v),
        # The worker sets it (runtime.py). kv_unified is not a key: its slots' n_ctx_slot differs already
        # (ctx_size, not ctx_size / parallel), and with one slot the two layouts are the same bytes.
        "swa_full": True,
    }


def best_entry(rule: ReuseRule, entries, tokens: list[int], scope: str = ""):
    """Of `entries` (each with .tokens and .scope), those of `scope` only, the one that would keep the most of
    `tokens`, and how many. A saved state holds only the last window of
    sliding-window layers (or a recurrent snapshot), so an entry can be
    trimmed only as far as that allows (ReuseRule). Longest first, and an
    entry that could not beat the best so far is not compared: this runs on
    the thread that decodes."""
    best, most = None, 0
    for entry in sorted(entries, key=lambda e: len(e.tokens), reverse=True):
        n = len(entry.tokens)
        if min(n, len(tokens) - 1) <= most or entry.scope != scope:
            continue
        lowest = rule.lowest_saved(n)
        if tokens[:n] == entry.tokens:  # the usual case, compared in C
            shared = n
        elif lowest > 0:  # a window or a snapshot: a shorter share could serve only the regenerate of n - 1
            shared = n - 1 if tokens[:n - 1] == entry.tokens[:n - 1] else 0
        else:
            shared = common_prefix(entry.tokens, tokens)
        keep = rule.keepable(shared, len(tokens), exact=n if lowest == 0 else 0, pos_min=lowest, n_held=n)
        if keep > most:
            best, most = entry, keep
    return best, most


def best_indexed(rule: ReuseRule, index, tokens: list[int], scope: str = ""):
    """best_entry through a kv_files.PrefixIndex: the entries that share a
    prefix with `tokens` in `scope` are found by block keys, so the cost
    follows the prompt's blocks, not the entries held."""
    best, most = None, 0
    for entry, shared in index.candidates(tokens, scope):
        n = len(entry.tokens)
        if min(n, len(tokens) - 1) <= most or entry.scope != scope:
            continue
        lowest = rule.lowest_saved(n)
        if lowest > 0 and shared < n - 1:
            continue  # a window or a snapshot: its own length, or the regenerate of it
        keep = rule.keepable(shared, len(tokens), exact=n if lowest == 0 else 0, pos_min=lowest, n_held=n)
        if keep > most:
            best, most = entry, keep
    return best, most


def held_by(rule: ReuseRule, index, tokens: list[int], scope: str = "") -> bool:
    """An entry of `index` restores these tokens: their own, or a longer one that can be cut back to them."""
    if index.exact(tokens, scope) is not None:
        return True
    return any(shared >= len(tokens) and len(e.tokens) > len(tokens) and rule.replaces(len(e.tokens))
               for e, shared in index.candidates(tokens, scope))


def load_state(ctx: ctypes.c_void_p, rule: ReuseRule, slot: Slot, tokens: list[int], state) -> bool:
    """Put a saved state (bytes or a uint8 numpy array, read in place: no copy)
    into the slot's sequence. False, the slot left empty, when llama.cpp
    refused it or holds other positions than `tokens`: a checksum proves the
    bytes are the ones written, not that they hold these positions."""
    memory = llama.llama_get_memory(ctx)
    llama.llama_memory_seq_rm(memory, slot.id, -1, -1)
    if isinstance(state, (bytes, bytearray)):
        pointer = ctypes.cast(ctypes.c_char_p(bytes(state)), ctypes.POINTER(ctypes.c_uint8))
    else:
        pointer = state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    loaded = llama.llama_state_seq_set_data(ctx, pointer, len(state), slot.id)
    if loaded == 0 or llama.llama_memory_seq_pos_max(memory, slot.id) != len(tokens) - 1:
        llama.llama_memory_seq_rm(memory, slot.id, -1, -1)
        slot.cache.clear()
        slot.exact = 0
        slot.checkpoints = []
        return False
    slot.cache[:] = tokens
    slot.checkpoints = []
    # Exact (the layout says they were saved so) only where every position from 0 sits in its own cell.
    whole = llama.llama_memory_seq_pos_min(memory, slot.id) == 0
    slot.exact = len(tokens) if rule.deterministic and whole else 0
    return True


def slot_state(ctx: ctypes.c_void_p, rule: ReuseRule, slot: Slot, min_tokens: int, budget: int,
               out: np.ndarray | None = None):
    """(tokens, state as a uint8 numpy array) of what the slot may save, or
    None: too short, not restorable as it stands, or larger than `budget`.
    In the deterministic mode the slot is cut to the cells a restore puts back
    bit for bit (the caller gives the slot away or tears it down next).
    `out`: a buffer to write the state into when it is large enough (the state
    is then a view of it, valid until the next call): pages already touched,
    where a fresh buffer costs a page fault per 4 KiB, as much as the copy."""
    memory = llama.llama_get_memory(ctx)
    tokens = slot.cache[:slot.cache.index(-1)] if -1 in slot.cache else list(slot.cache)
    if rule.deterministic:
        del tokens[rule.savable(slot.exact):]  # only cells a restore puts back bit for bit
    if len(tokens) < min_tokens:
        return None
    if rule.recurrent and len(tokens) < len(slot.cache):
        return None  # a recurrent state cannot be cut back to them
    if not rule.recurrent and llama.llama_memory_seq_pos_min(memory, slot.id) > rule.lowest_saved(len(tokens)):
        return None  # the window lost cells a restore of them would need (best_entry assumes it holds them)
    if len(tokens) < len(slot.cache):
        if not llama.llama_memory_seq_rm(memory, slot.id, len(tokens), -1):
            return None  # an image or inexact cells follow, and llama.cpp would not cut them off
        slot.truncate(len(tokens))
    size = llama.llama_state_seq_get_size(ctx, slot.id)
    if size <= 0 or size > budget:
        return None  # could never be kept: do not copy it to drop it
    # llama.cpp writes straight into it: the one copy out of the KV cache
    state = out[:size] if out is not None and len(out) >= size else np.empty(size, np.uint8)
    got = llama.llama_state_seq_get_data(ctx, state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, slot.id)
    if got <= 0:
        return None
    return tokens, state[:got]


def take_checkpoint(ctx: ctypes.c_void_p, slot: Slot) -> Checkpoint | None:
    """The slot's window or recurrent state as it stands (its cache's length now), or None."""
    size = llama.llama_state_seq_get_size_ext(ctx, slot.id, PARTIAL)
    if size <= 8:
        return None
    state = np.empty(size, np.uint8)
    got = llama.llama_state_seq_get_data_ext(ctx, state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size,
                                             slot.id, PARTIAL)
    if got <= 8:
        return None
    # A pure recurrent memory ignores the flag (llama_memory_recurrent::state_write): the partial state is the
    # whole one, which a tier can keep as an entry by itself (there are no attention cells to share).
    whole = got == llama.llama_state_seq_get_size(ctx, slot.id)
    return Checkpoint(len(slot.cache), state[:got], whole)


def restore_checkpoint(ctx: ctypes.c_void_p, slot: Slot, checkpoint: Checkpoint) -> bool:
    """Cut the slot back to the checkpoint's length and put its window or
    recurrent state back. The attention cells of those positions are the
    slot's own (a checkpoint is only kept while the slot holds its tokens).
    False, the slot left empty, when llama.cpp refused it."""
    memory = llama.llama_get_memory(ctx)
    n = checkpoint.n
    if n > len(slot.cache):
        return _emptied(memory, slot)
    # A recurrent memory refuses a partial cut and is left as it was (llama_memory_recurrent::seq_rm;
    # a hybrid tries its recurrent half first): then the checkpoint's state replaces the recurrent one
    # first (it ends at n - 1), after which the cut past n only touches a hybrid's attention cells.
    cut_first = n == len(slot.cache) or llama.llama_memory_seq_rm(memory, slot.id, n, -1)
    state = checkpoint.state
    loaded = llama.llama_state_seq_set_data_ext(ctx, state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), len(state),
                                                slot.id, PARTIAL)
    if loaded == 0 or not cut_first and not llama.llama_memory_seq_rm(memory, slot.id, n, -1):
        return _emptied(memory, slot)
    slot.truncate(n)
    if llama.llama_memory_seq_pos_max(memory, slot.id) != n - 1:
        return _emptied(memory, slot)
    slot.exact = 0  # a restored window sits in other cells than a fresh read's
    return True


def checkpoint_state(state: np.ndarray, checkpoint: Checkpoint) -> np.ndarray | None:
    """The whole state of a sequence at checkpoint.n tokens, from `state`, the
    same sequence's whole state (llama_state_seq_get_data) when it held more;
    for a hybrid model, whose state prompt_blocks cannot cut into blocks.
    llama_memory_hybrid::state_write writes the attention cache, then the
    recurrent one; the checkpoint (the partial flag) is the 8-byte prefix and
    the recurrent state alone, the same size in every state of the sequence.
    So: the prefix, the attention cells of positions 0..n-1 (the same
    whatever followed them), then the checkpoint's recurrent state. None when
    the attention cache is not one prompt_blocks reads or lacks a position."""
    recurrent = len(checkpoint.state) - 8
    if recurrent <= 0 or len(state) <= 8 + recurrent:
        return None
    try:
        parsed = blocks.parse(state[:len(state) - recurrent])
    except blocks.UnknownLayout:
        return None
    cells = parsed.caches[0]
    if len(parsed.caches) != 1 or isinstance(cells, bytes) or not cells.full() or len(cells.meta) < checkpoint.n:
        return None
    caches = [parsed.prefix, [cells.head(checkpoint.n)], bytes(memoryview(checkpoint.state)[8:])]
    out = np.empty(blocks.state_size(caches), np.uint8)
    blocks.join_into(out, caches)
    return out


def _emptied(memory: ctypes.c_void_p, slot: Slot) -> bool:
    llama.llama_memory_seq_rm(memory, slot.id, -1, -1)
    slot.truncate(0)
    return False
