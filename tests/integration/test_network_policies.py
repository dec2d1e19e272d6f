"""Network policies and image pinning of the rendered manifests (issue 22 item 9).

The overlays and manifests/kfp-profile are rendered with the real kustomize (`kubectl kustomize`) and checked by
`kubernetes-validate --strict` (tests/integration/test_manifests.py has the helpers). What the NetworkPolicies allow
is checked by flows: `allowed` below evaluates the rendered policies with the semantics of the Kubernetes documentation
("Network Policies": a pod is isolated for a direction once a policy of its namespace selects it for that
direction; a connection then needs an egress rule at the source and an ingress rule at the destination that match
the peer and the port; peers are podSelector / namespaceSelector / both / ipBlock). ipBlock is taken to match
addresses outside the cluster only, as the documentation advises for pod traffic.
"""

from __future__ import annotations

import ipaddress
import re

import pytest
import yaml

from tests.integration.test_manifests import MANIFESTS, by_kind, kubernetes_validate, kustomize_command, one, render

KFP_NS = "kubeflow-user-example-com"
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


# ------------------------------------------------------------------------------- a NetworkPolicy evaluator
def _selects(selector: dict | None, labels: dict[str, str]) -> bool:
    """Whether a LabelSelector matches labels ({} and None-but-present match everything)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        k, op, values = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(k) not in values or op == "NotIn" and labels.get(k) in values \
                or op == "Exists" and k not in labels or op == "DoesNotExist" and k in labels:
            return False
    return True


def _peer_matches(peer: dict, policy_ns: str, other: dict) -> bool:
    if "ipBlock" in peer:
        if "ip" not in other:
            return False
        block = peer["ipBlock"]
        ip = ipaddress.ip_address(other["ip"])
        return ip in ipaddress.ip_network(block["cidr"]) and not any(
            ip in ipaddress.ip_network(x) for x in block.get("except", []))
    if "ip" in other:
        return False
    if "namespaceSelector" in peer:
        ns_ok = _selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": other["ns"]})
    else:
        ns_ok = other["ns"] == policy_ns
    return ns_ok and _selects(peer.get("podSelector"), other["labels"])


def _side_allows(policies: list[dict], pod: dict, other: dict, port: int, protocol: str, direction: str) -> bool:
    """Whether `pod`'s policies let traffic to/from `other` on port through, for direction Ingress or Egress."""
    if "ip" in pod:
        return True  # outside the cluster: no policy of ours applies
    mine = [p for p in policies if p["metadata"]["namespace"] == pod["ns"]
            and _selects(p["spec"]["podSelector"], pod["labels"])
            and direction in p["spec"].get("policyTypes", ["Ingress"])]
    if not mine:
        return True  # not isolated in this direction
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    for p in mine:
        for rule in p["spec"].get(key) or []:
            peers = rule.get(peers_key)
            if peers and not any(_peer_matches(peer, p["metadata"]["namespace"], other) for peer in peers):
                continue
            ports = rule.get("ports")
            if not ports or any(pp.get("port") in (None, port) and pp.get("protocol", "TCP") == protocol
                                for pp in ports):
                return True
    return False


def allowed(policies: list[dict], src: dict, dst: dict, port: int, protocol: str = "TCP") -> bool:
    """Whether a connection src -> dst:port is allowed. Endpoints: {"ns", "labels"} for pods, {"ip"} outside."""
    return (_side_allows(policies, src, dst, port, protocol, "Egress")
            and _side_allows(policies, dst, src, port, protocol, "Ingress"))


def _pod(ns: str, **labels: str) -> dict:
    return {"ns": ns, "labels": labels}


def _deployment_pod(docs: list[dict], name: str, ns: str) -> dict:
    return {"ns": ns, "labels": one(docs, "Deployment", name)["spec"]["template"]["metadata"]["labels"]}


DNS = _pod("kube-system", **{"k8s-app": "kube-dns"})
MLFLOW = _pod("mlflow", app="mlflow")
KFP_API = _pod("kubeflow", app="ml-pipeline")
MLMD = _pod("kubeflow", component="metadata-grpc-server")
S3 = {"ip": "52.216.0.10"}  # an S3 address, outside the cluster
ELSEWHERE = {"ip": "203.0.113.7"}  # TEST-NET-3: any other host


def test_network_policy_evaluator_follows_the_documented_semantics_when_given_known_cases():
    deny_in = {"metadata": {"namespace": "a"}, "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}
    allow_b = {"metadata": {"namespace": "a"}, "spec": {"podSelector": {"matchLabels": {"x": "1"}}, "policyTypes":
               ["Ingress"], "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {
                   "kubernetes.io/metadata.name": "b"}}}], "ports": [{"port": 80}]}]}}
    pod = _pod("a", x="1")
    assert allowed([], _pod("b"), pod, 80)  # no policy: open
    assert not allowed([deny_in], _pod("b"), pod, 80)
    assert allowed([deny_in, allow_b], _pod("b"), pod, 80) and not allowed([deny_in, allow_b], _pod("b"), pod, 81)
    assert not allowed([deny_in, allow_b], _pod("c"), pod, 80) and not allowed([deny_in, allow_b], _pod("a"), pod, 80)


# ------------------------------------------------------------------------------------------- prod overlay
def _prod_policies() -> tuple[list[dict], dict, dict]:
    docs = render("prod")
    policies = by_kind(docs, "NetworkPolicy")
    return policies, _deployment_pod(docs, "tailguard-monitor", "tailguard"), \
        _deployment_pod(docs, "tailguard-trigger", "tailguard")


