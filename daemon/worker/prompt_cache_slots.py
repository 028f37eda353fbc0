"""llama-server's slot actions on the worker side: save a slot's prompt cache
to a named file, restore one into a slot, erase a slot (POST /slots/{id}).

The files are the prompt cache's own format (daemon/model/kv_files.py:
sealed, the model's fingerprint and the context layout in the header,
written atomically), named by the client instead of by their tokens, in
`slot_save_path/<model id>/`. A file of another model or layout, cut short
or failing its checksum is refused, never loaded.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from daemon import protocol as p
from daemon.model.kv_files import (FORMAT_VERSION, KvFileError, KvHeader, model_fingerprint, read_header, read_state,
                                   scope_id, write_file)
from daemon.worker.errors import RequestError
from daemon.worker.kv_cache import context_layout, load_state, slot_state
from daemon.worker.llama_lib import llama

# llama-server's fs_validate_filename, narrowed: a plain name, no directory, no hidden file.
FILENAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$")
MAX_STATE_BYTES = 2**40  # what a slot file may hold: its budget is the disk, not the prompt cache's
RESTORED_ELSEWHERE = "\0restored-from-another-scope"  # no request's scope: the HTTP layer never makes a NUL


def _forget_draft(engine, slot) -> None:
    """The draft's copy of the slot's sequence goes with what the slot held."""
    if engine.speculator is not None:
        engine.speculator.forget(slot)


def slot_action(engine, msg: p.Query) -> p.Answer:
    """kind slot_save / slot_restore / slot_erase; tokens = [slot id], text = the file name.
    Answer.tokens = [tokens saved, restored or erased, bytes written or read]."""
    spec = engine.rt.spec
    if len(msg.tokens) != 1 or not 0 <= msg.tokens[0] < len(engine.slots):
        raise RequestError(f"id_slot must be 0..{len(engine.slots) - 1}")
    slot = engine.slots[msg.tokens[0]]
    if slot.job is not None or slot.reserved_for is not None:
        raise RequestError(f"slot {slot.id} is busy: try again when it is idle", "slot_busy")
    if msg.kind == "slot_erase":
        n = len(slot.cache)
        llama.llama_memory_seq_rm(engine.memory, slot.id, -1, -1)
        slot.truncate(0)
        _forget_draft(engine, slot)
        engine._slots_changed = True
        return p.Answer(msg.request_id, tokens=[n, 0])
    if not spec.slot_dir:
        raise RequestError("slot save and restore are off: set slot_save_path", "not_supported")
    if not FILENAME.fullmatch(msg.text):
        raise RequestError("filename must be 1-200 letters, digits, '.', '_' or '-', not starting with '.'")
    directory = Path(spec.slot_dir)
    model = model_fingerprint(spec.model)
    layout = context_layout(engine.ctx, engine.rt.model, engine.reuse)
    if msg.kind == "slot_save":
        # Another scope's prompt is not the caller's to save (nor to learn the length of).
        taken = slot_state(engine.ctx, engine.reuse, slot, 1, MAX_STATE_BYTES) if slot.scope == msg.cache_scope \
            else None
        if taken is None:
            raise RequestError(f"slot {slot.id} holds nothing that can be saved")
        tokens, state = taken
        header = KvHeader(FORMAT_VERSION, model, layout, tokens, len(state), "", scope=scope_id(slot.scope))
        try:
            path = write_file(directory, header, memoryview(state), name=msg.text)
        except OSError as exc:
            raise RequestError(f"cannot write {msg.text}: {exc.strerror or exc}", "slot_file_error") from None
        return p.Answer(msg.request_id, tokens=[len(tokens), path.stat().st_size])
    if msg.kind == "slot_restore":
        path = directory / msg.text
        try:
            header, offset = read_header(path, named=False)
            if header.model != model:
                raise KvFileError("other_model", f"{msg.text}: saved for another model file")
            if header.layout != layout:
                raise KvFileError("other_layout", f"{msg.text}: saved with other context parameters")
            if len(header.tokens) >= engine.n_ctx_slot:
                raise KvFileError("corrupt", f"{msg.text}: more tokens than a slot holds")
            state = read_state(path, header, offset, named=False)
        except KvFileError as exc:
            raise RequestError(f"cannot restore {msg.text}: {exc}", "slot_file_error") from None
        if not engine._room_for_prompt(slot, len(header.tokens)):  # a shared pool: idle slots' prompts leave it
            raise RequestError(f"cannot restore {msg.text} now: the slots share one KV pool (kv_unified) and busy "
                               "slots hold the room it needs; retry", "context_full")
        if not load_state(engine.ctx, engine.reuse, slot, header.tokens, state):
            engine._slots_changed = True
            raise RequestError(f"cannot restore {msg.text}: llama.cpp refused its state", "slot_file_error")
        slot.last_used = time.monotonic()
        _forget_draft(engine, slot)
        # The file serves the scope that saved it, and only when that scope restores it: restored
        # by another, it serves no request (a scope no request has), so no scope reads another's.
        slot.scope = msg.cache_scope if scope_id(msg.cache_scope) == header.scope else RESTORED_ELSEWHERE
        engine._slots_changed = True
        return p.Answer(msg.request_id, tokens=[len(header.tokens), path.stat().st_size])
    raise RequestError(f"unknown query kind {msg.kind!r}")
