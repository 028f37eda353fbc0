"""deploy/haproxy/haproxy.cfg is generated from deploy/haproxy/fleet.toml by
deploy/haproxy/generate.py: the committed file is the script's output, HAProxy
itself accepts it (`haproxy -c`), and its lines are the ones the agent
answers. tests/reliability/test_haproxy.py runs it in front of real daemons."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from config.models import MODEL_ID
from daemon.http.agent import ROLES, TIER_HOLD_SECONDS, WOKEN_BUSY_HOLD_SECONDS

ROOT = Path(__file__).resolve().parents[2]
HAPROXY_DIR = ROOT / "deploy" / "haproxy"
SCRIPT = HAPROXY_DIR / "generate.py"
FLEET = HAPROXY_DIR / "fleet.toml"
CFG = HAPROXY_DIR / "haproxy.cfg"

needs_haproxy = pytest.mark.skipif(shutil.which("haproxy") is None,
                                   reason="haproxy is not installed (.ci/run installs Debian's)")


def load_generator():
    spec = importlib.util.spec_from_file_location("deploy_haproxy_generate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


generate = load_generator()


def run_script(*args: str) -> subprocess.CompletedProcess:
    # As CI and an operator run it: a plain python3, no daemon on the path.
    return subprocess.run([sys.executable, "-I", str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def haproxy_check(cfg: Path, replicas) -> subprocess.CompletedProcess:
    env = {**os.environ, "DORMOUSE_HAPROXY_SOCKET": str(cfg.parent / "haproxy.sock")}
    env.update({generate.env_name(r): f"127.0.0.1:{18000 + i}" for i, r in enumerate(replicas)})
    return subprocess.run(["haproxy", "-c", "-f", str(cfg)], env=env, capture_output=True, text=True, timeout=60)


def test_the_committed_cfg_is_the_scripts_output():
    done = run_script("--check")
    assert done.returncode == 0, done.stderr
    assert CFG.read_text() == generate.render(generate.load_fleet(FLEET))


def test_the_check_fails_when_the_description_changes(tmp_path):
    """The check is not vacuous: a fleet.toml edited without regenerating fails it."""
    edited = tmp_path / "fleet.toml"
    edited.write_text(FLEET.read_text() + '\n[models.extra]\naliases = ["more"]\n')
    done = run_script("--check", "-f", str(edited), "-o", str(CFG))
    assert done.returncode == 1 and "is not what" in done.stderr
    stale = tmp_path / "haproxy.cfg"
    stale.write_text(CFG.read_text().replace("agent-inter 500ms", "agent-inter 2s"))  # a hand edit
    assert run_script("--check", "-o", str(stale)).returncode == 1


@needs_haproxy
def test_haproxy_accepts_the_committed_cfg(tmp_path):
    replicas = tomllib.loads(FLEET.read_text())["replicas"]
    done = haproxy_check(CFG, replicas)
    assert done.returncode == 0, done.stdout + done.stderr
    # Warnings are mistakes too (a keyword HAProxy ignores, a server it cannot use).
    assert "WARNING" not in done.stdout + done.stderr, done.stdout + done.stderr


@needs_haproxy
@pytest.mark.parametrize("description", [
    # A fleet of one: every request goes to it, as a daemon with one model does.
    {"replicas": ["a"], "models": {"only": {}}},
    # More replicas, some models on a subset, ids with the characters the daemon allows.
    {"replicas": ["gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5"], "default_model": "qwen2.5:7b",
     "models": {"llama-3.1_8b": {"aliases": ["gpt-4o"]}, "qwen2.5:7b": {"replicas": ["gpu-5", "gpu-4"]},
                "nomic.embed": {"aliases": ["text-embedding-3-small", "embed"], "replicas": ["gpu-3"]}}},
    # llama-server router's names (owner/name:QUANT), and an id that is one of them with '.' for '/'.
    {"replicas": ["a", "b"], "default_model": "ggml-org/gemma-3-270m-GGUF:Q8_0",
     "models": {"ggml-org/gemma-3-270m-GGUF:Q8_0": {"aliases": ["unsloth/gemma:Q4_K_M"]},
                "ggml-org.gemma-3-270m-GGUF:Q8_0": {}, "a/b/c": {"replicas": ["b"]}}},
])
def test_haproxy_accepts_other_descriptions(tmp_path, description):
    fleet = generate.parse_fleet(description)
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(generate.render(fleet))
    done = haproxy_check(cfg, fleet.replicas)
    assert done.returncode == 0 and "WARNING" not in done.stdout + done.stderr, done.stdout + done.stderr


def servers(text: str) -> dict[str, list[tuple[str, str]]]:
    """backend -> [(server name, the rest of its line)] in the file's order."""
    found: dict[str, list[tuple[str, str]]] = {}
    backend = None
    for line in text.splitlines():
        if line.startswith("backend "):
            backend = line.split()[1]
            found[backend] = []
        elif line.startswith(("frontend ", "global", "defaults")):
            backend = None
        elif backend and line.strip().startswith("server "):
            _, name, rest = line.strip().split(" ", 2)
            found[backend].append((name, rest))
    return found


