"""The metric catalogue (tailguard.core.metrics): it holds every name parity and the validate step produce, its
rows reproduce what parity computes, its directions agree with the three rules it replaced, the spec's old tables
are computed from it unchanged, `spec check` validates monitor thresholds with it, and docs/spec.md holds it.

No mocks: parity runs on small seeded synthetic outputs; `spec check` runs through the CLI (typer's CliRunner)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from tailguard.cli import app
from tailguard.components.validate.result import PERF_KEYS, ValidationResult
from tailguard.core import metrics as M
from tailguard.core import parity  # the old path of tailguard.core.parity (the brief's "parity.py")
from tailguard.core import report as R
from tailguard.core.errors import InputError, SpecError
from tailguard.core.spec import gates as S
from tailguard.core.spec import parse_spec
from tailguard.core.spec.monitor import MONITOR_METRICS
from tailguard.core.spec.root import SKIP_CROSS_FIELD, Spec
from tailguard.monitoring import config as monitor_config
from tailguard.monitoring import testing as T

DOCS = Path(__file__).resolve().parents[2] / "docs" / "spec.md"
ROWS = 40


# ------------------------------------------------------------------- the rules and tables the catalogue replaced
# Copied from the code before the catalogue (git a16f846): pipelines/spec.py, components/validate/report.py,
# monitoring/config.py. The catalogue must agree with them wherever they were used.
def _old_spec_rule(metric: str) -> bool:
    if metric.startswith(("abs_error", "rel_error", "kl_divergence")) or metric.startswith("latency_ms") or \
            metric in ("usd_per_1m_inferences", "peak_rss_mb", "model_size_mb"):
        return False
    return True


def _old_report_rule(metric: str) -> bool:
    return any(p in metric for p in ("accuracy", "agreement", "cosine_similarity", "speedup", "throughput"))


OLD_MONITOR_DIRECTION = {"top1_agree": True, "cosine_similarity": True, "kl_divergence": False,
                         "abs_error": False, "rel_error": False}
OLD_MONITOR_RANGE = {"top1_agree": (0.0, 1.0), "cosine_similarity": (-1.0, 1.0), "kl_divergence": (0.0, math.inf),
                     "abs_error": (0.0, math.inf), "rel_error": (0.0, math.inf)}
OLD_MONITOR_DEFAULTS = {"classification": ("top1_agree", "kl_divergence", "abs_error"),
                        "embedding": ("cosine_similarity", "abs_error"),
                        "regression": ("abs_error", "rel_error"), "generic": ("abs_error", "rel_error")}
OLD_TASK_METRICS = {
    "classification": ("accuracy", "reference_accuracy", "top1_agreement", "kl_divergence.mean",
                       "kl_divergence.p99", "abs_error.max", "abs_error.mean", "abs_error.p99"),
    "embedding": ("cosine_similarity.mean", "cosine_similarity.p01", "cosine_similarity.min",
                  "nn_top1_agreement", "nn_top5_agreement", "abs_error.max", "abs_error.mean", "abs_error.p99",
                  "accuracy", "reference_accuracy", "nn_recall_at_k", "nn_top1_margin_agreement"),
    "regression": ("abs_error.max", "abs_error.mean", "abs_error.p99", "rel_error.max", "rel_error.mean"),
    "generic": ("abs_error.max", "abs_error.mean", "abs_error.p99", "rel_error.max", "rel_error.mean"),
}
# The old substring rule of the report was wrong for these two (it drew their per-slice plots best-first).
REPORT_RULE_BUGS = {"nn_recall_at_k", "quantized_mac_fraction"}
# Issue 38 added the token_classification task after the old rules and tables: its metrics and per-row values are
# checked against these, the old ones against the old tables.
TOKEN_METRICS = ("token_top1_agreement", "sequence_exact_match", "cer")
TOKEN_ROWS = {"token_top1_agree": (True, (0.0, 1.0)), "sequence_exact": (True, (0.0, 1.0)),
              "char_error": (False, (0.0, 1.0))}


# ------------------------------------------------------------------------------------------ synthetic outputs
def _outputs(model_task: str, seed: int = 0) -> dict:
    """(reference, candidate, labels) for a task: ROWS rows, the candidate = reference + small noise, a few
    rows with a flipped top-1 (classification) so no metric is trivially constant."""
    rng = np.random.default_rng(seed)
    width = {"classification": 5, "embedding": 8, "regression": 1, "generic": 3, "token_classification": 5}[model_task]
    shape = (ROWS, 6, width) if model_task == "token_classification" else (ROWS, width)  # (rows, time, classes)
    ref = rng.normal(size=shape).astype(np.float32)
    cand = (ref + rng.normal(scale=0.05, size=ref.shape)).astype(np.float32)
    labels = None
    if model_task == "classification":
        labels = ref.argmax(axis=1)
        labels[:5] = (labels[:5] + 1) % width
    elif model_task == "embedding":
        labels = np.array(["a", "b", "c", "d"])[rng.integers(0, 4, size=ROWS)]
    return {"reference": ref, "candidate": cand, "labels": labels}


def _parity(model_task: str) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    per_sample = parity.per_sample_metrics(model_task, **_outputs(model_task))
    return per_sample, parity.aggregate(model_task, per_sample)


# -------------------------------------------------------------------------------------------------- coverage
@pytest.mark.parametrize("model_task", M.MODEL_TASKS)
def test_catalogue_holds_every_name_parity_produces_when_run_on_each_task(model_task):
    per_sample, overall = _parity(model_task)
    assert tuple(overall) == M.model_task_metrics(model_task)  # same names, same order
    for name in overall:
        assert model_task in M.metric(name).model_tasks and M.metric(name).is_parity, name
    assert set(per_sample) == {r.key for r in M.ROW_METRICS if model_task in r.model_tasks and r.from_parity}
    without_labels = parity.per_sample_metrics(model_task, **{**_outputs(model_task), "labels": None})
    assert tuple(parity.aggregate(model_task, without_labels)) == M.model_task_metrics(model_task, with_labels=False)


@pytest.mark.parametrize("model_task", M.MODEL_TASKS)
def test_catalogue_row_key_and_statistic_reproduce_parity_when_recomputed(model_task):
    per_sample, overall = _parity(model_task)
    for name, value in overall.items():
        m = M.metric(name)
        x = per_sample[m.row_key].astype(np.float64)
        expected = {"mean": np.mean, "max": np.max, "min": np.min}.get(m.statistic)
        got = expected(x) if expected else np.percentile(x, float(m.statistic[1:]))
        assert value == pytest.approx(got, rel=1e-9, abs=1e-12), name
        if m.kind == "proportion":
            assert set(np.unique(x)) <= {0.0, 1.0} and M.is_proportion(name) and m.bound == "wilson"
        else:
            assert m.bound == "bootstrap" and not M.is_proportion(name)


def test_catalogue_parses_every_key_the_validate_step_logs_when_given_a_result():
    model_task = "classification"
    per_sample, overall = _parity(model_task)
    mask = np.arange(ROWS) < ROWS // 2
    slices = [{"slice": "length", "value": "[16,32)", "support": int(mask.sum()),
               **parity.aggregate(model_task, per_sample, mask)},
              {"slice": "temp", "value": "0.5", "support": int((~mask).sum()),
               **parity.aggregate(model_task, per_sample, ~mask)}]
    perf = {bs: {**{k: 1.0 for k in PERF_KEYS}, "n_iterations": 10} for bs in (1, 8)}
    result = ValidationResult(variant="v", model_task=model_task, rows=ROWS,
                              overall={**overall, "peak_rss_mb": 100.0, "model_size_mb": 1.0,
                                       "quantized_mac_fraction": 0.9},
                              perf=perf, slices=slices, gates=[], passed=True, non_finite_rows=0, batch_sizes=[1, 8])
    counts = re.compile(r"(\.support|\.n_iterations)$")  # counts, not metrics (module docstring of metrics.py)
    keys = [k for k in result.mlflow_metrics() if not counts.search(k)]
    assert keys and any(k.startswith("bs8.") for k in keys) and any(k.startswith("slice.temp.0.5.") for k in keys)
    for key in keys:
        parsed = M.parse_key(key)
        assert key.endswith(parsed.metric.name) or parsed.bound is not None, key
    parsed = M.parse_key("slice.temp.0.5.abs_error.p99")
    assert parsed.slice == ("temp", "0.5") and parsed.metric.name == "abs_error.p99"
    parsed = M.parse_key("bs8.speedup_vs_onnx_fp32.lb95")
    assert (parsed.batch_size, parsed.bound, parsed.confidence) == (8, "lower", 0.95)
    parsed = M.parse_key("baseline.onnx_fp32.bs1.latency_ms.p50")
    assert (parsed.baseline, parsed.batch_size, parsed.metric.name) == ("onnx_fp32", 1, "latency_ms.p50")


@pytest.mark.parametrize("key, problem", [
    ("slice.length.[16,32).support", "unknown metric"),
    ("bs1.peak_rss_mb", "not measured per batch size"),
    ("slice.a.b.latency_ms.p50", "not computed per slice"),
    ("top1_agrement", "did you mean 'top1_agreement'"),
])
def test_parse_key_raises_input_error_when_key_names_no_metric(key, problem):
    with pytest.raises(InputError, match=re.escape(problem)):
        M.parse_key(key)


def test_higher_is_better_returns_default_only_when_asked_for_an_unknown_name():
    with pytest.raises(InputError):
        M.higher_is_better("support")
    with pytest.raises(InputError, match="no direction"):
        M.higher_is_better("nn_margin")
    assert M.higher_is_better("support", default=True) and not M.higher_is_better("support", default=False)
    assert not M.higher_is_better("bs32.latency_ms.p99") and M.higher_is_better("slice.a.b.top1_agreement")


# ------------------------------------------------------------------------------------------------- direction
def test_direction_agrees_with_the_old_spec_rule_when_metric_is_gateable():
    gateable = [m.name for m in M.METRICS if m.gateable and m.name not in TOKEN_METRICS]
    assert {n: M.higher_is_better(n) for n in gateable} == {n: _old_spec_rule(n) for n in gateable}
    assert not hasattr(S, "higher_is_better") and not hasattr(R, "higher_is_better")  # one, the catalogue's


def test_direction_agrees_with_the_old_report_rule_except_its_two_bugs():
    shown = [m.name for m in M.METRICS if m.kind != "record" and m.name not in TOKEN_METRICS]
    differ = {n for n in shown if M.higher_is_better(n) != _old_report_rule(n)}
    assert differ == REPORT_RULE_BUGS
    assert all(M.higher_is_better(n) for n in REPORT_RULE_BUGS)  # recall and coverage: more is better


def test_monitor_tables_equal_the_old_ones_when_computed_from_the_catalogue():
    # issue 27 added the monitor-only candidate_error_rate (lower is better, [0, 1]) to the old table
    tok_direction = {k: v[0] for k, v in TOKEN_ROWS.items()}
    tok_range = {k: v[1] for k, v in TOKEN_ROWS.items()}
    assert monitor_config.HIGHER_IS_BETTER == {**OLD_MONITOR_DIRECTION, **tok_direction, "candidate_error_rate": False}
    assert monitor_config.METRIC_RANGE == {**OLD_MONITOR_RANGE, **tok_range, "candidate_error_rate": (0.0, 1.0)}
    assert monitor_config.DEFAULT_METRICS == {
        **{t: (*m, "candidate_error_rate") for t, m in OLD_MONITOR_DEFAULTS.items()},
        "token_classification": (*TOKEN_ROWS, "candidate_error_rate")}
    assert {k: M.higher_is_better(k) for k in OLD_MONITOR_DIRECTION} == OLD_MONITOR_DIRECTION


def test_parity_metric_direction_follows_its_row_and_self_score_its_direction():
    for m in M.METRICS:
        if m.is_parity:
            assert m.direction == M.row_metric(m.row_key).direction, m.name
            if m.self_score is not None:  # what max_drop counts from: the best value of the metric
                assert m.self_score == (1.0 if m.higher_is_better else 0.0), m.name
    assert {m.name for m in M.METRICS if m.is_parity and m.self_score is None} == {"accuracy", "reference_accuracy"}


def test_spec_tables_equal_the_old_literals_when_computed_from_the_catalogue():
    for model_task, names in OLD_TASK_METRICS.items():
        assert set(S.MODEL_TASK_METRICS[model_task]) == set(names)
        if model_task != "embedding":  # embedding now lists accuracy, reference_accuracy first, as classification does
            assert S.MODEL_TASK_METRICS[model_task] == names
    assert S.PERF_METRICS == ("latency_ms.p50", "latency_ms.p95", "latency_ms.p99", "throughput_per_s",
                              "usd_per_1m_inferences", "speedup_vs_torch", "speedup_vs_onnx_fp32", "peak_rss_mb",
                              "model_size_mb")
    assert S.MODEL_TASK_METRICS["token_classification"] == TOKEN_METRICS
    assert S.PROPORTION_METRICS == {"accuracy", "reference_accuracy", "top1_agreement", "nn_top1_agreement",
                                    "nn_top1_margin_agreement", "sequence_exact_match"}
    assert S.RATIO_METRICS == {"speedup_vs_onnx_fp32"} and S.BUILD_METRICS == ("quantized_mac_fraction",)
    assert S.BATCHED_METRICS == {"latency_ms.p50", "latency_ms.p95", "latency_ms.p99", "throughput_per_s",
                                 "usd_per_1m_inferences", "speedup_vs_torch", "speedup_vs_onnx_fp32"}
    assert set(S.LOWER_IS_BETTER_PREFIXES) == {"abs_error", "rel_error", "kl_divergence", "char_error"}
    assert MONITOR_METRICS == ("top1_agree", "kl_divergence", "cosine_similarity", "abs_error", "rel_error",
                               *TOKEN_ROWS, "candidate_error_rate")


# -------------------------------------------------------------------------------- monitor thresholds, spec check
def _spec_locs(monitoring: dict) -> list[str]:
    with pytest.raises(SpecError) as e:
        parse_spec(T.spec_dict(monitoring))
    return [err.loc for err in e.value.errors]


def test_spec_check_fails_with_field_path_when_monitor_threshold_has_wrong_direction(tmp_path):
    doc = T.spec_dict({"sample_rate": 0.1, "thresholds": {"kl_divergence": {"min": 0.01}}})
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(doc))
    r = CliRunner().invoke(app, ["spec", "check", "--no-data", str(path)])
    assert r.exit_code == 2, r.output
    assert "monitoring.thresholds.kl_divergence.min" in r.output and "give max, not min" in r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize("thresholds, loc", [
    ({"top1_agree": {"max": 0.5}}, "monitoring.thresholds.top1_agree.max"),  # higher-is-better needs min
    ({"abs_error": {"min": 0.1}}, "monitoring.thresholds.abs_error.min"),  # lower-is-better needs max
    ({"top1_agree": {"min": 97}}, "monitoring.thresholds.top1_agree.min"),  # a percentage, not a fraction
    ({"top1_agree": {"min": 0}}, "monitoring.thresholds.top1_agree.min"),  # the lowest value: never alerts
    ({"kl_divergence": {"max": -0.1}}, "monitoring.thresholds.kl_divergence.max"),  # below the range
    ({"top1_agree": {"baseline": 0.5, "max_drop": 0.6}}, "monitoring.thresholds.top1_agree.max_drop"),
    ({"top1_agree": {"baseline": 1.2, "max_drop": 0.1}}, "monitoring.thresholds.top1_agree.baseline"),
    ({"cosine_similarity": {"min": 0.9}}, "monitoring.thresholds.cosine_similarity"),  # not a metric of the task
])
def test_spec_check_rejects_monitor_threshold_when_it_does_not_suit_the_metric(thresholds, loc):
    assert _spec_locs({"sample_rate": 0.1, "thresholds": thresholds}) == [loc]


def test_spec_check_rejects_threshold_when_metric_is_not_tracked():
    locs = _spec_locs({"sample_rate": 0.1, "metrics": ["top1_agree"], "thresholds": {"abs_error": {"max": 1}}})
    assert locs == ["monitoring.thresholds.abs_error"]


def test_spec_check_accepts_monitor_thresholds_when_they_suit_the_metrics():
    spec = parse_spec(T.spec_dict({"sample_rate": 0.1, "thresholds": {
        "top1_agree": {"baseline": 0.99, "max_drop": 0.02}, "kl_divergence": {"max": 0.05},
        "abs_error": {"max": 0.5}}}))
    bounds = monitor_config.resolve_config(spec).bounds
    assert {m: (round(b.value, 9), b.higher_is_better) for m, b in bounds.items()} == {
        "top1_agree": (0.97, True), "kl_divergence": (0.05, False), "abs_error": (0.5, False),
        "candidate_error_rate": (0.0, False)}  # always added unless given (docs/monitor.md, Failures count)


def test_resolve_config_reports_the_same_problems_when_spec_skipped_cross_field_checks():
    doc = T.spec_dict({"sample_rate": 0.1, "metrics": ["top1_agree", "cosine_similarity"],
                       "thresholds": {"top1_agree": {"max": 0.5}}})
    spec = Spec.model_validate(doc, context={SKIP_CROSS_FIELD: True})  # the seam: a spec built without them
    with pytest.raises(SpecError) as e:
        monitor_config.resolve_config(spec)
    expected = spec.monitoring.model_task_problems("classification")
    assert [err.loc for err in e.value.errors] == [err.loc for err in expected]
    assert {err.loc for err in e.value.errors} == {"monitoring.metrics.1", "monitoring.thresholds.top1_agree.max"}


def test_resolve_config_rejects_default_threshold_when_its_metric_is_not_tracked():
    spec = parse_spec(T.spec_dict({"sample_rate": 0.1, "metrics": ["kl_divergence"]}))  # default: top1_agree min
    with pytest.raises(SpecError) as e:
        monitor_config.resolve_config(spec)
    assert [err.loc for err in e.value.errors] == ["monitoring.thresholds.top1_agree"]


# ------------------------------------------------------------------------------------------------------- docs
def test_docs_spec_md_holds_the_generated_catalogue_when_read():
    text = DOCS.read_text()
    block = text.split("<!-- metric-catalogue:start -->\n", 1)[1].split("<!-- metric-catalogue:end -->", 1)[0]
    assert block == M.catalogue_markdown(), (
        "docs/spec.md's metric catalogue is stale: paste tailguard.core.metrics.catalogue_markdown() between its "
        "metric-catalogue markers")
    for name in [*M.CATALOGUE, *M.ROW_CATALOGUE]:
        assert f"`{name}`" in block, name
