"""Derived slices in the kernel (tailguard.core.derive) and the spec (issue 35): per-row values from inputs and the
reference's output, padding-invariant, labelled as validation labels column slices; `spec check` refuses what
cannot be computed, naming the field."""

import numpy as np
import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from tailguard.cli import app
from tailguard.core.derive import (
    derive_dataset,
    derive_rows,
    derive_values,
    fit_centroids,
    nearest_centroid,
    row_labels,
)
from tailguard.core.errors import SpecError
from tailguard.core.slices import slice_groups
from tailguard.core.spec import parse_spec
from tailguard.core.spec.data import SliceSpec
from tailguard.preflight import column_errors
from tests.core.test_spec import TINY

# `spec check` resolves model.registered_name in an existing local store: a private home per test (conftest)
pytestmark = pytest.mark.usefixtures("private_home")

N_TOKENS = SliceSpec(name="n_tokens", derive={"input": "attention_mask", "reduce": "length"}, bins=[0, 4, 8, 129])
IDS_SUM = SliceSpec(name="ids", derive={"input": "input_ids", "reduce": "sum"})


def _rows(seed=0, n=40):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 12, size=n)
    ids = [rng.integers(1, 50, size=k).astype(np.int64) for k in lengths]
    return {"input_ids": ids, "attention_mask": [np.ones(k, np.int64) for k in lengths]}, lengths


def _padded(rows, idx):
    width = max(len(rows["input_ids"][i]) for i in idx)
    out = {}
    for name, r in rows.items():
        a = np.zeros((len(idx), width), np.int64)
        for j, i in enumerate(idx):
            a[j, :len(r[i])] = r[i]
        out[name] = a
    return out


def test_derive_values_give_each_row_its_own_value_when_rows_are_padded_in_a_batch():
    rows, lengths = _rows()
    alone = derive_rows(N_TOKENS, rows)
    assert alone.tolist() == lengths.tolist()
    for spec in (N_TOKENS, IDS_SUM):
        one = derive_rows(spec, rows)
        for idx in (np.arange(0, 16), np.arange(16, 40)):  # padded to the longest row of each batch
            assert derive_values(spec, _padded(rows, idx)).tolist() == one[idx].tolist()


def test_derive_values_reduce_selected_elements_and_reference_output_when_declared():
    x = np.array([[1.0, 2.0, 3.0, 4.0], [0.0, -1.0, 5.0, 0.0]], np.float32)
    sel = SliceSpec(name="ink", derive={"input": "x", "select": [1, 3], "reduce": "sum"})
    assert derive_values(sel, {"x": x}).tolist() == [5.0, 4.0]
    for how, want in (("mean", [2.5, 1.0]), ("max", [4.0, 5.0]), ("min", [1.0, -1.0]), ("count_nonzero", [4, 2]),
                      ("norm", [np.sqrt(30.0), np.sqrt(26.0)]), ("length", [4, 3])):
        s = SliceSpec(name="v", derive={"input": "x", "reduce": how})
        assert derive_values(s, {"x": x}) == pytest.approx(want)
    pred = SliceSpec(name="predicted", derive={"output": "reference", "reduce": "argmax"})
    logits = np.array([[0.1, 0.9, 0.0], [np.nan, 0.0, 1.0], [3.0, 1.0, 2.0]])
    v = derive_values(pred, {}, [logits])
    assert v[0] == 1 and np.isnan(v[1]) and v[2] == 0
    assert row_labels(pred, v) == ["1", "null", "0"]


def test_row_labels_equal_validation_group_labels_when_same_values():
    x = np.array([-3.0, 0.0, 3.9, 4.0, 8.0, 200.0, np.nan, 7.5])
    for spec in (N_TOKENS, SliceSpec(name="v", derive={"input": "x", "reduce": "sum"}),
                 SliceSpec(name="v", derive={"input": "x", "reduce": "sum"}, values=[0, 4, 8])):
        groups = slice_groups(pd.DataFrame(index=range(len(x))), [spec], {spec.name: x})
        from_groups = [None] * len(x)
        for g in groups:
            for i in np.flatnonzero(g.mask):
                from_groups[i] = g.value
        assert row_labels(spec, x) == from_groups


@pytest.mark.parametrize("low, high, dtype", [(0, 10, np.int64), (-5, 3, np.int32), (0, 256, np.uint8),
                                              (-10_000, 10_000, np.int64)])
def test_row_labels_label_each_integer_row_by_its_value_when_the_range_is_small_or_wide(low, high, dtype):
    """Integer values (an argmax's classes) are labelled by counting when their range is small and by sorting when
    it is wide: either way each row gets its own value's label."""
    pred = SliceSpec(name="predicted", derive={"output": "reference", "reduce": "argmax"})
    x = np.random.default_rng(abs(low) + high).integers(low, high, 300).astype(dtype)
    assert row_labels(pred, x) == [str(int(v)) for v in x]
    assert row_labels(pred, x[:1]) == [str(int(x[0]))]


