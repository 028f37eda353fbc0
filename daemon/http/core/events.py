"""What a running job says, as typed events every dialect reads: the worker's
items (p.Tokens ... then p.Done, or a failure) read per choice into Start,
ReasoningDelta, TextDelta, ToolCallDelta and End, or a Failure. A dialect
shapes these into its answer; none reads the worker's items itself.

One ChoiceReader per choice does the reading that is the same in every
dialect: thinking split from the answer as it streams (when the dialect
reads it apart), text held back while it may be a tool call (the model's own
format) or a forced call's arguments streamed as they are generated, and at
the end the calls read from the whole answer. A step's log-probabilities ride
on the first event that step produced (a TextDelta with no text carries them
when it produced nothing else), so each dialect decides which of its chunks
they go out with.

Also here, the figures more than one dialect reports the same way: a token's
text (piece_text), token log-probabilities as {token, logprob, bytes,
top_logprobs} (token_logprobs), and llama.cpp's timings block (timings).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from daemon import protocol as p
from daemon.http.core.job import ToolMode
from daemon.http.core.run import failure_error, is_failure
from daemon.http.errors import ApiError
from daemon.model.jobs import Job, JobFailure
from daemon.tools.forced_stream import ForcedCallStream
from daemon.tools.parse import ParsedCall, ToolCallStream, new_call_id
from daemon.tools.reasoning import ReasoningStream

Logprobs = tuple[p.TokenLogprob, ...]


# -- the events ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Start:
    """A choice's first step: the prompt's counts (on the request's first Tokens) and
    whether the prompt left a thinking block open."""

    index: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    reasoning_open: bool = False


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    index: int
    text: str
    logprobs: Logprobs = ()


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Answer text safe to send now (never call markup); text "" only to carry logprobs."""

    index: int
    text: str
    logprobs: Logprobs = ()


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A forced call's progress as it is generated: one `tool_calls` delta list
    ({"index", "id", "type", "function": {"name", "arguments"}} for its start,
    {"index", "function": {"arguments"}} for a piece of its arguments)."""

    index: int
    deltas: list[dict[str, Any]]
    logprobs: Logprobs = ()


@dataclass(frozen=True, slots=True)
class End:
    """A choice's end. reason: stop, length or tool_calls (calls read, not cut
    short). rest: answer text held back to the end while it might have been a
    call (it was not; it goes out before the calls). calls: every call the
    answer holds, the first `announced` of them already streamed as
    ToolCallDelta. done: the request's end (counts and timings), None for a
    choice that ended before the others (n > 1)."""

    index: int
    reason: str
    done: p.Done | None
    rest: str = ""
    calls: tuple[ParsedCall, ...] = ()
    announced: int = 0


@dataclass(frozen=True, slots=True)
class Failure:
    """Generation failed after it began: the worker's item, and the ApiError it is."""

    item: JobFailure | p.Done

    @property
    def error(self) -> ApiError:
        return failure_error(self.item)


@dataclass(frozen=True, slots=True)
class Progress:
    """How far the prompt has been read (llama-server's return_progress), before the first token: sent as the
    read begins (processed == cache) and after each chunk (the last: processed == total)."""

    index: int  # 0: the prompt is read once for every choice
    total: int
    cache: int
    processed: int
    seconds: float  # since the request took its slot

    def prompt_progress(self) -> dict[str, int]:
        return {"total": self.total, "cache": self.cache, "processed": self.processed,
                "time_ms": round(self.seconds * 1000)}

    def timings(self) -> dict[str, Any]:
        """llama.cpp's timings block so far: nothing read yet is no time spent reading."""
        read = self.processed > self.cache
        return timings(p.Done("", "", prompt_tokens=self.processed, cached_tokens=self.cache,
                              prompt_seconds=self.seconds if read else 0.0))


Event = Start | ReasoningDelta | TextDelta | ToolCallDelta | End | Failure | Progress


# -- the reader -----------------------------------------------------------------------------------

