"""`tailguard spec check` with its data files (pipelines/preflight.py `check_spec_file`): files, columns and input
shapes are checked, every error of a spec is reported at once with its field path, exit 2 on errors.

Real parts: Parquet files written with pandas / pyarrow in tmp_path, the typer CLI in-process.
"""

import re

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

from tailguard.cli import app
from tailguard.core.errors import SpecError
from tailguard.core.spec import validate_spec
from tailguard.preflight import check_spec_file

# `spec check` resolves model.registered_name in an existing local store: a private home per test (conftest)
pytestmark = pytest.mark.usefixtures("private_home")

runner = CliRunner()


def _image_rows(n: int, seed: int = 0) -> pd.DataFrame:
    """CNN input rows: 'image' nested lists of shape (1, 8, 8), 'label' int, 'digit' str."""
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"image": [rng.random((1, 8, 8)).tolist() for _ in range(n)],
                         "label": rng.integers(0, 10, n), "digit": [str(i % 10) for i in range(n)]})


def _spec(root, **overrides) -> dict:
    doc = {
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "digits-cnn"},
        "model": {"registered_name": "digits-cnn", "task": "classification",
                  "inputs": [{"name": "image", "dtype": "float32", "shape": ["batch", 1, 8, 8]}],
                  "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", 10]}]},
        "data": {"calibration": {"uri": "cal.parquet"},
                 "validation": {"uri": "val.parquet", "label_column": "label"}},
        "slices": [{"name": "digit", "column": "digit"}],
        "variants": [{"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"}],
        "gates": [{"metric": "top1_agreement", "scope": "per_slice", "min": 0.9, "min_support": 5}],
    }
    doc.update(overrides)
    return doc


def _write(root, doc, name="spec.yaml"):
    p = root / name
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


@pytest.fixture
def files(tmp_path):
    _image_rows(40, 0).to_parquet(tmp_path / "val.parquet")
    _image_rows(20, 1).to_parquet(tmp_path / "cal.parquet")
    return tmp_path


def test_spec_check_exits_0_and_counts_rows_when_files_columns_and_shapes_fit(files):
    r = runner.invoke(app, ["spec", "check", str(_write(files, _spec(files)))])
    assert r.exit_code == 0, r.output
    assert "valid" in r.output and "data.validation: 40 rows checked" in r.output
    assert "data.calibration: 20 rows checked" in r.output


def test_spec_check_exits_2_naming_both_files_when_data_files_are_missing(tmp_path):
    r = runner.invoke(app, ["spec", "check", str(_write(tmp_path, _spec(tmp_path)))])
    assert r.exit_code == 2, r.output
    assert "data.validation.uri: file not found" in r.output and "data.calibration.uri: file not found" in r.output
    assert "Traceback" not in r.output


def test_spec_check_exits_0_when_no_data_turns_the_file_check_off(tmp_path):
    r = runner.invoke(app, ["spec", "check", "--no-data", str(_write(tmp_path, _spec(tmp_path)))])
    assert r.exit_code == 0, r.output
    assert "not checked (--no-data)" in r.output


def test_spec_check_reports_type_metric_and_data_errors_together_when_all_are_wrong(tmp_path):
    doc = _spec(tmp_path, benchmark={"batch_sizes": "one"})  # a type error ...
    doc["gates"][0]["metric"] = "top1_agreemnt"  # ... used to hide this cross-field error until the next try
    r = runner.invoke(app, ["spec", "check", str(_write(tmp_path, doc))])
    assert r.exit_code == 2, r.output
    out = r.output
    assert "benchmark.batch_sizes" in out
    assert "gates.0.metric: 'top1_agreemnt' is not produced" in out and "did you mean 'top1_agreement'" in out
    assert "data.validation.uri: file not found" in out
    # the list of choices is printed once, inside the gates.0.metric line, never as an error without a field path
    assert out.count("choose one of") == 1
    assert not re.search(r"^\s*- choose one of", out, re.M)
    assert "5 error(s)" in out and "data.calibration.uri: file not found" in out  # + "gates: no parity gate"


def test_spec_check_names_the_rows_when_an_image_row_has_the_wrong_shape(files):
    bad = _image_rows(12, 2)
    bad.at[3, "image"] = np.zeros((1, 8, 7)).tolist()
    bad.at[7, "image"] = np.zeros((2, 8, 8)).tolist()
    bad.to_parquet(files / "val.parquet")
    with pytest.raises(SpecError) as info:
        check_spec_file(_write(files, _spec(files)))
    errors = {e.loc: e.message for e in info.value.errors}
    assert set(errors) == {"model.inputs.0.shape"}
    msg = errors["model.inputs.0.shape"]
    assert "2 of 12 rows" in msg and "shape (1, 8, 7) in row(s) [3]" in msg and "shape (2, 8, 8) in row(s) [7]" in msg
    assert "val.parquet" in msg


def test_spec_check_accepts_fixed_shape_tensor_columns_when_the_shape_fits(files):
    arr = np.random.default_rng(0).random((10, 1, 8, 8)).astype(np.float32)
    tensor = pa.FixedShapeTensorArray.from_numpy_ndarray(arr)
    pq.write_table(pa.table({"image": tensor, "label": np.arange(10) % 10,
                             "digit": [str(i) for i in range(10)]}), files / "val.parquet")
    spec, check = check_spec_file(_write(files, _spec(files)))
    assert check.rows == {"validation": 10, "calibration": 20}


def test_spec_check_lists_every_missing_column_when_inputs_label_and_slice_columns_are_absent(files):
    pd.DataFrame({"pixels": [[0.0] * 64] * 5, "other": range(5)}).to_parquet(files / "val.parquet")
    doc = _spec(files, analysis={"discovery": {"columns": ["nope"]}})
    with pytest.raises(SpecError) as info:
        check_spec_file(_write(files, doc))
    locs = [e.loc for e in info.value.errors]
    assert locs == ["model.inputs.0.name", "slices.0.column", "analysis.discovery.columns.0",
                    "data.validation.label_column"]
    assert "columns: ['pixels', 'other']" in info.value.errors[0].message


def test_spec_check_skips_remote_files_with_a_note_when_data_is_on_s3(tmp_path):
    doc = _spec(tmp_path, data={"calibration": {"uri": "s3://bucket/cal.parquet"},
                                "validation": {"uri": "s3://bucket/val.parquet", "label_column": "label"}})
    r = runner.invoke(app, ["spec", "check", str(_write(tmp_path, doc))])
    assert r.exit_code == 0, r.output
    assert r.output.count("not checked") == 2 and "s3://bucket/val.parquet" in r.output


def test_validate_spec_returns_the_unknown_slice_error_when_a_field_type_error_hides_it():
    doc = _spec(None, benchmark={"iterations": "many"})
    doc["gates"][0]["slice"] = "digits"
    spec, errors = validate_spec(doc)
    assert [e.loc for e in errors] == ["benchmark.iterations", "gates.0.slice"]
    assert spec is not None and spec.metadata.name == "digits-cnn"  # the rest, for the data checks
