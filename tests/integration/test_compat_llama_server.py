"""Dormouse as a drop-in for llama-server (issue 17, section 7): requests in
llama-server's shapes, on its routes, and the fields it answers with, on a
fake worker speaking the real protocol (tests/fixtures/compat_fake_worker.py
records what reached the worker). What needs the real model (text keys
tokenized, post-sampling probabilities computed, a draft model's counts) is
in tests/e2e/test_compat_llama_server_e2e.py."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
from contextlib import asynccontextmanager

import pytest

from config import ConfigError, load_settings
from tests.conftest import fake_daemon, fake_fleet
from tests.integration.test_http_hardening import error_of, ready

COMPAT = "tests.fixtures.compat_fake_worker"
ASK = [{"role": "user", "content": "hi"}]
# ctx_size 256 over 4 slots: a request without a limit ends at 64 tokens, quickly.
SMALL = {"worker_module": COMPAT, "ctx_size": 256}


@pytest.fixture
def submits(tmp_path, monkeypatch):
    """What each Submit asked of the worker, in order (its SamplingParams as builtins)."""
    path = tmp_path / "submits.jsonl"
    monkeypatch.setenv("FAKE_SUBMIT_LOG", str(path))
    monkeypatch.setenv("FAKE_TOKEN_SECONDS", "0.001")

    def read() -> list[dict]:
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    return read


@asynccontextmanager
async def compat(**overrides):
    async with fake_daemon(**{**SMALL, **overrides}) as (controller, client):
        await ready(controller)
        yield controller, client


async def sse(response) -> list[dict]:
    assert response.status == 200, await response.text()
    lines = (await response.text()).split("\n\n")
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


# -- routes: each beside its /v1/ form -------------------------------------------


async def test_unversioned_aliases_answer_as_their_v1_forms(submits):
    async with compat() as (controller, client):
        chat = await client.post("/chat/completions", json={"messages": ASK, "max_tokens": 2})
        assert chat.status == 200 and (await chat.json())["object"] == "chat.completion"
        text = await client.post("/completions", json={"prompt": "hi", "max_tokens": 2})
        native = await text.json()  # llama-server's native completion there, as on /completion (OpenAI's: /v1/)
        assert text.status == 200 and isinstance(native["content"], str) and "object" not in native
        assert native["tokens_predicted"] == 2 and native["stop"] is True
        listed = await (await client.get("/models")).json()
        assert listed == await (await client.get("/v1/models")).json() and listed["data"][0]["id"] == "fake"
        health = await client.get("/v1/health")
        assert health.status == 200 and (await health.json())["status"] == "ok"


async def test_v1_health_is_a_probe_behind_the_metrics_key():
    async with compat(metrics_key="m", api_key="k") as (controller, client):
        assert (await client.get("/v1/health")).status == 401
        assert (await client.get("/v1/health", headers={"Authorization": "Bearer m"})).status == 200


def test_system_fingerprint_follows_the_model_file_not_the_process(tmp_path):
    from daemon.http.dialects.openai.shapes import _fingerprint, system_fingerprint

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"a" * 4096)
    first = system_fingerprint(str(model))
    _fingerprint.cache_clear()  # as a restart
    assert system_fingerprint(str(model)) == first
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(model.read_bytes())
    assert system_fingerprint(str(copy)) == first  # the same build of the same file
    model.write_bytes(b"GGUF" + b"b" * 4096)
    assert system_fingerprint(str(model)) != first


@pytest.mark.parametrize("path, body", [("/completion", {"prompt": "x"}),
                                        ("/infill", {"input_prefix": "a", "input_suffix": "b", "input_extra": []})])
async def test_n_predict_0_reads_the_prompt_and_predicts_nothing(path, body):
    """Editor plugins warm the cache with n_predict 0 (llama.vim's ring update): an answer, not an error.
    On the real worker: tests/e2e/test_infill_rerank.py (and that the next request finds the cache)."""
    async with compat() as (controller, client):
        response = await client.post(path, json={**body, "n_predict": 0})
        answer = await response.json()
        assert response.status == 200, answer
        assert (answer["content"], answer["tokens_predicted"], answer["stop_type"]) == ("", 0, "limit")
        assert answer["generation_settings"]["n_predict"] == 0
        streamed = await client.post(path, json={**body, "n_predict": 0, "stream": True})
        events = [line for line in (await streamed.text()).splitlines() if line.startswith("data: ")]
        assert json.loads(events[-1][6:])["stop"] is True and json.loads(events[-1][6:])["tokens_predicted"] == 0


async def test_embeddings_alias():
    async with compat(embeddings=True) as (controller, client):
        response = await client.post("/embeddings", json={"input": ["a", "b"]})
        body = await response.json()
        assert response.status == 200 and [d["index"] for d in body["data"]] == [0, 1], body


async def test_aliases_keep_their_keys_and_probes():
    async with compat(api_key="k") as (controller, client):
        for path, body in (("/chat/completions", {"messages": ASK}), ("/completions", {"prompt": "x"}),
                           ("/embeddings", {"input": "x"})):
            assert (await client.post(path, json=body)).status == 401, path
        assert (await client.get("/models")).status == 401
        assert (await client.get("/v1/models/fake")).status == 401
        assert (await client.get("/v1/health")).status == 200  # a probe, as /health
        keyed = await client.post("/chat/completions", json={"messages": ASK, "max_tokens": 1},
                                  headers={"Authorization": "Bearer k"})
        assert keyed.status == 200


async def test_one_model_by_id_or_alias_and_404_in_openai_shape():
    async with fake_daemon(worker_module=COMPAT, models={"chat": {"aliases": ["gpt-4o-mini"]}, "other": {}}) as (
            fleet, client):
        one = await (await client.get("/v1/models/chat")).json()
        listed = (await (await client.get("/v1/models")).json())["data"][0]
        assert one["id"] == "chat" and one["object"] == "model" and one.keys() == listed.keys()
        assert (await (await client.get("/v1/models/gpt-4o-mini")).json())["id"] == "chat"
        for name in ("nope", "x" * 5000, "a/b/c", "%00"):
            error = await error_of(await client.get(f"/v1/models/{name}"), 404)
            assert error["code"] == "model_not_found" and error["type"] == "not_found_error", name


# -- logit_bias: [[id, bias]] lists, text keys, false bans -------------------------


async def test_logit_bias_lists_text_keys_and_bans_reach_the_worker(submits):
    async with compat() as (controller, client):
        for body in ({"logit_bias": [[15, 2.5], ["Hello", -1], [7, False]]},
                     {"logit_bias": {"15": 2.5, "Hello": -1, "7": False}}):
            response = await client.post("/completion", json={"prompt": "hi", "n_predict": 1, **body})
            assert response.status == 200, await response.text()
        for params in submits():
            assert params["logit_bias"] == {"15": 2.5, "7": -math.inf}
            assert params["logit_bias_text"] == [["Hello", -1.0]]


async def test_a_list_pair_of_digits_is_text_and_an_object_key_of_digits_an_id(submits):
    async with compat() as (controller, client):
        await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "logit_bias": [["42", 1]]})
        await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "logit_bias": {"42": 1}})
        listed, keyed = submits()
        assert listed.get("logit_bias", {}) == {} and listed["logit_bias_text"] == [["42", 1.0]]
        assert keyed["logit_bias"] == {"42": 1.0} and "logit_bias_text" not in keyed


async def test_logit_bias_entries_for_one_token_add_up(submits):
    async with compat() as (controller, client):
        await client.post("/chat/completions", json={"messages": ASK, "max_tokens": 1,
                                                     "logit_bias": [[3, 1], [3, 2.5], [4, False], [4, 3]]})
        assert submits()[0]["logit_bias"] == {"3": 3.5, "4": -math.inf}


HOSTILE_BIAS = [
    ([[1]], "pairs"),
    ([[1, 2, 3]], "pairs"),
    ([1, 2], "pairs"),
    ([[True, 1]], "a bias is a number"),
    ([[1, True]], "a bias is a number"),
    ({"1": True}, "a bias is a number"),
    ([[1, 101]], "[-100, 100]"),
    ({"Hello": -1000}, "[-100, 100]"),
    ([[1, "a lot"]], "logit_bias"),
    ([["", 1]], "logit_bias"),
    ([["x" * 257, 1]], "logit_bias"),
    ({"x" * 257: 1}, "1 to 256 characters"),
    ({"": 1}, "1 to 256 characters"),
    ({"-5": 1}, "token ids"),
    ({"+5": 1}, "token ids"),
    ({"²": 1}, "token ids"),
    ([[-1, 1]], "logit_bias"),
    ([[2**31, 1]], "logit_bias"),
    ({str(i): 1 for i in range(1025)}, "at most 1024"),
    ([[i, 1] for i in range(1025)], "at most 1024"),
    ([[i, 1] for i in range(40_000)], "at most 1024"),
    ("Hello", "logit_bias"),
    (5, "logit_bias"),
    ([[[[[[1]]]]]], "logit_bias"),
    ({"1": {"2": 3}}, "logit_bias"),
]


@pytest.mark.parametrize("bias,needle", HOSTILE_BIAS, ids=[repr(b)[:40] for b, _ in HOSTILE_BIAS])
async def test_hostile_logit_bias_is_400_naming_it_on_every_route(bias, needle):
    async with compat() as (controller, client):
        for path, body in (("/completion", {"prompt": "x"}), ("/v1/chat/completions", {"messages": ASK}),
                           ("/completions", {"prompt": "x"})):
            error = await error_of(await client.post(path, json={**body, "logit_bias": bias}), 400)
            assert error["param"].startswith("logit_bias") and needle in error["message"], (path, error)
        assert (await client.post("/completion", json={"prompt": "x", "n_predict": 1})).status == 200


async def test_deeply_nested_logit_bias_is_refused_as_json():
    async with compat() as (controller, client):
        raw = '{"prompt": "x", "logit_bias": ' + "[" * 100_000 + "]" * 100_000 + "}"
        response = await client.post("/completion", data=raw, headers={"Content-Type": "application/json"})
        error = await error_of(response, 400)
        assert error["code"] == "invalid_json" or error["param"] == "logit_bias", error
        assert (await client.post("/completion", json={"prompt": "x", "n_predict": 1})).status == 200


# -- /completion: n_probs with post_sampling_probs, tokens / return_tokens --------


async def test_n_probs_are_logprobs_and_post_sampling_probs_are_probabilities(submits):
    async with compat() as (controller, client):
        plain = await (await client.post("/completion", json={"prompt": "hi", "n_predict": 3, "n_probs": 2})).json()
        entry = plain["completion_probabilities"][0]
        assert set(entry) == {"id", "token", "bytes", "logprob", "top_logprobs"}
        assert set(entry["top_logprobs"][0]) == {"id", "token", "bytes", "logprob"} and len(entry["top_logprobs"]) == 2
        post = await (await client.post("/completion", json={"prompt": "hi", "n_predict": 3, "n_probs": 2,
                                                             "post_sampling_probs": True})).json()
        assert len(post["completion_probabilities"]) == 3
        for entry in post["completion_probabilities"]:
            assert set(entry) == {"id", "token", "bytes", "prob", "top_probs"}
            assert 0 < entry["prob"] <= 1 and len(entry["top_probs"]) == 2
            probs = [t["prob"] for t in entry["top_probs"]]
            assert probs == sorted(probs, reverse=True) and sum(probs) <= 1 + 1e-9
            assert set(entry["top_probs"][0]) == {"id", "token", "bytes", "prob"}
        settings = post["generation_settings"]
        assert settings["post_sampling_probs"] is True and settings["n_probs"] == 2
        first, second = submits()
        assert first["logprobs"] == 2 and not first.get("post_sampling_probs")
        assert second["logprobs"] == 2 and second["post_sampling_probs"] is True


async def test_post_sampling_probs_without_n_probs_asks_for_nothing(submits):
    async with compat() as (controller, client):
        body = await (await client.post("/completion", json={"prompt": "hi", "n_predict": 2,
                                                             "post_sampling_probs": True})).json()
        assert "completion_probabilities" not in body
        assert "logprobs" not in submits()[0] and not submits()[0].get("post_sampling_probs")


async def test_post_sampling_probs_stream(submits):
    async with compat() as (controller, client):
        chunks = await sse(await client.post("/completion", json={"prompt": "hi", "n_predict": 2, "n_probs": 1,
                                                                  "post_sampling_probs": True, "stream": True}))
        probs = [c["completion_probabilities"][0] for c in chunks if c.get("completion_probabilities")]
        assert len(probs) == 2 and all("prob" in e and "top_probs" in e for e in probs)
        assert chunks[-1]["stop"] is True and chunks[-1]["generation_settings"]["post_sampling_probs"] is True


async def test_return_tokens_gives_the_generated_ids(submits):
    async with compat() as (controller, client):
        body = await (await client.post("/completion", json={"prompt": "hi", "n_predict": 3,
                                                             "return_tokens": True})).json()
        assert body["tokens"] == [100, 101, 102] and "completion_probabilities" not in body
        assert submits()[0]["logprobs"] == 0  # the ids travel with the chosen token's entry
        plain = await (await client.post("/completion", json={"prompt": "hi", "n_predict": 3})).json()
        assert plain["tokens"] == [] and "logprobs" not in submits()[1]
        chunks = await sse(await client.post("/completion", json={"prompt": "hi", "n_predict": 3, "stream": True,
                                                                  "return_tokens": True}))
        assert [t for c in chunks for t in c["tokens"]] == [100, 101, 102] and chunks[-1]["tokens"] == []
        assert all(c["index"] == 0 for c in chunks)


async def test_native_answer_has_llama_servers_fields():
    async with compat() as (controller, client):
        body = await (await client.post("/completion", json={"prompt": "hi", "n_predict": 2, "temperature": 0.5,
                                                             "top_k": 7})).json()
        for key in ("index", "content", "tokens", "stop", "model", "tokens_predicted", "tokens_evaluated",
                    "generation_settings", "has_new_line", "truncated", "stop_type", "tokens_cached", "timings"):
            assert key in body, key
        settings = body["generation_settings"]
        assert settings["temperature"] == 0.5 and settings["top_k"] == 7 and settings["n_predict"] == 2
        assert settings["samplers"] == ["penalties", "top_k", "top_p", "min_p", "temperature"]


@pytest.mark.parametrize("fields,param", [
    ({"post_sampling_probs": "maybe"}, "post_sampling_probs"),
    ({"return_tokens": 5}, "return_tokens"),
    ({"return_tokens": [True]}, "return_tokens"),
    ({"n_probs": 21}, "n_probs"),
    ({"n_probs": -1}, "n_probs"),
    ({"n_predict": -2}, "n_predict"),
    ({"n_predict": 2**40}, "n_predict"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"seed": -2}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"temperature": "hot"}, "temperature"),
])
async def test_hostile_native_fields_are_400_naming_them(fields, param):
    async with compat() as (controller, client):
        error = await error_of(await client.post("/completion", json={"prompt": "x", **fields}), 400)
        assert error["param"] == param and param in error["message"], error


async def test_wrong_content_type_on_the_aliases_is_415():
    async with compat() as (controller, client):
        for path in ("/chat/completions", "/completions", "/embeddings"):
            response = await client.post(path, data=b'{"prompt": "x"}', headers={"Content-Type": "text/plain"})
            assert response.status == 415, path


# -- system_fingerprint and draft timings ------------------------------------------


async def test_system_fingerprint_on_bodies_and_every_chunk_and_stable():
    async with compat() as (controller, client):
        seen = set()
        for path, body in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "hi"})):
            answer = await (await client.post(path, json={**body, "max_tokens": 2})).json()
            seen.add(answer["system_fingerprint"])
            chunks = await sse(await client.post(path, json={**body, "max_tokens": 2, "stream": True,
                                                             "stream_options": {"include_usage": True}}))
            seen.update(c["system_fingerprint"] for c in chunks)
        assert len(seen) == 1 and re.fullmatch(r"b[0-9.]+-[0-9a-f]{8}", seen.pop())


async def test_timings_carry_draft_counts_when_a_draft_proposed(monkeypatch, submits):
    async with compat() as (controller, client):
        plain = await (await client.post("/completion", json={"prompt": "hi", "n_predict": 2})).json()
        assert "draft_n" not in plain["timings"] and "draft_n_accepted" not in plain["timings"]
    monkeypatch.setenv("FAKE_DRAFTED", "5")
    async with compat() as (controller, client):
        for path, body in (("/completion", {"prompt": "hi", "n_predict": 2}),
                           ("/v1/chat/completions", {"messages": ASK, "max_tokens": 2})):
            timings = (await (await client.post(path, json=body)).json())["timings"]
            assert timings["draft_n"] == 5 and timings["draft_n_accepted"] == 4, (path, timings)
        chunks = await sse(await client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2,
                                                                           "stream": True}))
        assert [c["timings"]["draft_n"] for c in chunks if "timings" in c] == [5]


# -- /props, /slots, /models/load ----------------------------------------------------


async def test_props_default_generation_settings_are_the_servers():
    async with compat(n_predict=12, seed=7, temperature=0.3) as (controller, client):
        props = await (await client.get("/props")).json()
        settings = props["default_generation_settings"]
        assert settings["n_ctx"] == 64
        params = settings["params"]
        assert params["n_predict"] == 12 and params["max_tokens"] == 12 and params["seed"] == 7
        assert params["temperature"] == 0.3 and params["top_k"] == 40 and params["n_probs"] == 0
    async with compat() as (controller, client):
        params = (await (await client.get("/props")).json())["default_generation_settings"]["params"]
        assert params["n_predict"] == -1 and params["seed"] == -1 and params["temperature"] == 0.8


async def test_slots_say_is_processing_beside_the_state(monkeypatch):
    monkeypatch.setenv("FAKE_TOKEN_SECONDS", "0.05")
    async with compat(parallel=2, model_draft=None) as (controller, client):
        asleep = await (await client.get("/slots")).json()
        assert [s["is_processing"] for s in asleep] == [False, False]
        assert all(s["n_ctx"] == 128 and s["speculative"] is False for s in asleep)
        pending = asyncio.create_task(client.post("/completion", json={"prompt": "hi", "n_predict": 20}))
        for _ in range(200):
            slots = await (await client.get("/slots")).json()
            if any(s["is_processing"] for s in slots):
                break
            await asyncio.sleep(0.01)
        assert [(s["state"] != "idle", s["is_processing"]) for s in slots] == [(True, True), (False, False)]
        props = await (await client.get("/props")).json()
        assert props["slots"][0]["is_processing"] is True
        assert (await pending).status == 200


async def test_models_load_and_unload_answer_success():
    async with fake_daemon(worker_module=COMPAT, models={"a": {}, "b": {}}) as (fleet, client):
        loaded = await client.post("/models/load", json={"model": "b"})
        body = await loaded.json()
        assert loaded.status == 200 and body["success"] is True and body["state"] == "ready", body
        unloaded = await client.post("/models/unload", json={"model": "b"})
        body = await unloaded.json()
        assert unloaded.status == 200 and body["success"] is True and body["state"] == "sleeping", body
        error = await error_of(await client.post("/models/load", json={"model": "nope"}), 404)
        assert error["code"] == "model_not_found"
        assert (await client.post("/models/load", json={})).status == 400


async def test_slot_erase_as_curl_sends_it_needs_no_body(tmp_path):
    """`curl -X POST '.../slots/0?action=erase'`: no body, no Content-Type, as llama-server takes it;
    save still needs its filename (a 400 naming the body, not a 415)."""
    async with fake_daemon(slot_save_path=str(tmp_path)) as (fleet, client):
        erased = await client.post("/slots/0?action=erase", data=None, skip_auto_headers=("Content-Type",))
        assert erased.status == 200 and (await erased.json()) == {"id_slot": 0, "n_erased": 7}
        error = await error_of(await client.post("/slots/0?action=save", skip_auto_headers=("Content-Type",)), 400)
        assert "JSON" in error["message"]
        assert (await client.post("/slots/0?action=erase", data=b"x", headers={"Content-Type": "text/plain"})
                ).status == 415  # a body of another type is still refused


# -- server-wide sampling defaults ---------------------------------------------------


async def test_requests_without_a_limit_take_the_servers_n_predict(submits):
    async with compat(n_predict=5, seed=7, temperature=0.3) as (controller, client):
        native = await (await client.post("/completion", json={"prompt": "hi"})).json()
        assert native["tokens_predicted"] == 5
        text = await (await client.post("/v1/completions", json={"prompt": "hi"})).json()
        assert text["usage"]["completion_tokens"] == 5
        chat = await (await client.post("/chat/completions", json={"messages": ASK})).json()
        assert chat["usage"]["completion_tokens"] == 5
        for params in submits():
            assert (params["max_tokens"], params["seed"], params["temperature"]) == (5, 7, 0.3)
        # A request's own values win.
        await client.post("/completion", json={"prompt": "hi", "n_predict": 2, "seed": 1, "temperature": 0})
        await client.post("/completion", json={"prompt": "hi", "max_tokens": 3, "seed": -1})
        await client.post("/v1/chat/completions", json={"messages": ASK, "max_completion_tokens": 4})
        own, alias, chat_own = submits()[3:]
        assert (own["max_tokens"], own["seed"], own["temperature"]) == (2, 1, 0.0)
        assert alias["max_tokens"] == 3 and "seed" not in alias  # -1: random, as llama-server
        assert chat_own["max_tokens"] == 4


SAMPLING = {"top_k": 20, "top_p": 0.8, "min_p": 0.0, "repeat_penalty": 1.05, "repeat_last_n": 128,
            "presence_penalty": 1.5, "frequency_penalty": 0.1}


async def test_requests_take_the_servers_sampler_settings_and_their_own_win(submits):
    # llama-server's --top-k, --top-p, --min-p and penalties (a model's recommended sampling, in llama-swap's lines)
    async with compat(**SAMPLING) as (controller, client):
        await client.post("/completion", json={"prompt": "hi"})
        await client.post("/v1/completions", json={"prompt": "hi"})
        await client.post("/v1/chat/completions", json={"messages": ASK})
        await client.post("/api/chat", json={"model": "default", "messages": ASK, "stream": False})
        await client.post("/v1/messages", json={"model": "m", "max_tokens": 4, "messages": ASK})
        for params in submits():
            assert {key: params.get(key) for key in SAMPLING} == SAMPLING, params
        own = {"top_k": 3, "top_p": 0.5, "min_p": 0.2, "repeat_penalty": 1.3, "repeat_last_n": 8,
               "presence_penalty": -1.0, "frequency_penalty": 0.7}
        await client.post("/completion", json={"prompt": "hi", **own})
        await client.post("/v1/chat/completions", json={"messages": ASK, **own})
        await client.post("/api/chat", json={"model": "default", "messages": ASK, "stream": False, "options": own})
        for params in submits()[5:]:
            assert {key: params.get(key) for key in own} == own, params
        # the Responses object echoes the values used, the server's where the request named none
        echoed = await (await client.post("/v1/responses", json={"model": "m", "input": "hi"})).json()
        assert echoed["top_p"] == SAMPLING["top_p"] and echoed["temperature"] == 0.8, echoed
        # /props and /slots say what a request that names nothing gets
        shown = (await (await client.get("/props")).json())["default_generation_settings"]["params"]
        assert {key: shown[key] for key in SAMPLING} == SAMPLING
        parameters = (await (await client.post("/api/show", json={"model": "default"})).json())["parameters"]
        assert "top_k 20\n" in parameters and "repeat_penalty 1.05\n" in parameters and "min_p 0.0\n" in parameters


async def test_each_model_of_a_fleet_takes_its_own_tables_sampling_defaults(submits, bundled_model):
    from config import Settings
    from daemon.fleet.plans import model_plans

    # a [models.ID] table's values win over the top level's (a preset section's --top-k ...: its model's)
    settings = Settings(top_k=30, models={"qwen": {"path": bundled_model, "top_k": 20, "temperature": 0.6},
                                          "plain": {"path": bundled_model}})
    plans = {plan.id: plan.settings for plan in model_plans(settings, fetch=False)}
    assert (plans["qwen"].top_k, plans["qwen"].temperature) == (20, 0.6)
    assert (plans["plain"].top_k, plans["plain"].temperature) == (30, 0.8)
    tables = {"qwen": {"top_k": 20, "temperature": 0.6}, "plain": {}}
    async with fake_fleet(models=tables, top_k=30, **SMALL) as (fleet, client):
        for model in ("qwen", "plain"):
            answer = await client.post("/v1/chat/completions", json={"model": model, "messages": ASK})
            assert answer.status == 200, await answer.text()
            answer = await client.post("/api/chat", json={"model": model, "messages": ASK, "stream": False})
            assert answer.status == 200, await answer.text()
        qwen, qwen_ollama, plain, plain_ollama = submits()
        for params in (qwen, qwen_ollama):
            assert (params["top_k"], params["temperature"]) == (20, 0.6)
        for params in (plain, plain_ollama):
            assert (params["top_k"], params["temperature"]) == (30, 0.8)


async def test_ollamas_seed_minus_one_is_random_over_a_server_seed(submits):
    async with compat(seed=7, temperature=0.3) as (controller, client):
        for options in ({}, {"seed": -1}, {"seed": 5, "temperature": 0.9}):
            answer = await client.post("/api/chat", json={"model": "default", "messages": ASK, "stream": False,
                                                          "options": options})
            assert answer.status == 200, await answer.text()
        server, random, own = submits()
        assert (server["seed"], server["temperature"]) == (7, 0.3)
        assert "seed" not in random and random["temperature"] == 0.3  # Ollama's -1: random, as llama.cpp's
        assert (own["seed"], own["temperature"]) == (5, 0.9)


async def test_without_n_predict_each_dialect_keeps_its_default(submits):
    async with compat(ctx_size=512) as (controller, client):
        await client.post("/completion", json={"prompt": "hi"})
        await client.post("/v1/completions", json={"prompt": "hi"})
        await client.post("/v1/chat/completions", json={"messages": ASK})
        native, text, chat = submits()
        assert native["max_tokens"] == 512  # -1: ctx_size (the worker stops at the slot's end)
        assert text.get("max_tokens", 256) == 256 and chat.get("max_tokens", 256) == 256  # OpenAI's routes: 256
        assert "seed" not in native and native.get("temperature", 0.8) == 0.8
    async with compat(n_predict=-1, ctx_size=512) as (controller, client):
        await client.post("/v1/completions", json={"prompt": "hi"})
        assert submits()[-1]["max_tokens"] == 512  # every route: to the slot's end


def test_sampling_defaults_as_settings_flags_and_their_bounds(monkeypatch, capsys):
    from daemon.cli import main

    assert main(["check-config", "--n-predict", "9", "--seed", "4", "--temp", "0.2"]) == 0
    shown = json.loads(capsys.readouterr().out)["settings"]
    assert (shown["n_predict"], shown["seed"], shown["temperature"]) == (9, 4, 0.2)
    monkeypatch.setenv("DORMOUSE_TEMPERATURE", "0.1")
    assert load_settings().temperature == 0.1
    assert main(["check-config", "--top-k", "20", "--top-p", "0.8", "--min-p", "0", "--repeat-penalty", "1.1",
                 "--repeat-last-n", "-1", "--presence-penalty", "1.5", "--frequency-penalty", "-2"]) == 0
    shown = json.loads(capsys.readouterr().out)["settings"]
    assert {key: shown[key] for key in SAMPLING} == {"top_k": 20, "top_p": 0.8, "min_p": 0.0, "repeat_penalty": 1.1,
                                                     "repeat_last_n": -1, "presence_penalty": 1.5,
                                                     "frequency_penalty": -2.0}
    monkeypatch.setenv("DORMOUSE_TOP_K", "5")
    assert load_settings().top_k == 5
    for cli, needle in (({"n_predict": 0}, "n_predict"), ({"n_predict": -2}, "n_predict"),
                        ({"seed": 2**32}, "seed"), ({"seed": -2}, "seed"), ({"temperature": 3}, "temperature"),
                        ({"temperature": -0.1}, "temperature"), ({"top_k": -2}, "top_k"), ({"top_k": 2**31}, "top_k"),
                        ({"top_k": "many"}, "top_k"), ({"top_p": -0.1}, "top_p"), ({"top_p": 1.5}, "top_p"),
                        ({"min_p": -0.1}, "min_p"), ({"min_p": float("nan")}, "min_p"),
                        ({"repeat_penalty": 0}, "repeat_penalty"), ({"repeat_penalty": 11}, "repeat_penalty"),
                        ({"repeat_last_n": -2}, "repeat_last_n"), ({"presence_penalty": 2.5}, "presence_penalty"),
                        ({"frequency_penalty": -3}, "frequency_penalty"), ({"frequency_penalty": [1]}, "frequency_penalty")):
        with pytest.raises(ConfigError, match=needle):
            load_settings(cli=cli)


def test_a_bad_value_names_the_llama_server_option_or_variable_it_came_from(monkeypatch, capsys):
    from daemon.cli import main

    for name in [n for n in os.environ if n.startswith(("DORMOUSE_", "LLAMA_ARG_"))]:
        monkeypatch.delenv(name)
    assert main(["check-config", "--top-k", "-2"]) == 2
    assert "top_k: Input should be greater than or equal to -1 (from command line --top-k)" in capsys.readouterr().err
    assert main(["check-config", "-n", "0"]) == 2
    assert "0 predicts nothing: give at least 1, or -1 for until the end (from command line -n)" in capsys.readouterr().err
    monkeypatch.setenv("LLAMA_ARG_TOP_K", "-2")
    assert main(["check-config"]) == 2
    assert "(from environment LLAMA_ARG_TOP_K)" in capsys.readouterr().err
    monkeypatch.setenv("DORMOUSE_TOP_K", "-2")  # Dormouse's own variable: named as itself
    assert main(["check-config", "--top-k", "7"]) == 0  # the command line wins over both
    assert json.loads(capsys.readouterr().out)["settings"]["top_k"] == 7


async def test_top_k_minus_one_is_off_and_top_p_zero_keeps_one_token_as_in_llama_server(submits, capsys):
    # llama-server and vLLM take -1 for "no top-k": accepted on the command line and in a request,
    # and the worker's chain adds top-k only above 0. top_p 0 (OpenAI's range is 0..1; some clients
    # send it) keeps the most probable token, as llama.cpp's top-p does (tests/e2e: it is greedy).
    from daemon.cli import main

    assert main(["check-config", "--top-k", "-1"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["top_k"] == -1
    async with compat(top_k=-1) as (controller, client):
        await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert submits()[-1]["top_k"] == -1
        await client.post("/completion", json={"prompt": "hi", "n_predict": 1, "top_k": 5})
        assert submits()[-1]["top_k"] == 5
        for path, body in (("/v1/chat/completions", {"messages": ASK, "max_tokens": 1, "top_p": 0}),
                           ("/v1/messages", {"model": "m", "max_tokens": 1, "messages": ASK, "top_p": 0})):
            response = await client.post(path, json=body)
            assert response.status == 200, await response.text()
            assert submits()[-1]["top_p"] == 0.0
        await client.post("/api/generate", json={"model": controller.model_id, "prompt": "hi", "stream": False,
                                                 "options": {"top_k": -1, "num_predict": 1}})
        assert submits()[-1]["top_k"] == -1


async def test_openapi_shows_the_sampling_defaults_this_server_was_given():
    async with compat() as (controller, client):
        plain = (await (await client.get("/openapi.json")).json())["components"]["schemas"]
    assert plain["CompletionRequest"]["properties"]["temperature"]["default"] == 0.8
    async with compat(temperature=0.3, top_k=-1, seed=5) as (controller, client):
        schemas = (await (await client.get("/openapi.json")).json())["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "NativeCompletionRequest", "ResponsesRequest"):
        fields = schemas[name]["properties"]
        assert (fields["temperature"]["default"], fields["top_k"]["default"], fields["seed"]["default"]) == (0.3, -1, 5)
        assert "this server's" in fields["temperature"]["description"]
        assert fields["top_p"]["default"] == 0.95 and "this server's" not in fields["top_p"].get("description", "")
    anthropic = schemas["MessagesRequest"]["properties"]
    assert anthropic["temperature"]["default"] == 0.3
    # -1 is outside Anthropic's top_k range (0 and up): said, not made a default its own schema refuses.
    assert anthropic["top_k"]["default"] is None and "this server's default is -1" in anthropic["top_k"]["description"]


def test_openapi_is_serialized_once_and_says_where_model_tables_set_their_own():
    from daemon.http.admin.openapi import openapi_document, served_document

    before = json.dumps(openapi_document())
    settings = load_settings(cli={"temperature": 0.3, "models": {"a": {"path": "/m/a.gguf", "top_p": 0.5},
                                                                 "b": {"path": "/m/b.gguf"}}})
    body = served_document(settings)
    assert served_document(settings) is body  # a GET costs no copy of the document
    assert json.dumps(openapi_document()) == before  # the cached document is left as it was
    fields = json.loads(body)["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert fields["top_p"]["default"] == 0.95 and "some models' own tables set another" in fields["top_p"]["description"]
    assert fields["temperature"]["default"] == 0.3
    assert served_document(load_settings()) == json.dumps(openapi_document()).encode()  # nothing configured


# -- the context overflow, in llama-server's shape on its own route --------------------


async def test_overflow_on_completion_is_llama_servers_error():
    async with compat() as (controller, client):
        response = await client.post("/completion", json={"prompt": "OVERFLOW"})
        assert response.status == 400
        error = (await response.json())["error"]
        assert error == {"code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": 9000, "n_ctx": 1024,
                         "message": error["message"]}
        assert "9000 tokens" in error["message"] and "1024 tokens" in error["message"]
        more = (await (await client.post("/completion", json={"prompt": "OVERFLOW_MORE"})).json())["error"]
        assert (more["n_prompt_tokens"], more["n_ctx"]) == (1025, 1024) and "more than 1024 tokens" in more["message"]
        # A worker message without counts (the plain fake's): the slot's size, and more than it.
        listed = (await (await client.post("/completion", json={"prompt": "FAIL"})).json())["error"]
        assert listed["type"] == "exceed_context_size_error" and listed["n_prompt_tokens"] == 65
        assert listed["n_ctx"] == 64
        # The OpenAI routes keep OpenAI's fields (code, param), with llama-server's type and counts beside them
        # (its test_context_size_exceeded, on /chat/completions).
        for path, body in (("/v1/completions", {"prompt": "OVERFLOW"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "OVERFLOW"}]})):
            openai = await error_of(await client.post(path, json=body), 400)
            assert openai["code"] == "context_length_exceeded" and openai["type"] == "exceed_context_size_error"
            assert (openai["n_prompt_tokens"], openai["n_ctx"]) == (9000, 1024), openai
        # And the daemon serves on.
        assert (await client.post("/completion", json={"prompt": "hi", "n_predict": 1})).status == 200


# -- /completion: several prompts, answered as a list ---------------------------


async def test_several_prompts_are_answered_as_a_list_in_their_order(submits):
    """llama-server's batch form: a list of prompts (texts, token ids, ids with texts between them,
    objects) gets a list of answers, each with its index; one job per prompt, one after another."""
    async with compat() as (controller, client):
        prompts = ["hi", [1, 2, 3], [4, "mixed", 5], {"prompt_string": "an object"}]
        response = await client.post("/completion", json={"prompt": prompts, "n_predict": 2})
        assert response.status == 200, await response.text()
        answers = await response.json()
        assert isinstance(answers, list) and [a["index"] for a in answers] == [0, 1, 2, 3]
        assert all(isinstance(a["content"], str) and a["stop"] is True and a["tokens_predicted"] == 2 for a in answers)
        assert len(submits()) == 4
        single = await (await client.post("/completion", json={"prompt": ["alone"], "n_predict": 1})).json()
        assert isinstance(single, dict) and single["index"] == 0  # one prompt in a list: one answer, as llama-server


async def test_several_prompts_refuse_a_stream_and_fail_whole_on_an_overflow(submits):
    async with compat() as (controller, client):
        error = await error_of(await client.post("/completion", json={"prompt": ["a", "b"], "stream": True}), 400)
        assert error["param"] == "stream" and "several prompts" in error["message"]
        response = await client.post("/completion", json={"prompt": ["hi", "OVERFLOW"], "n_predict": 1})
        assert response.status == 400
        error = (await response.json())["error"]
        assert error["type"] == "exceed_context_size_error" and error["message"].startswith("prompt[1]: ")
        for hostile in (["x"] * 17, [[]], [["a", "b"]], [{}], [[1, [2]]], [[-1], [1]]):
            error = await error_of(await client.post("/completion", json={"prompt": hostile}), 400)
            assert "prompt" in error["message"], (hostile, error)
        assert (await client.post("/completion", json={"prompt": "x", "n_predict": 1})).status == 200  # still serving


# -- __verbose: the prompt as the chat template rendered it ---------------------

BOOK = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]


async def test_a_verbose_request_gets_its_rendered_prompt(submits):
    async with compat() as (controller, client):
        for verbose in (True, False):
            response = await client.post("/chat/completions", json={"messages": BOOK, "max_tokens": 2,
                                                                     "verbose": verbose})
            body = await response.json()
            assert response.status == 200 and ("__verbose" in body) == verbose, body
        assert body["object"] == "chat.completion"
        verbose = await (await client.post("/v1/chat/completions", json={"messages": BOOK, "max_tokens": 2,
                                                                         "verbose": True})).json()
        assert verbose["__verbose"]["prompt"] == "system: Book\nuser: What is the best book\n"  # the fake's template
        chunks = await sse(await client.post("/chat/completions", json={"messages": BOOK, "max_tokens": 2,
                                                                        "verbose": True, "stream": True}))
        assert chunks and not any("__verbose" in chunk for chunk in chunks)  # whole answers only
        for hostile in ("loud", [], {"a": 1}, 2):
            error = await error_of(await client.post("/chat/completions", json={"messages": BOOK, "verbose": hostile}),
                                   400)
            assert "verbose" in error["message"], (hostile, error)


async def test_verbose_answers_give_every_whole_chat_answer_its_prompt(submits):
    async with compat(verbose_answers=True) as (controller, client):
        body = await (await client.post("/chat/completions", json={"messages": BOOK, "max_tokens": 2})).json()
        assert "Book" in body["__verbose"]["prompt"]
        plain = await (await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})).json()
        assert "__verbose" not in plain  # chat answers only


async def test_no_slots_turns_get_slots_off_and_props_still_lists_them():
    """llama-server's test_server_slots: --no-slots answers GET /slots with 501 and an error."""
    async with fake_daemon(slots_endpoint=False) as (controller, client):
        await ready(controller)
        response = await client.get("/slots")
        assert response.status == 501
        error = (await response.json())["error"]
        assert error["code"] == "not_supported" and "slots_endpoint" in error["message"]
        assert len((await (await client.get("/props")).json())["slots"]) >= 1
    async with fake_daemon() as (controller, client):
        await ready(controller)
        assert (await client.get("/slots")).status == 200


async def test_metrics_can_be_turned_off_and_are_on_by_default():
    """llama-server's test_metrics_disabled: a /metrics turned off is a 501 that says how to turn it on;
    the model is not woken and nothing else changes."""
    async with fake_daemon(metrics_endpoint=False) as (controller, client):
        await ready(controller)
        response = await client.get("/metrics")
        error = (await response.json())["error"]
        assert response.status == 501 and error["code"] == "not_supported" and "metrics_endpoint" in error["message"]
        assert (await client.get("/health")).status == 200
    async with fake_daemon() as (controller, client):
        assert (await client.get("/metrics")).status == 200
