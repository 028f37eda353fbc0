"""The daemon's OpenAPI document, built from the same pydantic models that
validate requests, served at /openapi.json.

Every path may answer 403 (allowed_hosts; a cross-origin POST), every POST
415 (a body not declared application/json), and a path behind a key 401."""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic.json_schema import models_json_schema

from daemon import __version__
from daemon.http.schemas import (ApplyTemplateRequest, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                  EmbeddingsRequest, NativeCompletionRequest, TokenizeRequest)

_ERROR = {"$ref": "#/components/schemas/Error"}
_JSON = "application/json"


def _error_responses(*codes: int) -> dict[str, Any]:
    return {str(c): {"description": "error", "content": {_JSON: {"schema": _ERROR}}} for c in codes}


def _generation(ref: str, description: str = "the completion (JSON, or SSE when stream is true)",
                stream: bool = True) -> dict[str, Any]:
    content: dict[str, Any] = {_JSON: {"schema": {"type": "object"}}}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    return {
        "post": {
            "requestBody": {"required": True, "content": {_JSON: {"schema": {"$ref": f"#/components/schemas/{ref}"}}}},
            "responses": {
                "200": {"description": description, "content": content},
                **_error_responses(400, 401, 403, 404, 413, 415, 500, 503),
            },
        }
    }


# An optional model (an id or an alias from /v1/models) for the admin and state paths.
_MODEL_QUERY = {"name": "model", "in": "query", "required": False, "schema": {"type": "string", "maxLength": 1000}}
_MODEL_BODY = {"type": "object", "properties": {"model": {"type": "string"}}}


def _get(description: str, *errors: int, model: bool = False) -> dict[str, Any]:
    operation: dict[str, Any] = {"responses": {"200": {"description": description, "content": {_JSON: {"schema": {}}}},
                                               **_error_responses(*errors)}}
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


@cache
def openapi_document() -> dict[str, Any]:
    _, schemas = models_json_schema(
        [(model, "validation") for model in (CompletionRequest, ChatCompletionRequest, EmbeddingsRequest, TokenizeRequest,
                                             DetokenizeRequest, ApplyTemplateRequest, NativeCompletionRequest)],
        ref_template="#/components/schemas/{model}",
    )
    components = schemas.get("$defs", {})
    components["Error"] = {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["message", "type"],
                                 "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                                "code": {"type": ["string", "null"]}, "param": {"type": ["string", "null"]}}}},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "Dormouse", "version": __version__},
        "paths": {
            "/v1/completions": _generation("CompletionRequest"),
            "/v1/chat/completions": _generation("ChatCompletionRequest"),
            "/v1/embeddings": _generation("EmbeddingsRequest", "pooled, normalized embeddings (embeddings models)", False),
            "/completion": _generation("NativeCompletionRequest", "llama-server's native completion, with timings"),
            "/tokenize": _generation("TokenizeRequest", "token ids (with their pieces when asked)", False),
            "/detokenize": _generation("DetokenizeRequest", "the text of token ids", False),
            "/apply-template": _generation("ApplyTemplateRequest", "the prompt the chat template renders", False),
            "/v1/models": _get("every configured model with its status (loaded, loading, sleeping, unloading, failed)",
                               401, 403),
            "/health": {"get": {"responses": {"200": {"description": "ok", "content": {_JSON: {"schema": {}}}},
                                              "503": {"description": "loading or failed", "content": {_JSON: {"schema": {}}}},
                                              **_error_responses(401, 403)}}},
            "/props": _get("a model's properties and the fleet's", 400, 401, 403, 404, model=True),
            "/slots": _get("a model's slot states", 400, 401, 403, 404, model=True),
            "/metrics": {"get": {"responses": {"200": {"description": "Prometheus text",
                                                        "content": {"text/plain": {"schema": {"type": "string"}}}},
                                               **_error_responses(401, 403)}}},
            "/sleep": _admin(False),
            "/wake": _admin(False),
            "/models/load": _admin(True),
            "/models/unload": _admin(True),
        },
        "components": {"schemas": components},
    }
