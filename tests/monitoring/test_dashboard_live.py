"""The dashboard and the PrometheusRule against the live /metrics of a running monitor (not its collector list).

A real monitor service (tailguard.monitoring.app.build_app, tiny ONNX models of tailguard.monitoring.testing,
in-process through Starlette's TestClient) gets OIP /infer requests, a malformed body, and /pairs whose live answers
disagree on one slice until a slice alert fires; then every metric named by a dashboard panel or variable, and every
`tailguard_monitor_*` metric of a PrometheusRule expression, must be a series of the scraped exposition (parsed by
prometheus_client's own text parser), with a sample suffix its family's type allows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.monitoring.test_dashboard import dashboard, promql_metric_names, queries
from tests.monitoring.test_monitor_service import NAME, _body, _pair, _service

RULES = Path(__file__).resolve().parents[2] / "manifests" / "base" / "monitoring" / "prometheusrule.yaml"

# Sample-name suffixes each metric type may expose (OpenMetrics / prometheus_client exposition).
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("_sum", "_count", "_created"), "gauge": (), "untyped": (), "unknown": ()}


def family_of(name: str, families: dict[str, str]) -> str | None:
    """The family a queried series name belongs to: itself, or itself minus a suffix its type allows.

    Args:
        name: a series name from a query, e.g. `x_seconds_bucket`, `x_total`, `x_depth`.
        families: {family name: type} of the exposition (prometheus_client names counters without `_total`).
    """
    if name in families and families[name] not in ("counter", "histogram", "summary"):
        return name
    for fam, kind in families.items():
        if any(name == fam + s for s in SUFFIXES[kind]):
            return fam
    return None


def unresolved(names: set[str], families: dict[str, str], samples: set[str]) -> list[str]:
    """Names that are no family's allowed series, or that the exposition has no sample of."""
    bad = []
    for n in sorted(names):
        fam = family_of(n, families)
        if fam is None:
            bad.append(f"{n}: no such metric family")
        elif n not in samples:
            bad.append(f"{n}: family {fam} ({families[fam]}) exports no {n} series")
    return bad


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """(families {name: type}, sample names, [(name, labels, value)]) scraped from a monitor that has seen every kind
    of traffic."""
    from tailguard.monitoring import testing as T

    d = tmp_path_factory.mktemp("live")
    svc, client = _service(T.linear_classifier(d / "ref.onnx"),
                           T.linear_classifier(d / "cand.onnx", T.weights(noise=0.02)),
                           min_support=10, window_size=40, max_request_rows=1)  # one-row requests
    with client:
        for i in range(8):  # /infer: requests, sampling, shadow inference, parity per slice
            assert client.post(f"/v2/models/{NAME}/infer", json=_body(i, "web")).status_code == 200
        r = client.post(f"/v2/models/{NAME}/infer", content=b"{not json")  # invalid_requests_total
        assert r.status_code == 400
        for i in range(40):  # /pairs: live answers disagree on domain=legal -> alert_active / alerts_total
            flip = i % 2 == 0 and i >= 8
            assert client.post(f"/v2/models/{NAME}/pairs",
                               json=_pair(100 + i, "legal" if i % 2 == 0 else "web", flip)).status_code == 200
        assert svc.wait_idle(20)
        assert svc.alerts(), "no slice alert fired: the alert series would be missing from the exposition"
        scrape = client.get("/metrics")
        assert scrape.status_code == 200
    families, samples, values = {}, set(), []
    for fam in text_string_to_metric_families(scrape.text):
        families[fam.name] = fam.type
        samples |= {s.name for s in fam.samples}
        values += [(s.name, s.labels, s.value) for s in fam.samples]
    return families, samples, values


def test_unresolved_flags_names_when_suffix_does_not_fit_the_family_type():
    families = {"m_seconds": "histogram", "m_requests": "counter", "m_depth": "gauge"}
    samples = {"m_seconds_bucket", "m_seconds_sum", "m_seconds_count", "m_requests_total", "m_depth"}
    assert unresolved({"m_seconds_bucket", "m_requests_total", "m_depth"}, families, samples) == []
    assert [b.split(":")[0] for b in unresolved({"m_depth_total", "m_requests_bucket", "m_seconds", "m_requests",
                                                 "m_seconds_created"}, families, samples)] == [
        "m_depth_total", "m_requests", "m_requests_bucket", "m_seconds", "m_seconds_created"]


def test_dashboard_queries_name_only_live_series_when_monitor_has_served_traffic(live):
    families, samples, _ = live
    bad = []
    for where, expr in queries(dashboard()):
        names = promql_metric_names(expr)
        assert names, f"{where}: no metric found in {expr!r}"
        bad += [f"{where}: {b}" for b in unresolved(names, families, samples)]
    assert not bad, "dashboard series missing from the live /metrics:\n" + "\n".join(bad)


def test_prometheusrule_monitor_expressions_name_only_live_series_when_monitor_has_served_traffic(live):
    families, samples, _ = live
    doc = yaml.safe_load(RULES.read_text())
    checked, bad = 0, []
    for group in doc["spec"]["groups"]:
        for rule in group["rules"]:
            where = f"{group['name']}/{rule.get('alert') or rule.get('record')}"
            names = {n for n in promql_metric_names(rule["expr"]) if n.startswith("tailguard_monitor_")}
            checked += bool(names)
            bad += [f"{where}: {b}" for b in unresolved(names, families, samples)]
    assert checked >= 5, f"only {checked} rules name tailguard_monitor_* metrics: is {RULES} the right file?"
    assert not bad, "alert rule series missing from the live /metrics:\n" + "\n".join(bad)


def test_sampled_total_of_slice_all_counts_each_request_once_when_requests_carry_several_slice_keys(live):
    # What the dashboard's sampling ratio and TailguardMonitorDroppingSamples rely on: at sample_rate 1 every valid
    # request is sampled; slice="all" counts it once, the sum over slices once per slice key.
    _, _, values = live
    sampled = {labels["slice"]: v for name, labels, v in values if name == "tailguard_monitor_sampled_total"}
    requests = sum(v for name, _, v in values if name == "tailguard_monitor_requests_total")
    assert requests == 48 and sampled["all"] == requests
    assert sum(sampled.values()) > sampled["all"]


def test_slice_bookkeeping_series_are_live_with_model_label_when_monitor_has_served_traffic(live):
    _, _, values = live
    got = {(name, tuple(sorted(labels))): v for name, labels, v in values
           if name in ("tailguard_monitor_slices_tracked", "tailguard_monitor_slices_evicted_total",
                       "tailguard_monitor_slice_values_cut_total", "tailguard_monitor_slice_evidence")}
    assert got[("tailguard_monitor_slices_tracked", ("model",))] >= 3  # all, domain=web, domain=legal
    assert ("tailguard_monitor_slices_evicted_total", ("model", "table")) in got
    assert ("tailguard_monitor_slice_values_cut_total", ("model",)) in got
    evidence = {labels["slice"]: v for name, labels, v in values if name == "tailguard_monitor_slice_evidence"}
    active = {(labels["slice"], labels["metric"]): v for name, labels, v in values
              if name == "tailguard_monitor_alert_active"}
    assert set(evidence) == {sl for sl, _ in active} and "all" in evidence  # one series per exported (slice, metric)
    # keyed by (slice, metric): the slice's candidate_error_rate series is 0 beside its firing top1_agree alert
    assert active[("domain=legal", "top1_agree")] == 1 and all(v >= 0 for v in evidence.values())
