"""Ollama's model listing and details: /api/tags, /api/ps, /api/show, /api/version,
and the model-management endpoints Dormouse does not have (501; /api/pull is
pull.py's).

Everything here answers from the fleet and the GGUF file's header
(daemon/model/gguf_header.py, read off the event loop and kept per file
version), never from the worker: listing or showing a sleeping model does not
wake it, nor reset its idle timer.

/api/ps lists the models a worker holds now. Its `expires_at` is the real idle
deadline: the armed idle timer's, or, while requests are in flight, the idle
time that will be armed once they end (the model's sleep_idle_seconds or the
latest request's keep_alive); a model that never sleeps on idle shows the far
future, as Ollama shows a negative keep_alive.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from aiohttp import web
from pydantic import StrictBool

from daemon import __version__
from daemon.fleet.owner import FleetModel
from daemon.http.errors import ApiError
from daemon.http.keys import FLEET, model_for
from daemon.http.dialects.ollama.answer import created_at
from daemon.http.core.job import parse_body
from daemon.http.core.schemas import SERVER_DEFAULTED, RequestModel
from daemon.model.gguf_header import GgufError, SkippedArray, SkippedString, read_header
from statemachine import ServerState

# The Ollama release whose API shapes these endpoints follow (clients read it to
# decide what they may send); Dormouse's own version is beside it.
OLLAMA_API_VERSION = "0.12.0"
FOREVER_SECONDS = (2**63 - 1) / 1e9  # Go's longest time.Duration: what Ollama adds for a negative keep_alive

# llama.cpp's llama_ftype (general.file_type) -> Ollama's quantization_level names.
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
              12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
              19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
              26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
              36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4", 39: "NVFP4", 40: "Q1_0", 41: "Q2_0"}
MAX_TEMPLATE_BYTES = 1 << 20  # a chat_template_file shown by /api/show


@dataclass(frozen=True)
class FileFacts:
    """What the listing shows of a model file; empty when it cannot be read."""

    size: int = 0
    modified: float = 0.0
    digest: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    n_params: int = 0

    @property
    def architecture(self) -> str:
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) else ""

    @property
    def quantization(self) -> str:
        file_type = self.metadata.get("general.file_type")
        return FILE_TYPES.get(file_type, "unknown") if isinstance(file_type, int) else "unknown"


@lru_cache(maxsize=64)
def _read_facts(path: str, size: int, mtime_ns: int) -> FileFacts:
    # The digest names this version of the file (path, size, mtime), not its
    # bytes: hashing gigabytes per listing would be a scan of the disk.
    digest = hashlib.sha256(f"{path}\0{size}\0{mtime_ns}".encode()).hexdigest()
    try:
        header = read_header(path)
    except (GgufError, OSError):
        return FileFacts(size, mtime_ns / 1e9, digest)
    n_params = sum(math.prod(t.dims) for t in header.tensors)
    return FileFacts(size, mtime_ns / 1e9, digest, dict(header.metadata), n_params)


async def file_facts(path: str) -> FileFacts:
    try:
        st = os.stat(path)
    except OSError:
        return FileFacts()
    return await asyncio.to_thread(_read_facts, path, st.st_size, st.st_mtime_ns)


def human_number(n: int) -> str:
    """Ollama's parameter_size: "268.10M", "7.6B"."""
    if n >= 1_000_000_000:
        value = n / 1e9
        return f"{value:.0f}B" if value == int(value) else f"{value:.1f}B"
    if n >= 1_000_000:
        value = n / 1e6
        return f"{value:.0f}M" if value == int(value) else f"{value:.2f}M"
    if n >= 1_000:
        return f"{n / 1e3:.0f}K"
    return str(n)


def details(facts: FileFacts) -> dict[str, Any]:
    arch = facts.architecture
    return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch] if arch else None,
            "parameter_size": human_number(facts.n_params) if facts.n_params else "",
            "quantization_level": facts.quantization}


def _iso(at: float) -> str:
    return created_at(at)


def ollama_model(request: web.Request, name: str | None) -> FleetModel:
    """The model a request names. Ollama's clients add ":latest" to a name without a tag."""
    try:
        return model_for(request, name)
    except ApiError:
        if name is not None and name.endswith(":latest"):
            return model_for(request, name.removesuffix(":latest"))
        raise


def slot_context(model: FleetModel) -> int:
    """Tokens one request's slot holds: the worker's word once loaded, else what the settings make."""
    c = model.controller
    return c.n_ctx_slot or c.settings.slot_context


async def tags(request: web.Request) -> web.Response:
    """Every configured model (Ollama: the models pulled)."""
    out = []
    for model in request.app[FLEET].models.values():
        facts = await file_facts(model.controller.model_path)
        out.append({"name": model.id, "model": model.id, "modified_at": _iso(facts.modified or time.time()),
                    "size": facts.size or model.bytes, "digest": facts.digest, "details": details(facts)})
    return web.json_response({"models": out})


def expires_in(model: FleetModel) -> float:
    """Seconds until the model falls asleep on idle, from the real idle timer."""
    c = model.controller
    remaining = c.idle_deadline()
    if remaining is not None:
        return remaining
    idle = c.machine.idle_seconds
    return FOREVER_SECONDS if idle < 0 else idle  # busy: the timer is armed with this once the requests end


