"""Fill-in-the-middle (/infill, `suffix` on /v1/completions) and rerank
(/v1/rerank and its aliases) on the fake worker (the real protocol): the
shapes editor plugins and Jina/Cohere/TEI clients read, and hostile input for
every new endpoint and field: a 400 that names the field, never a 500, and
the daemon keeps answering. The real model's side is in
tests/e2e/test_infill_rerank.py."""

from __future__ import annotations

import json

import pytest

from daemon import protocol as p
from daemon.http.dialects.llama_server.infill import InfillRequest, pick_fields
from tests.integration.test_http_hardening import daemon, error_of

RERANK_PATHS = ["/v1/rerank", "/rerank", "/reranking", "/v1/reranking"]
DOCS = ["a cat sat", "tea with the hatter", "the dormouse sleeps at the tea party"]
# As llama.vim sends it (autoload/llama.vim, s:fim_on_... request): every field, the ignored ones included.
LLAMA_VIM = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n",
             "input_extra": [{"text": "x = 1\n", "time": 12.5, "filename": "util.py"}], "prompt": "return",
             "n_predict": 4, "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.90, "stream": False,
             "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
             "t_max_predict_ms": 1000, "response_fields": ["content", "timings/prompt_n", "timings/predicted_n",
                                                           "truncated", "tokens_cached", "timings/nothing"]}


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


FIM = {"input_prefix": "a", "input_suffix": "b"}
HOSTILE = [
    ("/infill", {}, "input_prefix"),
    ("/infill", {"input_suffix": ""}, "input_prefix"),
    ("/infill", {"input_prefix": "a"}, "input_suffix"),
    ("/infill", {"input_prefix": 5, "input_suffix": ""}, "input_prefix"),
    ("/infill", {"input_prefix": ["a"], "input_suffix": ""}, "input_prefix"),
    ("/infill", {**FIM, "input_extra": "x"}, "input_extra"),
    ("/infill", {**FIM, "input_extra": [{"filename": "a.py"}]}, "input_extra.0.text"),
    ("/infill", {**FIM, "input_extra": [{"text": 5}]}, "input_extra.0.text"),
    ("/infill", {**FIM, "input_extra": [{"text": "x", "filename": ["a"]}]}, "input_extra.0.filename"),
    ("/infill", {**FIM, "input_extra": [{"text": "x", "filename": "a" * 5000}]}, "input_extra.0.filename"),
    ("/infill", {**FIM, "input_extra": [{"text": "x"}] * 1025}, "input_extra"),
    ("/infill", {**FIM, "input_extra": nested(500)}, "input_extra"),
    ("/infill", {**FIM, "input_extra": [nested(100)]}, "input_extra.0"),
    ("/infill", {**FIM, "prompt": [1, 2]}, "prompt"),
    ("/infill", {**FIM, "prompt": 5}, "prompt"),
    ("/infill", {**FIM, "n_predict": -2}, "n_predict"),
    ("/infill", {**FIM, "n_predict": 10**12}, "n_predict"),
    ("/infill", {**FIM, "n": 2}, "n"),
    ("/infill", {**FIM, "n_probs": 100}, "n_probs"),
    ("/infill", {**FIM, "temperature": -1}, "temperature"),
    ("/infill", {**FIM, "response_fields": "content"}, "response_fields"),
    ("/infill", {**FIM, "response_fields": [5]}, "response_fields.0"),
    ("/infill", {**FIM, "response_fields": ["a"] * 65}, "response_fields"),
    ("/infill", {**FIM, "response_fields": ["a" * 300]}, "response_fields.0"),
    ("/infill", {**FIM, "cache_prompt": "sometimes"}, "cache_prompt"),
    ("/v1/completions", {"prompt": [1, 2], "suffix": "x"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "suffix": 5}, "suffix"),
    ("/v1/completions", {"prompt": "x", "suffix": ["a"]}, "suffix"),
    ("/v1/completions", {"prompt": "x", "suffix": nested(500)}, "suffix"),
]
for path in RERANK_PATHS[:1]:  # every alias is the same handler (test_rerank_aliases_answer_the_same)
    HOSTILE += [
        (path, {}, "query"),
        (path, {"documents": DOCS}, "query"),
        (path, {"query": 5, "documents": DOCS}, "query"),
        (path, {"query": ["q"], "documents": DOCS}, "query"),
        (path, {"query": "q"}, "documents"),
        (path, {"query": "q", "documents": []}, "documents"),
        (path, {"query": "q", "documents": "a cat"}, "documents"),
        (path, {"query": "q", "documents": [5]}, "documents.0"),
        (path, {"query": "q", "documents": [{"txt": "a"}]}, "documents.0"),
        (path, {"query": "q", "documents": ["a"] * 1025}, "documents"),
        (path, {"query": "q", "documents": nested(500)}, "documents"),
        (path, {"query": "q", "documents": [nested(100)]}, "documents.0"),
        (path, {"query": "q", "documents": DOCS, "texts": DOCS}, "documents"),
        (path, {"query": "q", "texts": []}, "texts"),
        (path, {"query": "q", "documents": DOCS, "top_n": 0}, "top_n"),
        (path, {"query": "q", "documents": DOCS, "top_n": -1}, "top_n"),
        (path, {"query": "q", "documents": DOCS, "top_n": 2**40}, "top_n"),
        (path, {"query": "q", "documents": DOCS, "top_n": "all"}, "top_n"),
        (path, {"query": "q", "documents": DOCS, "return_documents": "maybe"}, "return_documents"),
        (path, {"query": "q", "texts": DOCS, "return_text": [True]}, "return_text"),
    ]


