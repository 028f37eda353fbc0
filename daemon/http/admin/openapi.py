"""The daemon's OpenAPI document, built from the same pydantic models that
validate requests, served at /openapi.json. Every dialect is in it: OpenAI's
/v1/* (Chat Completions, Completions, Embeddings, Responses, models) with
llama-server's unversioned aliases, llama-server's own routes (/completion,
/infill, /rerank, /slots ...), Anthropic Messages and Ollama's /api/*.

Every path may answer 403 (allowed_hosts; a cross-origin POST), every POST
415 (a body not declared application/json), and a path behind a key 401.
Errors are in the dialect's own shape (Error, AnthropicError, OllamaError)."""

from __future__ import annotations

import copy
import json
from functools import cache, lru_cache
from typing import Any

from pydantic.json_schema import models_json_schema

from daemon import __version__
from config import Settings
from daemon.http.core.schemas import SERVER_DEFAULTED, CompletionRequest
from daemon.http.dialects.llama_server.schemas import (ApplyTemplateRequest, DetokenizeRequest, EmbeddingsRequest,
                                                       NativeCompletionRequest, TokenizeRequest)

_JSON = "application/json"
_NDJSON = "application/x-ndjson"
_SSE = "text/event-stream"
_ERRORS = {"openai": "Error", "anthropic": "AnthropicError", "ollama": "OllamaError"}
_GENERATION_ERRORS = (400, 401, 403, 404, 413, 415, 500, 503)


def _error_responses(*codes: int, dialect: str = "openai") -> dict[str, Any]:
    schema = {"$ref": f"#/components/schemas/{_ERRORS[dialect]}"}
    return {str(c): {"description": "error", "content": {_JSON: {"schema": schema}}} for c in codes}


def _generation(ref: str, description: str = "the completion (JSON, or SSE when stream is true)",
                stream: bool = True, dialect: str = "openai", streamed_as: str = _SSE,
                errors: tuple[int, ...] = _GENERATION_ERRORS, whole: dict | None = None) -> dict[str, Any]:
    """whole: the schema of a whole (not streamed) answer; an object unless given."""
    content: dict[str, Any] = {_JSON: {"schema": whole or {"type": "object"}}}
    if stream:
        content[streamed_as] = {"schema": {"type": "string"}}
    return {
        "post": {
            "requestBody": {"required": True, "content": {_JSON: {"schema": {"$ref": f"#/components/schemas/{ref}"}}}},
            "responses": {
                "200": {"description": description, "content": content},
                **_error_responses(*errors, dialect=dialect),
            },
        }
    }


# An optional model (an id or an alias from /v1/models) for the admin and state paths.
_MODEL_QUERY = {"name": "model", "in": "query", "required": False, "schema": {"type": "string", "maxLength": 1000}}
_MODEL_BODY = {"type": "object", "properties": {"model": {"type": "string"}}}
_TOOL_CALL = {"type": "object", "required": ["tool"], "properties": {
    "tool": {"type": "string"}, "params": {"type": "object"}, "stream": {"type": "boolean"}}}


def _get(description: str, *errors: int, model: bool = False, dialect: str = "openai") -> dict[str, Any]:
    operation: dict[str, Any] = {"responses": {"200": {"description": description, "content": {_JSON: {"schema": {}}}},
                                               **_error_responses(*errors, dialect=dialect)}}
    if model:
        operation["parameters"] = [_MODEL_QUERY]
    return {"get": operation}


def _admin(required_model: bool) -> dict[str, Any]:
    # /sleep and /wake may take no body (an empty one needs no Content-Type); /models/load and
    # /models/unload take {"model": ID} as llama-server's router does.
    body = {"required": required_model, "content": {_JSON: {"schema": {**_MODEL_BODY, **(
        {"required": ["model"]} if required_model else {})}}}}
    return {"post": {"parameters": [_MODEL_QUERY], "requestBody": body,
                     "responses": {"200": {"description": "done", "content": {_JSON: {"schema": {"type": "object"}}}},
                                   **_error_responses(400, 401, 403, 404, 409, 415, 503)}}}


def _health() -> dict[str, Any]:
    # Ready while any model can serve; ?model=ID answers for that model alone (a per-model probe).
    return {"get": {"parameters": [_MODEL_QUERY],
                    "responses": {"200": {"description": "ok", "content": {_JSON: {"schema": {}}}},
                                  "503": {"description": "no model can serve (with ?model=: that model cannot)",
                                          "content": {_JSON: {"schema": {}}}},
                                  **_error_responses(401, 403, 404)}}}


