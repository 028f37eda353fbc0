"""CORS (cors_origins) and error bodies in each dialect's shape, through the
real middleware on a fake worker."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from config import Settings
from tests.conftest import fake_daemon

UI = "http://ui.example:3000"


def preflight(origin: str, method: str = "POST", headers: str = "authorization, content-type") -> dict:
    return {"Origin": origin, "Access-Control-Request-Method": method, "Access-Control-Request-Headers": headers}


async def test_an_allowed_origin_gets_its_preflight_answered_without_a_key():
    async with fake_daemon(cors_origins=[UI], api_key="k") as (_, client):
        for path in ("/v1/chat/completions", "/v1/models", "/api/chat", "/v1/messages", "/completion", "/props"):
            response = await client.options(path, headers=preflight(UI))
            assert response.status == 200, path  # llama-server's status for a preflight
            assert response.headers["Access-Control-Allow-Origin"] == UI
            assert "POST" in response.headers["Access-Control-Allow-Methods"] or "GET" in \
                response.headers["Access-Control-Allow-Methods"]
            assert response.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
            assert "Origin" in response.headers.getall("Vary")


async def test_every_route_answers_a_preflight_from_a_listed_origin():
    """Every route the app serves (each dialect's, llama-server's aliases, /slots/{id}), with its method."""
    import re

    async with fake_daemon(cors_origins=[UI], api_key="k", admin_key="a") as (_, client):
        routes = {(re.sub(r"\{(\w+)(:[^}]*)?\}", "0", route.resource.canonical), route.method)
                  for route in client.server.app.router.routes() if route.method not in ("HEAD", "OPTIONS")}
        assert ("/slots/0", "POST") in routes and ("/api/chat", "POST") in routes and ("/models", "GET") in routes
        for path, method in sorted(routes):
            response = await client.options(path, headers=preflight(UI, method))
            assert response.status == 200, (path, method)
            assert response.headers["Access-Control-Allow-Origin"] == UI
            assert method in response.headers["Access-Control-Allow-Methods"], (path, method)


async def test_a_preflight_from_another_origin_gets_no_cors_headers_and_its_post_stays_refused():
    """llama-server's answer to an unlisted origin's preflight: 200 with no Access-Control-* header (the
    browser refuses the real request). The POST a page can send without a preflight still never runs."""
    async with fake_daemon(cors_origins=[UI]) as (_, client):
        response = await client.options("/v1/chat/completions", headers=preflight("http://evil.example"))
        assert response.status == 200
        assert not [h for h in response.headers if h.lower().startswith("access-control-")], response.headers
        assert (await client.options("/no/such/route", headers=preflight(UI))).status == 404
        # A form-style POST (no preflight) and a JSON one from the unlisted origin: refused before any handler runs.
        for data, kind in ((b"prompt=hi", "application/x-www-form-urlencoded"), (b'{"prompt": "hi"}', "application/json")):
            refused = await client.post("/v1/completions", data=data, headers={"Origin": "http://evil.example",
                                                                                "Content-Type": kind})
            assert refused.status == 403 and (await refused.json())["error"]["code"] == "cross_origin"
    async with fake_daemon() as (_, client):  # no cors_origins: no origin is allowed
        response = await client.options("/v1/models", headers=preflight(UI))
        assert response.status == 200 and "Access-Control-Allow-Origin" not in response.headers


LOOPBACK = ["http://localhost", "http://localhost:8080", "http://127.0.0.1", "http://127.0.0.1:3000",
            "http://[::1]", "http://[::1]:3000", "https://localhost:8443"]
NOT_LOOPBACK = ["http://web.mydomain.fr", "http://evil.com", "http://notlocalhost", "http://localhost.evil.com",
                "http://127.0.0.1.evil.com", "null", "localhost", "*", "http://[::2]", "x" * 5000]


async def test_cors_origins_localhost_allows_every_loopback_origin_and_port_and_nothing_else():
    """llama-server's --cors-origins localhost: a page from this machine on any port; a look-alike host is not."""
    async with fake_daemon(cors_origins=["localhost"]) as (_, client):
        for origin in LOOPBACK:
            response = await client.options("/completions", headers=preflight(origin))
            assert response.status == 200 and response.headers.get("Access-Control-Allow-Origin") == origin, origin
            served = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                       headers={"Origin": origin})
            assert served.status == 200 and served.headers["Access-Control-Allow-Origin"] == origin, origin
        for origin in NOT_LOOPBACK:
            response = await client.options("/completions", headers=preflight(origin))
            assert response.status == 200 and "Access-Control-Allow-Origin" not in response.headers, origin
            refused = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                        headers={"Origin": origin})
            assert refused.status == 403, origin