@pytest.mark.parametrize("values", [[3.0, 1.0, 3.0, 7.0], [3.0, np.nan, 1.0], [0.5, 1.0, 0.5], [1e300, 0.0, 1.0],
                                    [np.inf, 1.0, -np.inf], [-2.0, 4.0, -0.0, 0.0], [2.0 ** 53, 1.0], [9.0]])
def test_row_labels_label_each_float_row_as_np_unique_does_when_values_are_integral_or_not(values):
    """Float values (derive_values gives an argmax's classes as integral floats) are labelled by counting when
    every value is an integral float of a small range, else by np.unique: the same labels either way (NaN, an
    infinity, a fraction, a value past 2**52 take np.unique)."""
    pred = SliceSpec(name="predicted", derive={"output": "reference", "reduce": "argmax"})
    x = np.asarray(values * 3, dtype=np.float64)
    uniq = np.unique(x)
    expected = [row_labels(pred, uniq[i:i + 1])[0] for i in np.unique(x, return_inverse=True)[1].ravel()]
    assert row_labels(pred, x) == expected
    with np.errstate(over="ignore"):  # 1e300 is an infinity in float32
        x32 = x.astype(np.float32)
    assert row_labels(pred, x32) == [row_labels(pred, x32[i:i + 1])[0] for i in range(x32.shape[0])]


def test_fit_centroids_give_the_same_labels_when_fitted_twice_on_the_same_outputs():
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(3, 8)) * 5
    emb = np.concatenate([c + rng.normal(size=(30, 8)) for c in centres])
    a, b = fit_centroids(emb, 3), fit_centroids(emb[::-1].copy(), 3)
    assert a.shape == (3, 8) and np.allclose(a, b, atol=1e-5)
    labels = nearest_centroid(emb, a)
    assert len(set(labels[:30])) == len(set(labels[30:60])) == len(set(labels[60:])) == 1
    topic = SliceSpec(name="topic", derive={"output": "reference", "reduce": "nearest_centroid", "centroids": 3})
    values, fitted = derive_dataset([topic, N_TOKENS], _rows(n=90)[0], [emb])
    assert np.allclose(fitted["topic"], a) and values["topic"].tolist() == labels.tolist()
    assert values["n_tokens"].shape == (90,)


def _doc(slices):
    doc = yaml.safe_load(TINY.read_text())
    doc["slices"] = slices
    doc["gates"] = [g for g in doc["gates"] if g.get("scope") != "per_slice"]
    return doc


@pytest.mark.parametrize("slice_, loc, text", [
    ({"name": "s", "derive": {"input": "token_ids", "reduce": "sum"}}, "slices.0.derive.input", "unknown input"),
    ({"name": "s", "derive": {"input": "input_ids", "reduce": "mean"}}, "slices.0.derive.reduce", "padding"),
    ({"name": "s", "derive": {"output": "reference", "reduce": "argmax"}}, "slices.0.derive.reduce",
     "classification"),
    ({"name": "s", "derive": {"output": "reference", "select": [8, 20], "reduce": "sum"}}, "slices.0.derive.select",
     "past the 16 elements"),
    ({"name": "s", "column": "group", "header": "x-tenant"}, "slices.0", "exactly one of column, derive, header"),
    ({"name": "s", "derive": {"output": "reference", "reduce": "nearest_centroid"}}, "slices.0.derive",
     "centroids"),
])
def test_spec_check_exits_2_naming_the_field_when_a_derived_slice_cannot_be_computed(tmp_path, slice_, loc, text):
    doc = _doc([slice_])
    with pytest.raises(SpecError) as ei:
        parse_spec(doc)
    assert any(e.loc == loc and text in e.message for e in ei.value.errors), ei.value.errors
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(doc))
    r = CliRunner().invoke(app, ["spec", "check", str(tmp_path / "spec.yaml")])
    assert r.exit_code == 2 and loc in r.output


def test_spec_check_accepts_derived_and_header_slices_and_checks_only_header_columns_when_declared():
    doc = _doc([{"name": "n_tokens", "derive": {"input": "attention_mask", "reduce": "length"}, "bins": [0, 8, 129]},
                {"name": "topic", "derive": {"output": "reference", "reduce": "nearest_centroid", "centroids": 4}},
                {"name": "tenant", "header": "X-Tenant"}])
    spec = parse_spec(doc)
    errors = column_errors(spec, ["input_ids", "attention_mask"], None)
    assert [(e.loc, e.value) for e in errors] == [("slices.2.header", "X-Tenant")]
