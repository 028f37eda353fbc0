"""Vertex AI's prediction route (predict_route; AIP_MODE=PREDICTION sets it) through the real HTTP app on
the fake worker: each instance runs as the request its @requestFormat names, over this daemon's own
socket with the prediction's key, and its answer (or its error) takes the instance's place. Hostile
bodies are a 400 naming the problem or an error in that instance's place; a key opens no route through
a prediction that it does not open directly; the route cannot reach itself."""

from __future__ import annotations

import aiohttp
import pytest

from config import Settings
from config.vertex_ai import VertexAIError, vertex_settings
from daemon.http.vertex_predict import MAX_INSTANCES, RouteTaken, format_name
from tests.integration.test_http_hardening import daemon

pytestmark = pytest.mark.timeout(120)

CHAT = {"@requestFormat": "chatCompletions", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
NATIVE = {"@requestFormat": "completion", "prompt": "hi", "n_predict": 3}


def test_format_names_are_llama_servers():
    assert format_name("/v1/chat/completions") == "chatCompletions"
    assert format_name("/apply-template") == "applyTemplate"
    assert format_name("/completion") == "completion"
    assert format_name("/v1/responses/input_tokens") == "responsesInputTokens"


async def test_each_instance_runs_as_the_request_it_names():
    async with daemon(predict_route="/predict") as (_, client):
        r = await client.post("/predict", json={"instances": [CHAT, NATIVE, {**CHAT, "@requestFormat": "/v1/completions",
                                                                              "prompt": "hi", "stream": True}]})
        assert r.status == 200, await r.text()
        chat, native, openai = (await r.json())["predictions"]
        assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
        assert chat["choices"][0]["message"]["content"]
        assert isinstance(native["content"], str) and "timings" in native  # llama-server's native answer
        assert openai["object"] == "text_completion"  # "stream": true was turned off: one JSON answer


async def test_a_wrong_instance_is_an_error_in_its_place_and_the_others_are_answered():
    async with daemon(predict_route="/predict") as (_, client):
        instances = [7, {"max_tokens": 3}, {"@requestFormat": 5}, {"@requestFormat": "noSuchRoute"},
                     {"@requestFormat": "predict", "instances": []}, {"@requestFormat": "/predict"},
                     {**CHAT, "messages": "not a list"}, CHAT]
        r = await client.post("/predict", json={"instances": instances})
        assert r.status == 200
        out = (await r.json())["predictions"]
        assert "must be a JSON object" in out[0]["error"]["message"]
        assert "@requestFormat" in out[1]["error"]["message"] and "@requestFormat" in out[2]["error"]["message"]
        for refused in out[3:6]:  # the prediction route is no format: it cannot reach itself
            assert "no route for @requestFormat" in refused["error"]["message"]
        assert out[6]["error"]["param"] == "messages"  # the route's own 400, as a direct call gets it
        assert out[7]["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("body, message", [
    (b"[1, 2]", "must be a JSON object"),
    (b"{nope", "not valid JSON"),
    (b'{"instances": {"a": 1}}', "array field named instances"),
    (b'{"predictions": []}', "array field named instances"),
    (b'{"instances": [' + b",".join([b"{}"] * (MAX_INSTANCES + 1)) + b"]}", f"at most {MAX_INSTANCES}"),
    (b"[" * 100_000, "not valid JSON"),
])
async def test_a_wrong_body_is_a_400_that_says_why(body, message):
    async with daemon(predict_route="/predict") as (_, client):
        r = await client.post("/predict", data=body, headers={"Content-Type": "application/json"})
        assert r.status == 400 and message in (await r.json())["error"]["message"]


async def test_the_prediction_needs_the_api_key_and_its_instances_need_their_own_routes_keys():
    async with daemon(predict_route="/predict", api_key="user-key", admin_key="admin-key") as (_, client):
        assert (await client.post("/predict", json={"instances": [CHAT]})).status == 401
        user = {"Authorization": "Bearer user-key"}
        r = await client.post("/predict", headers=user, json={"instances": [
            CHAT, {"@requestFormat": "/models/unload", "model": "fake"}, {"@requestFormat": "sleep"}]})
        chat, unload, sleep = (await r.json())["predictions"]
        assert chat["choices"][0]["message"]["role"] == "assistant"
        assert unload["error"]["code"] == "invalid_api_key" and sleep["error"]["code"] == "invalid_api_key"
        assert (await client.post("/predict", data=b"{}", headers={**user, "Content-Type": "text/plain"})).status == 415


async def test_the_health_route_answers_as_health_under_the_metrics_key():
    async with daemon(predict_route="/predict", predict_health_route="/ping", metrics_key="scrape") as (_, client):
        assert (await client.get("/ping")).status == 401
        r = await client.get("/ping", headers={"Authorization": "Bearer scrape"})
        assert r.status == 200 and (await r.json())["status"] == "ok"


async def test_off_by_default():
    async with daemon() as (_, client):
        assert (await client.post("/predict", json={"instances": [CHAT]})).status == 404


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/completion", "/props", "/sleep", "/slots/0",
                                   "/v1/models/fake"])
async def test_a_route_dormouse_serves_cannot_be_the_prediction_route_nor_the_health_route(route):
    """By any method, a route with a parameter too: the keys a route needs go by its path (a GET alias of
    /health on POST /v1/chat/completions, or on POST /slots/0, would open them to the metrics key)."""
    with pytest.raises(RouteTaken, match="already a route"):
        async with daemon(predict_route=route):
            pass
    with pytest.raises(RouteTaken, match="already a route"):
        async with daemon(predict_health_route=route):
            pass


