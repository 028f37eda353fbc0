"""Slots and continuous batching on one llama.cpp context.

Each step decodes the next token of every generating slot in one batch (one
llama_decode for all of them), then each prompt chunk on its own (see
Engine.step for why). Requests beyond the slots wait in a FIFO. A request lands
on the idle slot whose cache shares the longest prefix with its prompt, and
only the rest of the prompt is decoded (llama-server's prompt cache).

Two mixins carry the rest: how a request becomes tokens and tokens become
text (prompt_text.PromptText), and how a queued request gets its slot and what
that slot's cache keeps (slot_assignment.SlotAssignment).
"""

from __future__ import annotations

import ctypes
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from daemon import protocol as p
from daemon.worker.chat import END_OF_TURN_MARKERS, ChatRenderer, template_for
from daemon.worker.embedding_queue import EmbeddingQueue, EmbeddingWork
from daemon.worker.end_of_generation import end_of_generation_tokens
from daemon.worker.errors import RequestError
from daemon.worker.llama_lib import llama
from daemon.protocol import VERIFY_GROUP
from daemon.worker.prompt_text import PromptText
from daemon.worker.reuse import ReuseRule
from daemon.worker.runtime import Runtime
from daemon.worker.slot import Choices, Job, Slot
from daemon.worker.slot_assignment import SlotAssignment
from daemon.worker.structured import tokenizers
from statemachine import SlotState

NO_FREE_CELLS = 1  # llama_decode: no room in the KV cache for the batch (nothing was decoded)


@dataclass
class DecodeCounts:
    """The engine's decodes since its last report (llama-server's n_decode_total, n_busy_slots_per_decode,
    n_tokens_max, spec_decode_num_drafts_total)."""

    decodes: int = 0
    busy_slot_decodes: int = 0
    draft_rounds: int = 0
    tokens_max: int = 0


