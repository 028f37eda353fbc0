"""Issue 29's conformance fixes through the real middleware on a fake worker: /metrics carries
llama-server's Process-Start-Time-Unix, and the unversioned /responses, /responses/input_tokens and
/chat/completions/input_tokens routes are served behind the same API key as their /v1 forms."""

from __future__ import annotations

import psutil

from tests.conftest import fake_daemon


async def test_metrics_say_when_the_process_started():
    async with fake_daemon() as (_, client):
        first = await client.get("/metrics")
        second = await client.get("/metrics")
        assert first.status == 200
        started = first.headers["Process-Start-Time-Unix"]
        assert started == second.headers["Process-Start-Time-Unix"]  # a start time, not the scrape's time
        assert int(started) == int(psutil.Process().create_time())


async def test_unversioned_routes_need_the_key_and_refuse_hostile_bodies():
    async with fake_daemon(api_key="k") as (_, client):
        for path in ("/responses", "/responses/input_tokens", "/chat/completions/input_tokens"):
            assert (await client.post(path, json={})).status == 401, path
            wrong_type = await client.post(path, data=b"{}", headers={"Authorization": "Bearer k",
                                                                     "Content-Type": "text/plain"})
            assert wrong_type.status == 415, path
            for body in ([1, 2], {"input": 5, "messages": "x"}, {"max_output_tokens": -1, "input": "hi"}):
                bad = await client.post(path, json=body, headers={"Authorization": "Bearer k"})
                assert bad.status == 400, (path, body, await bad.text())
        key = {"Authorization": "Bearer k"}
        counted = await client.post("/chat/completions/input_tokens", headers=key,
                                    json={"messages": [{"role": "user", "content": "hello there"}]})
        assert counted.status == 200 and (await counted.json())["input_tokens"] > 0
        versioned = await client.post("/v1/chat/completions/input_tokens", headers=key,
                                      json={"messages": [{"role": "user", "content": "hello there"}]})
        assert (await versioned.json())["input_tokens"] == (await counted.json())["input_tokens"]
        answered = await client.post("/responses", headers=key, json={"input": "hi", "max_output_tokens": 4})
        assert answered.status == 200 and (await answered.json())["object"] == "response"