@pytest.mark.parametrize("path, body, param", HOSTILE, ids=[f"{p} {param} {i}" for i, (p, _, param) in enumerate(HOSTILE)])
async def test_hostile_field_is_a_400_naming_it(path, body, param):
    async with daemon(embeddings="rank" in path, pooling="rank" if "rank" in path else "mean") as (controller, client):
        response = await client.post(path, json=body)
        error = await error_of(response, 400)
        assert (error["param"] or "").startswith(param), error
        assert error["type"] == "invalid_request_error"  # the OpenAI shape, as llama-server answers
        ok = "/v1/rerank" if "rank" in path else "/infill"
        good = {"query": "q", "documents": ["q"]} if "rank" in path else {**FIM, "n_predict": 1}
        assert (await client.post(ok, json=good)).status == 200


@pytest.mark.parametrize("path", ["/infill", *RERANK_PATHS])
async def test_new_endpoints_refuse_wrong_content_type_non_json_and_no_key(path):
    async with daemon(api_key="k") as (controller, client):
        auth = {"Authorization": "Bearer k"}
        response = await client.post(path, data=b"query=x", headers={**auth, "Content-Type": "text/plain"})
        assert response.status == 415
        deep = b'{"query": "q", "input_prefix": "a", "input_suffix": "b", "documents": ' + b"[" * 100_000
        for raw in (b"{not json", b"[1, 2]", b'"x"', b"[" * 100_000, deep + b"]" * 100_000 + b"}"):
            response = await client.post(path, data=raw, headers={**auth, "Content-Type": "application/json"})
            assert (await error_of(response, 400))["code"] == "invalid_json", raw[:10]
        body = {"query": "q", "documents": ["a"]} if "rank" in path else {**FIM, "n_predict": 2}
        assert (await client.post(path, json=body)).status == 401
        assert (await client.post(path, json=body, headers={"Authorization": "Bearer wrong"})).status == 401
        # With the key: the fake model is no reranker, so rerank is a 400 that says how to configure one.
        answer = await client.post(path, json=body, headers=auth)
        if "rank" in path:
            error = await error_of(answer, 400)
            assert error["code"] == "reranking_not_enabled" and 'pooling = "rank"' in error["message"]
        else:
            assert answer.status == 200


async def test_infill_answers_as_llama_server_to_what_llama_vim_sends():
    async with daemon() as (controller, client):
        r = await client.post("/infill", json=LLAMA_VIM)
        assert r.status == 200, await r.text()
        body = await r.json()
        # response_fields: llama-server's flattened picks; a path that is not there is left out.
        assert set(body) == {"content", "timings/prompt_n", "timings/predicted_n", "truncated", "tokens_cached"}
        assert body["content"] == "t0 t1 t2 t3 " and body["timings/predicted_n"] == 4 and body["truncated"] is False
        r = await client.post("/infill", json={**LLAMA_VIM, "response_fields": None, "n_predict": 2})
        body = await r.json()
        assert body["content"] == "t0 t1 " and body["stop"] is True and body["stop_type"] == "limit"
        assert body["tokens_predicted"] == 2 and "timings" in body and "generation_settings" in body
        # Streamed as /completion streams: data: lines, the last one with stop: true, no [DONE].
        r = await client.post("/infill", json={**LLAMA_VIM, "stream": True, "n_predict": 3})
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in (await r.text()).splitlines() if line.startswith("data: ")]
        assert "".join(e["content"] for e in events) == "t0 t1 t2 "
        assert [e["stop"] for e in events] == [False, False, False, True] and events[-1]["tokens_predicted"] == 3


