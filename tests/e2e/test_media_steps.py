"""A prompt with images is read piece by piece: each image (encoded by the
projector, then decoded) and each batch of text is its own bounded part, as is
each image's decode from its file, and
the worker's liveness step ends after each (Engine's `progressed`, which the
worker wires to channel.Channel.step_progressed). So a prompt of many images or
much text is never one step that the supervisor could judge hung. The pieces
give the logits mtmd's own reader (mtmd_helper_eval_chunks) gives.

The real engine, the bundled model and the test projector in this process (no
daemon): pieces are counted, never timed."""

from __future__ import annotations

import ctypes
import math

import pytest

from daemon import protocol as p
from tests.fixtures.projector import png_bytes

pytestmark = pytest.mark.e2e

N_BATCH = 32
TEXT = ("The first part of a long text, read in batches. " * 6 + "<__media__> and between the images "
        + "more words " * 20 + "<__media__> and the end of it all.")


@pytest.fixture(scope="module")
def engine(bundled_model, projector):
    from daemon.worker.engine import Engine
    from daemon.worker.runtime import Runtime

    spec = p.ModelSpec(model=bundled_model, mmproj=projector, ctx_size=1024, parallel=2, threads=2,
                       batch_size=N_BATCH)
    runtime = Runtime(spec)
    runtime.load()
    messages: list = []
    pieces: list[int] = []
    eng = Engine(runtime, messages.append, progressed=lambda: pieces.append(1))
    eng.messages, eng.pieces = messages, pieces
    yield eng
    eng.close()


def expected_pieces(engine, text: str, images: list[bytes]) -> int:
    """Each image's decode, then each text chunk's batches of N_BATCH and each image's encode: what mtmd
    splits the prompt into."""
    lib, count = engine.media.lib, len(images)
    with engine.media._chunks(text, images) as chunks:
        for i in range(lib.mtmd_input_chunks_size(chunks)):
            chunk = lib.mtmd_input_chunks_get(chunks, i)
            if lib.mtmd_input_chunk_get_type(chunk) == lib.MTMD_INPUT_CHUNK_TYPE_TEXT:
                count += math.ceil(lib.mtmd_input_chunk_get_n_tokens(chunk) / N_BATCH)
            else:
                count += 1
    return count


def test_each_image_and_each_batch_of_text_ends_a_liveness_step(engine):
    images = [png_bytes(), png_bytes(16, 16)]
    expected = expected_pieces(engine, TEXT, images)
    assert expected >= 2 * 2 + 6  # two images decoded and encoded, and the text in several batches
    engine.pieces.clear()
    engine.submit(p.Submit("media", p.SamplingParams(max_tokens=3, temperature=0), prompt=TEXT, images=images))
    while engine.busy:
        engine.step()
    done = [m for m in engine.messages if isinstance(m, p.Done) and m.request_id == "media"]
    assert len(done) == 1 and done[0].finish_reason == "length", done
    assert len(engine.pieces) == expected


def test_the_pieces_give_the_logits_of_mtmds_own_reader(engine):
    from daemon.worker.llama_lib import llama

    images = [png_bytes(), png_bytes(16, 16)]
    media, ctx, n_vocab = engine.media, engine.ctx, engine.n_vocab

    def last_logits() -> list[float]:
        return list(llama.llama_get_logits_ith(ctx, -1)[:n_vocab])

    llama.llama_memory_seq_rm(engine.memory, 0, -1, -1)
    n_pos, tokens = media.evaluate(ctx, TEXT, images, 0, N_BATCH, engine.n_ctx_slot)
    ours = last_logits()
    llama.llama_memory_seq_rm(engine.memory, 0, -1, -1)
    with media._chunks(TEXT, images) as chunks:
        new_n_past = llama.llama_pos(0)
        assert media.lib.mtmd_helper_eval_chunks(media.ctx, ctx, chunks, 0, 0, N_BATCH, True,
                                                 ctypes.byref(new_n_past)) == 0
    theirs = last_logits()
    llama.llama_memory_seq_rm(engine.memory, 0, -1, -1)
    assert n_pos == new_n_past.value
    assert len(tokens) == n_pos and tokens.count(-1) >= 2  # the images' positions, as placeholders
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-4
