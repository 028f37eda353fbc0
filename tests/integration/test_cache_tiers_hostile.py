"""POST /slots/{id}?action=save|restore|erase (llama-server's) under hostile
input, on the fake worker: every refusal is a 4xx in OpenAI's shape naming
the field, the daemon goes on; the answers have llama-server's fields. And
the prompt cache's RAM setting refuses what is not a size."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from config import Settings
from tests.integration.test_http_hardening import daemon, error_of

ADMIN = {"Authorization": "Bearer adm"}


async def test_save_restore_erase_answer_as_llama_server(tmp_path):
    async with daemon(admin_key="adm", slot_save_path=str(tmp_path), parallel=2) as (controller, client):
        r = await client.post("/slots/1?action=save", json={"filename": "a.bin"}, headers=ADMIN)
        assert r.status == 200, await r.text()
        body = await r.json()
        assert {k: body[k] for k in ("id_slot", "filename", "n_saved", "n_written")} == \
            {"id_slot": 1, "filename": "a.bin", "n_saved": 7, "n_written": 4096}
        assert body["timings"]["save_ms"] >= 0
        body = await (await client.post("/slots/0?action=restore", json={"filename": "a.bin"}, headers=ADMIN)).json()
        assert body["n_restored"] == 7 and body["n_read"] == 4096 and "restore_ms" in body["timings"]
        body = await (await client.post("/slots/0?action=erase", json={}, headers=ADMIN)).json()
        assert body == {"id_slot": 0, "n_erased": 7}


async def test_slot_actions_need_the_admin_key(tmp_path):
    async with daemon(admin_key="adm", slot_save_path=str(tmp_path)) as (controller, client):
        r = await client.post("/slots/0?action=save", json={"filename": "a.bin"})
        assert r.status == 401


async def test_without_slot_save_path_the_actions_are_not_supported():
    async with daemon(admin_key="adm") as (controller, client):
        error = await error_of(await client.post("/slots/0?action=save", json={"filename": "a"}, headers=ADMIN), 501)
        assert "slot-save-path" in error["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/slots/0?action=fly", {"filename": "a"}, "action"),
    ("/slots/0", {"filename": "a"}, "action"),
    ("/slots/-1?action=save", {"filename": "a"}, "id_slot"),
    ("/slots/x?action=save", {"filename": "a"}, "id_slot"),
    ("/slots/99999999999?action=save", {"filename": "a"}, "id_slot"),
    ("/slots/4?action=save", {"filename": "a"}, "id_slot"),  # parallel 4: slots 0..3
    ("/slots/0?action=save", {}, "filename"),
    ("/slots/0?action=save", {"filename": 5}, "filename"),
    ("/slots/0?action=save", {"filename": ["a"]}, "filename"),
    ("/slots/0?action=save", {"filename": ""}, "filename"),
    ("/slots/0?action=save", {"filename": "x" * 100_000}, "filename"),
    ("/slots/0?action=restore", {"filename": {"a": {"b": {"c": 1}}}}, "filename"),
])
async def test_hostile_slot_requests_are_400s_naming_the_field(tmp_path, path, body, param):
    async with daemon(admin_key="adm", slot_save_path=str(tmp_path), parallel=4) as (controller, client):
        error = await error_of(await client.post(path, json=body, headers=ADMIN), 400)
        assert error["param"] == param, error
        assert (await client.get("/health")).status == 200


@pytest.mark.parametrize("name", ["../etc/passwd", "a/b", ".hidden", "a b", "\x00", "é"])
async def test_a_filename_that_is_not_a_plain_name_is_refused_by_the_worker(tmp_path, name):
    # The fake worker does not check names; the real one refuses them (prompt_cache_slots.FILENAME).
    from daemon.worker.prompt_cache_slots import FILENAME
    assert not FILENAME.fullmatch(name)


async def test_nested_json_and_wrong_content_type_are_4xx(tmp_path):
    async with daemon(admin_key="adm", slot_save_path=str(tmp_path)) as (controller, client):
        deep = "[" * 100_000 + "]" * 100_000
        r = await client.post("/slots/0?action=save", data=deep, headers={**ADMIN, "Content-Type": "application/json"})
        assert 400 <= r.status < 500
        r = await client.post("/slots/0?action=save", data="filename=a", headers={**ADMIN, "Content-Type": "text/plain"})
        assert r.status == 415


async def test_a_busy_slot_is_a_409(tmp_path):
    async with daemon(admin_key="adm", slot_save_path=str(tmp_path)) as (controller, client):
        error = await error_of(await client.post("/slots/0?action=save", json={"filename": "busy"}, headers=ADMIN), 409)
        assert error["code"] == "slot_busy"


@pytest.mark.parametrize("value", [-1, "lots", True, 2**70, "1.5 parsecs"])
def test_a_ram_budget_that_is_not_a_size_is_refused(value):
    with pytest.raises(ValidationError, match="prompt_cache_ram_bytes"):
        Settings(prompt_cache_ram_bytes=value)


@pytest.mark.parametrize("value, expected", [(0, 0), ("0", 0), (1, 1), ("2GiB", 2 * 2**30)])
def test_a_ram_budget_of_zero_or_one_byte_is_accepted(value, expected):
    assert Settings(prompt_cache_ram_bytes=value).prompt_cache_ram_bytes == expected