def test_every_model_has_its_tiers_on_its_replicas_in_order():
    fleet = generate.load_fleet(FLEET)
    lines = servers(CFG.read_text())
    assert set(lines) == {f"{kind}.{m.id}" for m in fleet.models for kind in ("model", "overflow")}
    for model in fleet.models:
        # serve lines (active) first, then warm, then wake (backups), each in the model's replica order;
        # the overflow backend once each.
        expected = [(f"model.{model.id}", r if tier == "serve" else f"{r}-{tier}", r, tier)
                    for tier in ("serve", "warm", "wake") for r in model.replicas]
        expected += [(f"overflow.{model.id}", r, r, "overflow") for r in model.replicas]
        found = [(backend, name, rest) for backend in (f"model.{model.id}", f"overflow.{model.id}")
                 for name, rest in lines[backend]]
        assert [(b, n) for b, n, _ in found] == [(b, n) for b, n, _, _ in expected], model.id
        for (_, name, rest), (_, _, replica, tier) in zip(found, expected):
            assert rest.startswith(f'"${{{generate.env_name(replica)}}}"'), (model.id, name)
            # Every line runs its own health check: HAProxy observes (marks down at
            # the first refused connection) only lines that do, and any may carry a request.
            assert " check " in rest and " track " not in rest, (model.id, name)
            assert f'agent-send "{tier} {model.id}\\n"' in rest, (model.id, name)
            assert (" backup " in rest) == (tier in ("warm", "wake")), (model.id, name)
            assert tier in ROLES  # a role the daemon's agent answers


def test_ids_with_slashes_get_names_haproxy_takes_and_no_two_ids_share_one():
    ids = ["ggml-org/gemma:Q8_0", "ggml-org.gemma:Q8_0", "a/b", "a.b", "a/b/c", "a.b/c"]
    parts = [generate.name_part(i) for i in ids]
    assert len(set(parts)) == len(ids) and all(re.fullmatch(r"[A-Za-z0-9._:-]+", part) for part in parts)
    assert generate.name_part("qwen2.5:7b") == "qwen2.5:7b"  # an id without '/' keeps its names


def test_the_frontend_routes_every_name_and_refuses_the_others():
    fleet = generate.load_fleet(FLEET)
    text = CFG.read_text()
    for model in fleet.models:
        assert f"acl wants_{model.id} var(txn.model) -m str {' '.join((model.id, *model.aliases))}\n" in text
        assert f"use_backend model.{model.id} if wants_{model.id}\n" in text
    assert f"default_backend model.{fleet.default_model}\n" in text
    assert f"http-request set-var(txn.model) str({fleet.default_model}) if !{{ var(txn.model) -m found }}" in text
    assert "http-request return status 404" in text


def test_the_agents_hold_outlasts_two_agent_intervals():
    """A line of the tier a model leaves for a warmer one stays on until the
    new tier's line has surely been asked (daemon/http/agent.py)."""
    (inter,) = re.findall(r"agent-inter (\d+)ms", CFG.read_text())
    assert TIER_HOLD_SECONDS >= 2 * int(inter) / 1000


def test_a_woken_busy_replica_holds_past_haproxys_turn_around():
    """HAProxy retries a refused connection after min(timeout connect, 1 s);
    the warm line of a wake that ended busy stays on past that and one more
    agent interval (daemon/http/agent.py)."""
    text = CFG.read_text()
    (inter,) = re.findall(r"agent-inter (\d+)ms", text)
    (connect,) = re.findall(r"timeout connect (\d+)s", text)
    assert WOKEN_BUSY_HOLD_SECONDS > min(int(connect), 1) + int(inter) / 1000


def test_the_description_uses_the_daemons_names():
    # The same rule as the daemon's [models.ID] ids and aliases, so that every
    # name the daemons accept can be described.
    assert generate.MODEL_ID.pattern == MODEL_ID.pattern
    for model in generate.load_fleet(FLEET).models:
        assert all(MODEL_ID.fullmatch(name) for name in (model.id, *model.aliases))


