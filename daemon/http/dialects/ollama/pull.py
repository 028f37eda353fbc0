"""Ollama's /api/pull, answered by the code of `dormouse pull` (daemon/model/hub.py's pull_for_api).

- A model this daemon already serves (by id or alias, ":latest" or not) is
  {"status": "success"} at once, as Ollama answers a model it has: nothing is
  fetched, no key beyond the API key is needed.
- Any other name is a Hugging Face repository, `owner/name[:QUANT]` (Ollama's
  own `hf.co/owner/name:QUANT` too), checked before anything is asked of the
  hub (a 400 naming `model`), and fetched into the cache that `serve` and
  `dormouse pull` use. A download fills the disk the operator budgets, so with
  `admin_key` set it needs the admin key, as loading a model does. The model is
  not served until the configuration names it (`hf = "owner/name:QUANT"`).
- `stream` (Ollama's default: true) streams Ollama's progress objects as NDJSON,
  a failure as a last {"error": ...} line; `stream: false` answers the last
  object alone, a failure as a 502 (the hub refused or failed).

huggingface_hub is synchronous: the progress generator runs on a thread of its
own and hands its objects to the event loop, which never waits on the hub. A
client that leaves stops the download at its next chunk (hub_ollama_pull.py).
"""

from __future__ import annotations

import asyncio
import threading
from contextlib import aclosing
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
from aiohttp import web
from pydantic import Field, StrictBool, StrictStr

from daemon.http.core.job import parse_body
from daemon.http.core.schemas import RequestModel
from daemon.http.errors import ApiError
from daemon.http.keys import FLEET, LOG, SETTINGS, require_privilege
from daemon.model.hub import MAX_SPEC, HubError, parse_hf_repo, pull_for_api

class PullRequest(RequestModel):
    model: StrictStr | None = Field(None, max_length=MAX_SPEC, description="owner/name[:QUANT] on Hugging Face, "
                                                                          "or a model this daemon serves")
    name: StrictStr | None = Field(None, max_length=MAX_SPEC, description="Ollama's older name for `model`")
    stream: StrictBool = True
    insecure: StrictBool = Field(False, description="Ollama's (TLS to its registry): only false; the hub is reached "
                                                    "as HF_ENDPOINT names it")


async def _progress(items: Iterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """The generator's objects, read on a thread of its own; closed (the download stopped) when the reader leaves."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    gone = threading.Event()

    def hand(item: dict[str, Any] | None) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop has closed (the daemon stopped): nobody is reading
            gone.set()

    def drain() -> None:
        try:
            for item in items:
                hand(item)
                if gone.is_set():
                    break
        except Exception as exc:  # noqa: BLE001 - a bug in the pull must reach the client, not a dead thread
            hand({"error": f"pull failed: {type(exc).__name__}: {str(exc)[:300]}"})
        finally:
            items.close()  # sets the download's cancel flag when it stopped early
            hand(None)

    threading.Thread(target=drain, name="ollama-pull-reader", daemon=True).start()
    try:
        while (item := await queue.get()) is not None:
            yield item
    finally:
        gone.set()


async def pull(request: web.Request) -> web.StreamResponse:
    body = await parse_body(request, PullRequest)
    name = body.model or body.name
    if not name or not name.strip():
        raise ApiError(400, "model: required: owner/name[:QUANT] on Hugging Face (e.g. "
                            "ggml-org/gemma-3-1b-it-GGUF:Q4_K_M), or a model /api/tags lists", "invalid_value",
                       param="model")
    if body.insecure:
        raise ApiError(400, "insecure: the hub is reached as HF_ENDPOINT names it (https by default); there is no "
                            "registry connection to make insecure; send false or leave it out", "invalid_value",
                       param="insecure")
    if _serves(request, name):
        return _served(body.stream)
    try:
        parse_hf_repo(name.strip().removesuffix(":latest"))
    except HubError as exc:
        raise ApiError(400, f"model: {exc}; models this daemon serves are listed by /api/tags", "invalid_value",
                       param="model") from None
    require_privilege(request, "pulling a model (a download into the daemon's state directory)")
    log = request.app[LOG]
    log.info("pull.start", name=name)
    async with aclosing(_progress(pull_for_api(name, request.app[SETTINGS]))) as items:  # a client gone: stopped
        return await (_stream(request, items, log, name) if body.stream else _whole(items, log, name))


async def _whole(items: AsyncIterator[dict[str, Any]], log, name: str) -> web.Response:
    last: dict[str, Any] = {}
    async for item in items:
        last = item
    if "error" in last or last.get("status") != "success":
        log.warning("pull.failed", name=name, error=str(last.get("error", last))[:500])
        raise ApiError(502, str(last.get("error") or "the pull ended without success"), "pull_failed")
    log.info("pull.done", name=name)
    return web.json_response(last)


async def _stream(request: web.Request, items: AsyncIterator[dict[str, Any]], log, name: str) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache"})
    await response.prepare(request)
    last = {}
    async for item in items:
        last = item
        await response.write(msgspec.json.encode(item) + b"\n")
    if last.get("status") == "success":
        log.info("pull.done", name=name)
    else:
        log.warning("pull.failed", name=name, error=str(last.get("error", last))[:500])
    await response.write_eof()
    return response


def _serves(request: web.Request, name: str) -> bool:
    """Whether a model of the fleet has this exact id or alias (Ollama's ":latest" or not). Not the routing's
    rule: a fleet of one may answer every name (Fleet.any_name), and a pull of another name must reach the hub."""
    names = {n for m in request.app[FLEET].models.values() for n in (m.id, *m.aliases)}
    return name in names or name.removesuffix(":latest") in names


def _served(stream: bool) -> web.Response:
    """Ollama's answer for a model it has: one success object, as a stream of one line or whole."""
    if not stream:
        return web.json_response({"status": "success"})
    return web.Response(body=b'{"status":"success"}\n', headers={"Content-Type": "application/x-ndjson"})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/api/pull", pull)
