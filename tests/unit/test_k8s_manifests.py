"""deploy/k8s/ against Kubernetes' own schemas (kubernetes-validate's bundled
OpenAPI schemas, strict: an unknown field fails, as `kubectl apply` refuses
it), the two CRDs against schemas written from their CRD docs
(tests/unit/k8s_schemas/, see the $comment in each), and the manifests
against each other and against the daemon's settings."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path

import pytest

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the test extra")
import jsonschema  # noqa: E402  (installed with kubernetes-validate)
import yaml  # noqa: E402

from config import load_settings  # noqa: E402
from daemon.server import stop_budget  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SCHEMAS = Path(__file__).parent / "k8s_schemas"
# The oldest Kubernetes the manifests are for (preStop's sleep action is on by
# default from 1.30), and the newest the package knows.
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring-v1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda-v1alpha1.json",
}


def documents() -> list[tuple[str, dict]]:
    found = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((path.name, doc))
    return found


def one(kind: str, name: str | None = None) -> dict:
    matches = [d for _, d in documents() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(matches) == 1, (kind, name, len(matches))
    return matches[0]


def validate(doc: dict, version: str) -> None:
    """Raises on a manifest Kubernetes (or the CRD) would refuse."""
    crd = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if crd is not None:
        schema = json.loads((SCHEMAS / crd).read_text())
        jsonschema.Draft202012Validator(schema).validate(doc)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_passes_its_schema(version):
    docs = documents()
    assert {d["kind"] for _, d in docs} >= {"ConfigMap", "Service", "StatefulSet", "PodDisruptionBudget",
                                            "ServiceMonitor", "ScaledObject"}
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
    doc = copy.deepcopy(one(kind))
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
])
def test_the_validation_refuses_broken_manifests(kind, edit):
    """The schemas are not vacuous: each of these mistakes fails."""
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate(broken(kind, edit), VERSIONS[0])


@pytest.fixture
def settings(tmp_path, monkeypatch):
    """The daemon's settings from the ConfigMap's TOML, through its own loader."""
    for name in [n for n in __import__("os").environ if n.startswith("DORMOUSE_")]:
        monkeypatch.delenv(name)
    toml = tmp_path / "dormouse.toml"
    toml.write_text(one("ConfigMap")["data"]["dormouse.toml"])
    return load_settings(toml)


def test_the_pod_matches_the_daemons_settings(settings):
    sts = one("StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    c = container(sts)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert settings.host == "0.0.0.0"  # the kubelet's probes come from outside the pod
    assert ports == {"http": settings.port, "agent": settings.agent_port}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["config"] == "/etc/dormouse" and c["command"][-1] == "/etc/dormouse/dormouse.toml"
    assert pod["volumes"][0] == {"name": "config", "configMap": {"name": one("ConfigMap")["metadata"]["name"]}}
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
    # Probes send the pod IP as Host and cannot send a key from a Secret.
    assert settings.allowed_hosts == [] and settings.metrics_key is None
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
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