def _slot_action() -> dict[str, Any]:
    # llama-server's POST /slots/{id}?action=save|restore|erase; erase reads no body.
    return {"post": {
        "parameters": [
            {"name": "id_slot", "in": "path", "required": True, "schema": {"type": "integer", "minimum": 0}},
            {"name": "action", "in": "query", "required": True,
             "schema": {"type": "string", "enum": ["save", "restore", "erase"]}},
            _MODEL_QUERY,
        ],
        "requestBody": {"required": False,
                        "content": {_JSON: {"schema": {"$ref": "#/components/schemas/SlotFileRequest"}}}},
        "responses": {"200": {"description": "id_slot with n_saved/n_restored (and timings) or n_erased",
                              "content": {_JSON: {"schema": {"type": "object"}}}},
                      **_error_responses(400, 401, 403, 404, 409, 415, 501, 503)},
    }}


def _not_served(method: str, digest: bool = False) -> dict[str, Any]:
    # Ollama's model management: the models come from the configuration, so these answer 501.
    operation: dict[str, Any] = {"responses": {
        "501": {"description": "not served: models come from the configuration",
                "content": {_JSON: {"schema": {"$ref": "#/components/schemas/OllamaError"}}}},
        **_error_responses(401, 403, 415, dialect="ollama")}}
    if digest:
        operation["parameters"] = [{"name": "digest", "in": "path", "required": True, "schema": {"type": "string"}}]
    if method == "post":
        operation["requestBody"] = {"required": False, "content": {_JSON: {"schema": {"type": "object"}}}}
    return {method: operation}


def _request_models() -> list[type]:
    # Imported here: the dialect modules import the routes that serve this document.
    from daemon.http.dialects.anthropic.request import CountTokensRequest, MessagesRequest
    from daemon.http.dialects.llama_server.infill import InfillRequest
    from daemon.http.dialects.openai.body import ChatCompletionRequest
    from daemon.http.dialects.ollama.request import (OllamaChatRequest, OllamaEmbedRequest, OllamaGenerateRequest,
                                        OllamaLegacyEmbeddingsRequest)
    from daemon.http.dialects.ollama.models import ShowRequest
    from daemon.http.dialects.ollama.pull import PullRequest
    from daemon.http.dialects.llama_server.rerank import RerankRequest
    from daemon.http.dialects.responses.request import ResponsesRequest
    from daemon.http.dialects.llama_server.slot_files import SlotFileRequest

    return [CompletionRequest, ChatCompletionRequest, EmbeddingsRequest, TokenizeRequest, DetokenizeRequest,
            ApplyTemplateRequest, NativeCompletionRequest, ResponsesRequest, MessagesRequest, CountTokensRequest,
            OllamaChatRequest, OllamaGenerateRequest, OllamaEmbedRequest, OllamaLegacyEmbeddingsRequest, ShowRequest,
            InfillRequest, RerankRequest, SlotFileRequest, PullRequest]


def served_document(settings: Settings) -> bytes:
    """/openapi.json's body for this daemon: the document with its sampling defaults (with_server_defaults),
    serialized once per configuration. The endpoint needs no key, so a GET must cost no copy of the document."""
    configured = tuple((name, getattr(settings, name)) for name in SERVER_DEFAULTED
                       if getattr(settings, name) != Settings.model_fields[name].default)
    per_model = frozenset(name for table in settings.models.values() for name in SERVER_DEFAULTED
                          if getattr(table, name, None) is not None)
    return _served(configured, per_model)


@lru_cache(maxsize=4)
def _served(configured: tuple[tuple[str, Any], ...], per_model: frozenset[str]) -> bytes:
    return json.dumps(with_server_defaults(openapi_document(), dict(configured), per_model)).encode()


