"""Scale to zero and back with the shared tier (issue 31): a conversation
that wakes a replica from zero restores its prompt from the shared tier.

Replica A (the tiny test model in a real worker, its own state_dir, the
shared_cache_dir) serves a conversation and is stopped with SIGTERM, as
KEDA's scale-down to zero stops the last pod. Then a NEW replica B starts,
as the pod a request wakes from zero on another node would: an empty
state_dir of its own (nothing of A's), the same shared_cache_dir. The
conversation's next turn, B's first request, reports most of its prompt
cached (usage.prompt_tokens_details.cached_tokens), and B's /metrics count
it as restored from the shared tier (origin="shared"). B's metrics also show
what each figure counts: disk_hits/disk_tokens{origin} split the tier="disk"
figure (their sum is it), and saved_bytes, at B's sleep, counts the bytes
written to both tiers (its own file and the shared copy).

Beside it, the manifests: the path that wakes from zero on Kubernetes
(deploy/k8s/scale-from-zero: KEDA's HTTP add-on scaling the base's
StatefulSet) mounts the shared claim where the ConfigMap's
shared_cache_dir points."""

from __future__ import annotations

import tomllib
from pathlib import Path

import yaml

from tests.fixtures.tiny_model import write_tiny_model
from tests.reliability.test_haproxy import DEFAULT, Replica, figures
from tests.reliability.test_shared_cache import chat, shared_metrics, words

from tests.reliability.test_haproxy import pytestmark  # noqa: E402,F401 (reliability; skipped without haproxy)

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def test_a_replica_started_from_zero_restores_the_conversation_from_the_shared_tier(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    tiny = str(write_tiny_model(tmp_path / "tiny-llama.gguf"))
    settings = {"shared_cache_dir": str(shared), "kv_cache_min_tokens": 16, "sleep_idle_seconds": 3600,
                "parallel": 2, "ctx_size": 4096}
    a = Replica("a", tiny, tmp_path, settings=settings)
    b = Replica("b", tiny, tmp_path, settings=settings)
    b_state = Path(b.log_path.with_suffix(".state"))
    try:
        a.start()
        a.wait_state("ready", "sleeping", timeout=120)
        messages = [{"role": "system", "content": words(5, 120)}, {"role": "user", "content": words(6, 20)}]
        first = chat(a, messages)
        exit_code = a.stop(timeout=60)  # the last pod scaled away: SIGTERM, A's caches saved on the way out
        files = sorted(p.name for p in shared.rglob("*.kv"))
        assert not b_state.exists()  # B has nothing of its own: a fresh pod's empty volume
        b.start()
        b.wait_state("ready", "sleeping", timeout=120)
        messages += [first["choices"][0]["message"], {"role": "user", "content": words(7, 10)}]
        second = chat(b, messages)  # the request that woke the set
        seen = shared_metrics(b)
        split = {what: (b.metric(f"dormouse_prompt_cache_{what}_total", model=DEFAULT, tier="disk"),
                        sum(b.metric(f"dormouse_prompt_cache_disk_{what}_total", model=DEFAULT, origin=origin)
                            for origin in ("own", "shared"))) for what in ("hits", "tokens")}
        assert b.http.post("/sleep").status_code == 200  # B's caches to both tiers
        b.wait_state("sleeping")
        saved = b.metric("dormouse_prompt_cache_saved_bytes_total", model=DEFAULT)
        own_bytes = sum(f.stat().st_size for f in b_state.rglob("*.kv"))
        shared_bytes = sum(f.stat().st_size for f in shared.rglob("*.kv") if f.name not in files)
    finally:
        for r in (a, b):
            if r.stop(timeout=30) is None:
                r.kill()
            r.http.close()
    usage = second["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    share = cached / usage["prompt_tokens"]
    figures("a conversation that wakes a new replica from zero", a_exit_code=exit_code,
            shared_files_after_a_stopped=len(files), prompt_tokens=usage["prompt_tokens"], cached_tokens=cached,
            cached_share=round(share, 3), **seen, disk_tier_and_its_origins=split, saved_bytes=saved,
            own_bytes_written=own_bytes, shared_bytes_written=shared_bytes)
    assert exit_code == 0
    assert files, "A's stop wrote nothing to the shared directory"
    assert share >= 0.8, usage  # the goal: most of the prompt restored
    assert seen["shared_hits"] >= 1 and seen["shared_tokens"] >= cached  # from the shared tier, not B's own
    assert seen["reachable"] == 1
    # What the metrics count (docs/SCALING.md, "A shared tier"): disk_hits/disk_tokens{origin} split the
    # tier="disk" figure by where the file was (their sum is it: add one or the other, never both), and
    # saved_bytes counts the bytes written to both tiers, B's own file and its copy in the shared directory.
    assert split["hits"][0] == split["hits"][1] >= 1 and split["tokens"][0] == split["tokens"][1] == cached
    assert own_bytes > 0 and shared_bytes > 0 and saved == own_bytes + shared_bytes


def k8s_documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_the_path_that_wakes_from_zero_mounts_the_shared_claim():
    overlay = k8s_documents(K8S / "scale-from-zero" / "kustomization.yaml")[0]
    assert ".." in overlay["resources"]  # the base's StatefulSet, as it is
    # The overlay's only patch deletes the base's ScaledObject; nothing touches the StatefulSet's volumes.
    for patch in overlay.get("patches", []):
        patched = yaml.safe_load(patch["patch"])
        assert patched["kind"] == "ScaledObject" and patched["$patch"] == "delete", patch
    (scaler,) = k8s_documents(K8S / "scale-from-zero" / "httpscaledobject.yaml")
    assert scaler["spec"]["replicas"]["min"] == 0  # it does scale to zero
    target = scaler["spec"]["scaleTargetRef"]
    (statefulset,) = [d for d in k8s_documents(K8S / "statefulset.yaml") if d["kind"] == "StatefulSet"]
    assert (target["kind"], target["name"]) == ("StatefulSet", statefulset["metadata"]["name"])

    (configmap,) = k8s_documents(K8S / "configmap.yaml")
    settings = tomllib.loads(configmap["data"]["dormouse.toml"])
    pod = statefulset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    shared_mount = mounts[settings["shared_cache_dir"]]
    assert not shared_mount.get("readOnly", False)  # every replica writes its saved prompts there
    volume = next(v for v in pod["volumes"] if v["name"] == shared_mount["name"])
    claim = volume["persistentVolumeClaim"]["claimName"]
    # One claim that every pod mounts (not a per-pod volumeClaimTemplate: a pod woken from
    # zero on another node would get an empty one), distinct from each pod's own state claim.
    assert claim not in {t["metadata"]["name"] for t in statefulset["spec"]["volumeClaimTemplates"]}
    assert settings["shared_cache_dir"] != settings["state_dir"]
    assert mounts[settings["state_dir"]]["name"] in {t["metadata"]["name"] for t in statefulset["spec"]["volumeClaimTemplates"]}
