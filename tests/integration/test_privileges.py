"""Who may put a model to sleep or load it (issue 27, items 2 and 3).

- Socket activation: a socket systemd passes is judged like a bound one: off
  loopback, the daemon needs `admin_key` or refuses to serve (exit status 2).
- Ollama's load and unload (an empty request, `keep_alive` 0, a negative
  `keep_alive` that holds the model for ever, or one over an hour) need what
  POST /sleep needs: the admin key when one is set. A keep_alive that only
  keeps the model awake a while longer is anyone's.
"""

from __future__ import annotations

import asyncio
import signal
import socket

import pytest

from config import Settings
from statemachine import ServerState
from tests.integration.test_http_hardening import daemon

ADMIN = {"Authorization": "Bearer adm"}
API = {"Authorization": "Bearer api"}


async def asleep(controller, client) -> None:
    assert (await client.post("/sleep", headers=ADMIN)).status == 200
    assert controller.state is ServerState.SLEEPING


# -- socket activation -------------------------------------------------------------------------


async def _serve_with_inherited(monkeypatch, address: str, **settings) -> int:
    """daemon.server.serve() given a listening socket as systemd passes one; its exit status."""
    from daemon.fleet.plans import ModelPlan
    from daemon.server import serve
    import daemon.server as server

    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((address, 0))
    sock.listen()
    monkeypatch.setattr(server, "inherited_socket", lambda: sock)
    s = Settings(worker_module="tests.fakes.fake_worker", sleep_idle_seconds=-1, spawn_ahead=False, **settings)
    plan = ModelPlan("fake", s, "/models/fake.gguf", (), False, is_default=True)
    try:
        return await asyncio.wait_for(serve(s, [plan]), 30)
    finally:
        sock.close()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # serve() takes them over: give them back
            asyncio.get_running_loop().remove_signal_handler(sig)


async def test_socket_activation_off_loopback_without_admin_key_refuses_to_serve(monkeypatch):
    """Bound to 0.0.0.0 by systemd (LISTEN_FDS), /sleep and /wake answered the network with no key."""
    import io

    from daemon.logs import configure_logging

    log = io.StringIO()  # the log's own stream: structlog keeps whatever stream an earlier test gave it
    configure_logging("json", "info", stream=log)
    assert await _serve_with_inherited(monkeypatch, "0.0.0.0") == 2
    assert "admin_key is required" in log.getvalue()


def test_the_admin_rule_is_judged_on_the_served_address():
    from daemon.server import _open_off_loopback

    open_settings = Settings()
    assert _open_off_loopback([("0.0.0.0", 8080)], open_settings)
    assert _open_off_loopback([("::", 8080, 0, 0)], open_settings)
    assert _open_off_loopback([("127.0.0.1", 8080), ("10.0.0.7", 8080)], open_settings)
    assert _open_off_loopback([("127.0.0.1", 8080), ("::1", 8080, 0, 0)], open_settings) is None
    assert _open_off_loopback(["/run/dormouse.sock"], open_settings) is None  # a Unix socket: local users only
    assert _open_off_loopback([("0.0.0.0", 8080)], Settings(host="0.0.0.0", admin_key="adm")) is None


# -- Ollama's load and unload ----------------------------------------------------------------


