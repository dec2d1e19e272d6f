"""The Grafana dashboard (manifests/base/monitoring/dashboards/tailguard-monitor.json).

Every panel query and template variable may only name metrics the monitor exports: the exposition names are taken
from the monitor's own prometheus-client collectors (`tailguard.monitoring.prometheus.MonitorMetrics`, else
`METRIC_NAMES`), with the `_bucket/_sum/_count` series of histograms and the `_total` of counters. Every query is
also parsed by Prometheus itself (`promtool check rules` on the queries as recording rules). The check against the
live /metrics of a running monitor is in tests/monitoring/test_dashboard_live.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "manifests" / "base" / "monitoring" / "dashboards" / "tailguard-monitor.json"

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
             "unless", "inf", "nan"}
GRAFANA_VARS = {"$__rate_interval": "5m", "$__range": "1h", "$__interval": "1m"}


def grafana_to_promql(expr: str) -> str:
    """Replace Grafana's variables so the query is plain PromQL (range vars -> durations, others -> "x")."""
    for k, v in GRAFANA_VARS.items():
        expr = expr.replace(k, v)
    return re.sub(r"\$\{?\w+\}?", "x", expr)


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL (or Grafana `label_values(...)`) expression selects.

    Strings, label matchers, range/subquery brackets, grouping clauses, numbers and function calls are removed;
    what remains as a bare identifier is a metric name. `{__name__=~"..."}` selectors are not resolved (they
    yield no name); callers check those separately.
    """
    e = grafana_to_promql(expr)
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', e)
    e = re.sub(r"label_values\(\s*([^,()]*?)\s*(?:,\s*\w+\s*)?\)", r" \1 ", e)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\boffset\s+\w+", " ", e)
    e = re.sub(r"(?<![\w:])\d+(\.\d+)?([eE][-+]?\d+)?", " ", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        if e[m.end():].lstrip().startswith("(") or m.group(0).lower() in _KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def exported_series_names() -> set[str]:
    """Exposition names of the monitor's metrics (`tailguard.monitoring.prometheus`)."""
    from tailguard.monitoring import prometheus as mm

    names = set(mm.METRIC_NAMES)
    if hasattr(mm, "MonitorMetrics"):
        for fam in mm.MonitorMetrics().registry.collect():
            if fam.type == "histogram":
                names |= {fam.name + s for s in ("_bucket", "_sum", "_count")}
            elif fam.type == "counter":
                names.add(fam.name + "_total")
            else:
                names.add(fam.name)
        missing = set(mm.METRIC_NAMES) - names
        assert not missing, f"METRIC_NAMES lists names the collectors do not export: {missing}"
    return names


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(d: dict) -> list[dict]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return [p for p in out if p["type"] != "row"]


def queries(d: dict) -> list[tuple[str, str]]:
    """(where, expression) for every panel target and query variable."""
    qs = [(f"panel {p['title']!r}", t["expr"]) for p in panels(d) for t in p.get("targets", [])]
    for v in d.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            qs.append((f"variable ${v['name']}", q))
    return qs


# ---------------------------------------------------------------------------------------------- tests
def test_promql_metric_names_finds_metrics_when_expression_is_complex():
    expr = ('histogram_quantile(0.99, sum by (model, role, le) (rate(tailguard_monitor_inference_seconds_bucket'
            '{namespace="$namespace", model=~"$model"}[$__rate_interval]))) / on(namespace) group_left '
            'sum(rate(bogus_metric_total[5m] offset 1h)) > 1e-9')
    assert promql_metric_names(expr) == {"tailguard_monitor_inference_seconds_bucket", "bogus_metric_total"}
    assert promql_metric_names('label_values(tailguard_monitor_slice_parity{namespace="x"}, metric)') == {
        "tailguard_monitor_slice_parity"}


def test_dashboard_panels_have_queries_and_layout_when_loaded():
    d = dashboard()
    ps = panels(d)
    assert len(ps) >= 10
    assert len({p["id"] for p in d["panels"]}) == len(d["panels"])
    for p in ps:
        assert p.get("targets") and all(t.get("expr") for t in p["targets"]), p["title"]
        assert p["datasource"]["uid"] == "${datasource}"
        assert 0 <= p["gridPos"]["x"] and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24


