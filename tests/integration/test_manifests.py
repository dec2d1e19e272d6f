"""Kubernetes manifests (manifests/base + overlays/dev, overlays/prod).

Real tools: `kubectl kustomize` (or a standalone `kustomize build`) renders each overlay, and
`kubernetes-validate --strict` checks every rendered resource against the Kubernetes JSON schemas (it has no
schemas for the Prometheus Operator CRDs; those are checked structurally here and by promtool in
test_alert_rules.py). Tests skip with the reason when a tool is missing; `scripts/install_tools.sh` installs them.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
OVERLAYS = ("dev", "prod")
NAMESPACES = {"dev": "tailguard-dev", "prod": "tailguard"}
CRD_GROUP = "monitoring.coreos.com/"


def kustomize_command(path: Path) -> list[str] | None:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize", str(path)]
    if shutil.which("kustomize"):
        return ["kustomize", "build", str(path)]
    return None


@functools.lru_cache(maxsize=None)
def render_text(overlay: str) -> str:
    """The rendered overlay (YAML stream). Skips when neither kubectl nor kustomize is installed."""
    cmd = kustomize_command(MANIFESTS / "overlays" / overlay)
    if cmd is None:
        pytest.skip("neither kubectl nor kustomize is installed (scripts/install_tools.sh installs kustomize)")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{r.stderr}")
    return r.stdout


def render(overlay: str) -> list[dict]:
    """The rendered overlay as a list of resources."""
    return [d for d in yaml.safe_load_all(render_text(overlay)) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def configmap(docs: list[dict], prefix: str) -> dict:
    found = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].startswith(prefix + "-")
             or d["metadata"]["name"] == prefix]
    assert len(found) == 1, f"ConfigMap {prefix}: {len(found)} found"
    return found[0]


def kubernetes_validate(path: Path) -> subprocess.CompletedProcess:
    try:
        import kubernetes_validate  # noqa: F401
    except ImportError:
        pytest.skip("kubernetes-validate is not installed (pip install 'tailguard[dev]')")
    return subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", str(path)],
                          capture_output=True, text=True, timeout=300)


# ---------------------------------------------------------------------------------------------- render
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_every_resource_when_kustomized(overlay):
    docs = render(overlay)
    kinds = sorted(d["kind"] for d in docs)
    for kind, n in {"Deployment": 2, "Service": 2, "ServiceAccount": 2, "Role": 1, "RoleBinding": 1,
                    "ServiceMonitor": 1, "PrometheusRule": 1, "Namespace": 1}.items():
        assert kinds.count(kind) == n, f"{overlay}: {kind} x{kinds.count(kind)}"
    for prefix in ("tailguard-specs", "tailguard-trigger-config", "tailguard-env", "tailguard-monitor-models",
                   "tailguard-grafana-dashboard"):
        configmap(docs, prefix)
    for d in docs:
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == NAMESPACES[overlay], f"{d['kind']}/{d['metadata']['name']}"
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tailguard"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_passes_kubernetes_validate_strict_when_rendered(overlay, tmp_path):
    f = tmp_path / f"{overlay}.yaml"
    f.write_text(render_text(overlay))
    r = kubernetes_validate(f)
    assert r.returncode == 0, r.stdout + r.stderr
    docs = render(overlay)
    passed = r.stdout.count(" passed for resource ")
    crds = [d for d in docs if d["apiVersion"].startswith(CRD_GROUP)]
    assert passed == len(docs) - len(crds), r.stdout  # every core resource was really checked
    warned = [ln for ln in r.stdout.splitlines() if ln.startswith("WARN")]
    assert len(warned) == len(crds) and all("monitoring.coreos.com" in ln for ln in warned), warned


def test_kubernetes_validate_strict_fails_when_deployment_has_unknown_field(tmp_path):
    docs = render("prod")
    dep = one(docs, "Deployment", "tailguard-trigger")
    dep["spec"]["template"]["spec"]["containers"][0]["resourcez"] = {"limits": {"cpu": "1"}}
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(dep))
    r = kubernetes_validate(f)
    assert r.returncode != 0 and "resourcez" in r.stdout


# ------------------------------------------------------------------------------------------ workloads
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_deployments_have_probes_resources_and_restricted_security_when_rendered(overlay):
    docs = render(overlay)
    for name in ("tailguard-trigger", "tailguard-monitor"):
        pod = one(docs, "Deployment", name)["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for c in pod["containers"] + pod.get("initContainers", []):
            assert c["image"].startswith("ghcr.io/tailguard/") and ":" in c["image"], c["image"]
            assert {"requests", "limits"} <= set(c["resources"]), c["name"]
            assert {"cpu", "memory"} <= set(c["resources"]["limits"]), c["name"]
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]
        for c in pod["containers"]:
            assert c["readinessProbe"]["httpGet"]["path"] == "/readyz", c["name"]
            assert c["livenessProbe"]["httpGet"]["path"] == "/healthz", c["name"]
            assert any(p["name"] == "http" for p in c["ports"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_are_only_referenced_when_rendered(overlay):
    docs = render(overlay)
    assert not by_kind(docs, "Secret"), "secrets must be created out of band, never committed"
    trigger = one(docs, "Deployment", "tailguard-trigger")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in trigger["env"]}
    assert env["TAILGUARD_WEBHOOK_SECRET"]["valueFrom"]["secretKeyRef"] == {"name": "tailguard-webhook",
                                                                            "key": "secret"}
    for dep in by_kind(docs, "Deployment"):
        for c in dep["spec"]["template"]["spec"]["containers"] + \
                dep["spec"]["template"]["spec"].get("initContainers", []):
            for e in c.get("env", []):
                if any(w in e["name"].upper() for w in ("SECRET", "PASSWORD", "TOKEN", "KEY")) \
                        and not e["name"].endswith("_PATH"):
                    assert "value" not in e, f"{c['name']}: {e['name']} has a literal value"
    for cm in by_kind(docs, "ConfigMap"):
        text = yaml.safe_dump(cm["data"]).lower()
        assert "password" not in text and "aws_secret" not in text, cm["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rbac_is_least_privilege_when_rendered(overlay):
    docs = render(overlay)
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    for role in by_kind(docs, "Role"):
        for rule in role["rules"]:
            assert rule["apiGroups"] == ["pipelines.kubeflow.org"], rule
            assert "*" not in rule["resources"] and "*" not in rule["verbs"]
            assert set(rule["verbs"]) <= {"get", "list", "create"}, rule
            assert not {"secrets", "pods", "pods/exec"} & set(rule["resources"])
    (binding,) = by_kind(docs, "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tailguard-trigger",
                                    "namespace": NAMESPACES[overlay]}]
    for sa in by_kind(docs, "ServiceAccount"):
        assert sa["automountServiceAccountToken"] is False
    trigger = one(docs, "Deployment", "tailguard-trigger")["spec"]["template"]["spec"]
    (token,) = [v for v in trigger["volumes"] if v["name"] == "kfp-token"]
    assert token["projected"]["sources"][0]["serviceAccountToken"]["audience"] == "pipelines.kubeflow.org"


# ------------------------------------------------------------------------------------------- configs
def _mounts(container: dict, pod: dict) -> dict[str, str]:
    """{mount path: ConfigMap name} for the container's ConfigMap volumes."""
    vols = {v["name"]: v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v}
    return {m["mountPath"]: vols[m["name"]] for m in container.get("volumeMounts", []) if m["name"] in vols}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_trigger_config_and_specs_are_valid_and_mounted_when_rendered(overlay):
    from tailguard.core.spec import parse_spec
    from tailguard.trigger import TriggerConfig

    docs = render(overlay)
    specs_cm = configmap(docs, "tailguard-specs")
    for fname, text in specs_cm["data"].items():
        parse_spec(yaml.safe_load(text), source=fname)
    cfg = TriggerConfig.model_validate(yaml.safe_load(configmap(docs, "tailguard-trigger-config")["data"]
                                                      ["trigger.yaml"]))
    pod = one(docs, "Deployment", "tailguard-trigger")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    mounts = _mounts(c, pod)
    assert mounts["/etc/tailguard/specs"] == specs_cm["metadata"]["name"]
    config_path = c["args"][c["args"].index("--config") + 1]
    assert mounts[str(Path(config_path).parent)].startswith("tailguard-trigger-config")
    for model, path in cfg.models.items():
        p = Path(path)
        assert mounts[str(p.parent)] == specs_cm["metadata"]["name"] and p.name in specs_cm["data"], path
        assert yaml.safe_load(specs_cm["data"][p.name])["model"]["registered_name"] == model
    assert (cfg.kfp_host is None) == (overlay == "dev"), "dev runs locally, prod submits to KFP"
    mon_pod = one(docs, "Deployment", "tailguard-monitor")["spec"]["template"]["spec"]
    mon = mon_pod["containers"][0]
    spec_arg = Path(mon["args"][mon["args"].index("--spec") + 1])
    assert _mounts(mon, mon_pod)[str(spec_arg.parent)] == specs_cm["metadata"]["name"]
    assert spec_arg.name in specs_cm["data"]
    assert "monitoring" in yaml.safe_load(specs_cm["data"][spec_arg.name])