async def test_a_model_without_fim_tokens_is_a_400_that_says_so(monkeypatch):
    monkeypatch.setenv("FAKE_NO_FIM", "1")
    async with daemon() as (controller, client):
        for path, body in (("/infill", FIM), ("/v1/completions", {"prompt": "a", "suffix": "b", "max_tokens": 2})):
            error = await error_of(await client.post(path, json=body), 400)
            assert "fill-in-the-middle" in error["message"], path
        stream = await client.post("/infill", json={**FIM, "stream": True})
        assert "fill-in-the-middle" in (await error_of(stream, 400))["message"]  # refused before the stream opens
        assert (await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})).status == 200


async def test_suffix_on_completions_fills_in_and_a_generation_only_model_refuses_rerank():
    async with daemon() as (controller, client):
        r = await client.post("/v1/completions", json={"prompt": "def f(", "suffix": "):\n", "max_tokens": 2})
        body = await r.json()
        assert r.status == 200 and body["choices"][0]["text"] == "t0 t1 "
        r = await client.post("/v1/completions", json={"prompt": ["def f("], "suffix": "", "max_tokens": 1, "n": 2})
        assert r.status == 200 and len((await r.json())["choices"]) == 2


async def test_infill_on_an_embeddings_model_is_refused():
    async with daemon(embeddings=True, pooling="rank") as (controller, client):
        error = await error_of(await client.post("/infill", json=FIM), 400)
        assert error["code"] == "model_not_generative"


async def test_rerank_orders_by_score_honours_top_n_and_return_documents():
    async with daemon(embeddings=True, pooling="rank") as (controller, client):
        query = "the dormouse at the tea party"
        r = await client.post("/v1/rerank", json={"model": "fake", "query": query, "documents": DOCS})
        body = await r.json()
        assert r.status == 200 and body["object"] == "list" and body["model"] == "fake"
        # The fake's score is the number of the query's words a document has: 5, 2, 0.
        assert [(x["index"], x["relevance_score"]) for x in body["results"]] == [(2, 5.0), (1, 2.0), (0, 0.0)]
        assert all("document" not in x for x in body["results"])
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
        r = await client.post("/v1/rerank", json={"query": query, "documents": [{"text": d} for d in DOCS], "top_n": 2,
                                                  "return_documents": True})
        results = (await r.json())["results"]
        assert [(x["index"], x["document"]) for x in results] == [(2, {"text": DOCS[2]}), (1, {"text": DOCS[1]})]
        r = await client.post("/v1/rerank", json={"query": query, "documents": DOCS, "top_n": 99})
        assert len((await r.json())["results"]) == 3
        # Ties keep the documents' order.
        r = await client.post("/v1/rerank", json={"query": "zzz", "documents": ["a", "b", "c"]})
        assert [x["index"] for x in (await r.json())["results"]] == [0, 1, 2]
        # TEI's request (texts) gets TEI's answer: a bare list, text with return_text.
        r = await client.post("/rerank", json={"query": query, "texts": DOCS, "return_text": True, "top_n": 1})
        assert (await r.json()) == [{"index": 2, "score": 5.0, "text": DOCS[2]}]
        # A reranker has no embeddings and no generation.
        assert (await client.post("/v1/completions", json={"prompt": "x"})).status == 400


async def test_rerank_aliases_answer_the_same():
    async with daemon(embeddings=True, pooling="rank") as (controller, client):
        answers = []
        for path in RERANK_PATHS:
            r = await client.post(path, json={"query": "tea party", "documents": DOCS, "top_n": 2})
            assert r.status == 200, path
            body = await r.json()
            answers.append((body["results"], body["usage"]))
        assert all(a == answers[0] for a in answers)


def test_infill_request_maps_onto_the_protocol():
    body = InfillRequest.model_validate({**LLAMA_VIM, "input_extra": [{"text": "x = 1\n", "filename": "util.py"},
                                                                       {"text": "y"}]})
    assert body.to_protocol() == p.Infill("def add(a, b):\n    ", "\n\nprint(add(1, 2))\n",
                                          [("util.py", "x = 1\n"), ("tmp", "y")], "return")
    # null means "not given" (RequestModel): the defaults.
    assert InfillRequest.model_validate({**FIM, "input_extra": None, "prompt": None}).to_protocol() == p.Infill("a", "b")
    # The message survives the wire.
    submit = p.Submit("r", p.SamplingParams(), infill=body.to_protocol())
    assert p.decode_for_worker(p.encode(submit)[4:]) == submit


def test_pick_fields_is_llama_servers_nested_pick():
    answer = {"content": "x", "timings": {"prompt_n": 3}, "stop": True}
    assert pick_fields(answer, ["content", "timings/prompt_n", "timings/nope", "stop/deeper", "missing"]) == {
        "content": "x", "timings/prompt_n": 3}
