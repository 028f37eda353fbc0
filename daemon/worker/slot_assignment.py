"""Slot assignment: queued requests onto idle slots, with what each slot's cache keeps.

A mixin of Engine (daemon/worker/engine.py), kept apart so that the engine
reads as the decode loop it is. Before a step decodes anything, a request
waiting in the queue is given a slot here: the idle slot whose cache shares
the longest usable prefix with its prompt (reuse.ReuseRule decides how much
of it may be kept, and through which checkpoint), or a prompt cache entry
from RAM or disk (a disk read happens off the decode thread, and the slot
waits reserved for it); n choices reserve their slots and fork from the
first one's KV, and a prompt with images is decoded through mtmd at once.
"""

from __future__ import annotations

import time

import msgspec

from daemon import protocol as p
from daemon.worker.errors import RequestError, context_advice
from daemon.worker.llama_lib import llama
from daemon.worker.sampling import SamplerChain
from daemon.worker.structured import startable
from daemon.worker.slot import Checkpoint, Choices, Job, Slot, choose_slot, least_recently_used
from statemachine import SlotState

RESTORE_WAIT_SECONDS = 0.02  # with only disk reads in flight, a step waits this long for one (not a spin)


def _kv():
    """kv_cache (numpy), imported when a prompt cache first needs it."""
    from daemon.worker import kv_cache

    return kv_cache