async def test_cross_origin_posts_from_a_listed_origin_are_served_with_cors_headers():
    async with fake_daemon(cors_origins=[UI]) as (_, client):
        body = {"prompt": "hi", "max_tokens": 2}
        response = await client.post("/v1/completions", json=body, headers={"Origin": UI})
        assert response.status == 200
        assert response.headers["Access-Control-Allow-Origin"] == UI
        assert "X-Request-Id" in response.headers["Access-Control-Expose-Headers"]
        streamed = await client.post("/v1/completions", json={**body, "stream": True}, headers={"Origin": UI})
        assert streamed.status == 200 and streamed.headers["Access-Control-Allow-Origin"] == UI
        await streamed.read()
        # Keys still apply to a listed origin, and the refusal carries CORS headers so the page can read it.
        refused = await client.post("/v1/completions", json=body, headers={"Origin": "http://evil.example"})
        assert refused.status == 403 and (await refused.json())["error"]["code"] == "cross_origin"
        assert "Access-Control-Allow-Origin" not in refused.headers
    async with fake_daemon(cors_origins=["*"], api_key="k") as (_, client):
        response = await client.post("/v1/completions", json=body, headers={"Origin": "https://any.example"})
        assert response.status == 401  # any origin, but still the key
        assert response.headers["Access-Control-Allow-Origin"] == "https://any.example"


@pytest.mark.parametrize("value, expected", [
    (["https://UI.example:443"], ["https://ui.example"]), ("http://a.example, http://b.example:8080",
                                                          ["http://a.example", "http://b.example:8080"]),
    (["*"], ["*"]), ("localhost, http://a.example", ["localhost", "http://a.example"]),
])
def test_cors_origins_are_normalized_as_browsers_send_them(value, expected):
    assert Settings(cors_origins=value).cors_origins == expected


@pytest.mark.parametrize("bad", [["ftp://x.example"], ["https://x.example/path"], ["x.example"],
                                 ["https://user:pw@x.example"], ["https://x.example?q=1"]])
def test_a_value_that_is_not_an_origin_is_refused(bad):
    with pytest.raises(ValidationError, match="is not an origin"):
        Settings(cors_origins=bad)


async def test_each_dialect_answers_a_refusal_in_its_own_error_shape():
    async with fake_daemon(api_key="k") as (_, client):
        anthropic = await client.post("/v1/messages", data=b"{}", headers={"Content-Type": "text/plain",
                                                                           "x-api-key": "k"})
        assert anthropic.status == 415
        body = await anthropic.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert "application/json" in body["error"]["message"]
        ollama = await client.post("/api/chat", json={})
        assert ollama.status == 401
        assert set(await ollama.json()) == {"error"} and isinstance((await ollama.json())["error"], str)
        openai = await client.post("/v1/chat/completions", json={})
        assert openai.status == 401 and (await openai.json())["error"]["code"] == "invalid_api_key"
        # x-api-key opens every API path, as Authorization: Bearer does.
        assert (await client.get("/v1/models", headers={"x-api-key": "k"})).status == 200


async def test_ollamas_clients_may_post_without_a_content_type_but_no_web_page_may():
    """LiteLLM's ollama_chat/ provider sends JSON with no Content-Type: accepted
    under /api/ only, and only without an Origin (browsers send one on every POST)."""
    body = b'{"model": "fake", "prompt": "", "stream": false}'
    async with fake_daemon() as (_, client):
        bare = await client.post("/api/generate", data=body, skip_auto_headers=["Content-Type"])
        assert bare.status == 200, await bare.text()
        from_page = await client.post("/api/generate", data=body, skip_auto_headers=["Content-Type"],
                                      headers={"Origin": "http://evil.example"})
        assert from_page.status == 403
        same_host = await client.post("/api/generate", data=body, skip_auto_headers=["Content-Type"],
                                      headers={"Origin": f"http://{client.server.host}:{client.server.port}"})
        assert same_host.status == 415
        assert (await client.post("/api/generate", data=body, headers={"Content-Type": "text/plain"})).status == 415
        openai = await client.post("/v1/completions", data=b'{"prompt": "x"}', skip_auto_headers=["Content-Type"])
        assert openai.status == 415


async def test_openapi_documents_every_route_in_its_dialects_error_shape():
    """/openapi.json lists every route the app serves (each dialect's, llama-server's aliases), with the
    method it is served on, and its errors in the shape that path answers in."""
    import re

    from daemon.http.errors import dialect_of

    shapes = {"openai": "Error", "anthropic": "AnthropicError", "ollama": "OllamaError"}
    async with fake_daemon() as (_, client):
        document = await (await client.get("/openapi.json")).json()
        served = set()
        for route in client.server.app.router.routes():
            path = re.sub(r"\{(\w+)(:[^}]*)?\}", r"{\1}", route.resource.canonical)
            if route.method == "HEAD" and path != "/api/blobs/{digest}":
                continue  # aiohttp's HEAD beside each GET
            served.add((path, route.method.lower()))
    undocumented = {(path, method) for path, method in served
                    if path not in ("/", "/ui", "/ui/{name}", "/openapi.json")
                    and method not in document["paths"].get(path, {})}
    assert not undocumented
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            assert (path, method) in served, (path, method)
            for status, answer in operation["responses"].items():
                if status[0] == "4":
                    assert answer["content"]["application/json"]["schema"]["$ref"].endswith(
                        "/" + shapes[dialect_of(path)]), (path, status)
    schemas = document["components"]["schemas"]
    for name in ("ResponsesRequest", "MessagesRequest", "OllamaChatRequest", "InfillRequest", "RerankRequest",
                 "SlotFileRequest"):
        assert name in schemas
    # A refused variant (an item type Dormouse does not take) is valid for nothing in the document.
    assert schemas["RefusedItem"]["not"] == {}
    assert schemas["ResponsesRequest"]["properties"]["previous_response_id"]["type"] == "null"