class ChoiceReader:
    """One choice's Tokens to events. tools: the answer may hold calls (None:
    all of it is text). reasoning: thinking is read apart as it streams.
    call_id: the ids of streamed forced calls. most_calls: how many calls a
    forced answer streams at most when parallel calls are allowed (one when not)."""

    def __init__(self, index: int = 0, tools: ToolMode | None = None, reasoning: bool = False,
                 call_id: Callable[[], str] = new_call_id, most_calls: int | None = None) -> None:
        self.index = index
        self.tools = tools
        self.reads_reasoning = reasoning
        self.reasoning: ReasoningStream | None = None  # made at the first Tokens (it says if thinking is open)
        forced = tools is not None and tools.forced
        self.scan = ToolCallStream(tools.names) if tools is not None and not forced else None
        most = most_calls if tools is not None and tools.parallel else 1
        self.forced = ForcedCallStream(tools.names, call_id, most=most) if forced else None
        self.answer: list[str] = []  # the text after its thinking, read whole at the end for its calls
        self.prompt_tokens = self.cached_tokens = 0  # from its first Tokens
        self.latest: p.Tokens | None = None  # its last Tokens: the worker's clock so far (timings_so_far)
        self.started = False
        self.finished = False
        self.reason: str | None = None  # from its last Tokens (n > 1)

    def feed(self, tokens: p.Tokens) -> list[Event]:
        out: list[Event] = []
        self.latest = tokens
        if not self.started:
            self.started = True
            self.prompt_tokens, self.cached_tokens = tokens.n_prompt_tokens, tokens.n_cached_tokens
            out.append(Start(self.index, tokens.n_prompt_tokens, tokens.n_cached_tokens, tokens.reasoning_open))
        text = tokens.text
        if self.reads_reasoning:
            if self.reasoning is None:
                self.reasoning = ReasoningStream(tokens.reasoning_open)
            thinking, text = self.reasoning.feed(text)
            if thinking:
                out.append(ReasoningDelta(self.index, thinking))
        out += self._content(text)
        if tokens.logprobs:  # they ride on the step's first delta
            logprobs = tuple(tokens.logprobs)
            first = next((i for i, event in enumerate(out) if not isinstance(event, Start)), None)
            if first is None:
                out.append(TextDelta(self.index, "", logprobs))
            else:
                out[first] = replace(out[first], logprobs=logprobs)
        return out

    def timings_so_far(self) -> dict[str, Any] | None:
        """llama.cpp's timings block as this choice stands (llama-server's timings_per_token); None before
        its first token."""
        t = self.latest
        if t is None:
            return None
        return timings(p.Done("", "", prompt_tokens=self.prompt_tokens, completion_tokens=t.n_tokens,
                              cached_tokens=self.cached_tokens, prompt_seconds=t.prompt_seconds,
                              generation_seconds=t.generation_seconds))

    def _content(self, text: str) -> list[Event]:
        if not text:
            return []
        if self.tools is None:
            return [TextDelta(self.index, text)]
        self.answer.append(text)
        if self.forced is not None:
            return [ToolCallDelta(self.index, deltas) for deltas in self.forced.feed(text)]
        said = self.scan.feed(text)
        return [TextDelta(self.index, said)] if said else []

    def finish(self, reason: str, done: p.Done | None) -> list[Event]:
        """What was held back, then the End; reason: the worker's for this choice."""
        self.finished = True
        out: list[Event] = []
        if self.reasoning is not None:
            thinking, text = self.reasoning.finish()
            if thinking:
                out.append(ReasoningDelta(self.index, thinking))
            out += self._content(text)
        calls: list[ParsedCall] = []
        rest = ""
        if self.tools is not None:
            content, calls, reason = self.tools.calls("".join(self.answer), reason)
            if self.scan is not None:
                held, _ = self.scan.finish()  # what it held back; the calls are read from the whole text
                rest = held if content is not None else ""  # None: what it held back was the calls
        announced = self.forced.announced if self.forced is not None else 0
        out.append(End(self.index, reason, done, rest, tuple(calls), announced))
        return out


