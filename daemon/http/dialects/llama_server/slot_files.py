"""llama-server's POST /slots/{id}?action=save|restore|erase (the admin key is
required by the middleware on /slots/*): save a slot's prompt cache to a
named file in `slot_save_path/<model id>/`, restore one into a slot, erase a
slot. Answers as llama-server's: id_slot, filename, n_saved / n_restored,
n_written / n_read, timings; erase: id_slot, n_erased. The worker does the
work (daemon/worker/prompt_cache_slots.py) in the prompt cache's own sealed
file format."""

from __future__ import annotations

import time

from aiohttp import web
from pydantic import Field

from daemon.http.errors import ApiError
from daemon.http.keys import FLEET, model_for, model_param
from daemon.http.core.job import parse_body
from daemon.http.core.run import failure_error, first_item, tracked
from daemon.http.core.schemas import RequestModel
from daemon.http.dialects.llama_server.request import check_slot
from daemon.model.jobs import JobFailure
from daemon.protocol import Answer

ACTIONS = ("save", "restore", "erase")
STATUS = {"slot_busy": 409, "not_supported": 501, "slot_file_error": 400, "invalid_request": 400, "context_full": 503}


class SlotFileRequest(RequestModel):
    filename: str = Field(min_length=1, max_length=200)
    model: str | None = None


def _slot_id(request: web.Request) -> int:
    raw = request.match_info["id_slot"]
    if not raw.isdigit() or len(raw) > 4:
        raise ApiError(400, "id_slot: must be a slot number (0, 1, ...)", "invalid_value", param="id_slot")
    return int(raw)


async def slot_action(request: web.Request) -> web.Response:
    action = request.query.get("action")
    if action not in ACTIONS:
        raise ApiError(400, f"action: must be one of {', '.join(ACTIONS)}", "invalid_value", param="action")
    id_slot = _slot_id(request)
    if action == "erase":
        filename, model = "", await model_param(request)
    else:
        body = await parse_body(request, SlotFileRequest)
        filename = body.filename
        model = model_for(request, body.model) if body.model else await model_param(request)
    model = model or request.app[FLEET].default_model
    settings = model.controller.settings
    if settings.slot_save_path is None:
        raise ApiError(501, "This server does not support slots action. Start it with `--slot-save-path` "
                            "(slot_save_path)", "not_supported")
    check_slot(id_slot, settings.parallel)
    start = time.perf_counter()
    job = model.controller.new_query("slots", f"slot_{action}", tokens=[id_slot], text=filename)
    async with tracked(request, model, job):
        item = await first_item(request, model, job)
    if isinstance(item, JobFailure):
        raise failure_error(item)
    if not isinstance(item, Answer):  # pragma: no cover - a query is answered by one Answer
        raise ApiError(500, "the worker answered a slot action with something else", "internal_error")
    if item.error is not None:
        raise ApiError(STATUS.get(item.error_code or "", 500), item.error, item.error_code,
                       retry_after=1 if item.error_code == "context_full" else None)
    n_tokens, n_bytes = (item.tokens + [0, 0])[:2]
    ms = (time.perf_counter() - start) * 1000
    if action == "erase":
        return web.json_response({"id_slot": id_slot, "n_erased": n_tokens})
    if action == "save":
        return web.json_response({"id_slot": id_slot, "filename": filename, "n_saved": n_tokens, "n_written": n_bytes,
                                  "timings": {"save_ms": ms}})
    return web.json_response({"id_slot": id_slot, "filename": filename, "n_restored": n_tokens, "n_read": n_bytes,
                              "timings": {"restore_ms": ms}})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/slots/{id_slot}", slot_action)
