"""Prompt-cache scopes on the HTTP side (issue 26): a request's scope
(p.Submit.cache_scope) is the name of the key that opened the route and the
body's `cache_salt` (vLLM's field), so the worker never restores or counts an
entry of another key or salt; `api_keys` names several keys; and
`report_cached_tokens = false` leaves no count of cached tokens in an answer."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from config import Settings
from daemon import protocol as p
from daemon.http.keys import cache_scope
from tests.integration.scripted import scripted  # noqa: F401 (a fixture)
from tests.integration.test_http_hardening import daemon, error_of

KEYS = {"alice": "key-a", "bob": "key-b"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def as_(name: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[name]}"}


@pytest.fixture
def scopes(monkeypatch) -> list[str]:
    """The cache_scope of every p.Submit the controller makes (what the worker receives)."""
    from daemon.model.controller import Controller

    seen: list[str] = []
    original = Controller.new_job

    def spy(self, *args, **kwargs):
        job = original(self, *args, **kwargs)
        seen.append(job.submit.cache_scope)
        return job

    monkeypatch.setattr(Controller, "new_job", spy)
    return seen


def test_the_composition_is_unambiguous():
    assert cache_scope(None, None) == cache_scope("", None) == ""  # no key name, no salt: today's one scope
    pairs = [("alice", None), ("alice", "s"), ("", "s"), ("a", '",null'), ('a","b', None), ("#admin", None),
             ("alice", "")]
    assert len({cache_scope(k, s) for k, s in pairs}) == len(pairs)
    assert json.loads(cache_scope("alice", "s")) == ["alice", "s"]


async def test_two_keys_and_two_salts_make_four_scopes(scopes):
    async with daemon(api_keys=KEYS) as (controller, client):
        for name in ("alice", "bob"):
            for salt in (None, "s1", "s2", "s1"):
                body = CHAT | ({"cache_salt": salt} if salt else {})
                response = await client.post("/v1/chat/completions", json=body, headers=as_(name))
                assert response.status == 200, await response.text()
        assert (await client.post("/v1/chat/completions", json=CHAT)).status == 401
    assert [json.loads(s) for s in scopes] == [["alice", None], ["alice", "s1"], ["alice", "s2"], ["alice", "s1"],
                                              ["bob", None], ["bob", "s1"], ["bob", "s2"], ["bob", "s1"]]
    assert len(set(scopes)) == 6


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", CHAT),
    ("/chat/completions", CHAT),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/completion", {"prompt": "hi", "n_predict": 2}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    ("/v1/messages", {"model": "fake", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
])
async def test_every_route_takes_the_salt(scopes, path, body):
    async with daemon(api_keys=KEYS) as (controller, client):
        response = await client.post(path, json=body | {"cache_salt": "tenant-7"}, headers=as_("bob"))
        assert response.status == 200, await response.text()
        response = await client.post(path, json=body, headers=as_("bob"))  # the next request: no salt carried over
        assert response.status == 200, await response.text()
    assert [json.loads(s) for s in scopes] == [["bob", "tenant-7"], ["bob", None]]


async def test_one_unnamed_key_or_none_keeps_todays_single_scope(scopes):
    async with daemon(api_key="k1") as (controller, client):
        assert (await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer k1"})).status == 200
    async with daemon() as (controller, client):
        assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200
        assert (await client.post("/v1/chat/completions", json=CHAT | {"cache_salt": "s"})).status == 200
        chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": False,
                "options": {"num_predict": 1}}
        assert (await client.post("/api/chat", json=chat)).status == 200
    assert scopes == ["", "", json.dumps(["", "s"], separators=(",", ":")), ""]


async def test_the_key_name_scopes_the_other_dialects_too(scopes):
    async with daemon(api_keys=KEYS, admin_key="adm") as (controller, client):
        chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": False,
                "options": {"num_predict": 1}}
        assert (await client.post("/api/chat", json=chat, headers=as_("alice"))).status == 200
        assert (await client.post("/api/chat", json=chat, headers={"Authorization": "Bearer adm"})).status == 200
    assert [json.loads(s) for s in scopes] == [["alice", None], ["#admin", None]]


@pytest.mark.parametrize("salt", ["", "x" * 1025, "x" * 200_000, 5, 1.5, True, ["s"], {"s": 1}])
async def test_a_hostile_cache_salt_is_a_400_naming_it(scopes, salt):
    async with daemon() as (controller, client):
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                           ("/completion", {"prompt": "hi", "n_predict": 2}), ("/v1/responses", {"input": "hi"})):
            response = await client.post(path, json=body | {"cache_salt": salt})
            error = await error_of(response, 400)
            assert error["param"] == "cache_salt", (path, error)
        # null is "not given", as every optional field
        assert (await client.post("/v1/chat/completions", json=CHAT | {"cache_salt": None})).status == 200
        assert (await client.get("/health")).status == 200
    assert scopes == [""]


def test_a_salt_of_1024_characters_is_accepted():
    from daemon.http.dialects.openai.body import ChatCompletionRequest

    assert ChatCompletionRequest.model_validate(CHAT | {"cache_salt": "é" * 1024}).cache_salt == "é" * 1024


# -- api_keys --------------------------------------------------------------------------------------


def test_named_keys_from_toml_and_the_environment(tmp_path, monkeypatch):
    from config import load_settings

    config = tmp_path / "d.toml"
    config.write_text('[api_keys]\nalice = "key-a"\nbob = "key-b"\n')
    settings = load_settings(config)
    assert {n: k.get_secret_value() for n, k in settings.api_keys.items()} == KEYS
    assert settings.public_dict()["api_keys"] == {"alice": "********", "bob": "********"}
    monkeypatch.setenv("DORMOUSE_API_KEYS", "alice:key-a, bob:key:b")
    assert load_settings().api_keys["bob"].get_secret_value() == "key:b"
    monkeypatch.setenv("DORMOUSE_API_KEYS", '{"carol": "key-c"}')
    assert list(load_settings().api_keys) == ["carol"]


@pytest.mark.parametrize("settings, message", [
    ({"api_keys": {"alice": "same", "bob": "same"}}, "every key must be different"),
    ({"api_key": "same", "api_keys": {"bob": "same"}}, "every key must be different"),
    ({"api_keys": {"bob": "same"}, "admin_key": "same"}, "admin key must differ"),
    ({"api_key": "same", "admin_key": "same"}, "admin key must differ"),
    ({"api_keys": {"": "k"}}, "key name"),
    ({"api_keys": {"a" * 65: "k"}}, "key name"),
    ({"api_keys": {"#admin": "k"}}, "key name"),
    ({"api_keys": {"a b": "k"}}, "key name"),
    ({"api_keys": {"alice": ""}}, "must not be empty"),
    ({"api_keys": {"alice": "has space"}}, "visible ASCII"),
    ({"api_keys": {"alice": 5}}, "valid string"),
    ({"api_keys": ["alice"]}, "valid dictionary"),
    ({"api_keys": {f"k{i}": f"v{i}" for i in range(257)}}, "at most 256"),
    ({"api_keys": "alice"}, "name:key pairs"),
    ({"api_keys": "alice:a,alice:b"}, "given twice"),
])
def test_named_keys_are_validated(settings, message):
    with pytest.raises(ValidationError, match=message):
        Settings(**settings)


async def test_every_named_key_opens_the_api_and_none_opens_sleep_when_an_admin_key_is_set():
    async with daemon(api_keys=KEYS, admin_key="adm") as (controller, client):
        for name in KEYS:
            assert (await client.get("/v1/models", headers=as_(name))).status == 200
            assert (await client.post("/sleep", headers=as_(name))).status == 401
        assert (await client.get("/v1/models", headers={"Authorization": "Bearer key-c"})).status == 401
    async with daemon(api_keys=KEYS) as (controller, client):  # no admin key: an API key opens /sleep
        assert (await client.post("/sleep", headers=as_("bob"))).status == 200


# -- report_cached_tokens ------------------------------------------------------------------------


async def _answered(client, jobs, path: str, body: dict, headers=None):
    before = len(jobs)
    request = asyncio.ensure_future(client.post(path, json=body, headers=headers))
    for _ in range(2000):
        if len(jobs) > before:
            break
        await asyncio.sleep(0.005)
    job = jobs[-1]
    job.put(p.Tokens(job.id, "ok", 1, n_prompt_tokens=10, n_cached_tokens=8))
    job.put(p.Done(job.id, "stop", prompt_tokens=10, completion_tokens=1, cached_tokens=8, restored_tokens=8,
                   cache_tier="disk"))
    response = await request
    assert response.status == 200, await response.text()
    return response


@pytest.mark.parametrize("report", [True, False])
async def test_report_cached_tokens_off_leaves_no_count(scripted, report):
    cached = 8 if report else 0
    async with daemon(report_cached_tokens=report) as (controller, client):
        jobs = scripted(controller)
        body = await (await _answered(client, jobs, "/v1/chat/completions", CHAT)).json()
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
        body = await (await _answered(client, jobs, "/completion", {"prompt": "hi", "n_predict": 2})).json()
        assert body["tokens_cached"] == cached and body["timings"]["cache_n"] == cached
        assert ("cache_tier" in body["timings"]) is report
        text = await (await _answered(client, jobs, "/v1/chat/completions",
                                      CHAT | {"stream": True, "stream_options": {"include_usage": True}})).text()
        usage = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")][-1]["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == cached
        body = await (await _answered(client, jobs, "/v1/responses", {"input": "hi"})).json()
        assert body["usage"]["input_tokens_details"]["cached_tokens"] == cached
        body = await (await _answered(client, jobs, "/v1/messages", {"model": "fake", "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"}]}, headers={"anthropic-version": "2023-06-01"})).json()
        assert body["usage"]["cache_read_input_tokens"] == cached
        slots = await (await client.get("/slots")).json()
        assert all(slot["n_cached"] == 0 for slot in slots) or report


def test_report_cached_tokens_is_a_boolean():
    assert Settings().report_cached_tokens is True
    with pytest.raises(ValidationError, match="report_cached_tokens"):
        Settings(report_cached_tokens="sometimes")