@pytest.mark.parametrize("src, dst, port, protocol", [
    ("serving", "monitor", 8080, "TCP"), ("prometheus", "monitor", 8082, "TCP"),  # Prometheus: the probe port
    ("mlflow", "trigger", 8080, "TCP"), ("prometheus", "trigger", 8080, "TCP"),
    ("monitor", "dns", 53, "UDP"), ("trigger", "dns", 53, "TCP"),
    ("monitor", "mlflow", 5000, "TCP"), ("monitor", "s3", 443, "TCP"),
    ("trigger", "mlflow", 5000, "TCP"), ("trigger", "kfp", 8888, "TCP"),
])
def test_prod_network_policies_allow_what_each_workload_needs_when_rendered(src, dst, port, protocol):
    policies, monitor, trigger = _prod_policies()
    ends = {"serving": _pod("serving", app="my-model-predictor"), "prometheus": _pod("monitoring", app="prometheus"),
            "mlflow": MLFLOW, "monitor": monitor, "trigger": trigger, "dns": DNS, "s3": S3, "kfp": KFP_API}
    assert allowed(policies, ends[src], ends[dst], port, protocol)


@pytest.mark.parametrize("src, dst, port", [
    ("other-namespace", "monitor", 8080),  # ingest only from the serving namespace (and Prometheus)
    ("kubeflow", "monitor", 8080),
    ("other-namespace", "trigger", 8080),
    ("monitor", "kfp", 8888),  # the monitor has no business with KFP
    ("monitor", "elsewhere", 80), ("monitor", "elsewhere", 22),
    ("trigger", "s3", 443),  # the trigger reads no data
    ("trigger", "monitor", 8080),  # not even inside the namespace
    ("monitor", "kube-api", 6443),  # neither talks to the Kubernetes API
    ("serving", "monitor", 9090),
    ("serving", "monitor", 8082),  # the probe port (/metrics) is Prometheus' only
])
def test_prod_network_policies_refuse_everything_else_when_rendered(src, dst, port):
    policies, monitor, trigger = _prod_policies()
    ends = {"other-namespace": _pod("default", app="curl"), "kubeflow": KFP_API, "monitor": monitor,
            "trigger": trigger, "kfp": KFP_API, "s3": S3, "elsewhere": ELSEWHERE, "kube-api": {"ip": "10.0.0.1"},
            "serving": _pod("serving", app="my-model-predictor")}
    assert not allowed(policies, ends[src], ends[dst], port)


def test_prod_network_policies_select_every_pod_for_both_directions_when_rendered():
    docs = render("prod")
    policies = by_kind(docs, "NetworkPolicy")
    for dep in by_kind(docs, "Deployment"):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        for direction in ("Ingress", "Egress"):
            assert any(_selects(p["spec"]["podSelector"], labels) and direction in p["spec"]["policyTypes"]
                       for p in policies), f"{dep['metadata']['name']}: not isolated for {direction}"
    assert not by_kind(render("dev"), "NetworkPolicy")  # dev: a developer cluster, left open on purpose


# ------------------------------------------------------------------------------------------- kfp profile
@pytest.fixture(scope="module")
def kfp_profile() -> list[dict]:
    import subprocess

    cmd = kustomize_command(MANIFESTS / "kfp-profile")
    if cmd is None:
        pytest.skip("neither kubectl nor kustomize is installed (scripts/install_tools.sh installs kustomize)")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def test_kfp_profile_policy_passes_kubernetes_validate_strict_when_rendered(kfp_profile, tmp_path):
    f = tmp_path / "kfp-profile.yaml"
    f.write_text(yaml.safe_dump_all(kfp_profile))
    r = kubernetes_validate(f)
    assert r.returncode == 0 and r.stdout.count(" passed for resource ") == len(kfp_profile) == 1, r.stdout
    assert kfp_profile[0]["metadata"]["namespace"] == KFP_NS


@pytest.mark.parametrize("dst, port, protocol, ok", [
    (DNS, 53, "UDP", True), (MLFLOW, 5000, "TCP", True), (KFP_API, 8887, "TCP", True),
    (KFP_API, 8888, "TCP", True), (MLMD, 8080, "TCP", True), (_pod("kubeflow", app="minio"), 9000, "TCP", True),
    (S3, 443, "TCP", True), ({"ip": "10.0.0.1"}, 6443, "TCP", True),  # the Kubernetes API
    (ELSEWHERE, 80, "TCP", False), (ELSEWHERE, 22, "TCP", False), (MLFLOW, 22, "TCP", False),
    (_pod("tailguard", **{"app.kubernetes.io/name": "tailguard-monitor"}), 8080, "TCP", False),
    (_pod("default", app="db"), 5432, "TCP", False),
])
def test_kfp_profile_policy_lets_pipeline_tasks_reach_only_their_services_when_rendered(kfp_profile, dst, port,
                                                                                         protocol, ok):
    task = _pod(KFP_NS, **{"pipelines.kubeflow.org/v2_component": "true", "workflows.argoproj.io/workflow": "w"})
    assert allowed(kfp_profile, task, dst, port, protocol) is ok


# ------------------------------------------------------------------------------------------------ images
def _images(docs: list[dict]) -> list[str]:
    return [c["image"] for dep in by_kind(docs, "Deployment")
            for c in dep["spec"]["template"]["spec"]["containers"] + dep["spec"]["template"]["spec"].get(
                "initContainers", [])]


def test_prod_overlay_runs_every_image_by_digest_when_rendered():
    images = _images(render("prod"))
    assert len(images) == 3
    tag_only = [i for i in images if not DIGEST.search(i)]
    assert not tag_only, f"prod images without @sha256:<digest>: {tag_only}"
    # the check is not vacuous: the dev overlay runs tag-only images
    assert all(not DIGEST.search(i) for i in _images(render("dev")))