async def embedding_length(model: FleetModel) -> int | None:
    """The size of the model's vectors: the worker's word once loaded, else the file's header."""
    n_embd = model.controller.model_info.get("n_embd")
    if isinstance(n_embd, int) and n_embd > 0:
        return n_embd
    facts = await file_facts(model.controller.model_path)
    value = facts.metadata.get(f"{facts.architecture}.embedding_length")
    return value if isinstance(value, int) and value > 0 else None


def _vram_bytes(model: FleetModel) -> int:
    by_device: dict[str, dict[str, int]] = model.controller.model_info.get("memory_by_device") or {}
    return sum(n for devices in by_device.values() for device, n in devices.items()
               if not device.upper().startswith("CPU"))


async def ps(request: web.Request) -> web.Response:
    """The models a worker holds now."""
    out = []
    for model in request.app[FLEET].models.values():
        if model.controller.state is not ServerState.READY:
            continue
        facts = await file_facts(model.controller.model_path)
        expires = expires_in(model)
        out.append({"name": model.id, "model": model.id, "size": model.bytes, "digest": facts.digest,
                    "details": details(facts),
                    "expires_at": _iso(time.time() + min(expires, FOREVER_SECONDS)),
                    "size_vram": _vram_bytes(model), "context_length": slot_context(model)})
    return web.json_response({"models": out})


class ShowRequest(RequestModel):
    model: str | None = None
    name: str | None = None  # Ollama's older name for it
    verbose: StrictBool = False


def _shown(key: str, value: Any) -> Any:
    if isinstance(value, (SkippedArray, SkippedString)):
        return None  # a vocabulary or a long string: walked past, never read
    if isinstance(value, tuple) and key.startswith("tokenizer."):
        return None  # the vocabulary, its scores and merges: null, as Ollama shows them without verbose
    if isinstance(value, tuple):
        return [_shown("", v) for v in value]
    return value


def _template(model: FleetModel, facts: FileFacts) -> str:
    """The template the model is served with: the configured one (chat_template_file, then chat_template:
    Jinja text or a llama.cpp built-in name) over the GGUF's."""
    settings = model.controller.settings
    path = settings.chat_template_file
    if path is not None:
        try:
            with open(path, "rb") as f:
                return f.read(MAX_TEMPLATE_BYTES).decode("utf-8", errors="replace")
        except OSError:
            return ""
    if settings.chat_template:
        return settings.chat_template
    template = facts.metadata.get("tokenizer.chat_template")
    return template if isinstance(template, str) else ""


def capabilities(model: FleetModel) -> list[str]:
    settings = model.controller.settings
    if settings.embeddings:
        return ["embedding"]
    return ["completion", "tools", *(["vision"] if settings.mmproj else [])]


async def show(request: web.Request) -> web.Response:
    body = await parse_body(request, ShowRequest)
    name = body.model or body.name
    if not name:
        raise ApiError(400, "model: required (a name that /api/tags lists)", "invalid_value", param="model")
    if body.verbose:
        raise ApiError(400, "verbose: the vocabulary is never read from the file here (its header reader walks past "
                            "it); /tokenize and /detokenize answer from the model", "invalid_value", param="verbose")
    model = ollama_model(request, name)
    facts = await file_facts(model.controller.model_path)
    info = {key: _shown(key, value) for key, value in facts.metadata.items() if key != "tokenizer.chat_template"}
    if facts.n_params:
        info["general.parameter_count"] = facts.n_params
    settings = model.controller.settings  # what a request that names nothing gets (the server-wide defaults)
    defaults = {key: getattr(settings, key) for key in SERVER_DEFAULTED if key != "seed"}  # the sampler's, in order
    parameters = "\n".join(f"{key} {value}" for key, value in {"num_ctx": slot_context(model), **defaults}.items())
    modelfile = (f"# Dormouse serves {model.id} from its configuration; Modelfiles are not read.\n"
                 f"FROM {model.controller.model_path}\n"
                 + "".join(f"PARAMETER {line}\n" for line in parameters.split("\n")))
    license_ = facts.metadata.get("general.license")
    return web.json_response({
        "license": license_ if isinstance(license_, str) else "", "modelfile": modelfile, "parameters": parameters,
        "template": _template(model, facts), "details": details(facts), "model_info": info,
        "capabilities": capabilities(model), "modified_at": _iso(facts.modified or time.time()),
    })


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": OLLAMA_API_VERSION, "dormouse": __version__})


def _not_here(what: str):
    async def handler(request: web.Request) -> web.Response:
        raise ApiError(501, f"{request.path} is not served: Dormouse's models come from its configuration "
                            f"({what}), not from a registry or Modelfiles", "not_implemented")
    return handler


def add_routes(app: web.Application) -> None:
    app.router.add_get("/api/tags", tags)
    app.router.add_get("/api/ps", ps)
    app.router.add_post("/api/show", show)
    app.router.add_get("/api/version", version)
    configured = "a [models.ID] table per model"
    for path in ("/api/push", "/api/create", "/api/copy"):  # /api/pull: pull.py
        app.router.add_post(path, _not_here(configured))
    app.router.add_delete("/api/delete", _not_here(configured))
    app.router.add_post("/api/blobs/{digest}", _not_here(configured))
    app.router.add_head("/api/blobs/{digest}", _not_here(configured))
