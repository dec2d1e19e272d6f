"""Long slice values in MLflow metric names (issue 22 item 7): a slice group's keys stay within MLflow's
250-character key limit, a long value is shortened with a hash of the raw value (stable, documented in
components/validate/logic.py), and the whole result logs to a real MLflow store."""

from __future__ import annotations

import hashlib

import pytest

from tailguard.components.validate.result import ValidationResult
from tailguard.core import metrics as M

LONG = "a legal clause quoted in full: " + "x" * 300  # 331 characters, e.g. a free-text metadata column
MLFLOW_KEY_LIMIT = 250  # mlflow/utils/validation.py MAX_ENTITY_KEY_LENGTH


def _result(values: list[str]) -> ValidationResult:
    slices = [{"slice": "clause", "value": v, "support": 40, "top1_agreement": 0.9, "kl_divergence.p99": 0.1,
               "nn_top1_margin_agreement": 0.5} for v in values]
    numerics = {"hardware_dependent": False, "exact_overall": {"top1_agreement": 0.95}, "metric": "top1_agreement"}
    return ValidationResult(variant="v", model_task="classification", rows=400, overall={"top1_agreement": 0.95},
                            perf={}, slices=slices, gates=[], passed=True, non_finite_rows=0, batch_sizes=[1],
                            numerics=numerics, exact_slices=slices)


def test_mlflow_metrics_keep_every_slice_key_within_mlflow_limit_when_a_value_is_long():
    keys = [k for k in _result([LONG, "short"]).mlflow_metrics() if "slice." in k]
    assert keys and max(len(k) for k in keys) <= MLFLOW_KEY_LIMIT, max(keys, key=len)
    assert "slice.clause.short.top1_agreement" in keys and "exact.slice.clause.short.top1_agreement" in keys


def test_slice_key_prefix_hashes_the_raw_value_stably_when_it_would_pass_the_limit():
    from tailguard.components.validate.result import SLICE_KEY_PREFIX_MAX, slice_key_prefix

    prefix = slice_key_prefix("clause", LONG)
    digest = hashlib.sha256(LONG.encode()).hexdigest()[:16]
    assert len(prefix) == SLICE_KEY_PREFIX_MAX and prefix.endswith("-h" + digest)
    assert prefix.startswith("slice.clause.a legal clause quoted in full_ xxx")  # sanitised beginning kept
    assert slice_key_prefix("clause", LONG) == prefix  # the same value, the same key, every run
    other = LONG[:-1] + "y"  # same beginning, another value: another key
    assert slice_key_prefix("clause", other) != prefix
    assert slice_key_prefix("clause", "short") == "slice.clause.short"  # values that fit are unchanged
    # the longest per-slice catalogue metric still fits with the exact. prefix and a clash suffix
    longest = max(len(m.name) for m in M.CATALOGUE.values() if m.per_slice)
    assert len("exact.") + SLICE_KEY_PREFIX_MAX + len("_99") + 1 + longest <= MLFLOW_KEY_LIMIT
    parsed = M.parse_key(prefix + ".top1_agreement")  # still a slice key to the catalogue
    assert parsed.slice == ("clause", prefix.removeprefix("slice.clause.")) and parsed.metric.name == "top1_agreement"


def test_log_validation_logs_every_metric_to_mlflow_when_slice_values_are_long(tmp_path):
    import mlflow

    from tailguard.components.validate.run_log import log_validation

    result = _result([LONG, LONG + " (2)", "short"])
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")  # a real store of this test's own
    run_id = client.create_run(client.create_experiment("long-slices")).info.run_id
    log_validation(client, run_id, result)
    logged = client.get_run(run_id).data.metrics
    slice_keys = [k for k in logged if k.startswith("slice.clause.")]
    assert len(slice_keys) == 3 * 4  # three groups x (support + three metrics), none lost or merged
    assert logged["slice.clause.short.top1_agreement"] == pytest.approx(0.9)
