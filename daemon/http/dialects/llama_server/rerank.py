"""Rerank: POST /v1/rerank (and llama-server's /rerank, /reranking,
/v1/reranking), from a model loaded as a reranker (embeddings = true,
pooling = "rank"): each document is read with the query and scored by the
model's classifier head (worker/embeddings.py), one document per worker step.

The request and answer are Jina's and Cohere's, as llama-server takes them:
{query, documents, top_n, return_documents} ->
{model, object: "list", usage, results: [{index, relevance_score, document?}]},
results by score, highest first, at most top_n. A document may be a string
or {"text": ...}. With `texts` instead of `documents` the request is
Hugging Face TEI's, answered as TEI does: a bare list of {index, score, text?}
(text with return_text), as llama-server answers it.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from aiohttp import web
from pydantic import ConfigDict, Field, field_validator

from daemon.http.errors import ApiError
from daemon.http.keys import model_for
from daemon.http.core.run import run_query
from daemon.http.core.job import parse_body
from daemon.http.core.schemas import _at_most, INT32_MAX, RequestModel

MAX_DOCUMENTS = 1024  # as Cohere's limit (1,000); each one is a decode


class DocumentIn(RequestModel):
    text: str


class RerankRequest(RequestModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    query: str
    documents: Annotated[list[str | DocumentIn], Field(min_length=1, max_length=MAX_DOCUMENTS)] | None = None
    texts: Annotated[list[str], Field(min_length=1, max_length=MAX_DOCUMENTS)] | None = Field(
        None, description="TEI's name for documents; the answer is then TEI's")
    top_n: int | None = Field(None, ge=1, le=INT32_MAX, description="at most this many results; all by default")
    return_documents: bool = Field(False, description="each result carries its document as {\"text\": ...}")
    return_text: bool = Field(False, description="TEI's: each result carries its text")

    @field_validator("documents", "texts", mode="before")
    @classmethod
    def _count(cls, value: Any) -> Any:
        return _at_most(value, MAX_DOCUMENTS, "documents")

    @property
    def tei(self) -> bool:
        return self.texts is not None

    def document_texts(self) -> list[str]:
        if self.texts is not None:
            return list(self.texts)
        return [d if isinstance(d, str) else d.text for d in self.documents or ()]


async def rerank(request: web.Request) -> web.Response:
    body = await parse_body(request, RerankRequest)
    if (body.documents is None) == (body.texts is None):
        raise ApiError(400, "documents: give the documents to rank as `documents` (or TEI's `texts`), once",
                       "invalid_value", param="documents")
    model = model_for(request, body.model)
    settings = model.controller.settings
    if not (settings.embeddings and settings.pooling == "rank"):
        raise ApiError(400, f"model {model.id!r} is not a reranker: load a reranker with embeddings = true and "
                            f"pooling = \"rank\" in its [models.ID] table, or name one", "reranking_not_enabled",
                       param="model")
    documents = body.document_texts()
    answer = await run_query(request, model, model.controller.new_query("rerank", "rerank", text=body.query,
                                                                        inputs=documents))
    if len(answer.embeddings) != len(documents) or not all(row for row in answer.embeddings):
        raise ApiError(500, "the worker answered rerank with the wrong number of scores", "internal_error")
    scores = [row[0] for row in answer.embeddings]
    if not all(math.isfinite(s) for s in scores):
        raise ApiError(500, "the reranker produced a score that is not a finite number", "internal_error")
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n]  # stable: ties keep their order
    if body.tei:
        return web.json_response([{"index": i, "score": scores[i], **({"text": documents[i]} if body.return_text else {})}
                                  for i in order])
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": documents[i]}} if body.return_documents else {})} for i in order]
    return web.json_response({"id": answer.request_id, "model": model.id, "object": "list",
                              "usage": {"prompt_tokens": answer.prompt_tokens, "total_tokens": answer.prompt_tokens},
                              "results": results})


def add_routes(app: web.Application) -> None:
    for path in ("/v1/rerank", "/rerank", "/reranking", "/v1/reranking"):
        app.router.add_post(path, rerank)
