"""The wider API's fields and endpoints under hostile input, on the fake
worker (the real protocol): every refusal is a 400 that names the field,
nothing reaches the worker that it cannot take, and the daemon keeps
answering. The real model's side is in tests/e2e/test_wider_api.py."""

from __future__ import annotations

import pytest

from tests.integration.test_http_hardening import daemon, error_of

ASK = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


HOSTILE = [
    ("/v1/chat/completions", {"messages": ASK, "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"messages": ASK, "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"messages": ASK, "response_format": "json"}, "response_format"),
    ("/v1/completions", {"prompt": "x", "json_schema": nested(200)}, "json_schema"),
    ("/v1/completions", {"prompt": "x", "json_schema": {"$ref": "https://example.com/s.json"}}, "json_schema"),
    # Enforced since llguidance (number ranges, multipleOf); these two it cannot enforce:
    ("/v1/completions", {"prompt": "x", "json_schema": {"type": "array", "uniqueItems": True}}, "json_schema"),
    ("/v1/completions", {"prompt": "x", "json_schema": {"type": "string", "x-guidance": {"lenient": True}}},
     "json_schema"),
    ("/v1/completions", {"prompt": "x", "grammar": "root ::= \"a\"" + " " * 100_000}, "grammar"),
    ("/v1/completions", {"prompt": "x", "grammar": 5}, "grammar"),
    # Found by review: each of these killed or hung the worker inside llama_sampler_init_grammar.
    ("/v1/completions", {"prompt": "x", "grammar": "root ::= " + "(" * 20000 + '"a"' + ")" * 20000}, "grammar"),
    ("/v1/completions", {"prompt": "x", "grammar": 'root ::= "a"{5,2}'}, "grammar"),
    ("/v1/completions", {"prompt": "x", "grammar": 'root ::= "a"{0,100000}'}, "grammar"),
    ("/v1/completions", {"prompt": "x", "grammar": "root ::= " + " ".join(["[a-z]?"] * 300)}, "grammar"),
    # ... and from the second review: a comment ended by \r hid the rest from the scan; repetitions expand.
    ("/v1/completions", {"prompt": "x", "grammar": 'root ::= "a" # c\rx ::= "b"{5,2}'}, "grammar"),
    ("/v1/completions", {"prompt": "x", "grammar": 'root ::= "a" # c\rx ::= ' + "(" * 30000 + '"a"' + ")" * 30000},
     "grammar"),
    ("/v1/completions", {"prompt": "x", "grammar": "root ::= " + '"a"{1000}' * 5000}, "grammar"),
    ("/v1/completions", {"prompt": "x", "grammar": 'root ::= "' + "a" * 60000 + '"{1000}'}, "grammar"),
    # ... and from the third: the GBNF reader's time grows with the square of the rules (2,000: ~10 s)
    ("/v1/completions", {"prompt": "x", "grammar": "".join(f'a{i} ::= "" | "k{i}" a{i + 1}\n' for i in range(600))
                         + 'a600 ::= "end"\nroot ::= a0\n'}, "grammar"),
    ("/v1/completions", {"prompt": "x", "grammar": "root ::= \"a\"", "json_schema": {"type": "string"}}, "grammar"),
    ("/v1/chat/completions", {"messages": ASK, "tools": [TOOL] * 129}, "tools"),
    ("/v1/chat/completions", {"messages": ASK, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ("/v1/chat/completions", {"messages": ASK, "tools": [{"type": "retrieval"}]}, "tools"),
    ("/v1/chat/completions", {"messages": ASK, "tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": ASK, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": ASK, "tools": [TOOL],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}] * 200}]},
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"messages": ASK, "functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ("/v1/chat/completions", {"messages": ASK, "function_call": {"name": "f"}}, "function_call"),
    ("/v1/chat/completions", {"messages": ASK, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": ASK, "logprobs": "maybe"}, "logprobs"),
    ("/v1/chat/completions", {"messages": ASK, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 10**9}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "n": 5}, "n"),  # more choices than the 4 slots
    ("/completion", {"prompt": "x", "n": 2}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": ["x"] * 257}, "input"),
    ("/v1/embeddings", {"input": [-1]}, "input"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "x", "dimensions": 8}, "dimensions"),
    ("/v1/embeddings", {"input": 5}, "input"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {}, "content"),
    ("/detokenize", {"tokens": [1, -2]}, "tokens"),
    ("/detokenize", {"tokens": list(range(5000))}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/apply-template", {"messages": []}, "messages"),
    ("/apply-template", {"messages": ASK, "tools": [TOOL] * 129}, "tools"),
    ("/completion", {"prompt": "x", "n_predict": -2}, "n_predict"),
    ("/completion", {"prompt": "x", "n_predict": 10**9}, "n_predict"),
    ("/completion", {"prompt": "x", "n_probs": 100}, "n_probs"),
    ("/completion", {"prompt": [2**40]}, "prompt"),
]


@pytest.mark.parametrize("path, body, param", HOSTILE, ids=[f"{p} {param} {i}" for i, (p, _, param) in enumerate(HOSTILE)])
async def test_hostile_field_is_a_400_naming_it(path, body, param):
    async with daemon(ctx_size=4096, raw_grammar=True) as (controller, client):
        response = await client.post(path, json=body)
        error = await error_of(response, 400)
        assert (error["param"] or "").startswith(param), error
        ok = await client.post("/v1/completions", json={"prompt": "still here", "max_tokens": 2})
        assert ok.status == 200


async def test_raw_grammar_is_on_unless_the_operator_turns_it_off():
    body = {"prompt": "x", "grammar": 'root ::= "a"', "max_tokens": 2}
    async with daemon() as (controller, client):  # llama-server's default: its clients send raw grammars
        assert (await client.post("/v1/completions", json=body)).status == 200
    async with daemon(raw_grammar=False) as (controller, client):
        error = await error_of(await client.post("/v1/completions", json=body), 400)
        assert error["param"] == "grammar" and "raw_grammar = false" in error["message"]
        schema = {"prompt": "x", "json_schema": {"type": "string"}, "max_tokens": 2}
        assert (await client.post("/v1/completions", json=schema)).status == 200  # schemas are always on


@pytest.mark.parametrize("path", ["/v1/embeddings", "/tokenize", "/detokenize", "/apply-template", "/completion"])
async def test_new_endpoints_refuse_wrong_content_type_and_non_json(path):
    async with daemon() as (controller, client):
        response = await client.post(path, data=b"content=x", headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert response.status == 415
        response = await client.post(path, data=b"{not json", headers={"Content-Type": "application/json"})
        assert (await error_of(response, 400))["code"] == "invalid_json"
        response = await client.post(path, data=b"[1, 2]", headers={"Content-Type": "application/json"})
        assert (await error_of(response, 400))["code"] == "invalid_json"


async def test_new_endpoints_need_the_api_key():
    async with daemon(api_key="k") as (controller, client):
        for path, body in (("/tokenize", {"content": "x"}), ("/completion", {"prompt": "x", "n_predict": 2}),
                           ("/v1/embeddings", {"input": "x"}), ("/detokenize", {"tokens": [1]}),
                           ("/apply-template", {"messages": ASK})):
            assert (await client.post(path, json=body)).status == 401, path
            ok = await client.post(path, json=body, headers={"Authorization": "Bearer k"})
            assert ok.status in (200, 400), path  # 400: embeddings from a model without them


async def test_a_query_wakes_a_sleeping_model_and_races_a_sleep_without_loss():
    """A query is a request to the state machine: asleep, it wakes the model; sent beside /sleep, either
    the sleep waits for it (409) or it wakes the model again; it is answered either way."""
    import asyncio

    async with daemon() as (controller, client):
        assert (await client.post("/sleep")).status == 200
        r = await client.post("/tokenize", json={"content": "a b"})
        assert r.status == 200 and (await r.json())["tokens"] == [1, 1]
        for _ in range(5):
            sleep, query = await asyncio.gather(client.post("/sleep"), client.post("/detokenize", json={"tokens": [7]}))
            assert sleep.status in (200, 409) and query.status == 200
            assert (await query.json()) == {"content": "w7"}


async def test_queries_round_trip_through_the_worker_protocol():
    """The fake worker answers queries as the real protocol says; the shapes are llama-server's."""
    async with daemon() as (controller, client):
        r = await client.post("/tokenize", json={"content": "ab cde", "with_pieces": True})
        assert (await r.json()) == {"tokens": [{"id": 2, "piece": "ab"}, {"id": 3, "piece": "cde"}]}
        r = await client.post("/detokenize", json={"tokens": [4, 5]})
        assert (await r.json()) == {"content": "w4 w5"}
        r = await client.post("/apply-template", json={"messages": ASK})
        assert (await r.json()) == {"prompt": "user: hi\n"}
        r = await client.post("/completion", json={"prompt": "x", "n_predict": 3})
        body = await r.json()
        assert body["stop"] is True and body["tokens_predicted"] == 3 and body["content"] == "t0 t1 t2 "
        assert body["timings"]["predicted_n"] == 3
        r = await client.post("/v1/embeddings", json={"input": "x"})
        assert (await error_of(r, 400))["code"] == "embeddings_not_enabled"


async def test_embeddings_model_answers_embeddings_and_refuses_generation():
    async with daemon(embeddings=True) as (controller, client):
        r = await client.post("/v1/embeddings", json={"input": ["a", "b"]})
        body = await r.json()
        assert [d["index"] for d in body["data"]] == [0, 1] and body["usage"]["prompt_tokens"] == 2
        r = await client.post("/v1/chat/completions", json={"messages": ASK})
        assert (await error_of(r, 400))["code"] == "model_not_generative"


async def test_n_choices_come_back_as_n_choices_streamed_and_not():
    """The worker protocol's choices (Tokens.index, each choice's finish_reason) become OpenAI's choices."""
    async with daemon() as (controller, client):
        r = await client.post("/v1/chat/completions", json={"messages": ASK, "n": 3, "max_tokens": 2})
        body = await r.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert [c["message"]["content"] for c in body["choices"]] == [f"c{i}t0 c{i}t1 " for i in range(3)]
        assert all(c["finish_reason"] == "length" for c in body["choices"]) and body["usage"]["completion_tokens"] == 6
        r = await client.post("/v1/completions", json={"prompt": "x", "n": 2, "max_tokens": 2, "stream": True})
        texts, reasons = {0: "", 1: ""}, {}
        for line in (await r.text()).splitlines():
            if line.startswith("data: {"):
                import json

                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] += c["text"]
                    if c["finish_reason"]:
                        reasons[c["index"]] = c["finish_reason"]
        assert texts == {0: "c0t0 c0t1 ", 1: "c1t0 c1t1 "} and reasons == {0: "length", 1: "length"}
        timed = [line for line in (await r.text()).splitlines() if '"timings"' in line]
        assert len(timed) == 1  # the last choice's last chunk carries the request's timings, as with one choice
