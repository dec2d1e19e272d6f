"""Alert rules (manifests/base/monitoring/prometheusrule.yaml) with promtool.

The PrometheusRule's `.spec` is a plain Prometheus rules file: it is written out as tailguard.rules.yaml next to a
copy of manifests/tests/alert_rules_test.yaml, then `promtool check rules` and `promtool test rules` run on them.
The unit tests hold, for every alert, a case where it fires and one where it must not.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.monitoring.test_dashboard import counts_each_request_once, exported_series_names, promql_metric_names

ROOT = Path(__file__).resolve().parents[2]
RULE_FILE = ROOT / "manifests" / "base" / "monitoring" / "prometheusrule.yaml"
UNIT_TESTS = ROOT / "manifests" / "tests" / "alert_rules_test.yaml"
RUNBOOKS = ROOT / "docs" / "runbooks"
# Not tailguard's: Prometheus' scrape health, and Argo Workflows' controller metrics (KFP v2's backend).
EXTERNAL_METRICS = {"up", "argo_workflows_count"}
EXTERNAL_NAME_REGEXES = {"argo_workflows_total_count(_total)?"}


def rules_spec() -> dict:
    return yaml.safe_load(RULE_FILE.read_text())["spec"]


def alerts() -> list[dict]:
    return [r for g in rules_spec()["groups"] for r in g["rules"] if "alert" in r]


def promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("promtool not installed (apt-get install prometheus, or scripts/install_tools.sh)")
    return exe


def write_rules(tmp: Path, spec: dict) -> Path:
    (tmp / "tailguard.rules.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    shutil.copy(UNIT_TESTS, tmp / UNIT_TESTS.name)
    return tmp / UNIT_TESTS.name


def test_promtool_check_rules_passes_when_rules_extracted(tmp_path):
    write_rules(tmp_path, rules_spec())
    r = subprocess.run([promtool(), "check", "rules", str(tmp_path / "tailguard.rules.yaml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in r.stdout


def test_promtool_unit_tests_pass_when_run(tmp_path):
    tests = write_rules(tmp_path, rules_spec())
    r = subprocess.run([promtool(), "test", "rules", str(tests)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_unit_tests_fail_when_an_alert_loses_its_for_clause(tmp_path):
    spec = rules_spec()
    for g in spec["groups"]:
        for r in g["rules"]:
            if r.get("alert") == "TailguardSliceParityDegraded":
                r.pop("for")
    tests = write_rules(tmp_path, spec)
    r = subprocess.run([promtool(), "test", "rules", str(tests)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "TailguardSliceParityDegraded" in r.stdout + r.stderr


def test_every_alert_has_a_firing_and_a_quiet_unit_test_when_listed():
    cases: dict[str, set[str]] = {}
    for t in yaml.safe_load(UNIT_TESTS.read_text())["tests"]:
        for case in t["alert_rule_test"]:
            cases.setdefault(case["alertname"], set()).add("fires" if case["exp_alerts"] else "quiet")
    for a in alerts():
        assert cases.get(a["alert"]) == {"fires", "quiet"}, f"{a['alert']}: {sorted(cases.get(a['alert'], []))}"
    assert set(cases) == {a["alert"] for a in alerts()}, "unit tests for alerts that do not exist"


def test_every_alert_has_severity_annotations_and_a_runbook_when_defined():
    for a in alerts():
        name = a["alert"]
        assert a["labels"]["severity"] in ("warning", "critical"), name
        assert {"summary", "description", "runbook_url"} <= set(a["annotations"]), name
        assert a["annotations"]["runbook_url"].endswith(f"docs/runbooks/{name}.md"), name
        runbook = RUNBOOKS / f"{name}.md"
        assert runbook.is_file(), f"missing runbook {runbook.relative_to(ROOT)}"
        text = runbook.read_text()
        for section in ("## Meaning", "## Impact", "## Diagnosis", "## Mitigation"):
            assert section in text, f"{runbook.name}: no {section!r} section"


def test_alert_rules_only_use_exported_or_documented_external_metrics_when_parsed():
    from tailguard.trigger import METRIC_NAMES as TRIGGER_METRICS

    allowed = exported_series_names() | set(TRIGGER_METRICS) | EXTERNAL_METRICS
    for a in alerts():
        names = promql_metric_names(a["expr"])
        unknown = names - allowed
        assert not unknown, f"{a['alert']}: {unknown}"
        for regex in re.findall(r'__name__=~"([^"]+)"', a["expr"]):
            assert regex in EXTERNAL_NAME_REGEXES, f"{a['alert']}: {regex}"
        assert names or "__name__" in a["expr"], a["alert"]


def test_alert_rules_count_each_sampled_request_once_when_they_use_sampled_total():
    bad = [a["alert"] for a in alerts() if not counts_each_request_once(a["expr"])]
    assert not bad, f"sampled_total summed over slices (use slice=\"all\"): {bad}"


def test_monitor_bookkeeping_alerts_watch_evictions_and_cut_values_when_defined():
    by_name = {a["alert"]: a for a in alerts()}
    assert "tailguard_monitor_slices_evicted_total" in promql_metric_names(
        by_name["TailguardMonitorSlicesEvicted"]["expr"])
    assert "tailguard_monitor_slice_values_cut_total" in promql_metric_names(
        by_name["TailguardMonitorSliceValuesCut"]["expr"])
    parity = by_name["TailguardSliceParityDegraded"]
    assert promql_metric_names(parity["expr"]) == {"tailguard_monitor_alert_active"}
    assert "/v1/alerts" in parity["annotations"]["description"]


def test_rendered_prometheusrule_equals_the_base_file_when_kustomized():
    from tests.integration.test_manifests import render

    for overlay in ("dev", "prod"):
        (rule,) = [d for d in render(overlay) if d["kind"] == "PrometheusRule"]
        assert rule["spec"] == rules_spec()