def with_server_defaults(document: dict[str, Any], configured: dict[str, Any],
                         per_model: frozenset[str] = frozenset()) -> dict[str, Any]:
    """A copy of the document whose sampling fields show the defaults this daemon was configured with
    (`--temp`, `top_k = 20`, ...: `configured`), which a request that leaves such a field out gets. A value
    outside a dialect's own range (a server temperature of 1.5 beside Anthropic's 0..1) is said, not set as
    the default, which the schema would then refuse. `per_model`: the keys some [models.ID] table sets for
    its own model, which one document cannot show: said in the field."""
    if not configured and not per_model:
        return document
    patched = copy.deepcopy(document)
    for schema in patched["components"]["schemas"].values():
        for name, field in schema.get("properties", {}).items():
            if "default" not in field or name not in configured and name not in per_model:
                continue
            notes = [field["description"]] if field.get("description") else []
            if name in configured and _within(field, configured[name]):
                field["default"] = configured[name]
                notes.append("the default is this server's")
            elif name in configured:
                notes.append(f"this server's default is {configured[name]!r}, outside this field's range: a "
                             "request that leaves the field out gets it")
            notes.append("some models' own tables set another" if name in per_model
                         else "a model's own table may set another")
            field["description"] = "; ".join(notes)
    return patched


def _within(field: dict[str, Any], value: Any) -> bool:
    """Whether a JSON schema field (or one branch of its anyOf, null aside) accepts the number `value`."""
    branches = [b for b in field.get("anyOf", [field]) if b.get("type") != "null"]
    return not branches or any(
        value >= b.get("minimum", value) and value <= b.get("maximum", value)
        and ("exclusiveMinimum" not in b or value > b["exclusiveMinimum"])
        and ("exclusiveMaximum" not in b or value < b["exclusiveMaximum"])
        for b in branches)


