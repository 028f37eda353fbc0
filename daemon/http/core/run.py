"""A job while it runs, for every dialect: its first item awaited within the
wake bounds, a failure turned into the ApiError it is, the request's one log
line and metrics however it ends, and the event stream opened only once there
is something to send; a query's one Answer (run_query). Knows no dialect."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import structlog
from aiohttp import web

from daemon import protocol as p
from daemon.fleet.owner import FleetModel
from daemon.http.errors import ApiError
from daemon.http.keys import JOB, LOG, LOGGED, SETTINGS, no_room
from daemon.model.jobs import Job, JobFailure


# Worker error codes that are the request's fault.
CLIENT_ERRORS = ("context_length_exceeded", "invalid_request", "invalid_grammar", "embeddings_not_enabled")


# The worker's overflow messages (slot_assignment.py, prompt_text.py): "prompt has N tokens; ..." or, when it
# stopped counting early (a text far longer than the context), "has more than N tokens".
_OVERFLOW = re.compile(r"has (more than )?(\d+) tokens; the context of a slot holds (\d+)")


def overflow_counts(message: str | None) -> tuple[int, int, bool] | None:
    """(prompt tokens, slot context, whether the count is only a lower bound) from a worker's overflow message."""
    found = _OVERFLOW.search(message or "")
    if not found:
        return None
    counted = int(found.group(2))
    return (counted + 1 if found.group(1) else counted), int(found.group(3)), bool(found.group(1))


def failure_error(item: JobFailure | p.Done) -> ApiError:
    if isinstance(item, JobFailure):
        return ApiError(item.status, item.message, item.code, retry_after=item.retry_after)
    if item.finish_reason == "cancelled":
        return ApiError(503, "request cancelled: the server is shutting down", "cancelled", retry_after=1)
    if item.error_code == "context_full":  # the shared KV pool (kv_unified) frees as the other requests end
        return ApiError(503, item.error or "the shared KV pool is full", item.error_code, retry_after=1)
    status = 400 if item.error_code in CLIENT_ERRORS else 500
    error = ApiError(status, item.error or "generation failed", item.error_code)
    counts = overflow_counts(item.error) if item.error_code == "context_length_exceeded" else None
    if counts is not None:  # llama-server's type and counts (its clients trim the prompt by them); `code` stays
        error.details = {"type": "exceed_context_size_error", "n_prompt_tokens": counts[0], "n_ctx": counts[1]}
    return error


def is_failure(item) -> bool:
    return isinstance(item, JobFailure) or (isinstance(item, p.Done) and item.finish_reason not in ("stop", "length"))


async def first_item(request: web.Request, model: FleetModel, job: Job):
    settings = request.app[SETTINGS]
    max_wait = getattr(job, "max_wait", None) if job.cold else None  # X-Dormouse-Max-Wait: a wake's wait only
    try:
        return await job.next(settings.wake_timeout if max_wait is None else min(max_wait, settings.wake_timeout))
    except TimeoutError:
        refused = no_room(request, model, since=job.accepted_at)
        if refused is not None:  # the wake never started: the fleet had no room for it
            raise refused from None
        raise ApiError(503, f"the model did not become ready within {settings.wake_timeout:g}s (wake_timeout)",
                       "wake_timeout", retry_after=5) from None


@asynccontextmanager
async def tracked(request: web.Request, model: FleetModel, job: Job, stream: bool = False) -> AsyncIterator[None]:
    """While a job's request is answered: its id on every log line. However it
    ends, the job is let go (a no-op once finished; frees its slot if the
    client left) and the request gets its one log line and its metrics."""
    structlog.contextvars.bind_contextvars(request_id=job.id)
    if not request.app[SETTINGS].report_cached_tokens:
        _without_cache_counts(job)
    request[LOGGED] = True  # the line below, with the job's timings
    request[JOB] = job  # the cold-start headers (daemon/http/cold_start.py)
    status, code = 200, None
    try:
        yield
    except ApiError as exc:
        status, code = exc.status, exc.code
        raise
    finally:
        model.controller.abandon(job)
        metrics = model.controller.metrics
        request.app[LOG].info("request", endpoint=job.endpoint, model=model.id, status=status, code=code, stream=stream,
                              cold=job.cold, seconds=round(time.monotonic() - job.accepted_at, 4),
                              finished=job.finished)
        metrics.requests.labels(endpoint=job.endpoint, status=str(status)).inc()
        metrics.request_seconds.labels(endpoint=job.endpoint, outcome="ok" if status == 200 else "error").observe(
            time.monotonic() - job.accepted_at)
        structlog.contextvars.unbind_contextvars("request_id")


def _without_cache_counts(job: Job) -> None:
    """report_cached_tokens = false: every item this request's answer is written from says the
    prompt cache held nothing (cached_tokens, cache_n, tokens_cached, cache_read_input_tokens read 0),
    whatever dialect writes it; the worker's own accounting (metrics) is untouched."""
    if getattr(job, "_counts_hidden", False):
        return
    receive = job.next

    async def next_item(wake_limit: float | None):
        item = await receive(wake_limit)
        # A prompt's progress starts at the cached count and moves by chunks from there: only its end
        # (everything read) says nothing of the cache.
        while isinstance(item, p.PromptProgress) and item.processed < item.total:
            item = await receive(wake_limit)
        if isinstance(item, p.Done) and (item.cached_tokens or item.restored_tokens or item.cache_tier):
            return msgspec.structs.replace(item, cached_tokens=0, restored_tokens=0, cache_tier="")
        if isinstance(item, p.Tokens) and item.n_cached_tokens:
            return msgspec.structs.replace(item, n_cached_tokens=0)
        if isinstance(item, p.PromptProgress):
            return msgspec.structs.replace(item, cache=0, seconds=0.0)
        return item

    job.next = next_item  # type: ignore[method-assign]  # this job's alone (an instance attribute)
    job._counts_hidden = True  # type: ignore[attr-defined]


async def first_answer_item(request: web.Request, model: FleetModel, job: Job):
    """The job's first item, or the ApiError of a job that failed before its answer began."""
    item = await first_item(request, model, job)
    if is_failure(item):
        raise failure_error(item)
    return item


async def run_query(request: web.Request, model: FleetModel, job: Job) -> p.Answer:
    """The worker's Answer, or the ApiError that says why there is none."""
    async with tracked(request, model, job):
        item = await first_item(request, model, job)
        if isinstance(item, JobFailure):
            raise failure_error(item)
        if not isinstance(item, p.Answer):  # pragma: no cover - a query is answered by one Answer
            raise ApiError(500, "the worker answered a query with something else", "internal_error")
        if item.error is not None:
            raise ApiError(400 if item.error_code in CLIENT_ERRORS else 500, item.error, item.error_code)
        return item


async def open_event_stream(request: web.Request, job: Job) -> web.StreamResponse:
    """The SSE response, its headers sent: only once the first item is there,
    so a refused or timed-out request still gets its status code."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": job.id})
    await response.prepare(request)
    return response
