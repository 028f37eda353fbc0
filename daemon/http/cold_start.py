"""What a response says about the wake it waited for, and how long a client may wait.

- `X-Dormouse-Max-Wait: <seconds>` (request): the longest this client will
  wait for its first token when the model is not awake: the predicted wake
  (bounded by wake_timeout too) plus the wait for a free slot behind the
  requests already accepted. A request predicted to wait longer is refused
  at once with 503 `wake_too_slow` and Retry-After
  (daemon/model/sleep_tiers.py too_slow), instead of after the wait; the
  wake starts anyway. Without the header only the predicted wake (measured
  on this host) is held against wake_timeout, which bounds the wait for a
  wake alone: a queue never refuses such a request early. Once accepted, the
  wait for the worker to take the request is bounded by the smaller of the
  header and wake_timeout (Job.next).
  `max_wait_header` reads it for every handler (a middleware) into a
  context variable that the controller's new_job/new_query read, so every
  dialect gets it without spelling it.
- `X-Dormouse-Cold-Start: true|false` and, when true,
  `X-Dormouse-Wake-Seconds: <measured>` (response): on every answer to a
  job (tracked() stashes it on the request), streams included, since
  on_response_prepare runs before the headers go out.

Wiring (daemon/http/app.py): `middlewares=[errors_and_access, max_wait_header]`
(inside errors_and_access, so a bad header gets the dialect's 400) and
`app.on_response_prepare.append(cold_start_headers)`.
"""

from __future__ import annotations

import math

from aiohttp import web

from daemon.http.errors import ApiError
from daemon.http.keys import JOB
from daemon.model.wake_prediction import requested_max_wait

MAX_WAIT_HEADER = "X-Dormouse-Max-Wait"
MAX_WAIT_LIMIT = 86400.0  # past wake_timeout it is bounded by wake_timeout anyway; past this it is nonsense


def parse_max_wait(raw: str | None) -> float | None:
    """Seconds from the header; ApiError(400) naming it when it is not a number of seconds in range."""
    if raw is None:
        return None
    text = raw.strip()
    try:
        if len(text) > 32:
            raise ValueError
        value = float(text)
    except ValueError:
        raise ApiError(400, f"{MAX_WAIT_HEADER}: must be a number of seconds (got {raw[:40]!r})", "invalid_value",
                       param=MAX_WAIT_HEADER) from None
    if not math.isfinite(value) or value < 0 or value > MAX_WAIT_LIMIT:
        raise ApiError(400, f"{MAX_WAIT_HEADER}: must be between 0 and {MAX_WAIT_LIMIT:g} seconds", "invalid_value",
                       param=MAX_WAIT_HEADER)
    return value


@web.middleware
async def max_wait_header(request: web.Request, handler):
    token = requested_max_wait.set(parse_max_wait(request.headers.get(MAX_WAIT_HEADER)))
    try:
        return await handler(request)
    finally:
        requested_max_wait.reset(token)


async def cold_start_headers(request: web.Request, response: web.StreamResponse) -> None:
    job = request.get(JOB)
    if job is None:
        return
    waited = getattr(job, "wake_seconds", None)  # set when a cold job was handed to its worker
    response.headers["X-Dormouse-Cold-Start"] = "true" if waited is not None else "false"
    if waited is not None:
        response.headers["X-Dormouse-Wake-Seconds"] = f"{waited:.3f}"
