"""The prompt cache's request field and setting under hostile input (issue 16,
sections 1 and 2): `cache_prompt` on llama-server's /completion reaches the
worker as it was sent, anything but a boolean is a 400 that names it, and
`cache_deterministic` is a boolean setting refused otherwise."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from config import Settings
from tests.integration.test_http_hardening import daemon, error_of


@pytest.mark.parametrize("value", ["sometimes", 2, [], {"a": 1}, "x" * 100_000])
async def test_cache_prompt_that_is_not_a_boolean_is_a_400_naming_it(value):
    async with daemon() as (controller, client):
        r = await client.post("/completion", json={"prompt": "hi", "n_predict": 2, "cache_prompt": value})
        error = await error_of(r, 400)
        assert error["param"] == "cache_prompt"
        assert (await client.get("/health")).status == 200  # the daemon goes on


@pytest.mark.parametrize("value, expected", [(False, False), (True, True), (None, True)])
async def test_cache_prompt_reaches_the_worker(value, expected, monkeypatch):
    from daemon.model.controller import Controller

    sent = []
    original = Controller.new_job

    def spy(self, *args, **kwargs):
        job = original(self, *args, **kwargs)
        sent.append(job.submit.cache_prompt)
        return job

    monkeypatch.setattr(Controller, "new_job", spy)
    body = {"prompt": "hi", "n_predict": 2} | ({} if value is None else {"cache_prompt": value})
    async with daemon() as (controller, client):
        r = await client.post("/completion", json=body)
        assert r.status == 200, await r.text()
    assert sent == [expected]


@pytest.mark.parametrize("value", ["sometimes", 3, [True]])
def test_cache_deterministic_is_a_boolean(value):
    with pytest.raises(ValidationError, match="cache_deterministic"):
        Settings(cache_deterministic=value)