class Engine(PromptText, SlotAssignment, EmbeddingQueue):
    def __init__(self, runtime: Runtime, emit: Callable[[p.Message], None],
                 progressed: Callable[[], object] = lambda: None) -> None:
        """progressed: called where one long step has made progress (each image, or batch of text, of a
        prompt with images): the liveness step ends there (channel.Channel.step_progressed)."""
        self.rt = runtime
        self.emit = emit
        self.progressed = progressed
        self.ctx = runtime.ctx
        self.vocab = runtime.vocab
        tokenizers.attach(self.vocab, runtime.spec.model)  # structured output's, kept while the file is the same
        self.n_vocab = llama.llama_vocab_n_tokens(self.vocab)
        # llama.cpp caps a context's batch at its requested n_ctx (a 128-token context takes 128 at a time)
        # while the slot it gives is padded to 256: a prompt between the two, read in batch_size steps,
        # would abort the worker (GGML_ASSERT n_tokens_all <= n_batch). Read in steps the context takes.
        self.n_batch = min(runtime.spec.batch_size, llama.llama_n_batch(self.ctx))
        self.n_ctx_slot = llama.llama_n_ctx_seq(self.ctx)
        self.memory = llama.llama_get_memory(self.ctx)
        self.slots = [Slot(i) for i in range(runtime.spec.parallel)]
        model = runtime.model
        self.reuse = ReuseRule(self.n_batch, max(0, llama.llama_model_n_swa(model)),
                               chunked_window=runtime.meta("general.architecture") == "llama4",
                               recurrent=bool(llama.llama_model_is_recurrent(model) or llama.llama_model_is_hybrid(model)),
                               deterministic=runtime.spec.cache_deterministic)
        self.queue: deque[p.Submit] = deque()
        self.batch = llama.llama_batch_init(runtime.spec.step_capacity(), 0, 1)
        self.add_bos = bool(llama.llama_vocab_get_add_bos(self.vocab))
        self._piece = ctypes.create_string_buffer(256)
        self.chat = ChatRenderer(
            template_for(runtime.spec.chat_template, runtime.meta("tokenizer.chat_template"), runtime.meta("general.architecture")),
            bos_token=self.token_text(llama.llama_vocab_bos(self.vocab)),
            eos_token=self.token_text(llama.llama_vocab_eos(self.vocab)),
        )
        self._slots_changed = False
        self.counts = DecodeCounts()  # since the last SlotStates
        self._prompt_turn = 0  # the slot whose prompt chunk goes first in the next step
        self._draft_turn = 0  # ... and whose draft catch-up chunk (_draft_chunk)
        self._draft_went_last = False  # the last step's chunk was the draft's: the prompts' turn
        self.speculator = None
        if runtime.draft_ctx is not None:
            from daemon.worker.speculative import Speculator

            spec = runtime.spec
            self.speculator = Speculator(runtime.draft_ctx, runtime.draft_model, spec.parallel, spec.batch_size,
                                         spec.draft_max, spec.draft_min, spec.draft_p_min)
        self.end_of_turn = self._single_tokens(END_OF_TURN_MARKERS)
        self.eog_tokens = end_of_generation_tokens(self.vocab, self._single_tokens)  # what ignore_eos biases away
        self.saved = None  # the prompt cache's RAM and disk tiers (prompt_cache.py); None: both off
        self.restoring: list[tuple] = []  # (DiskRead, msg, tokens, sampler, slot): disk restores read off this thread
        if not runtime.spec.embeddings:
            from daemon.worker.prompt_cache import PromptCache

            cache = PromptCache(self.ctx, runtime.model, runtime.spec, self.reuse)
            self.saved = cache if cache.enabled else None
            cache.room_for = self._room_for_prompt
        self.embeddings_only = runtime.spec.embeddings
        self.embedding_work: deque[EmbeddingWork] = deque()
        self.n_embd = llama.llama_model_n_embd(runtime.model)
        self.media = None
        if runtime.mmproj is not None:
            from daemon.worker.multimodal import MediaPrompts

            self.media = MediaPrompts(runtime.mmproj)

    # -- requests in --------------------------------------------------------

    def submit(self, msg: p.Submit) -> None:
        self.queue.append(msg)

    def cancel(self, request_id: str) -> None:
        for work in self.embedding_work:
            if work.msg.request_id == request_id:
                self.embedding_work.remove(work)
                self.emit(p.Answer(request_id, error="cancelled", error_code="cancelled"))
                return
        for i, msg in enumerate(self.queue):
            if msg.request_id == request_id:
                del self.queue[i]
                self.emit(p.Done(request_id, "cancelled"))
                return
        for slot in self.slots:
            if slot.job is not None and slot.job.request_id == request_id:
                self._finish(slot, "cancelled")
                return
        self._cancel_restoring(request_id)

    def query(self, msg: p.Query) -> None:
        """One-step work, answered at once (between decode steps); embeddings
        are queued and computed one input per step."""
        if msg.kind in ("embed", "rerank"):
            self._queue_embeddings(msg)
            return
        try:
            answer = self._answer(msg)
        except RequestError as exc:
            answer = p.Answer(msg.request_id, error=str(exc), error_code=exc.code or "invalid_request")
        except Exception as exc:  # noqa: BLE001 - a bug in one query fails that query only
            answer = p.Answer(msg.request_id, error=f"internal error: {exc!r}", error_code="internal_error")
        self.emit(answer)

    def _answer(self, msg: p.Query) -> p.Answer:
        n_ctx = llama.llama_n_ctx(self.ctx)
        if msg.kind == "tokenize":
            tokens = self.prompt_tokens_within(msg.text, n_ctx, msg.add_special, what="text")
            pieces = [self.token_bytes(t, special=True) for t in tokens] if msg.with_pieces else []
            return p.Answer(msg.request_id, tokens=tokens, pieces=pieces)
        if msg.kind == "detokenize":
            self._check_vocab(msg.tokens)
            data = b"".join(self.token_bytes(t, special=True) for t in msg.tokens)
            return p.Answer(msg.request_id, text=data.decode("utf-8", errors="replace"))
        if msg.kind in ("apply_template", "render_chat"):  # render_chat: a chat request's own prompt (__verbose)
            text, images = self.chat_prompt(msg)
            if images and msg.kind == "apply_template":
                raise RequestError("/apply-template renders text only: the messages have images")
            return p.Answer(msg.request_id, text=text)
        if msg.kind in ("slot_save", "slot_restore", "slot_erase"):  # POST /slots/{id} (llama-server's)
            from daemon.worker.prompt_cache_slots import slot_action

            return slot_action(self, msg)
        if msg.kind == "prompt_cache_shrink":  # the fleet, before it evicts a model: tokens = [RAM tier budget]
            if len(msg.tokens) != 1 or msg.tokens[0] < 0:
                raise RequestError("prompt_cache_shrink takes one budget in bytes")
            held = self.saved.shrink(msg.tokens[0]) if self.saved is not None else 0
            return p.Answer(msg.request_id, tokens=[held])
        if msg.kind == "count_chat":  # the prompt tokens a chat request with these messages and tools reads
            text, images = self.chat_prompt(msg)
            if images:
                return p.Answer(msg.request_id, prompt_tokens=self.media.count(text, images))
            return p.Answer(msg.request_id, prompt_tokens=len(self.prompt_tokens_within(text, self.n_ctx_slot)))
        raise RequestError(f"unknown query kind {msg.kind!r}")

    @property
    def busy(self) -> bool:
        return bool(self.queue) or bool(self.embedding_work) or bool(self.restoring) \
            or any(s.job is not None for s in self.slots)

    # -- one step -------------------------------------------------------------

    def step(self) -> None:
        """One decode for the next token of every generating slot, then one
        decode per prompt chunk.

        Why not one batch for everything: llama.cpp's CPU matmul kernels
        change with the number of tokens in a batch (above 4 they take another
        path, and logits move by up to ~1.0 for Gemma 3), so a prompt decoded
        beside other slots' prompts would give other greedy output than alone.
        A prompt chunk is decoded by itself, its size fixed by batch_size, so
        what a slot computes does not depend on its neighbours; the generating
        slots still share one decode (that is where batching pays).
        """
        if self.embedding_work:  # an embeddings model: generation is refused, so nothing else waits
            self._embed_next()
        self._admit()
        generating = [s for s in self.slots if s.state is SlotState.GENERATING and s.job.next_token is not None]
        if generating and self.speculator is not None:
            for slot in generating:
                if slot.job is not None:  # a full shared pool may have ended it for another's verify (_make_room)
                    self._speculate(slot)
        elif generating:
            entries = []
            for slot in generating:
                entries.append((slot, slot.job.next_token, True))
                slot.job.next_token = None
            self._decode(entries)
        for slot in self.slots:
            if slot.state is SlotState.STARTED:
                slot.move(SlotState.PROCESSING_PROMPT)
                self._slots_changed = True
                self._progress(slot.job)  # the read begins: what the cache held is all there is yet
        prompting = [s for s in self.slots if s.state is SlotState.PROCESSING_PROMPT]
        if self.speculator is not None and self._draft_chunk(bool(prompting)):
            prompting = []  # this step's one chunk was the draft's (it and the prompts take turns)
        if prompting:
            # One prompt chunk per step, the slots taking turns: a step stays one
            # chunk long whatever the number of prompts, so the generating slots
            # keep their pace and the worker answers the daemon's pings in time.
            slot = min(prompting, key=lambda s: (s.id - self._prompt_turn) % len(self.slots))
            self._prompt_turn = slot.id + 1
            job = slot.job
            end = min(len(job.prompt), job.n_prompt_done + self.n_batch)
            at_end = self.reuse.prompt_end_checkpoint(len(job.prompt)) if self.saved is not None else 0
            if job.n_prompt_done < at_end < end and at_end >= self.saved.min_tokens:
                end = at_end  # a recurrent state's checkpoint before the last token, which is read alone
            entries = [(slot, job.prompt[i], i == len(job.prompt) - 1) for i in range(job.n_prompt_done, end)]
            job.n_prompt_done = end
            # Before the decode: its last logits may fork n choices, which copy `exact`; a failed decode zeroes it.
            slot.exact = self.reuse.exact_after_read(job.n_cached, job.exact_from, end)
            if self._decode(entries, decoded=lambda: self._progress(job)) and self.saved is not None \
                    and self.reuse.checkpoints and len(slot.cache) == end >= self.saved.min_tokens:
                last = slot.checkpoints[-1].n if slot.checkpoints else 0
                every = self.rt.spec.cache_checkpoint_every
                if end == at_end or every > 0 and end - last >= every:
                    self._checkpoint(slot)  # a prompt's end (a regenerate comes back here), or every N tokens
        self.report_slots()

    def _progress(self, job: Job) -> None:
        if job.progress:
            self.emit(p.PromptProgress(job.request_id, total=len(job.prompt), cache=job.n_cached,
                                       processed=job.n_prompt_done, seconds=time.perf_counter() - job.started))

    def _speculate(self, slot: Slot) -> None:
        """Draft, then verify the next token and the drafts with the target."""
        job = slot.job
        room = min(job.params.max_tokens - job.n_generated, self.n_ctx_slot - len(slot.cache) - 2) - 1
        drafts = self.speculator.propose(slot, slot.cache + [job.next_token], room)
        if self.rt.spec.kv_unified:  # drafts go before any request: verify only what the shared pool has room for
            drafts = drafts[:max(0, self._free_cells() - 1)]
        job.n_drafted += len(drafts)
        self.counts.draft_rounds += bool(drafts)
        tokens = [job.next_token, *drafts]
        job.next_token = None
        i = 0
        while i < len(tokens):
            group = tokens[i:i + VERIFY_GROUP]
            first_pos = len(slot.cache)
            if not self._decode([(slot, t, True) for t in group], handle_logits=False):
                return
            for j in range(len(group)):
                token = self._on_logits(slot, j)
                if slot.job is None:
                    return  # finished (stop, length, end of generation)
                following = i + j + 1
                if following < len(tokens) and token == tokens[following]:
                    job.n_accepted += 1
                    job.next_token = None  # the draft already holds it: decoded in this group or the next
                    continue
                rejected_from = first_pos + j + 1
                if rejected_from < len(slot.cache):
                    llama.llama_memory_seq_rm(self.memory, slot.id, rejected_from, -1)
                    slot.truncate(rejected_from)
                return
            i += len(group)

    def _draft_chunk(self, prompts_wait: bool) -> bool:
        """The draft's catch-up: one chunk of one lagging slot's history (speculative.py), in
        turn with the prompt chunks when both wait, so no step reads more than one chunk.
        Until its draft is within a chunk, a slot generates without drafts. True if it read."""
        sp = self.speculator
        lagging = [s for s in self.slots if s.job is not None and sp.lags(s, s.cache)]
        if not lagging or (prompts_wait and self._draft_went_last):
            self._draft_went_last = False
            return False
        slot = min(lagging, key=lambda s: (s.id - self._draft_turn) % len(self.slots))
        self._draft_turn = slot.id + 1
        self._draft_went_last = sp.catch_up(slot, slot.cache) > 0
        return self._draft_went_last

    def _decode(self, entries: list[tuple[Slot, int, bool]], handle_logits: bool = True,
                decoded: Callable[[], None] | None = None) -> bool:
        """Decode (slot, token, wants logits) entries as one batch and handle the logits; `decoded`
        runs between the two (a prompt's progress goes out before the token its last chunk gives)."""
        outputs = self._fill_batch(entries)
        self.counts.decodes += 1
        self.counts.busy_slot_decodes += sum(1 for slot in self.slots if slot.job is not None)
        self.counts.tokens_max = max(self.counts.tokens_max, max(len(slot.cache) for slot, _, _ in entries))
        rc = llama.llama_decode(self.ctx, self.batch)
        while rc == NO_FREE_CELLS and self.rt.spec.kv_unified:
            # The shared pool is full. llama.cpp changed nothing (it places a whole batch before it
            # decodes any of it): take the tokens back, make room, and try again with what is left.
            for slot, _, _ in reversed(entries):
                slot.cache.pop()
            entries = self._make_room(entries)
            if not entries:
                return False
            outputs = self._fill_batch(entries)
            rc = llama.llama_decode(self.ctx, self.batch)
        if rc != 0:
            self._decode_failed(rc, {slot for slot, _, _ in entries})
            return False
        if decoded is not None:
            decoded()
        if handle_logits:
            for slot, index, job in outputs:
                if slot.job is job:  # not ended meanwhile by another choice of its request failing
                    self._on_logits(slot, index)
        return True

    def _fill_batch(self, entries: list[tuple[Slot, int, bool]]) -> list[tuple[Slot, int, Job]]:
        """The entries into the batch, each token onto its slot's cache; the (slot, index, job) of each output."""
        batch = self.batch
        outputs: list[tuple[Slot, int, Job]] = []
        for n, (slot, token, logits) in enumerate(entries):
            batch.token[n] = token
            batch.pos[n] = len(slot.cache)
            batch.n_seq_id[n] = 1
            batch.seq_id[n][0] = slot.id
            batch.logits[n] = logits
            slot.cache.append(token)
            if logits:
                outputs.append((slot, n, slot.job))
        batch.n_tokens = len(entries)
        return outputs

    def _make_room(self, entries: list[tuple[Slot, int, bool]]) -> list[tuple[Slot, int, bool]]:
        """Free cells of the shared KV pool (kv_unified) for a batch that found none; the entries still to
        decode. First an idle slot's prompt leaves the pool, least recently used first (into the prompt
        cache's RAM or disk tier, so its conversation is not lost); with none left, the request that started last
        ends (context_full: the least work lost, and the requests before it go on); its cells are freed."""
        idle = self._idle_holding()
        if idle:
            self._evict(idle[0])
            return entries
        busy = [s for s in self.slots if s.job is not None]
        if not busy:
            return []  # nothing holds the pool and the batch still does not fit: cannot happen below n_ctx
        last = max(busy, key=lambda s: s.job.started)
        group = last.job.group
        if group is not None and not group.reserved and all(s.job.group is group for s in busy):
            # One request's n choices fill the pool between them: its longest choice is cut, as a slot of
            # its own would have been cut at its end (a retry would only fill it again).
            ended = max(busy, key=lambda s: len(s.cache))
            self._finish(ended, "length")
        else:
            ended = last
            self._finish(last, "error", code="context_full",
                         error=f"context size has been exceeded: the slots share one KV pool of {self.n_ctx_slot} "
                               "tokens (kv_unified) and it is full; this request started last, so it ended to let "
                               "the others finish. Retry, or raise ctx_size")
        self._empty(ended)
        return [entry for entry in entries if entry[0].job is not None]  # an ended choice's siblings go too

    def _idle_holding(self, besides: Slot | None = None) -> list[Slot]:
        """Idle slots whose prompt is in the pool, least recently used first: none waiting for a disk read
        into it; one waiting for a fork of n choices holds an old prompt that the fork replaces anyway."""
        idle = [s for s in self.slots if s is not besides and s.job is None and s.cache
                and (s.reserved_for is None or isinstance(s.reserved_for, Choices))]
        return sorted(idle, key=lambda s: s.last_used)

    def _free_cells(self, besides: Slot | None = None) -> int:
        """The shared pool's cells no slot holds (but `besides`), counted by positions: cells n choices
        share count twice, which errs towards making room."""
        return self.n_ctx_slot - sum(len(s.cache) for s in self.slots if s is not besides)

    def _room_for_prompt(self, slot: Slot, n_tokens: int) -> bool:
        """kv_unified: before a prompt (or a restored state) of n_tokens takes `slot`, idle slots' prompts
        leave the shared pool until it fits; whether it does (busy slots may hold the rest: a decode that
        finds no cells makes room itself, _make_room). Split slots: always, the slot's own share."""
        if not self.rt.spec.kv_unified:
            return True
        for other in self._idle_holding(besides=slot):
            if self._free_cells(besides=slot) >= n_tokens:
                break
            self._evict(other)
        return self._free_cells(besides=slot) >= n_tokens

    def _evict(self, slot: Slot) -> None:
        """An idle slot's prompt out of the shared pool, kept in the prompt cache's RAM or disk tier when on."""
        if self.saved is not None:
            self.saved.stash(slot, 0)
        self._empty(slot)

    def _empty(self, slot: Slot) -> None:
        llama.llama_memory_seq_rm(self.memory, slot.id, -1, -1)
        slot.truncate(0)
        self._slots_changed = True
        if self.speculator is not None:
            self.speculator.forget(slot)

    def _decode_failed(self, rc: int, slots: set[Slot]) -> None:
        # The batch failed: the slots in it lose their cache and their request.
        for slot in slots:
            llama.llama_memory_seq_rm(self.memory, slot.id, -1, -1)
            slot.truncate(0)
            if slot.job is not None:
                self._finish(slot, "error", error=f"llama_decode failed ({rc})", code="decode_failed")

    def _on_logits(self, slot: Slot, index: int) -> int | None:
        """Sample at batch index, send the text; the token, or None if the request finished."""
        job = slot.job
        if slot.state is SlotState.PROCESSING_PROMPT:
            slot.move(SlotState.GENERATING)
            self._slots_changed = True
            if job.params.max_tokens <= 0 and job.group is None:  # the prompt read into the cache, nothing to predict
                self._finish(slot, "length")
                return None
            if job.group is not None and job.group.reserved:
                self._fork_choices(slot, index)
                if slot.job is not job:
                    return None  # a choice failed at its first token, which ended the request
        try:
            token = job.sampler.sample(self.ctx, index)
        except RequestError as exc:  # a grammar that allows nothing here: this request ends, no other
            self._finish(slot, "error", error=str(exc), code=exc.code)
            return None
        now = time.perf_counter()
        if job.first_token_at is None:
            job.first_token_at = now
        job.n_generated += 1
        end = llama.llama_vocab_is_eog(self.vocab, token) or token in job.end_tokens
        # ignore_eos: the sampler never draws an end-of-generation token, but under a grammar, which alone
        # says when the answer is whole (and then allows nothing else), the end it allows is the end.
        if end and (not job.params.ignore_eos or job.params.grammar is not None):
            job.n_generated -= 1  # the end-of-generation token is not part of the answer
            self._finish(slot, "stop")
            return None
        piece = self.token_bytes(token)
        if job.sampler.last_logprobs is not None:
            chosen, top = job.sampler.last_logprobs
            job.logprobs.append(p.TokenLogprob(token, piece, chosen,
                                               [p.TopLogprob(t, self.token_bytes(t), lp) for t, lp in top]))
        text = job.stops.feed(job.utf8.feed(piece))
        if text or job.n_generated == 1:
            first = job.n_generated == 1
            self.emit(
                p.Tokens(
                    job.request_id,
                    text,
                    job.n_generated,
                    n_prompt_tokens=len(job.prompt) if first else 0,
                    n_cached_tokens=job.n_cached if first else 0,
                    logprobs=self._take_logprobs(job),
                    index=job.index,
                    prompt_seconds=job.first_token_at - job.started,
                    generation_seconds=now - job.first_token_at,
                )
            )
        if job.stops.stopped:
            self._finish(slot, "stop")
        elif job.n_generated >= job.params.max_tokens:
            self._finish(slot, "length")
        elif len(slot.cache) + 1 >= self.n_ctx_slot:
            self._finish(slot, "length")  # the slot's context is full
        else:
            job.next_token = token
            return token
        return None

    @staticmethod
    def _take_logprobs(job: Job) -> list[p.TokenLogprob]:
        taken, job.logprobs = job.logprobs, []
        return taken

    def _finish(self, slot: Slot, reason: str, error: str | None = None, code: str | None = None) -> None:
        job = slot.job
        group = job.group
        if reason in ("stop", "length"):
            tail = job.stops.feed(job.utf8.flush()) + job.stops.flush()
            if tail or job.logprobs or group is not None:  # with n > 1 a choice's end is its own Tokens
                first = job.first_token_at or job.started
                self.emit(p.Tokens(job.request_id, tail, job.n_generated, logprobs=self._take_logprobs(job),
                                   index=job.index, finish_reason=reason if group is not None else None,
                                   prompt_seconds=first - job.started,
                                   generation_seconds=time.perf_counter() - first))
        job.sampler.free()  # a sampled token that was never decoded is simply not in the cache
        slot.job = None
        slot.move(SlotState.IDLE)
        self._slots_changed = True
        if group is None:
            self._done(job, reason, job.n_generated, error, code)
            return
        group.open -= 1
        group.completion_tokens += job.n_generated
        if reason in ("stop", "length") and group.open > 0:
            return  # the other choices go on
        if not group.ended:
            group.ended = True
            if reason not in ("stop", "length"):  # one choice failed or was cancelled: the request ends
                self._end_choices(group)
            self._done(group.first, reason, group.completion_tokens, error, code)

    def _end_choices(self, group: Choices) -> None:
        """Free every slot still working or waiting for this request, without a word (its Done follows)."""
        for other in self.slots:
            if other.reserved_for is group:
                other.reserved_for = None
            if other.job is not None and other.job.group is group:
                other.job.sampler.free()
                other.job = None
                other.move(SlotState.IDLE)
        group.reserved = []
        self._slots_changed = True

    def _done(self, job: Job, reason: str, completion_tokens: int, error: str | None, code: str | None) -> None:
        self.report_slots()  # before the Done: whoever hears that the request ended finds its slot idle
        now = time.perf_counter()
        first = job.first_token_at or now
        self.emit(
            p.Done(
                job.request_id,
                reason,
                prompt_tokens=len(job.prompt),
                completion_tokens=completion_tokens,
                cached_tokens=job.n_cached,
                error=error,
                error_code=code,
                prompt_seconds=first - job.started,
                generation_seconds=now - first,
                drafted_tokens=job.n_drafted,
                accepted_tokens=job.n_accepted,
                restored_tokens=job.restored_tokens,
                restore_seconds=job.restore_seconds,
                kv_lookup=job.kv_lookup,
                kv_rejected=job.kv_rejected,
                cache_tier=job.cache_tier,
                stopping_word=job.stops.matched,
                prompt_cache=self.saved.summary() if self.saved is not None else {},
            )
        )

    def report_slots(self) -> None:
        """The slots' states when they changed, with the decode counts since the last report (a request's
        end changes its slot: its counts are reported before its Done)."""
        if not self._slots_changed:
            return
        self._slots_changed = False
        counts, self.counts = self.counts, DecodeCounts()
        self.emit(
            p.SlotStates(
                [
                    p.SlotInfo(s.id, str(s.state), s.job.request_id if s.job else None, len(s.cache))
                    for s in self.slots
                ],
                decodes=counts.decodes, busy_slot_decodes=counts.busy_slot_decodes,
                draft_rounds=counts.draft_rounds, tokens_max=counts.tokens_max,
            )
        )

    def close(self) -> None:
        for slot in self.slots:
            if slot.job is not None:
                self._finish(slot, "cancelled")
        for msg in self.queue:
            self.emit(p.Done(msg.request_id, "cancelled"))
        self.queue.clear()
        self._cancel_restoring()
        for work in self.embedding_work:
            self.emit(p.Answer(work.msg.request_id, error="cancelled", error_code="cancelled"))
        self.embedding_work.clear()
        tokenizers.detach()  # a tokenizer build reading the vocabulary stops before it can be freed
        llama.llama_batch_free(self.batch)
        if self.speculator is not None:
            self.speculator.close()