async def test_vertex_ais_own_routes_are_served_and_a_health_route_of_health_adds_nothing():
    route = "/v1/endpoints/123/deployedModels/456:predict"  # Vertex AI's default AIP_PREDICT_ROUTE
    async with daemon(predict_route=route, predict_health_route="/health") as (_, client):
        r = await client.post(route, json={"instances": [CHAT]})
        assert r.status == 200 and (await r.json())["predictions"][0]["object"] == "chat.completion"
        assert (await client.get("/health")).status == 200


async def test_ollamas_routes_answer_one_body_and_a_failed_instance_leaves_the_others(monkeypatch):
    async with daemon(predict_route="/predict") as (_, client):
        ollama = {"@requestFormat": "apiChat", "model": "fake", "messages": [{"role": "user", "content": "hi"}],
                  "options": {"num_predict": 3}}  # Ollama streams unless told not to
        r = await client.post("/predict", json={"instances": [ollama, CHAT]})
        chat_ollama, chat = (await r.json())["predictions"]
        assert chat_ollama["done"] is True and chat_ollama["message"]["role"] == "assistant"
        assert chat["object"] == "chat.completion"
        # An instance whose connection breaks (the daemon's socket, a forwarded header), or whose session
        # closes at shutdown (a RuntimeError, no ClientError), fails in its place alone.
        post = aiohttp.ClientSession.post
        for failure in (aiohttp.ServerDisconnectedError(), RuntimeError("Session is closed")):
            def failing(session, url, failure=failure, **kwargs):
                if str(url).endswith("/tokenize"):
                    raise failure
                return post(session, url, **kwargs)

            monkeypatch.setattr(aiohttp.ClientSession, "post", failing)
            r = await client.post("/predict", json={"instances": [{"@requestFormat": "tokenize", "content": "x"},
                                                                  CHAT, 5]})
            failed, chat, wrong = (await r.json())["predictions"]
            assert r.status == 200 and failed["error"]["code"] == "instance_failed"
            assert chat["object"] == "chat.completion" and "JSON object" in wrong["error"]["message"]


async def test_answers_are_spliced_as_they_came_non_ascii_included():
    async with daemon(predict_route="/predict") as (_, client):
        text = "日本語のテキスト" * 50
        r = await client.post("/predict", json={"instances": [{"@requestFormat": "tokenize", "content": text},
                                                              {"@requestFormat": "detokenize", "tokens": [1, 2]}]})
        tokenized, detokenized = (await r.json())["predictions"]
        assert isinstance(tokenized["tokens"], list) and isinstance(detokenized["content"], str)


@pytest.mark.parametrize("route", ["predict", "/a b", "/" + "x" * 300, "/é", "/a?b", "/a#b"])
def test_a_route_that_is_no_path_is_a_config_error(route):
    with pytest.raises(ValueError, match="predict_route"):
        Settings(predict_route=route)


def test_vertex_ais_variables():
    assert vertex_settings({}) == ({}, [])
    assert vertex_settings({"AIP_MODE": "TRAINING", "AIP_HTTP_PORT": "1"}) == ({}, [])
    settings, notes = vertex_settings({"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "9000",
                                       "AIP_PREDICT_ROUTE": "v1/endpoints/1:predict",
                                       "AIP_HEALTH_ROUTE": "/healthz"})
    assert settings == {"port": 9000, "predict_route": "/v1/endpoints/1:predict", "predict_health_route": "/healthz"}
    Settings(**settings)  # Vertex AI's own routes are valid settings
    assert "AIP_HTTP_PORT" in notes[0]
    assert vertex_settings({"AIP_MODE": "PREDICTION"})[0] == {"port": 8080, "predict_route": "/predict"}
    for port in ("0", "65536", "http", "-1", "9" * 40):
        with pytest.raises(VertexAIError, match="AIP_HTTP_PORT"):
            vertex_settings({"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": port})


def test_a_bad_vertex_route_names_its_variable(monkeypatch, capsys):
    from config.vertex_ai import VERTEX_VARIABLES
    from daemon.cli import main

    monkeypatch.setenv("AIP_MODE", "PREDICTION")
    monkeypatch.setenv("AIP_PREDICT_ROUTE", "/a b")
    assert main(["check-config"]) == 2
    assert "predict_route: String should match pattern" in (err := capsys.readouterr().err)
    assert "(from environment AIP_PREDICT_ROUTE)" in err
    assert set(VERTEX_VARIABLES) >= set(vertex_settings({"AIP_MODE": "PREDICTION", "AIP_HEALTH_ROUTE": "/h"})[0])


async def test_the_answers_of_one_prediction_are_bounded_together(monkeypatch):
    """128 instances of large answers (per-token embeddings) must not hold gigabytes: past the bound an
    instance's answer is an error in its place, and what came before it is written whole."""
    import daemon.http.vertex_predict as vertex_predict

    async with daemon(predict_route="/predict") as (_, client):
        one = await client.post("/predict", json={"instances": [{"@requestFormat": "tokenize", "content": "x" * 40}]})
        size = len(await one.read())
        monkeypatch.setattr(vertex_predict, "MAX_PREDICTION_BYTES", size * 3)
        r = await client.post("/predict", json={"instances": [{"@requestFormat": "tokenize", "content": "x" * 40}] * 8})
        out = (await r.json())["predictions"]
        assert r.status == 200 and len(out) == 8
        too_large = [p for p in out if "error" in p]
        assert 0 < len(too_large) < 8 and all(p["error"]["code"] == "prediction_too_large" for p in too_large)
        assert all(isinstance(p["tokens"], list) for p in out if "error" not in p)
