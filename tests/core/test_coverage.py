"""Calibration coverage per slice, and tail-aware (stratified) calibration sampling that fixes a missing rare group."""

import numpy as np
import pandas as pd

from tailguard.components.reference.coverage import calibration_coverage
from tailguard.core.data import load_dataset
from tailguard.core.spec.data import SliceSpec
from tailguard.core.spec.model import TensorSpec

INPUTS = [TensorSpec(name="x", dtype="int64", shape=["batch", "sequence"])]


def _write(path, groups: list[str], lengths: list[int]) -> str:
    pd.DataFrame({"x": [np.arange(n) for n in lengths], "cls": groups, "n": lengths}).to_parquet(path)
    return str(path)


def test_calibration_coverage_flags_the_rare_group_missing_when_the_sample_is_uniform(tmp_path):
    rng = np.random.default_rng(0)
    pool = ["common"] * 990 + ["rare"] * 10
    uri = _write(tmp_path / "pool.parquet", pool, list(rng.integers(2, 30, size=1000)))
    validation = load_dataset(_write(tmp_path / "val.parquet", ["common"] * 90 + ["rare"] * 10, [5] * 100), INPUTS)
    slices = [SliceSpec(name="cls", column="cls"), SliceSpec(name="len", column="n", bins=[0, 10, 100])]

    # seed chosen so the 32-row uniform sample has no "rare" row (1% of the pool)
    uniform = load_dataset(uri, INPUTS, max_samples=32, seed=1)
    assert "rare" not in set(uniform.frame["cls"])
    table = calibration_coverage(slices, uniform, validation).set_index(["slice", "value"])
    assert bool(table.loc[("cls", "rare"), "missing"]) is True
    assert table.loc[("cls", "rare"), "coverage_ratio"] == 0.0
    assert table.loc[("cls", "common"), "validation_rows"] == 90

    stratified = load_dataset(uri, INPUTS, max_samples=32, seed=1, stratify_by="cls")
    table = calibration_coverage(slices, stratified, validation).set_index(["slice", "value"])
    assert table.loc[("cls", "rare"), "calibration_rows"] == 10  # the whole rare group (water-filling)
    assert not table["missing"].any()
    assert table.loc[("cls", "rare"), "coverage_ratio"] == (10 / 32) / (10 / 100)


def test_calibration_coverage_is_empty_when_no_slices_are_declared(tmp_path):
    ds = load_dataset(_write(tmp_path / "a.parquet", ["a", "b"], [3, 4]), INPUTS)
    assert calibration_coverage([], ds, ds).empty