async def read_events(job: Job, item, readers: list[ChoiceReader]) -> AsyncIterator[Event]:
    """The job's events from its first item on (not a failure: that one is
    refused before an answer begins), one reader per choice. With n > 1 each
    choice ends at its last Tokens but the last one, which ends with the Done."""
    while isinstance(item, (p.Tokens, p.PromptProgress)):
        if isinstance(item, p.PromptProgress):  # only a stream that asked for it (return_progress) gets these
            yield Progress(0, item.total, item.cache, item.processed, item.seconds)
            item = await job.next(None)
            continue
        reader = readers[item.index]
        for event in reader.feed(item):
            yield event
        if item.finish_reason is not None:
            reader.reason = item.finish_reason
            if sum(not r.finished for r in readers) > 1:
                for event in reader.finish(item.finish_reason, None):
                    yield event
        item = await job.next(None)
    if is_failure(item):
        yield Failure(item)
        return
    for reader in readers:
        if not reader.finished:
            for event in reader.finish(reader.reason or item.finish_reason, item):
                yield event


# -- a whole answer -------------------------------------------------------------------------------

@dataclass
class WholeChoice:
    """One choice gathered for a whole body: its text as generated (thinking and
    calls left in: the dialect reads them out of the whole), its logprobs, its end."""

    text: str = ""
    logprobs: list[p.TokenLogprob] = field(default_factory=list)
    reasoning_open: bool = False
    reason: str = ""


@dataclass
class Whole:
    choices: list[WholeChoice]
    done: p.Done | None = None
    failure: Failure | None = None


def gather(events: Iterable[Event], n: int = 1) -> Whole:
    """Events read with plain readers (no tools, no reasoning) into a Whole."""
    whole = Whole([WholeChoice() for _ in range(n)])
    parts: list[list[str]] = [[] for _ in range(n)]
    for event in events:
        if isinstance(event, Failure):
            whole.failure = event
            continue
        choice = whole.choices[event.index]
        if isinstance(event, Start):
            choice.reasoning_open = event.reasoning_open
        elif isinstance(event, TextDelta):
            parts[event.index].append(event.text)
            choice.logprobs.extend(event.logprobs)
        elif isinstance(event, End):
            choice.reason = event.reason
            if event.done is not None:
                whole.done = event.done
    for choice, texts in zip(whole.choices, parts):
        choice.text = "".join(texts)
    return whole


async def whole_answer(job: Job, item, n: int = 1) -> Whole:
    return gather([event async for event in read_events(job, item, [ChoiceReader(i) for i in range(n)])], n)


async def whole_or_error(job: Job, item, n: int = 1) -> Whole:
    """The whole answer, or the ApiError of a job that failed midway (a dialect with its own error shape
    reads whole_answer's failure itself)."""
    whole = await whole_answer(job, item, n)
    if whole.failure is not None:
        raise whole.failure.error
    return whole


# -- figures more than one dialect reports alike -------------------------------------------------

def piece_text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


def token_logprobs(entries: Iterable[p.TokenLogprob]) -> list[dict]:
    """Each token as {token, logprob, bytes, top_logprobs} (its alternatives alike)."""
    return [{"token": piece_text(e.piece), "logprob": e.logprob, "bytes": list(e.piece),
             "top_logprobs": [{"token": piece_text(t.piece), "logprob": t.logprob, "bytes": list(t.piece)}
                              for t in e.top]} for e in entries]


def timings(done: p.Done) -> dict[str, Any]:
    """llama.cpp's timings block. prompt_n counts the tokens read (not the
    ones the prompt cache held); the prompt time runs to the first token.
    The first token comes from the prompt's last batch and costs no decode
    step of its own, so the generation rates are over the n - 1 tokens after
    it (as llama-server's). The rates are computed from the reported,
    rounded milliseconds, so that a client recomputing them gets the same."""
    prompt_n = max(done.prompt_tokens - done.cached_tokens, 0)
    prompt_ms = round(done.prompt_seconds * 1000, 3)
    predicted_n = done.completion_tokens
    predicted_ms = round(done.generation_seconds * 1000, 3)
    steps = max(predicted_n - 1, 0)
    out = {
        "cache_n": done.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1e3 / prompt_ms * prompt_n if prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / steps if steps else 0.0,
        "predicted_per_second": 1e3 / predicted_ms * steps if steps and predicted_ms > 0 else 0.0,
    }
    if done.cache_tier:  # where cache_n came from: slot, ram or disk (the prompt cache's tiers)
        out["cache_tier"] = done.cache_tier
    if done.drafted_tokens > 0:  # only when a draft model proposed tokens
        out["draft_n"] = done.drafted_tokens
        out["draft_n_accepted"] = done.accepted_tokens
    return out
