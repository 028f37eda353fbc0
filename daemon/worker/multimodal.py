"""Images in prompts, through llama.cpp's mtmd and the loaded projector.

The chat template puts mtmd's media marker where each image goes; mtmd splits
the prompt into text and image chunks, encodes the images with the projector
and decodes everything into the slot's sequence.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from daemon.worker.errors import RequestError, context_advice
from daemon.worker.llama_lib import fill_sequence, llama, mtmd


class MediaError(RequestError):
    """A prompt with images that cannot be encoded; the request fails, the worker goes on."""


class MediaPrompts:
    def __init__(self, mmproj: ctypes.c_void_p) -> None:
        self.lib = mtmd()
        self.ctx = mmproj
        self.marker = self.lib.mtmd_default_marker().decode()

    def count(self, text: str, images: list[bytes]) -> int:
        """The prompt tokens text+images take (image tokens included), without decoding them."""
        with self._chunks(text, images) as chunks:
            return self.lib.mtmd_helper_get_n_tokens(chunks)

    def evaluate(self, lctx: ctypes.c_void_p, text: str, images: list[bytes], seq_id: int, n_batch: int,
                 n_ctx_slot: int, make_room: Callable[[int], object] | None = None,
                 progressed: Callable[[], object] = lambda: None) -> tuple[int, list[int]]:
        """Decode text+images into sequence `seq_id` from position 0, logits for the
        last position; make_room(positions) first, when the slots share a KV pool (it frees cells for them).
        progressed() after each piece: one image, or one batch of text (the worker's liveness step ends
        there, so a prompt of many images or much text is never judged one hung step).
        Returns (positions used, the prompt's tokens: the text's ids, -1 for each image token)."""
        lib = self.lib
        with self._chunks(text, images, progressed) as chunks:
            n_chunks = lib.mtmd_input_chunks_size(chunks)
            last = lib.mtmd_input_chunks_get(chunks, n_chunks - 1) if n_chunks else None
            if last is None or lib.mtmd_input_chunk_get_type(last) != lib.MTMD_INPUT_CHUNK_TYPE_TEXT \
                    or lib.mtmd_input_chunk_get_n_tokens(last) == 0:
                # An image's last position has no logits to draw the next token from (llama.cpp would abort).
                raise MediaError(f"the prompt ends with an image: put text after the last image (its {self.marker} "
                                 "marker); the answer is read on from a text token")
            n_pos = lib.mtmd_helper_get_n_pos(chunks)
            if n_pos >= n_ctx_slot:
                # Worded as a text prompt's overflow, whose counts the HTTP layer reads (run.overflow_counts).
                raise MediaError(f"prompt with images has {n_pos} tokens; the context of a slot holds {n_ctx_slot} "
                                 f"(an image's positions counted): {context_advice()}", "context_length_exceeded")
            if make_room is not None:
                make_room(n_pos)
            # The prompt's tokens in order: each text chunk's ids, and -1 for each token of an image (what the
            # penalties skip: llama-server's LLAMA_TOKEN_NULL).
            tokens: list[int] = []
            n_past = 0
            batch = llama.llama_batch_init(n_batch, 0, 1)
            try:
                for i in range(n_chunks):
                    chunk = lib.mtmd_input_chunks_get(chunks, i)
                    if lib.mtmd_input_chunk_get_type(chunk) == lib.MTMD_INPUT_CHUNK_TYPE_TEXT:
                        ids = self._text_ids(chunk)
                        n_past = _decode_text(lctx, batch, ids, n_past, seq_id, n_batch, i == n_chunks - 1,
                                              make_room is not None, progressed)
                        tokens.extend(ids)
                        continue
                    new_n_past = llama.llama_pos(0)  # an image: encoded by the projector, then decoded (mtmd's own)
                    rc = lib.mtmd_helper_eval_chunk_single(self.ctx, lctx, chunk, n_past, seq_id, n_batch, False,
                                                           ctypes.byref(new_n_past))
                    _check(rc, make_room is not None)
                    n_past = new_n_past.value
                    tokens.extend([-1] * lib.mtmd_input_chunk_get_n_tokens(chunk))
                    progressed()
            finally:
                llama.llama_batch_free(batch)
            return n_past, tokens

    def _text_ids(self, chunk: ctypes.c_void_p) -> list[int]:
        n = ctypes.c_size_t(0)
        ids = self.lib.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
        return ids[: n.value]

    @contextmanager
    def _chunks(self, text: str, images: list[bytes],
                progressed: Callable[[], object] = lambda: None) -> Iterator[ctypes.c_void_p]:
        """text+images tokenized by mtmd (its input chunks, freed after); progressed() after each image's
        decode (stb_image's, of up to max_image_pixels)."""
        lib = self.lib
        if text.count(self.marker) != len(images):
            raise MediaError(f"the prompt has {text.count(self.marker)} {self.marker} markers and {len(images)} "
                             "images: each image goes at a marker, in order")
        bitmaps = []
        chunks = lib.mtmd_input_chunks_init()
        try:
            for i, data in enumerate(images):
                buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
                bitmap = lib.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(data), False)
                if not bitmap:
                    raise MediaError(f"image {i + 1} cannot be decoded (PNG, JPEG, BMP, GIF are supported)")
                bitmaps.append(bitmap)
                progressed()
            prompt = lib.mtmd_input_text()
            encoded = text.encode("utf-8")
            prompt.text = encoded
            prompt.text_len = len(encoded)
            prompt.add_special = True
            prompt.parse_special = True
            array = (lib.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
            rc = lib.mtmd_tokenize(self.ctx, chunks, ctypes.byref(prompt), array, len(bitmaps))
            if rc != 0:
                raise MediaError(f"the prompt and its images do not match (mtmd_tokenize returned {rc})")
            yield chunks
        finally:
            lib.mtmd_input_chunks_free(chunks)
            for bitmap in bitmaps:
                lib.mtmd_bitmap_free(bitmap)


def _decode_text(lctx: ctypes.c_void_p, batch, ids: list[int], n_past: int, seq_id: int, n_batch: int,
                 logits_last: bool, shared_pool: bool, progressed: Callable[[], object]) -> int:
    """A text chunk's ids in batches of n_batch, as mtmd_helper_eval_chunk_single reads them, progressed()
    after each. Returns the next position."""
    for start in range(0, len(ids), n_batch):
        piece = ids[start:start + n_batch]
        last = start + len(piece) == len(ids)
        fill_sequence(batch, piece, seq_id, n_past, logits_from=len(piece) - 1 if logits_last and last else len(piece))
        _check(llama.llama_decode(lctx, batch), shared_pool)
        n_past += len(piece)
        progressed()
    return n_past


def _check(rc: int, shared_pool: bool) -> None:
    if rc == 1 and shared_pool:  # no cells: busy slots hold the shared pool (1 is also a failed encode)
        raise MediaError("context size has been exceeded: the slots share one KV pool (kv_unified) and "
                         "busy slots hold the room this prompt with its images needs. Retry, or raise "
                         "ctx_size", "context_full")
    if rc != 0:
        raise MediaError(f"encoding the prompt with its images failed ({rc})")
