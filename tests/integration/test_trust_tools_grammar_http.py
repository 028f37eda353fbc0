"""A grammar is built off the event loop, within a time bound, a few at a
time (issue 16, section 3: one 313 KB chat request froze every model and
/health for 38 s; 990 optional properties gave a text/plain 500). On the fake
worker (the real protocol and HTTP app)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from daemon.grammar import off_loop
from daemon.grammar.limits import MAX_OPTIONAL_PROPERTIES
from tests.integration.test_http_hardening import daemon, error_of

ASK = [{"role": "user", "content": "hi"}]


def optional_object(n: int) -> dict:
    return {"type": "object", "properties": {f"field_number_{i}": {"type": "string"} for i in range(n)}}


def forced_tools(n_tools: int, n_properties: int) -> dict:
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": optional_object(n_properties)}}
             for i in range(n_tools)]
    return {"messages": ASK, "tools": tools, "tool_choice": "required", "max_tokens": 2}


def schema_body(schema: dict) -> dict:
    return {"messages": ASK, "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}}


@pytest.fixture
def held_builds(monkeypatch):
    """Builds block until released: what a slow build looks like from the loop."""
    release = threading.Event()
    started = threading.Semaphore(0)
    real = off_loop.grammar_for

    def held(**fields):
        started.release()
        release.wait(30)
        return real(**fields)

    monkeypatch.setattr(off_loop, "grammar_for", held)
    yield release, started
    release.set()


async def test_the_hostile_request_is_a_400_naming_the_field_while_health_answers():
    async with daemon() as (controller, client):
        hostile = asyncio.ensure_future(client.post("/v1/chat/completions", json=forced_tools(12, 900)))
        health = await client.get("/health")
        assert health.status == 200
        error = await error_of(await hostile, 400)
        assert error["param"] == "tools[0].function.parameters" and error["code"] == "invalid_value"
        assert "900 optional properties" in error["message"] and f"at most {MAX_OPTIONAL_PROPERTIES}" in error["message"]
        # 990 optional properties: an OpenAI error body, not a text/plain 500.
        response = await client.post("/v1/chat/completions", json=schema_body(optional_object(990)))
        assert response.content_type == "application/json"
        assert (await error_of(response, 400))["param"] == "response_format.json_schema.schema"
        assert (await client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2})).status == 200


async def test_a_build_runs_off_the_loop(held_builds):
    release, started = held_builds
    async with daemon() as (controller, client):
        request = asyncio.ensure_future(client.post("/v1/chat/completions", json=schema_body(optional_object(3))))
        assert await asyncio.to_thread(started.acquire, True, 10)  # the build is under way, and held
        health = await asyncio.wait_for(client.get("/health"), 10)  # answered while it is
        assert health.status == 200 and not request.done()
        release.set()
        assert (await request).status == 200


async def test_builds_are_bounded_in_threads_and_in_number(held_builds):
    release, started = held_builds
    async with daemon() as (controller, client):
        admitted = [asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2,
                                                                                "json_schema": {"type": "integer"}}))
                    for _ in range(off_loop.MAX_PENDING)]
        for _ in range(off_loop.MAX_BUILDERS):
            assert await asyncio.to_thread(started.acquire, True, 10)
        while off_loop.pending_builds() < off_loop.MAX_PENDING:
            await asyncio.sleep(0.01)
        extra = await client.post("/v1/completions", json={"prompt": "x", "json_schema": {"type": "integer"}})
        error = await error_of(extra, 503)
        assert error["code"] == "server_busy" and extra.headers["Retry-After"]
        builders = [t for t in threading.enumerate() if t.name.startswith("dormouse-grammar")]
        assert len(builders) <= off_loop.MAX_BUILDERS
        release.set()
        assert [r.status for r in await asyncio.gather(*admitted)] == [200] * off_loop.MAX_PENDING
        assert off_loop.pending_builds() == 0


async def test_a_build_past_its_time_is_a_400_naming_the_field(monkeypatch):
    real = off_loop.grammar_for

    def slow(**fields):
        threading.Event().wait(0.2)  # past the deadline below before the build looks at its first schema
        return real(**fields)

    monkeypatch.setattr(off_loop, "grammar_for", slow)
    monkeypatch.setattr(off_loop, "BUILD_SECONDS", 0.1)
    async with daemon() as (controller, client):
        error = await error_of(await client.post("/v1/chat/completions", json=forced_tools(1, 3)), 400)
        assert error["param"] == "tools[0].function.parameters" and "took longer than 0.1s" in error["message"]
