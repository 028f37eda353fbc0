"""Issue 30's Ollama client items through the real app on a fake worker: the
body types Ollama's clients send (curl's form, LiteLLM's octet-stream) read as
JSON only without an Origin, and /api/pull's refusals (each a 400 naming the
field, before any hub is asked), its answer for a served model, and the admin
key it needs. The real downloads are tests/e2e/test_ollama_clients.py's."""

from __future__ import annotations

import json

import pytest

from tests.conftest import fake_daemon

pytestmark = pytest.mark.timeout(120)

CHAT = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": False,
                   "options": {"num_predict": 3}}).encode()
GENERATE = json.dumps({"model": "fake", "prompt": "hi", "stream": False, "options": {"num_predict": 3}}).encode()
CLIENT_TYPES = ("application/x-www-form-urlencoded", "application/octet-stream")


async def ollama_error(response, status: int) -> str:
    assert response.status == status, await response.text()
    body = await response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    return body["error"]


@pytest.mark.parametrize("content_type", CLIENT_TYPES)
async def test_ollama_clients_body_types_are_read_as_json_without_an_origin(content_type):
    async with fake_daemon() as (_, client):
        for path, body in (("/api/chat", CHAT), ("/api/generate", GENERATE)):
            response = await client.post(path, data=body, headers={"Content-Type": content_type})
            assert response.status == 200, await response.text()
            answer = await response.json()
            assert answer["done"] is True and answer["eval_count"] == 3
            # A page's POST carries Origin (its own host here, so the origin check lets it by): no preflight
            # guards these types, so the 415 stays.
            same_host = f"http://{client.server.host}:{client.server.port}"
            from_page = await client.post(path, data=body, headers={"Content-Type": content_type,
                                                                      "Origin": same_host})
            assert content_type in await ollama_error(from_page, 415)
        # Not JSON (curl -d 'model=fake&prompt=hi'): a 400 that says the body is not JSON.
        form = await client.post("/api/generate", data=b"model=fake&prompt=hi", headers={"Content-Type": content_type})
        assert "not valid JSON" in await ollama_error(form, 400)
        # Only Ollama's paths: OpenAI's clients always declare JSON.
        openai = await client.post("/v1/completions", data=b'{"prompt": "x"}', headers={"Content-Type": content_type})
        assert openai.status == 415


async def test_text_plain_and_other_types_stay_refused_on_api():
    async with fake_daemon() as (_, client):
        for content_type in ("text/plain", "multipart/form-data; boundary=x", "application/xml"):
            response = await client.post("/api/generate", data=GENERATE, headers={"Content-Type": content_type})
            assert response.status == 415, content_type


# -- /api/pull ------------------------------------------------------------------------------

async def test_pull_of_a_served_model_is_success_at_once():
    async with fake_daemon() as (_, client):
        for name in ("fake", "fake:latest"):
            whole = await client.post("/api/pull", json={"model": name, "stream": False})
            assert whole.status == 200 and await whole.json() == {"status": "success"}
            streamed = await client.post("/api/pull", json={"name": name})  # Ollama's older field, streamed
            assert streamed.status == 200 and streamed.headers["Content-Type"] == "application/x-ndjson"
            assert [json.loads(line) for line in (await streamed.text()).splitlines()] == [{"status": "success"}]


@pytest.mark.parametrize("body, field, words", [
    ({"model": "a" * 1_000_000}, "model", "at most 256"),
    ({"model": "owner/re..po:Q4_K_M"}, "model", "no '..'"),
    ({"model": "owner/../etc:Q4_K_M"}, "model", "not a repository"),
    ({"model": "../../etc/passwd"}, "model", "not a repository"),
    ({"model": "gemma3"}, "model", "owner/name"),  # Ollama's library names are not here
    ({"model": "owner/repo:Q4 K M"}, "model", "quant tag"),
    ({"model": 5}, "model", "string"),
    ({"model": ["owner/repo"]}, "model", "string"),
    ({"model": None}, "model", "required"),
    ({}, "model", "required"),
    ({"model": "   "}, "model", "required"),
    ({"model": "owner/repo", "stream": "yes"}, "stream", "boolean"),
    ({"model": "owner/repo", "insecure": True}, "insecure", "HF_ENDPOINT"),
    ({"model": "owner/repo", "insecure": "no"}, "insecure", "boolean"),
])
async def test_pull_refuses_hostile_names_before_any_download(body, field, words):
    async with fake_daemon() as (_, client):
        message = await ollama_error(await client.post("/api/pull", json=body), 400)
        assert message.startswith(f"{field}:") and words in message, message


async def test_pull_is_refused_without_a_json_object_and_with_a_wrong_content_type():
    async with fake_daemon() as (_, client):
        assert "JSON object" in await ollama_error(await client.post("/api/pull", json=["owner/repo"]), 400)
        refused = await client.post("/api/pull", data=b'{"model": "owner/repo"}', headers={"Content-Type": "text/plain"})
        assert refused.status == 415


async def test_pull_from_the_hub_needs_the_admin_key_when_one_is_set():
    """A download fills the disk the operator budgets: with admin_key set, the API key alone may not start one,
    and the refusal comes before the hub is asked (none is reachable here). A served model needs no more."""
    async with fake_daemon(api_key="user", admin_key="admin") as (_, client):
        user = {"Authorization": "Bearer user"}
        refused = await client.post("/api/pull", json={"model": "owner/repo:Q4_K_M"}, headers=user)
        assert "admin key" in await ollama_error(refused, 403)
        served = await client.post("/api/pull", json={"model": "fake", "stream": False}, headers=user)
        assert served.status == 200 and await served.json() == {"status": "success"}
        assert (await client.post("/api/pull", json={"model": "fake"})).status == 401