def test_base_spec_matches_example_when_data_uris_are_ignored():
    example = ROOT / "examples" / "minilm" / "spec.yaml"
    if not example.is_file():
        pytest.skip("examples/minilm/spec.yaml does not exist yet")
    base = yaml.safe_load((MANIFESTS / "base" / "specs" / "minilm-embedder.yaml").read_text())
    ex = yaml.safe_load(example.read_text())
    for d in (base, ex):
        for ds in ("calibration", "validation"):
            d["data"][ds].pop("uri")
    assert base == ex, "manifests/base/specs/minilm-embedder.yaml drifted from examples/minilm/spec.yaml"
    uris = yaml.safe_load((MANIFESTS / "base" / "specs" / "minilm-embedder.yaml").read_text())["data"]
    assert all(uris[k]["uri"].startswith("s3://") for k in ("calibration", "validation"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_servicemonitor_scrapes_both_services_when_rendered(overlay):
    docs = render(overlay)
    (sm,) = by_kind(docs, "ServiceMonitor")
    (expr,) = sm["spec"]["selector"]["matchExpressions"]
    selected = [s for s in by_kind(docs, "Service")
                if s["metadata"]["labels"].get(expr["key"]) in expr["values"]]
    assert sorted(s["metadata"]["name"] for s in selected) == ["tailguard-monitor", "tailguard-trigger"]
    for ep in sm["spec"]["endpoints"]:
        assert ep["path"] == "/metrics"
        assert all(any(p["name"] == ep["port"] for p in s["spec"]["ports"]) for s in selected)
    for s in selected:  # each Service selects its Deployment's pods
        dep = one(docs, "Deployment", s["metadata"]["name"])
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert s["spec"]["selector"].items() <= labels.items()