async def test_keep_alive_zero_without_the_admin_key_is_refused_in_ollamas_shape():
    async with daemon(admin_key="adm") as (controller, client):
        for path, body in (("/api/generate", {"model": "fake", "keep_alive": 0}),
                           ("/api/chat", {"model": "fake", "keep_alive": 0}),
                           ("/api/generate", {"model": "fake", "prompt": "hi", "keep_alive": "0s",
                                              "options": {"num_predict": 1}, "stream": False}),
                           ("/api/chat", {"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                                          "keep_alive": 0, "stream": False})):
            response = await client.post(path, json=body)
            assert response.status == 403, (path, body, await response.text())
            error = (await response.json())["error"]
            assert isinstance(error, str) and "admin_key" in error, error  # Ollama's shape: {"error": "..."}
        for _ in range(5):  # nothing was unloaded
            await asyncio.sleep(0.02)
        assert controller.state is ServerState.READY
        # The admin key unloads through the same route.
        response = await client.post("/api/generate", json={"model": "fake", "keep_alive": 0}, headers=ADMIN)
        assert response.status == 200, await response.text()
        assert (await response.json())["done_reason"] == "unload"
        assert await controller.wait_for(lambda s: s is ServerState.SLEEPING, 10)


async def test_an_empty_load_request_without_the_admin_key_is_refused():
    async with daemon(admin_key="adm") as (controller, client):
        await asleep(controller, client)
        for path, body in (("/api/generate", {"model": "fake"}), ("/api/chat", {"model": "fake", "messages": []})):
            response = await client.post(path, json=body)
            error = (await response.json())["error"]
            assert response.status == 403 and "admin_key" in error, (path, error)
        assert controller.state is ServerState.SLEEPING  # nothing loaded it
        response = await client.post("/api/generate", json={"model": "fake"}, headers=ADMIN)
        assert response.status == 200 and (await response.json())["done_reason"] == "load"
        assert controller.state is ServerState.READY


@pytest.mark.parametrize("keep_alive", [-1, "-1m", "2h", 3601, "8760h"])
async def test_a_keep_alive_that_holds_the_model_needs_the_admin_key(keep_alive):
    async with daemon(admin_key="adm") as (controller, client):
        body = {"model": "fake", "prompt": "hi", "keep_alive": keep_alive, "options": {"num_predict": 1},
                "stream": False}
        response = await client.post("/api/generate", json=body)
        assert response.status == 403, await response.text()
        assert "admin_key" in (await response.json())["error"]
        assert (await client.post("/api/generate", json=body, headers=ADMIN)).status == 200


@pytest.mark.parametrize("keep_alive", ["5m", 60, "1h", None])
async def test_a_keep_alive_that_only_keeps_it_awake_a_while_is_anyones(keep_alive):
    async with daemon(admin_key="adm") as (controller, client):
        body = {"model": "fake", "prompt": "hi", "options": {"num_predict": 1}, "stream": False}
        response = await client.post("/api/generate", json=body | {"keep_alive": keep_alive})
        assert response.status == 200, await response.text()


async def test_with_an_api_key_too_the_api_key_may_not_unload_and_the_admin_key_may():
    async with daemon(api_key="api", admin_key="adm") as (controller, client):
        body = {"model": "fake", "keep_alive": 0}
        assert (await client.post("/api/generate", json=body)).status == 401
        response = await client.post("/api/generate", json=body, headers=API)
        assert response.status == 403 and "admin_key" in (await response.json())["error"]
        assert controller.state is ServerState.READY
        # The router's /models/load and /models/unload: the admin key alone.
        assert (await client.post("/models/unload", json={"model": "fake"}, headers=API)).status == 401
        assert (await client.post("/models/load", json={"model": "fake"}, headers=API)).status == 401
        assert (await client.post("/models/unload", json={"model": "fake"}, headers=ADMIN)).status == 200
        assert (await client.post("/models/load", json={"model": "fake"}, headers=ADMIN)).status == 200
        # The admin key opens the API routes (it is the stronger key), and unloads.
        response = await client.post("/api/generate", json=body, headers=ADMIN)
        assert response.status == 200, await response.text()
        assert await controller.wait_for(lambda s: s is ServerState.SLEEPING, 10)


async def test_without_an_admin_key_whoever_may_sleep_may_unload():
    async with daemon(api_key="api") as (controller, client):
        response = await client.post("/api/generate", json={"model": "fake", "keep_alive": 0}, headers=API)
        assert response.status == 200 and (await response.json())["done_reason"] == "unload"
    async with daemon() as (controller, client):  # no keys at all: as before
        response = await client.post("/api/generate", json={"model": "fake", "keep_alive": -1, "prompt": "hi",
                                                            "options": {"num_predict": 1}, "stream": False})
        assert response.status == 200


async def test_an_empty_embed_request_loads_only_with_the_admin_key():
    async with daemon(admin_key="adm", embeddings=True) as (controller, client):
        await asleep(controller, client)
        for path, body in (("/api/embed", {"model": "fake"}), ("/api/embeddings", {"model": "fake", "prompt": ""}),
                           ("/api/embed", {"model": "fake", "input": "x", "keep_alive": 0})):
            response = await client.post(path, json=body)
            assert response.status == 403 and "admin_key" in (await response.json())["error"], path
        assert controller.state is ServerState.SLEEPING
        assert (await client.post("/api/embed", json={"model": "fake"}, headers=ADMIN)).status == 200
        assert controller.state is ServerState.READY