def test_models_start_on_different_replicas_unless_told():
    fleet = generate.parse_fleet({"replicas": ["r1", "r2", "r3"],
                                  "models": {"a": {}, "b": {}, "c": {}, "d": {}, "e": {"replicas": ["r3"]}}})
    assert [m.replicas for m in fleet.models] == [
        ("r1", "r2", "r3"), ("r2", "r3", "r1"), ("r3", "r1", "r2"), ("r1", "r2", "r3"), ("r3",)]
    assert fleet.default_model == "a"  # the first table, as for the daemons


@pytest.mark.parametrize("description, needle", [
    ({"replicas": ["r1"], "models": {"a": {}}, "routers": 2}, "unknown keys ['routers']"),
    ({"replicas": [], "models": {"a": {}}}, "replicas must be a list"),
    ({"replicas": ["R_1"], "models": {"a": {}}}, "replica 'R_1'"),
    ({"replicas": ["r1-wake"], "models": {"a": {}}}, "replica 'r1-wake'"),
    ({"replicas": ["r1", "r1"], "models": {"a": {}}}, "listed twice"),
    ({"replicas": ["r1"], "models": {}}, "at least one [models.ID]"),
    ({"replicas": ["r1"], "models": {"a b": {}}}, "models.a b: a model id"),
    ({"replicas": ["r1"], "models": {"a//b": {}}}, "models.a//b: a model id"),
    ({"replicas": ["r1"], "models": {"a/../b": {}}}, "models.a/../b: a model id"),
    ({"replicas": ["r1"], "models": {"a/": {}}}, "models.a/: a model id"),
    ({"replicas": ["r1"], "models": {"a": {"path": "/m.gguf"}}}, "models.a: a table of"),
    ({"replicas": ["r1"], "models": {"a": {"aliases": ["x y"]}}}, "models.a.aliases"),
    ({"replicas": ["r1"], "models": {"a": {"aliases": ["b"]}, "b": {}}}, "the name 'b' is used by a too"),
    ({"replicas": ["r1"], "models": {"a": {"replicas": ["r9"]}}}, "models.a.replicas"),
    ({"replicas": ["r1"], "models": {"a": {}}, "default_model": "z"}, "default_model 'z'"),
])
def test_a_bad_description_is_refused_with_the_key(description, needle):
    with pytest.raises(generate.FleetError, match=re.escape(needle)):
        generate.parse_fleet(description)


def test_the_script_exits_2_on_a_bad_description(tmp_path):
    bad = tmp_path / "fleet.toml"
    bad.write_text('replicas = ["r1"]\n[models."a b"]\n')
    done = run_script("-f", str(bad), "-o", str(tmp_path / "out.cfg"))
    assert done.returncode == 2 and "a model id" in done.stderr
    assert not (tmp_path / "out.cfg").exists()


def test_bodies_far_past_16_kib_are_read_for_their_model_and_a_header_names_larger_ones():
    """HAProxy reads `model` from req.body only as far as tune.bufsize holds the body (16 KiB by
    default): the file raises it (overridable from the environment) and, for a body larger
    still, reads X-Dormouse-Model after the body and before ?model=."""
    text = CFG.read_text()
    found = re.search(r'^\s*tune\.bufsize "\$\{DORMOUSE_HAPROXY_BUFSIZE-(\d+)\}"$', text, re.M)
    assert found and int(found.group(1)) >= 256 * 1024 and int(found.group(1)) == generate.BUFSIZE
    frontend = [line.strip() for line in text.split("frontend dormouse", 1)[1].splitlines()
                if line.strip().startswith("http-request set-var(txn.model)")]
    sources = [line.split()[2] for line in frontend]
    assert sources[:4] == ["req.body,json_query('$.model')", "req.body,json_query('$.name')",
                           "req.hdr(x-dormouse-model)", "url_param(model)"]
    assert "DORMOUSE_HAPROXY_BUFSIZE" in text.split("global", 1)[0]  # listed with the other variables


@needs_haproxy
def test_haproxy_takes_the_buffer_size_from_the_environment(tmp_path):
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(CFG.read_text())
    env = {**os.environ, "DORMOUSE_HAPROXY_SOCKET": str(tmp_path / "haproxy.sock"), "DORMOUSE_HAPROXY_BUFSIZE": "65536",
           **{f"DORMOUSE_R{i}": f"127.0.0.1:{9000 + i}" for i in (1, 2, 3)}}
    checked = subprocess.run(["haproxy", "-c", "-f", str(cfg)], env=env, capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr
