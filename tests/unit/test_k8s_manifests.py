"""deploy/k8s/ against Kubernetes' own schemas (kubernetes-validate's bundled
OpenAPI schemas, strict: an unknown field fails, as `kubectl apply` refuses
it), the three CRDs (ServiceMonitor, KEDA's ScaledObject, its HTTP add-on's
HTTPScaledObject) against schemas written from their CRDs
(tests/unit/k8s_schemas/, see the $comment in each), the Secret that
kustomization.yaml generates from make_keys.py's keys, the scale-from-zero
overlay, and the manifests against each other, against the daemon's
settings and against the image (Dockerfile)."""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the test extra")
import jsonschema  # noqa: E402  (installed with kubernetes-validate)
import yaml  # noqa: E402

from config import ConfigError, load_settings  # noqa: E402
from daemon.server import stop_budget  # noqa: E402
from tests.unit.test_deploy_image import dockerfile  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
FROM_ZERO = K8S / "scale-from-zero"
SCHEMAS = Path(__file__).parent / "k8s_schemas"
# The oldest Kubernetes the manifests are for (preStop's sleep action is on by
# default from 1.30), and the newest the package knows.
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring-v1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda-v1alpha1.json",
    ("http.keda.sh/v1alpha1", "HTTPScaledObject"): "httpscaledobject-keda-http-v1alpha1.json",
}


def documents(directory: Path = K8S) -> list[tuple[str, dict]]:
    found = []
    for path in sorted(directory.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((path.name, doc))
    return found


def one(kind: str, name: str | None = None, directory: Path = K8S) -> dict:
    matches = [d for _, d in documents(directory)
               if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(matches) == 1, (kind, name, len(matches))
    return matches[0]


def kustomization(directory: Path = K8S) -> dict:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def make_keys(path: Path) -> dict[str, str]:
    """keys.env as deploy/k8s/make_keys.py writes it (run as an operator runs it)."""
    done = subprocess.run([sys.executable, "-I", str(K8S / "make_keys.py"), "--output", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line)


def generated_secret(keys: dict[str, str]) -> dict:
    """The Secret kustomize's secretGenerator makes of keys.env (before its name's hash suffix)."""
    (generator,) = kustomization()["secretGenerator"]
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": {"name": generator["name"]},
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in keys.items()}}


def validate(doc: dict, version: str) -> None:
    """Raises on a manifest Kubernetes (or the CRD) would refuse."""
    crd = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if crd is not None:
        schema = json.loads((SCHEMAS / crd).read_text())
        jsonschema.Draft202012Validator(schema).validate(doc)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_passes_its_schema(version, tmp_path):
    docs = documents() + [(f"scale-from-zero/{name}", doc) for name, doc in documents(FROM_ZERO)]
    docs.append(("secretGenerator", generated_secret(make_keys(tmp_path / "keys.env"))))
    assert {d["kind"] for _, d in docs} >= {"ConfigMap", "Service", "StatefulSet", "PodDisruptionBudget",
                                            "ServiceMonitor", "ScaledObject", "HTTPScaledObject", "Secret"}
    for name, doc in docs:
        try:
            validate(doc, version)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']} against {version}: "
                        f"{'.'.join(map(str, exc.path))}: {exc.message}")


def container(statefulset: dict) -> dict:
    (c,) = statefulset["spec"]["template"]["spec"]["containers"]
    return c


def broken(kind: str, edit) -> dict:
    doc = copy.deepcopy(one(kind, directory=FROM_ZERO if kind == "HTTPScaledObject" else K8S))
    edit(doc)
    return doc


@pytest.mark.parametrize("kind, edit", [
    # A misspelt field is refused, not ignored (strict).
    ("StatefulSet", lambda d: container(d).__setitem__("readinessProbes", container(d).pop("readinessProbe"))),
    # A wrong type.
    ("StatefulSet", lambda d: d["spec"]["template"]["spec"].__setitem__("terminationGracePeriodSeconds", "70")),
    ("PodDisruptionBudget", lambda d: d["spec"].__setitem__("maxUnavailabe", 1)),
    # KEDA's trigger metadata is a map of strings: an unquoted threshold is refused by the API server.
    ("ScaledObject", lambda d: d["spec"]["triggers"][0]["metadata"].__setitem__("threshold", 4)),
    ("ScaledObject", lambda d: d["spec"]["triggers"][0]["metadata"].pop("query")),
    ("ScaledObject", lambda d: d["spec"].__setitem__("minReplicas", 1)),
    ("ServiceMonitor", lambda d: d["spec"]["endpoints"][0].__setitem__("interval", "15 seconds")),
    ("ServiceMonitor", lambda d: d["spec"]["endpoints"][0].__setitem__("ports", "http")),
    # The HTTP add-on's route: a target needs exactly one of port and portName ...
    ("HTTPScaledObject", lambda d: d["spec"]["scaleTargetRef"].pop("port")),
    ("HTTPScaledObject", lambda d: d["spec"]["scaleTargetRef"].__setitem__("portName", "http")),
    # ... int32 fields are integers, timeouts Go durations, and the two scaling metrics exclusive.
    ("HTTPScaledObject", lambda d: d["spec"]["replicas"].__setitem__("min", "0")),
    ("HTTPScaledObject", lambda d: d["spec"]["timeouts"].__setitem__("conditionWait", "10 minutes")),
    ("HTTPScaledObject", lambda d: d["spec"]["scalingMetric"].__setitem__("requestRate", {"targetValue": 4})),
    ("HTTPScaledObject", lambda d: d["spec"].__setitem__("minReplicaCount", 0)),  # a ScaledObject's field
])
def test_the_validation_refuses_broken_manifests(kind, edit):
    """The schemas are not vacuous: each of these mistakes fails."""
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate(broken(kind, edit), VERSIONS[0])


def secret_env(keys: dict[str, str]) -> dict[str, str]:
    """The environment the StatefulSet gives the daemon from the generated Secret."""
    (generator,) = kustomization()["secretGenerator"]
    env = {}
    for var in container(one("StatefulSet"))["env"]:
        ref = var.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None:
            assert ref["name"] == generator["name"], var  # kustomize adds the hash suffix to this name
            env[var["name"]] = keys[ref["key"]]
    return env


@pytest.fixture
def configmap_toml(tmp_path, monkeypatch) -> Path:
    for name in [n for n in os.environ if n.startswith("DORMOUSE_")]:
        monkeypatch.delenv(name)
    toml = tmp_path / "dormouse.toml"
    toml.write_text(one("ConfigMap")["data"]["dormouse.toml"])
    return toml


@pytest.fixture
def settings(configmap_toml, tmp_path, monkeypatch):
    """The daemon's settings as the pod has them: the ConfigMap's TOML, the
    Secret's keys in the environment, through the daemon's own loader."""
    for name, value in secret_env(make_keys(tmp_path / "keys.env")).items():
        monkeypatch.setenv(name, value)
    return load_settings(configmap_toml)


def test_the_pod_matches_the_daemons_settings(settings):
    sts = one("StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    c = container(sts)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert settings.host == "0.0.0.0"  # the kubelet's probes come from outside the pod
    assert ports == {"http": settings.port, "agent": settings.agent_port}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["config"] == "/etc/dormouse" and c["args"][-1] == "/etc/dormouse/dormouse.toml"
    assert pod["volumes"][0] == {"name": "config", "configMap": {"name": one("ConfigMap")["metadata"]["name"]}}
    # The model is on the read-only models volume: the image carries none.
    assert str(settings.model).startswith(mounts["models"] + "/")
    assert {m["name"]: m.get("readOnly") for m in c["volumeMounts"]}["models"] is True
    # The state directory is on the replica's own claim.
    assert str(settings.state_dir) == mounts["state"]
    assert [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]] == ["state"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(settings.port) and annotations["prometheus.io/path"] == "/metrics"


def test_probes_use_health(settings):
    c = container(one("StatefulSet"))
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    # The first load gets minutes, not the readiness probe's seconds.
    startup = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
    assert startup >= 300
    # Probes send the pod IP as Host (served on 0.0.0.0 whatever allowed_hosts lists) and cannot
    # send a key from a Secret; the gateway's Host (scale-from-zero) is listed.
    assert "dormouse-gateway" in settings.allowed_hosts and settings.metrics_key is None
    assert "livenessProbe" not in c  # a 503 from /health (failed, stopping) must not restart the pod


def test_termination_grace_covers_prestop_and_the_daemons_stop_budget(settings):
    pod = one("StatefulSet")["spec"]["template"]["spec"]
    pre_stop = container(one("StatefulSet"))["lifecycle"]["preStop"]["sleep"]["seconds"]
    needed = pre_stop + stop_budget(settings)
    print(f"\n[termination] preStop={pre_stop}s stop_budget={stop_budget(settings)}s "
          f"terminationGracePeriodSeconds={pod['terminationGracePeriodSeconds']}s")
    assert pod["terminationGracePeriodSeconds"] >= needed + 5  # a margin for a loaded node


def test_the_objects_point_at_each_other():
    sts = one("StatefulSet")
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    services = [d for _, d in documents() if d["kind"] == "Service"]
    for svc in services:
        assert svc["spec"]["selector"].items() <= pod_labels.items(), svc["metadata"]["name"]
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in {p["name"] for p in container(sts)["ports"]}
    headless = one("Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    # The ServiceMonitor selects exactly one Service (two would scrape every pod twice), by a port it has.
    monitor = one("ServiceMonitor")
    selected = [s for s in services if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert [s["metadata"]["name"] for s in selected] == ["dormouse"]
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in selected[0]["spec"]["ports"]}
    pdb = one("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    target = one("ScaledObject")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("StatefulSet", sts["metadata"]["name"])


def test_keda_scales_on_waiting_plus_in_flight_summed_over_models(settings):
    (trigger,) = one("ScaledObject")["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    query = trigger["metadata"]["query"]
    # One sum over both families and every label (model, pod): the metric names exist in the daemon.
    assert query.startswith("sum(") and "dormouse_requests_(in_flight|waiting)" in query
    from daemon.metrics import MetricFamilies
    names = {m.name for m in MetricFamilies().registry.collect()}
    assert {"dormouse_requests_in_flight", "dormouse_requests_waiting"} <= names
    # The job label the ServiceMonitor gives is the Service's name.
    assert 'job="dormouse"' in query
    # One replica per `parallel` accepted requests.
    assert float(trigger["metadata"]["threshold"]) == settings.parallel


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (.ci/run installs it)")
def test_the_keda_query_is_valid_promql(tmp_path):
    """promtool parses the query as a recording rule's expression."""
    query = one("ScaledObject")["spec"]["triggers"][0]["metadata"]["query"]
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "keda", "rules": [{"record": "dormouse:accepted", "expr": query}]}]}))
    result = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_kustomization_lists_every_manifest():
    assert sorted(kustomization()["resources"]) == sorted(
        p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    overlay = kustomization(FROM_ZERO)
    assert sorted(overlay["resources"]) == sorted(
        [".."] + [p.name for p in FROM_ZERO.glob("*.yaml") if p.name != "kustomization.yaml"])


# -- keys: generated at install, a Secret, required off loopback --------------------

def test_the_keys_come_from_a_generated_secret(tmp_path):
    keys = make_keys(tmp_path / "keys.env")
    (generator,) = kustomization()["secretGenerator"]
    assert generator["envs"] == ["keys.env"]  # beside kustomization.yaml, where make_keys.py writes it
    assert set(keys) == {"api_key", "admin_key"} and keys["api_key"] != keys["admin_key"]
    env = secret_env(keys)
    assert set(env) == {"DORMOUSE_API_KEY", "DORMOUSE_ADMIN_KEY"}
    for key in keys.values():  # long, and sent as they are in a Bearer header
        assert len(key) >= 40 and re.fullmatch(r"[A-Za-z0-9_-]+", key), key
    assert (tmp_path / "keys.env").stat().st_mode & 0o077 == 0  # the owner's only
    # Never committed: git ignores the file where the generator reads it.
    assert "keys.env" in (K8S / ".gitignore").read_text().split()


def test_make_keys_keeps_existing_keys_unless_told(tmp_path):
    path = tmp_path / "keys.env"
    first = make_keys(path)
    assert make_keys(path) == first  # a second install keeps them (the clients have them)
    done = subprocess.run([sys.executable, "-I", str(K8S / "make_keys.py"), "--output", str(path), "--rotate"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    rotated = dict(line.split("=", 1) for line in path.read_text().splitlines())
    assert rotated.keys() == first.keys() and not set(rotated.values()) & set(first.values())


def test_the_configmap_alone_is_refused(configmap_toml):
    """host is 0.0.0.0: without the Secret's admin key the daemon does not start."""
    with pytest.raises(ConfigError, match="admin_key is required when host is '0.0.0.0'"):
        load_settings(configmap_toml)


# -- the image ------------------------------------------------------------------------

def test_the_pod_runs_the_image_as_it_is_built(settings):
    sts = one("StatefulSet")
    pod, c = sts["spec"]["template"]["spec"], container(sts)
    final = dockerfile()[1][-1]
    assert final.only("USER").args == f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}"
    # The state directory is the image's volume, and the pod's own claim.
    assert final.only("VOLUME").json_args() == [str(settings.state_dir)]
    assert c["args"] == final.only("CMD").json_args() and "command" not in c  # the image's entry point, `dormouse`
    # A GPU pod runs the CUDA variant (docker build --build-arg VARIANT=cuda).
    assert c["image"].startswith("dormouse:") and c["image"].endswith("-cuda")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1


# -- scale from zero: KEDA's HTTP add-on ------------------------------------------------

def go_duration_seconds(text: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3}
    parts = re.findall(r"([0-9.]+)(ms|h|m|s)", text)
    assert "".join(n + u for n, u in parts) == text, text
    return sum(float(n) * units[u] for n, u in parts)


def test_the_http_add_on_replaces_the_prometheus_scaler():
    """KEDA allows one scaler object per workload: the overlay deletes the
    base's ScaledObject and adds the HTTPScaledObject, which points at the
    same StatefulSet through the dormouse Service."""
    overlay = kustomization(FROM_ZERO)
    (patch,) = overlay["patches"]
    deleted = yaml.safe_load(patch["patch"])
    base = one("ScaledObject")
    assert deleted["$patch"] == "delete"
    assert (deleted["apiVersion"], deleted["kind"], deleted["metadata"]["name"]) == (
        base["apiVersion"], base["kind"], base["metadata"]["name"])
    route = one("HTTPScaledObject", directory=FROM_ZERO)["spec"]
    target, sts = route["scaleTargetRef"], one("StatefulSet")
    assert (target["kind"], target["name"]) == ("StatefulSet", sts["metadata"]["name"])
    service = one("Service", target["service"])
    assert target["port"] in {p["port"] for p in service["spec"]["ports"]}
    assert route["replicas"]["min"] == 0 and route["replicas"]["max"] == base["spec"]["maxReplicaCount"]


def test_the_http_add_on_waits_for_a_cold_start(settings):
    route = one("HTTPScaledObject", directory=FROM_ZERO)["spec"]
    startup = container(one("StatefulSet"))["startupProbe"]
    # The first request from zero waits for the pod and its first load: at
    # least as long as the startup probe lets the load take.
    assert go_duration_seconds(route["timeouts"]["conditionWait"]) >= startup["periodSeconds"] * startup["failureThreshold"]
    # A non-streamed completion's headers come with its whole answer.
    assert go_duration_seconds(route["timeouts"]["responseHeader"]) >= settings.wake_timeout
    # A replica per `parallel` requests in flight, as the Prometheus trigger asks.
    assert route["scalingMetric"]["concurrency"]["targetValue"] == settings.parallel
    # In-cluster clients reach the interceptor by a name the route serves.
    gateway = one("Service", "dormouse-gateway", directory=FROM_ZERO)
    assert gateway["spec"]["type"] == "ExternalName" and gateway["metadata"]["name"] in route["hosts"]
