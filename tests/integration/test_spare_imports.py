"""A light-tier model's spare worker has imported the engine's modules before its
Hello, so that a wake pays for the weights and the contexts only; a deep sleep's
spare stays lean. The worker side on the real `python -m daemon.worker`, the
controller side on the fake worker (which takes the same arguments)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from contextlib import asynccontextmanager

import psutil
import pytest

from daemon import protocol as p
from statemachine import ServerState as S
from tests.integration.test_sleep_tiers import tier_daemon, until

pytestmark = pytest.mark.timeout(120)


def test_the_engine_modules_follow_the_model():
    assert p.engine_modules(False, False, False) == ("prompt_cache",)
    assert p.engine_modules(True, False, False) == ()  # an embeddings engine keeps no prompt cache
    assert p.engine_modules(False, True, True) == ("prompt_cache", "speculative", "multimodal")
    assert set(p.engine_modules(False, True, True)) <= set(p.ENGINE_MODULES)


def numpy_loaded_after_hello(*args: str) -> bool:
    """Spawn the real worker, wait for its Hello, say whether numpy's core is mapped in it."""
    sock, child = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-m", "daemon.worker", "--fd", str(child.fileno()), *args],
                            pass_fds=(child.fileno(),), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    child.close()
    try:
        sock.settimeout(60)
        head = sock.recv(p.HEADER.size, socket.MSG_WAITALL)
        body = sock.recv(p.HEADER.unpack(head)[0], socket.MSG_WAITALL)
        assert isinstance(p.decode_for_daemon(body), p.Hello)
        return any("_multiarray_umath" in m.path for m in psutil.Process(proc.pid).memory_maps())
    finally:
        sock.close()  # a spare that is never needed exits on EOF
        assert proc.wait(30) == 0


def test_a_worker_asked_to_imports_the_engines_modules_before_hello_and_ignores_other_names():
    assert not numpy_loaded_after_hello()  # lean: numpy comes with the engine, after Load
    assert numpy_loaded_after_hello("--import", "prompt_cache,os,../x,")


async def spare_args(controller) -> list[str]:
    """The spare worker's command line, once it is there (it is spawned after the sleep's report)."""
    for _ in range(400):
        if controller.supervisor.spare is not None:
            return psutil.Process(controller.supervisor.spare.pid).cmdline()
        await asyncio.sleep(0.05)
    raise AssertionError("no spare worker within 20 s of the sleep")


@asynccontextmanager
async def light_sleeping(tmp_path):
    """A fake-worker daemon with spawn_ahead, put to sleep in the light tier; yields (controller, client)."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\1" * 4096)
    async with tier_daemon(deep_after=-1, spawn_ahead=True, state_dir=tmp_path / "state") as (controller, client):
        controller.model_path = str(gguf)  # the keeper maps the model's files; the fake's path is made up
        await until(controller, S.READY)
        await client.post("/sleep", json={"tier": "light"})
        yield controller, client


async def test_a_light_models_spare_imports_the_engine_and_a_deep_ones_does_not(tmp_path):
    async with light_sleeping(tmp_path) as (controller, client):
        args = await spare_args(controller)
        assert args[args.index("--import") + 1] == "prompt_cache"
        assert (await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})).status == 200
        await client.post("/sleep", json={"tier": "deep"})  # from awake: the worker exits, a lean spare follows
        assert "--import" not in await spare_args(controller)


async def test_a_light_models_spare_is_swapped_for_a_lean_one_when_it_goes_deep(tmp_path):
    """No worker exits on the way from light to deep: the importing spare is ended and a lean one spawned."""
    async with light_sleeping(tmp_path) as (controller, client):
        assert "--import" in await spare_args(controller)
        importing = controller.supervisor.spare.pid
        assert (await (await client.post("/sleep", json={"tier": "deep"})).json())["tier"] == "deep"
        for _ in range(400):  # the swap is a task of its own
            spare = controller.supervisor.spare
            if spare is not None and spare.pid != importing:
                break
            await asyncio.sleep(0.05)
        assert "--import" not in await spare_args(controller)
        assert not psutil.pid_exists(importing) or psutil.Process(importing).status() == psutil.STATUS_ZOMBIE
        assert (await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})).status == 200