def test_dashboard_queries_only_name_exported_metrics_when_checked():
    allowed = exported_series_names()
    bad = []
    for where, expr in queries(dashboard()):
        names = promql_metric_names(expr)
        assert names, f"{where}: no metric found in {expr!r}"
        bad += [f"{where}: {n}" for n in sorted(names - allowed)]
    assert not bad, f"metrics the monitor does not export: {bad}"


def test_dashboard_shows_parity_sampling_drops_latency_and_alerts_when_loaded():
    used = set().union(*(promql_metric_names(e) for _, e in queries(dashboard())))
    for metric in ("tailguard_monitor_slice_parity", "tailguard_monitor_sampled_total",
                   "tailguard_monitor_dropped_total", "tailguard_monitor_inference_seconds_bucket",
                   "tailguard_monitor_alert_active", "tailguard_monitor_slice_evidence",
                   "tailguard_monitor_slices_tracked", "tailguard_monitor_slices_evicted_total",
                   "tailguard_monitor_slice_values_cut_total"):
        assert metric in used, metric
    both_roles = [e for _, e in queries(dashboard()) if "inference_seconds_bucket" in e]
    assert any("role" in e for e in both_roles), "latency must be split by role (reference and candidate)"


def counts_each_request_once(expr: str) -> bool:
    """False when `expr` adds sampled_total over slices: every sampled request is counted once per slice key it
    carries, so only `slice="all"` (or a per-slice breakdown, `by (slice)`) counts requests."""
    if "tailguard_monitor_sampled_total" not in expr:
        return True
    selectors = re.findall(r"tailguard_monitor_sampled_total(\{[^}]*\})?", expr)
    per_slice = re.search(r"\bby\s*\([^)]*\bslice\b[^)]*\)", expr) is not None
    return per_slice or all(re.search(r'slice\s*=\s*"all"', sel or "") for sel in selectors)


def test_counts_each_request_once_flags_sums_over_slices_when_slice_all_missing():
    assert counts_each_request_once('sum(rate(tailguard_monitor_sampled_total{slice="all"}[5m]))')
    assert counts_each_request_once('sum by (slice) (rate(tailguard_monitor_sampled_total[5m]))')
    assert not counts_each_request_once('sum(rate(tailguard_monitor_sampled_total{model="m"}[5m]))')
    assert not counts_each_request_once('sum(rate(tailguard_monitor_sampled_total[5m])) / sum(x)')


def test_dashboard_sampling_queries_count_each_request_once_when_summed():
    bad = [f"{where}: {expr}" for where, expr in queries(dashboard()) if not counts_each_request_once(expr)]
    assert not bad, f"sampled_total summed over slices (use slice=\"all\"): {bad}"
    (ratio,) = [p for p in panels(dashboard()) if p["title"] == "Sampling ratio"]
    expr = ratio["targets"][0]["expr"]
    assert 'slice="all"' in expr and "tailguard_monitor_requests_total" in expr


def test_dashboard_evidence_panel_marks_the_alarm_level_at_one_when_loaded():
    (ev,) = [p for p in panels(dashboard())
             if any("tailguard_monitor_slice_evidence" in t["expr"] for t in p["targets"])]
    steps = ev["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["value"] for s in steps] == [None, 1]
    assert ev["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"].startswith("line")


def test_dashboard_queries_parse_as_promql_when_checked_by_promtool(tmp_path):
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (apt-get install prometheus, or scripts/install_tools.sh)")
    rules = [{"record": f"tailguard:dashboard_query:{i}", "expr": grafana_to_promql(e)}
             for i, (_, e) in enumerate(queries(dashboard())) if not e.startswith("label_values(")]
    f = tmp_path / "q.rules.yaml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = subprocess.run(["promtool", "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dashboard_configmap_carries_the_json_when_rendered():
    from tests.integration.test_manifests import render  # noqa: PLC0415 - shared kustomize runner

    for overlay in ("dev", "prod"):
        cms = [d for d in render(overlay) if d["kind"] == "ConfigMap"
               and d["metadata"]["name"] == "tailguard-grafana-dashboard"]
        assert len(cms) == 1
        assert cms[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(cms[0]["data"]["tailguard-monitor.json"]) == dashboard()
