"""Data check: real Great Expectations (ephemeral context) over real Parquet files written once per module."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from tailguard.components.check_data.logic import (
    CheckReport,
    add_derived_columns,
    check_datasets,
    expectation_classes,
    write_report,
)
from tailguard.core.contract import DATA_CHECK_FILE
from tailguard.core.errors import DataCheckError, InputError, SpecError
from tailguard.core.spec import parse_spec

N_ROWS = 40
VOCAB = 64


def _frame(seed: int = 0) -> pd.DataFrame:
    """N_ROWS rows: input_ids (int64 arrays, length 3..12, ids in [1, VOCAB)), features (float32 arrays of
    length 4), label (int), n_tokens (int), lang (str)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 13, size=N_ROWS)
    return pd.DataFrame({
        "input_ids": [rng.integers(1, VOCAB, size=n).astype(np.int64) for n in lengths],
        "features": [rng.normal(size=4).astype(np.float32) for _ in range(N_ROWS)],
        "label": rng.integers(0, 3, size=N_ROWS),
        "n_tokens": lengths.astype(np.int64),
        "lang": rng.choice(["en", "de", "fr"], size=N_ROWS),
    })


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Parquet files: good, NaN in one `features` row, a token id outside the vocabulary, a null label."""
    root = tmp_path_factory.mktemp("data")
    good = _frame()
    paths = {"good": root / "good.parquet", "nan": root / "nan.parquet", "oov": root / "oov.parquet",
             "null_label": root / "null_label.parquet"}
    good.to_parquet(paths["good"])
    bad = _frame()
    bad.at[7, "features"] = np.array([0.1, np.nan, 0.3, np.inf], dtype=np.float32)
    bad.to_parquet(paths["nan"])
    oov = _frame()
    oov.at[3, "input_ids"] = np.array([1, 2, VOCAB + 100], dtype=np.int64)
    oov.to_parquet(paths["oov"])
    nl = _frame().astype({"label": "float64"})
    nl.loc[5, "label"] = None
    nl.to_parquet(paths["null_label"])
    return {k: str(v) for k, v in paths.items()}


def make_spec(validation: str, calibration: str | None = None, *, expectations=(), slices=(), min_rows: int = 1):
    """A spec over the test frames: inputs input_ids (value_range [0, VOCAB-1]) and features."""
    return parse_spec({
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "check-test"},
        "model": {"registered_name": "m", "task": "classification",
                  "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"],
                              "value_range": [0, VOCAB - 1]},
                             {"name": "features", "dtype": "float32", "shape": ["batch", 4]}],
                  "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", 3]}]},
        "data": {"calibration": {"uri": calibration or validation},
                 "validation": {"uri": validation, "label_column": "label", "min_rows": min_rows},
                 "expectations": list(expectations)},
        "slices": list(slices),
        "variants": [{"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"}],
        "gates": [{"metric": "top1_agreement", "min": 0.9}],  # a promoting spec needs a parity gate
    })


def _failures(exc_info) -> list[dict]:
    return exc_info.value.failures


def test_check_datasets_passes_when_data_good(files, tmp_path):
    spec = make_spec(files["good"], slices=[{"name": "lang", "column": "lang"}],
                     expectations=[{"type": "expect_column_values_to_be_between",
                                    "kwargs": {"column": "n_tokens", "min_value": 1, "max_value": 512}}])
    report = check_datasets(spec)
    assert report.success and [d.name for d in report.datasets] == ["calibration", "validation"]
    val = report.datasets[1]
    assert val.n_rows == N_ROWS and all(r.success for r in val.results)
    types = {(r.type, r.column) for r in val.results}
    assert ("expect_column_values_to_be_in_set", "features") in types  # finite check ran on the array column
    assert ("expect_column_to_exist", "lang") in types  # slice column, validation only
    assert ("expect_column_to_exist", "lang") not in {(r.type, r.column) for r in report.datasets[0].results}
    assert any(r.origin == "spec" and r.spec_index == 0 for r in val.results)
    path = write_report(report, tmp_path)
    assert path.name == DATA_CHECK_FILE
    back = CheckReport.from_dict(json.loads(path.read_text()))
    assert back == report


def test_check_datasets_names_input_column_when_array_has_nan(files):
    with pytest.raises(DataCheckError) as exc:
        check_datasets(make_spec(files["nan"], calibration=files["good"]))
    failures = _failures(exc)
    assert [(f["dataset"], f["column"], f["expectation"]) for f in failures] == [
        ("validation", "features", "expect_column_values_to_be_in_set")]
    assert failures[0]["file"] == files["nan"] and failures[0]["observed"]["unexpected_count"] == 1
    assert "features" in exc.value.message and exc.value.exit_code == 1
    assert not exc.value.report.success


def test_check_datasets_fails_when_token_id_outside_value_range(files):
    with pytest.raises(DataCheckError) as exc:
        check_datasets(make_spec(files["oov"], calibration=files["good"]))
    failures = _failures(exc)
    assert {f["column"] for f in failures} == {"input_ids"}
    assert any(f["observed"]["partial_unexpected_list"] == [float(VOCAB + 100)] for f in failures)


def test_check_datasets_fails_when_too_few_rows(files):
    with pytest.raises(DataCheckError) as exc:
        check_datasets(make_spec(files["good"], min_rows=N_ROWS + 1))
    (failure,) = _failures(exc)
    assert failure["expectation"] == "expect_table_row_count_to_be_between"
    assert failure["observed"]["observed_value"] == N_ROWS and failure["dataset"] == "validation"


def test_check_datasets_fails_when_slice_column_missing(files):
    spec = make_spec(files["good"], slices=[{"name": "region", "column": "region"}])
    with pytest.raises(DataCheckError) as exc:
        check_datasets(spec)
    (failure,) = _failures(exc)
    assert (failure["dataset"], failure["expectation"], failure["column"]) == (
        "validation", "expect_column_to_exist", "region")
    assert "region" in exc.value.message and "column missing" in exc.value.message


def test_check_datasets_fails_when_label_null(files):
    with pytest.raises(DataCheckError) as exc:
        check_datasets(make_spec(files["null_label"], calibration=files["good"]))
    (failure,) = _failures(exc)
    assert (failure["column"], failure["expectation"]) == ("label", "expect_column_values_to_not_be_null")


def test_check_datasets_fails_when_declared_expectation_fails(files):
    spec = make_spec(files["good"], expectations=[
        {"type": "expect_column_values_to_be_between", "kwargs": {"column": "n_tokens", "min_value": 5},
         "datasets": ["validation"]}])
    with pytest.raises(DataCheckError) as exc:
        check_datasets(spec)
    (failure,) = _failures(exc)
    n_short = int((_frame()["n_tokens"] < 5).sum())
    assert n_short > 0 and failure["observed"]["unexpected_count"] == n_short
    assert (failure["dataset"], failure["column"]) == ("validation", "n_tokens")


def test_check_datasets_returns_report_when_not_raising(files):
    report = check_datasets(make_spec(files["good"], min_rows=N_ROWS + 1), raise_on_failure=False)
    assert not report.success and [f["dataset"] for f in report.failures()] == ["validation"]
    assert report.datasets[0].success  # calibration keeps the default min_rows of 1


def test_check_datasets_raises_spec_error_with_close_match_when_type_unknown(files):
    spec = make_spec(files["good"], expectations=[
        {"type": "expect_column_values_to_be_betwen", "kwargs": {"column": "n_tokens", "min_value": 1}},
        {"type": "expect_column_values_to_not_be_null", "kwargs": {"colum": "label"}}])
    with pytest.raises(SpecError) as exc:
        check_datasets(spec)
    locs = [e.loc for e in exc.value.errors]
    assert locs == ["data.expectations.0.type", "data.expectations.1.kwargs"]
    assert "expect_column_values_to_be_between" in exc.value.errors[0].message


def test_check_datasets_raises_input_error_naming_field_when_file_missing(tmp_path):
    with pytest.raises(InputError, match=r"data\.calibration\.uri"):
        check_datasets(make_spec(str(tmp_path / "nope.parquet")))


def test_add_derived_columns_marks_null_and_non_finite_rows_when_mixed():
    spec = make_spec("unused.parquet")
    df = pd.DataFrame({"input_ids": [np.array([1, 70]), None, np.array([], dtype=np.int64)],
                       "features": [np.array([[1.0, 2.0], [3.0, np.inf]], dtype=object), np.array([1.0]), None]})
    out = add_derived_columns(df, spec.model.inputs)
    assert out["__features_finite"].tolist() == [False, True, None]
    assert out["__input_ids_finite"].tolist() == [True, None, True]
    assert out["__input_ids_max"].tolist()[0] == 70.0 and np.isnan(out["__input_ids_max"].tolist()[2])


def test_expectation_classes_maps_snake_case_types_when_listed():
    import great_expectations as gx

    classes = expectation_classes()
    assert classes["expect_column_values_to_be_between"] is gx.expectations.ExpectColumnValuesToBeBetween
    assert len(classes) > 40