@cache
def openapi_document() -> dict[str, Any]:
    _, schemas = models_json_schema([(model, "validation") for model in _request_models()],
                                    ref_template="#/components/schemas/{model}")
    components = schemas.get("$defs", {})
    components["Error"] = {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["message", "type"],
                                 "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                                "code": {"type": ["string", "null"]}, "param": {"type": ["string", "null"]}}}},
    }
    components["AnthropicError"] = {
        "type": "object",
        "required": ["type", "error"],
        "properties": {"type": {"const": "error"},
                       "error": {"type": "object", "required": ["type", "message"],
                                 "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}},
    }
    components["OllamaError"] = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}

    chat = _generation("ChatCompletionRequest")
    completions = _generation("CompletionRequest")
    embeddings = _generation("EmbeddingsRequest", "pooled, normalized embeddings (embeddings models)", False)
    models = _get("every configured model with its status (loaded, loading, sleeping, unloading, failed)", 401, 403)
    rerank = _generation("RerankRequest", "documents' relevance scores (a pooling = \"rank\" model)", False)
    native = _generation("NativeCompletionRequest", "llama-server's native completion, with timings; several prompts: "
                         "a list of answers, in their order", whole={"oneOf": [
                             {"type": "object"}, {"type": "array", "items": {"type": "object"}}]})
    input_tokens = "the prompt tokens the request would read: {\"object\": \"response.input_tokens\", \"input_tokens\"}"
    paths: dict[str, Any] = {
        # OpenAI's /v1/*, and llama-server's unversioned aliases of them.
        "/v1/completions": completions,
        "/v1/chat/completions": chat,
        "/chat/completions": chat,
        "/v1/chat/completions/input_tokens": _generation("ChatCompletionRequest", input_tokens, False),
        "/chat/completions/input_tokens": _generation("ChatCompletionRequest", input_tokens, False),
        "/v1/embeddings": embeddings,
        "/embeddings": embeddings,
        "/v1/models": models,
        "/models": models,
        "/v1/models/{model_id}": {"get": {
            "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": {"description": "one model (by id or alias), as /v1/models lists it",
                                  "content": {_JSON: {"schema": {"type": "object"}}}},
                          **_error_responses(401, 403, 404)}}},
        # OpenAI Responses (stateless).
        "/v1/responses": _generation("ResponsesRequest",
                                     "a response object (JSON, or its SSE events when stream is true)"),
        "/v1/responses/input_tokens": _generation("ResponsesRequest", input_tokens, False),
        "/responses": _generation("ResponsesRequest", "as /v1/responses (llama-server's unversioned alias)"),
        "/responses/input_tokens": _generation("ResponsesRequest", input_tokens, False),
        # Anthropic Messages.
        "/v1/messages": _generation("MessagesRequest",
                                    "a message (JSON, or Anthropic's SSE events when stream is true)",
                                    dialect="anthropic"),
        "/v1/messages/count_tokens": _generation("CountTokensRequest", "{\"input_tokens\"}", False,
                                                 dialect="anthropic"),
        # llama-server's own routes.
        "/completion": native,
        "/completions": native,  # as llama-server routes it; OpenAI's is /v1/completions
        "/infill": _generation("InfillRequest", "fill-in-the-middle, as /completion answers (a model with FIM tokens)"),
        "/tokenize": _generation("TokenizeRequest", "token ids (with their pieces when asked)", False),
        "/detokenize": _generation("DetokenizeRequest", "the text of token ids", False),
        "/apply-template": _generation("ApplyTemplateRequest", "the prompt the chat template renders", False),
        "/v1/rerank": rerank,
        "/rerank": rerank,
        "/reranking": rerank,
        "/v1/reranking": rerank,
        "/health": _health(),
        "/v1/health": _health(),
        "/props": _get("a model's properties and the fleet's", 400, 401, 403, 404, model=True),
        "/slots": _get("a model's slot states", 400, 401, 403, 404, model=True),
        "/slots/{id_slot}": _slot_action(),
        "/metrics": {"get": {"responses": {"200": {"description": "Prometheus text",
                                                    "content": {"text/plain": {"schema": {"type": "string"}}}},
                                           **_error_responses(401, 403)}}},
        "/sleep": _admin(False),
        "/wake": _admin(False),
        "/models/load": _admin(True),
        "/models/unload": _admin(True),
        # llama-server's tools on the host (docs/tools.md): 403 feature_disabled unless tools or mcp_servers are set.
        "/tools": {"get": {"responses": {"200": {"description": "the enabled tools, each with its function "
                                                                "definition", "content": {_JSON: {"schema": {
                                                                    "type": "array", "items": {"type": "object"}}}}},
                                         **_error_responses(401, 403)}},
                   "post": {"requestBody": {"required": True, "content": {_JSON: {"schema": _TOOL_CALL}}},
                            "responses": {"200": {"description": "the tool's answer (JSON; SSE of {chunk} then {done} "
                                                                 "when stream is true)",
                                                  "content": {_JSON: {"schema": {"type": "object"}},
                                                              _SSE: {"schema": {"type": "string"}}}},
                                          **_error_responses(400, 401, 403, 404, 413, 415, 500, 503)}}},
        "/cors-proxy": {method: {"responses": _error_responses(403)} for method in ("get", "post")},
        # Ollama's /api/* (streams are NDJSON; a body may come without a Content-Type).
        "/api/chat": _generation("OllamaChatRequest", "a chat answer (JSON, or NDJSON lines when stream is true)",
                                 dialect="ollama", streamed_as=_NDJSON),
        "/api/generate": _generation("OllamaGenerateRequest",
                                     "a completion (JSON, or NDJSON lines when stream is true)",
                                     dialect="ollama", streamed_as=_NDJSON),
        "/api/embed": _generation("OllamaEmbedRequest", "embeddings (embeddings models)", False, dialect="ollama"),
        "/api/embeddings": _generation("OllamaLegacyEmbeddingsRequest", "one embedding (embeddings models)", False,
                                       dialect="ollama"),
        "/api/show": _generation("ShowRequest", "a model's details, template and GGUF metadata", False,
                                 dialect="ollama"),
        "/api/tags": _get("the configured models", 401, 403, dialect="ollama"),
        "/api/ps": _get("the loaded models, with expires_at from the real idle deadline", 401, 403, dialect="ollama"),
        "/api/version": _get("Ollama's API version that is spoken", 401, 403, dialect="ollama"),
        "/api/pull": _generation("PullRequest", "Ollama's pull progress (NDJSON lines, or the last object when stream "
                                               "is false): a served model is success at once, owner/name[:QUANT] is "
                                               "fetched from Hugging Face", dialect="ollama", streamed_as=_NDJSON,
                                 errors=(400, 401, 403, 413, 415, 502)),
        "/api/push": _not_served("post"),
        "/api/create": _not_served("post"),
        "/api/copy": _not_served("post"),
        "/api/delete": _not_served("delete"),
        "/api/blobs/{digest}": {**_not_served("post", digest=True), **_not_served("head", digest=True)},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "Dormouse", "version": __version__},
        "paths": paths,
        "components": {"schemas": components},
    }