class SlotAssignment:
    """Mixed into Engine: uses its slots, queue, restores, prompt cache (saved), reuse rule and decode."""

    def _admit(self) -> None:
        """Move queued requests onto idle slots, best cache match first."""
        self._finish_restores()
        passed: set[str] = set()  # pinned requests whose slot is taken: they wait, the ones behind them go on
        while self.queue:
            # A structured request waits in the queue while its tokenizer builds off this thread (structured.py).
            msg = startable([m for m in self.queue if m.request_id not in passed], self.vocab,
                            idle=all(s.job is None for s in self.slots))
            if msg is None:
                return
            idle = [s for s in self.slots if s.job is None and s.reserved_for is None]
            if not idle or len(idle) < min(msg.n, len(self.slots)):
                return  # first in, first served: n choices wait for n slots
            if 0 <= msg.slot < len(self.slots):
                if self.slots[msg.slot] not in idle:
                    # It waits for its slot (first in, first served there: it stays ahead in the queue),
                    # and holds no other: a request pinned to a busy slot never stalls the rest.
                    passed.add(msg.request_id)
                    continue
                idle = [self.slots[msg.slot]]
            self.queue.remove(msg)
            try:
                if self.embeddings_only:
                    raise RequestError("this model serves embeddings only (embeddings = true): use /v1/embeddings")
                if msg.slot >= len(self.slots) or msg.slot < -1:
                    raise RequestError(f"id_slot: this model has slots 0..{len(self.slots) - 1}")
                if msg.slot >= 0 and msg.n > 1:
                    raise RequestError("id_slot: n choices need n slots; a request pinned to one slot has n = 1")
                if msg.n > 1:
                    self._check_choices(msg)
                if msg.messages is not None:
                    text, images = self.chat_prompt(msg)
                    if images:  # only possible with a projector: chat_prompt refuses them otherwise
                        self._assign_media(min(idle, key=least_recently_used), msg, text, images)
                        continue
                    tokens = self.prompt_tokens_within(text, self.n_ctx_slot)
                elif msg.images:  # a completion's text with media markers (llama-server's multimodal_data)
                    if self.media is None:
                        raise RequestError("the prompt has images (multimodal_data) but no multimodal projector is "
                                           "loaded (start with --mmproj)")
                    if msg.n > 1 or not isinstance(msg.prompt, str):
                        raise RequestError("images go with one text prompt of one choice (n = 1)")
                    self._assign_media(min(idle, key=least_recently_used), msg, msg.prompt, msg.images)
                    continue
                else:
                    tokens = self.prompt_tokens(msg)
                if not tokens:
                    raise RequestError("prompt is empty")
                if len(tokens) >= self.n_ctx_slot:
                    raise RequestError(
                        f"prompt has {len(tokens)} tokens; the context of a slot holds {self.n_ctx_slot}: "
                        f"{context_advice(self.rt.spec.ctx_size, self.rt.spec.parallel, self.rt.spec.kv_unified)}",
                        "context_length_exceeded",
                    )
                sampler = SamplerChain(msg.params, self.n_vocab, self.n_ctx_slot, self.vocab, eog=self.eog_tokens,
                                       prompt=tokens)
            except RequestError as exc:
                self.emit(p.Done(msg.request_id, "error", error=str(exc), error_code=exc.code))
                continue
            except Exception as exc:  # noqa: BLE001 - a bug in one request's setup fails that request only
                self.emit(p.Done(msg.request_id, "error", error=f"internal error: {exc!r}", error_code="internal_error"))
                continue
            restored = (0, 0.0, "", None, "")
            if msg.cache_prompt:
                scope = msg.cache_scope  # a slot holding another scope's prompt keeps nothing for this one
                slot = choose_slot(idle, tokens, lambda s: self.keepable(s, tokens, scope))
                self._room_for_prompt(slot, len(tokens))
                if self.saved is not None:  # the best of RAM and disk, when it beats the slot; the slot's prefix kept
                    restored = self.saved.before_assign(slot, tokens, self.keepable(slot, tokens, scope), scope,
                                                        off_thread=msg.n == 1)
                    if not isinstance(restored, tuple):  # a disk read, off this thread: the slot waits for it
                        slot.reserved_for = restored
                        self.restoring.append((restored, msg, tokens, sampler, slot))
                        continue
                self._assign(slot, msg, tokens, sampler, *self.reuse_plan(slot, tokens, scope))
            else:  # the client asked for a fresh read: the least recently used slot, nothing kept
                slot = min(idle, key=least_recently_used)
                if self.saved is not None:
                    self.saved.stash(slot, 0)  # what it held still serves its own conversation later
                self._room_for_prompt(slot, len(tokens))
                self._assign(slot, msg, tokens, sampler, 0)
            self._started(slot, msg, idle, restored)

    def _finish_restores(self) -> None:
        """Disk restores whose file the reader has read and checked: into their
        slot (llama_state_seq_set_data, the one part on this thread), then
        their prompt starts. With nothing else to step, wait a moment for a
        read rather than spin (the channel thread answers pings meanwhile)."""
        if not self.restoring:
            return
        if all(s.job is None for s in self.slots) and not self.embedding_work and not self._queue_can_start():
            self.restoring[0][0].done.wait(RESTORE_WAIT_SECONDS)
        for item in [item for item in self.restoring if item[0].done.is_set()]:
            self.restoring.remove(item)
            read, msg, tokens, sampler, slot = item
            slot.reserved_for = None
            restored = self.saved.finish_read(slot, read)
            self._assign(slot, msg, tokens, sampler, *self.reuse_plan(slot, tokens, msg.cache_scope))
            self._started(slot, msg, [slot], restored)

    def _queue_can_start(self) -> bool:
        """A queued request has an idle slot it may take (a pinned one only its own)."""
        idle = {s.id for s in self.slots if s.job is None and s.reserved_for is None}
        return bool(idle) and any(not 0 <= m.slot < len(self.slots) or m.slot in idle for m in self.queue)

    def _cancel_restoring(self, request_id: str | None = None) -> bool:
        """Drop the waiting restores of a request (or all): their slots are free
        again, the reads finish unseen. Whether one was found."""
        found = [item for item in self.restoring if request_id is None or item[1].request_id == request_id]
        for item in found:
            self.restoring.remove(item)
            item[4].reserved_for = None
            self.emit(p.Done(item[1].request_id, "cancelled"))
        return bool(found)

    def _started(self, slot: Slot, msg: p.Submit, idle: list[Slot], restored: tuple) -> None:
        """A prompt given its slot: its choices' slots reserved, and what the cache gave it counted."""
        job = slot.job
        if msg.n > 1:  # the other choices' slots wait, least recently used first, for the prompt's KV
            others = sorted((s for s in idle if s is not slot), key=least_recently_used)[:msg.n - 1]
            job.group = Choices(msg.n, job, others)
            for other in others:
                other.reserved_for = job.group
        job.restored_tokens, job.restore_seconds, job.kv_lookup, job.kv_rejected, job.cache_tier = restored
        job.restored_tokens = min(job.restored_tokens, job.n_cached)  # the last token is decoded again
        if job.kv_lookup == "hit" and not job.restored_tokens:  # llama.cpp held less than predicted: no help
            job.kv_lookup, job.cache_tier = "miss", ""
        if not job.cache_tier and job.n_cached:
            job.cache_tier = "slot"
        if self.saved is not None:
            self.saved.counted(job.cache_tier, job.n_cached)
        if msg.messages is not None:
            slot.job.end_tokens = self.end_of_turn

    def _check_choices(self, msg: p.Submit) -> None:
        if msg.n > len(self.slots):
            raise RequestError(f"n: {msg.n} choices need {msg.n} slots; this model has {len(self.slots)} (parallel)")
        if self.speculator is not None:
            raise RequestError("n > 1 is not available with a draft model (each choice would need its own draft)")
        if any(not isinstance(m.content, str) and any(part.type == "image" for part in m.content)
               for m in msg.messages or ()):
            raise RequestError("n > 1 is not available with images")

    def _fork_choices(self, slot: Slot, index: int) -> None:
        """The first choice's prompt is decoded: copy its KV to the reserved
        slots and draw each other choice's first token from the same logits."""
        job = slot.job
        group = job.group
        waiting, group.reserved = group.reserved, []  # taken first: a forked choice's own first token must not fork
        for i, other in enumerate(waiting, start=1):
            if group.ended:
                break  # a choice failed at its first token: _end_choices freed the rest
            llama.llama_memory_seq_rm(self.memory, other.id, -1, -1)
            llama.llama_memory_seq_cp(self.memory, slot.id, other.id, -1, -1)
            other.cache, other.exact = list(slot.cache), slot.exact  # the same cells: nothing to trim
            other.scope, other.checkpoints = slot.scope, list(slot.checkpoints)
            params = job.params if job.params.seed is None else msgspec.structs.replace(
                job.params, seed=(job.params.seed + i) % 2**32)  # a set seed still gives n different choices
            sampler = SamplerChain(params, self.n_vocab, self.n_ctx_slot, self.vocab, grammar_of=job.sampler,
                                   eog=self.eog_tokens, prompt=job.prompt)
            other.job = Job(job.request_id, job.prompt, params, sampler, n_prompt_done=len(job.prompt), index=i,
                            group=group, started=job.started)
            other.job.end_tokens = job.end_tokens
            other.reserved_for = None
            other.last_used = time.monotonic()
            other.move(SlotState.STARTED)
            other.move(SlotState.PROCESSING_PROMPT)
            self._on_logits(other, index)
        self._slots_changed = True

    def _assign_media(self, slot: Slot, msg: p.Submit, text: str, images: list[bytes]) -> None:
        """A prompt with images is decoded at once through mtmd; its image
        positions hold no token ids, so the cache records placeholders that no
        later prompt can match."""
        from daemon.worker.multimodal import MediaError

        llama.llama_memory_seq_rm(self.memory, slot.id, -1, -1)
        slot.truncate(0)
        slot.scope = msg.cache_scope
        if self.speculator is not None:
            self.speculator.forget(slot)
        started = time.perf_counter()  # the encode and decode are the prompt's read, in its timings
        try:
            n_pos, tokens = self.media.evaluate(self.ctx, text, images, slot.id, self.n_batch, self.n_ctx_slot,
                                                make_room=(lambda n_pos: self._room_for_prompt(slot, n_pos))
                                                if self.rt.spec.kv_unified else None, progressed=self.progressed)
            sampler = SamplerChain(msg.params, self.n_vocab, self.n_ctx_slot, self.vocab, eog=self.eog_tokens,
                                   prompt=tokens)
        except (MediaError, RequestError) as exc:
            llama.llama_memory_seq_rm(self.memory, slot.id, -1, -1)
            self.emit(p.Done(msg.request_id, "error", error=str(exc), error_code=exc.code))
            return
        slot.cache.extend([-1] * n_pos)
        slot.job = Job(msg.request_id, tokens, msg.params, sampler, n_prompt_done=len(tokens), progress=msg.progress,
                       started=started)
        slot.last_used = time.monotonic()
        if msg.messages is not None:
            slot.job.end_tokens = self.end_of_turn
        slot.move(SlotState.STARTED)
        slot.move(SlotState.PROCESSING_PROMPT)
        self._slots_changed = True
        self._progress(slot.job)  # return_progress: the prompt is read, images and all
        self._on_logits(slot, -1)  # the last text batch left the last position's logits

    def keepable(self, slot: Slot, tokens: list[int], scope: str = "") -> int:
        """How many of `tokens` (a prompt of cache `scope`) the slot may keep (reuse.ReuseRule: the one rule)."""
        return self.reuse_plan(slot, tokens, scope)[0]

    def reuse_plan(self, slot: Slot, tokens: list[int], scope: str = "") -> tuple[int, Checkpoint | None]:
        """(tokens the slot may keep, the slot's checkpoint to put back first, or
        None). Nothing across cache scopes. A window that moved on (a state
        restored, then extended) is cut back through a checkpoint, each judged
        by the same rule as a saved state of its length."""
        if slot.scope != scope:
            return 0, None
        shared = slot.common_prefix(tokens)
        if shared == 0:
            return 0, None
        keep = self.reuse.keepable(shared, len(tokens), slot.exact,
                                   llama.llama_memory_seq_pos_min(self.memory, slot.id), len(slot.cache))
        best = None
        if self.reuse.checkpoints:
            for checkpoint in reversed(slot.checkpoints):
                if checkpoint.n <= keep:
                    break
                n = checkpoint.n
                k = self.reuse.keepable(min(shared, n), len(tokens), 0, self.reuse.lowest_saved(n), n)
                if k > keep:
                    keep, best = k, checkpoint
        return keep, best

    def _assign(self, slot: Slot, msg: p.Submit, tokens: list[int], sampler: SamplerChain, reuse: int,
                checkpoint: Checkpoint | None = None) -> None:
        if checkpoint is not None and not _kv().restore_checkpoint(self.ctx, slot, checkpoint):
            reuse = 0  # llama.cpp refused the window: a fresh read (the slot is empty now)
        if reuse < len(slot.cache) and not llama.llama_memory_seq_rm(self.memory, slot.id, reuse, -1):
            reuse = 0  # partial removal refused (a recurrent model): start over
        if reuse == 0:
            llama.llama_memory_seq_rm(self.memory, slot.id, -1, -1)
        slot.truncate(reuse)
        if self.speculator is not None and slot.scope != msg.cache_scope:
            self.speculator.forget(slot)  # the draft's copy is the other scope's: its reuse would show in timings
        slot.scope = msg.cache_scope
        if self.saved is not None and self.reuse.checkpoints and self.saved.min_tokens <= reuse < len(tokens) - 1 \
                and not any(c.n == reuse for c in slot.checkpoints):
            self._checkpoint(slot)  # a turn boundary: where this prompt leaves what the slot held
        slot.job = Job(msg.request_id, tokens, msg.params, sampler, n_prompt_done=reuse, n_cached=reuse,
                       exact_from=slot.exact, progress=msg.progress)
        slot.last_used = time.monotonic()
        slot.move(SlotState.STARTED)
        self._slots_changed = True

    def _checkpoint(self, slot: Slot) -> None:
        """Keep the slot's window as it stands (prompt cache checkpoints: see kv_cache.take_checkpoint)."""
        checkpoint = _kv().take_checkpoint(self.ctx, slot)
        if checkpoint is not None:
            slot.add_checkpoint(checkpoint)
