"""A wake_history.json or footprints.json that a crash, a disk or a hand left bad is set
aside (renamed to *.bad, a log line naming it and why) and the daemon serves as if it were
not there: never a 500 on every request to a sleeping model while /health says ok."""

from __future__ import annotations

import json

import pytest

from statemachine import ServerState as S
from tests.integration.test_sleep_tiers import tier_daemon, until

pytestmark = pytest.mark.timeout(120)
BODY = {"prompt": "hi", "max_tokens": 2}
SAMPLE = {"model": "fake", "tier": "deep", "bytes": 1 << 20, "cold_bytes": 0, "seconds": 0.5, "weights_seconds": 0.1}
HOSTILE = {
    "infinity": '{"version": 1, "samples": [%s]}' % json.dumps(SAMPLE).replace("0.5", "Infinity"),
    "nan": '{"version": 1, "samples": [%s]}' % json.dumps(SAMPLE).replace("0.1", "NaN"),
    "negative": json.dumps({"version": 1, "samples": [{**SAMPLE, "bytes": -5, "cold_bytes": -9}]}),
    "absurd": json.dumps({"version": 1, "samples": [{**SAMPLE, "bytes": 10 ** 30}]}),
}


@pytest.mark.parametrize("name", list(HOSTILE))
async def test_a_hostile_wake_history_is_set_aside_and_a_sleeping_model_still_wakes(tmp_path, name):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\7" * (1 << 20))
    state = tmp_path / "state"
    state.mkdir()
    (state / "wake_history.json").write_text(HOSTILE[name])
    async with tier_daemon(state_dir=state, wake_timeout=10) as (controller, client):
        controller.model_path = str(gguf)
        await until(controller, S.READY)
        await client.post("/sleep")
        await until(controller, S.SLEEPING)
        for _ in range(3):
            response = await client.post("/v1/completions", json=BODY, headers={"X-Dormouse-Max-Wait": "30"})
            assert response.status == 200, await response.text()
            assert (await client.post("/sleep")).status == 200
        assert (await client.get("/props")).status == 200
        assert (await client.get("/metrics")).status == 200
    assert (state / "wake_history.json.bad").read_text() == HOSTILE[name]
