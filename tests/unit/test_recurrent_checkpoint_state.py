"""kv_cache.take_checkpoint / restore_checkpoint on real recurrent models
(the tiny Mamba and the tiny Jamba, a hybrid, of
tests/fixtures/tiny_recurrent_model.py), in llama.cpp itself: a recurrent
state cannot be cut back (seq_rm refuses a partial cut), so putting a
checkpoint back must replace the recurrent state (and cut a hybrid's
attention cells back to it), and the next token's logits must be those of a
sequence that never went past it."""

from __future__ import annotations

import ctypes
import random

import numpy as np
import pytest

from daemon.worker.kv_cache import checkpoint_state, restore_checkpoint, take_checkpoint
from daemon.worker.llama_lib import llama
from daemon.worker.slot import Checkpoint, Slot

CHUNK = 64


@pytest.fixture(scope="module", params=["mamba", "jamba"])
def mamba(request, tmp_path_factory):
    from tests.fixtures import tiny_recurrent_model as tiny

    hybrid = request.param == "jamba"
    write = tiny.write_tiny_hybrid_model if hybrid else tiny.write_tiny_recurrent_model
    path = write(tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}.gguf")
    llama.llama_backend_init()
    model = llama.llama_model_load_from_file(str(path).encode(), llama.llama_model_default_params())
    assert model and bool(llama.llama_model_is_recurrent(model)) != hybrid
    assert bool(llama.llama_model_is_hybrid(model)) == hybrid
    params = llama.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 1024, CHUNK, CHUNK, 2
    params.kv_unified, params.n_threads, params.n_threads_batch = False, 1, 1
    ctx = llama.llama_init_from_model(model, params)
    assert ctx
    batch = llama.llama_batch_init(CHUNK, 0, 1)
    yield ctx, batch, llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(model))
    llama.llama_batch_free(batch)
    llama.llama_free(ctx)
    llama.llama_model_free(model)


def read(ctx, batch, slot: Slot, tokens: list[int], n_vocab: int) -> np.ndarray:
    """Decode `tokens` after what the slot holds, in CHUNK-token chunks; the last token's logits."""
    for start in range(0, len(tokens), CHUNK):
        chunk = tokens[start:start + CHUNK]
        batch.n_tokens = len(chunk)
        for i, token in enumerate(chunk):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, len(slot.cache) + i, 1
            batch.seq_id[i][0] = slot.id
            batch.logits[i] = i == len(chunk) - 1
        assert llama.llama_decode(ctx, batch) == 0
        slot.cache.extend(chunk)
    return np.ctypeslib.as_array(llama.llama_get_logits_ith(ctx, -1), (n_vocab,)).copy()


def empty(ctx, slot: Slot) -> None:
    llama.llama_memory_seq_rm(llama.llama_get_memory(ctx), slot.id, -1, -1)
    slot.cache.clear()
    slot.checkpoints = []


def test_a_checkpoint_puts_the_state_back_where_the_slot_went_past_it(mamba):
    ctx, batch, n_vocab = mamba
    rng = random.Random(1)
    prompt = [rng.randrange(3, 300) for _ in range(200)]
    slot, fresh = Slot(0), Slot(1)
    empty(ctx, slot), empty(ctx, fresh)
    read(ctx, batch, slot, prompt[:128], n_vocab)
    checkpoint = take_checkpoint(ctx, slot)
    assert checkpoint is not None and checkpoint.n == 128
    # A pure recurrent memory: the partial state is the whole one; a hybrid's leaves its attention cells out.
    assert checkpoint.whole == (not llama.llama_model_is_hybrid(llama.llama_get_model(ctx)))
    read(ctx, batch, slot, prompt[128:], n_vocab)
    memory = llama.llama_get_memory(ctx)
    assert not llama.llama_memory_seq_rm(memory, slot.id, 128, -1)  # what llama.cpp refuses: a partial cut

    assert restore_checkpoint(ctx, slot, checkpoint)
    assert slot.cache == prompt[:128] and llama.llama_memory_seq_pos_max(memory, slot.id) == 127
    edit = [rng.randrange(3, 300) for _ in range(40)]
    restored = read(ctx, batch, slot, edit, n_vocab)
    expected = read(ctx, batch, fresh, prompt[:128] + edit, n_vocab)  # the same chunks, from 0
    assert np.array_equal(restored, expected)
    empty(ctx, slot), empty(ctx, fresh)


def test_a_checkpoint_past_the_slot_or_of_garbage_leaves_the_slot_empty(mamba):
    ctx, batch, n_vocab = mamba
    rng = random.Random(2)
    slot = Slot(0)
    empty(ctx, slot)
    read(ctx, batch, slot, [rng.randrange(3, 300) for _ in range(100)], n_vocab)
    checkpoint = take_checkpoint(ctx, slot)
    memory = llama.llama_get_memory(ctx)
    slot.truncate(50)  # the slot says it holds less than the checkpoint: it must not be trusted
    assert not restore_checkpoint(ctx, slot, checkpoint)
    assert slot.cache == [] and llama.llama_memory_seq_pos_max(memory, slot.id) == -1

    read(ctx, batch, slot, [rng.randrange(3, 300) for _ in range(100)], n_vocab)
    for state in (checkpoint.state[:len(checkpoint.state) // 2], np.zeros(len(checkpoint.state), np.uint8)):
        garbage = Checkpoint(50, state, whole=checkpoint.whole)
        assert not restore_checkpoint(ctx, slot, garbage)
        assert slot.cache == [] and llama.llama_memory_seq_pos_max(memory, slot.id) == -1
        read(ctx, batch, slot, [rng.randrange(3, 300) for _ in range(100)], n_vocab)
    empty(ctx, slot)


def test_a_checkpoint_holds_the_state_only_not_the_tokens(mamba):
    """The checkpoint's bytes do not grow with the tokens it follows (a recurrent
    state is fixed-size): what the tiers pay per checkpoint."""
    ctx, batch, n_vocab = mamba
    slot = Slot(0)
    empty(ctx, slot)
    read(ctx, batch, slot, [5] * 64, n_vocab)
    short = take_checkpoint(ctx, slot)
    read(ctx, batch, slot, [6] * 384, n_vocab)
    long = take_checkpoint(ctx, slot)
    assert len(short.state) == len(long.state) > 0
    empty(ctx, slot)


def whole_state(ctx, slot: Slot) -> np.ndarray:
    size = llama.llama_state_seq_get_size(ctx, slot.id)
    state = np.empty(size, np.uint8)
    assert llama.llama_state_seq_get_data(ctx, state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, slot.id)
    return state


def test_a_tier_entry_of_a_checkpoint_is_the_longer_state_cut_to_it(mamba):
    """What the RAM and disk tiers keep of a checkpoint (prompt_cache._stash_checkpoints): on a
    hybrid, the longer state's attention cells cut to n and the checkpoint's recurrent state,
    which llama_state_seq_set_data takes as the sequence at n; on a pure recurrent model, the
    checkpoint itself (nothing to cut)."""
    ctx, batch, n_vocab = mamba
    rng = random.Random(3)
    prompt = [rng.randrange(3, 300) for _ in range(200)]
    slot, fresh = Slot(0), Slot(1)
    empty(ctx, slot), empty(ctx, fresh)
    read(ctx, batch, slot, prompt[:128], n_vocab)
    checkpoint = take_checkpoint(ctx, slot)
    read(ctx, batch, slot, prompt[128:], n_vocab)
    longer = whole_state(ctx, slot)
    state = checkpoint_state(longer, checkpoint)
    if checkpoint.whole:
        assert state is None  # the checkpoint is the entry
        state = checkpoint.state
    else:
        assert state is not None and len(state) < len(longer)
        assert checkpoint_state(longer[:len(longer) - 1], checkpoint) is None  # a torn state: not cut
    empty(ctx, slot)
    memory = llama.llama_get_memory(ctx)
    assert llama.llama_state_seq_set_data(ctx, state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), len(state),
                                          slot.id)
    assert llama.llama_memory_seq_pos_max(memory, slot.id) == 127
    slot.cache[:] = prompt[:128]
    edit = [rng.randrange(3, 300) for _ in range(40)]
    assert np.array_equal(read(ctx, batch, slot, edit, n_vocab), read(ctx, batch, fresh, prompt[:128] + edit, n_vocab))
    empty(ctx, slot), empty(ctx, fresh)
