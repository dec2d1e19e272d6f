"""Slice groups and the per-slice table (pipelines/core/slices.py)."""

import numpy as np
import pandas as pd
import pytest

from tailguard.core.errors import InputError
from tailguard.core.parity import per_sample_metrics
from tailguard.core.slices import per_slice_table, slice_groups
from tailguard.core.spec.data import SliceSpec
from tailguard.core.spec.gates import MODEL_TASK_METRICS


def _groups(frame, **kw):
    return [(g.value, g.support, g.mask.nonzero()[0].tolist())
            for g in slice_groups(frame, [SliceSpec(name="s", **kw)])]


def test_slice_groups_bins_are_left_closed_when_values_hit_edges():
    f = pd.DataFrame({"n": [0, 15, 16, 31, 32, 63, 64, 700, -1, np.nan]})
    assert _groups(f, column="n", bins=[0, 16, 32, 64]) == [
        ("(-inf,0)", 1, [8]), ("[0,16)", 2, [0, 1]), ("[16,32)", 2, [2, 3]), ("[32,64)", 2, [4, 5]),
        ("[64,inf)", 2, [6, 7]), ("null", 1, [9])]


def test_slice_groups_bins_skip_overflow_groups_when_all_rows_are_inside():
    f = pd.DataFrame({"n": [1.5, 2.5, 3.5]})
    assert [v for v, _, _ in _groups(f, column="n", bins=[1, 2, 4])] == ["[1,2)", "[2,4)"]


def test_slice_groups_quantiles_are_equal_frequency_when_values_distinct():
    f = pd.DataFrame({"x": np.arange(100, dtype=float)[::-1]})
    groups = _groups(f, column="x", quantiles=4)
    assert [s for _, s, _ in groups] == [25, 25, 25, 25]
    assert [v for v, _, _ in groups] == ["[0,24.75)", "[24.75,49.5)", "[49.5,74.25)", "[74.25,99]"]
    assert sum(s for _, s, _ in groups) == 100


def test_slice_groups_quantiles_merge_edges_when_column_is_heavily_tied():
    f = pd.DataFrame({"x": [1.0] * 90 + [2.0] * 10})
    groups = _groups(f, column="x", quantiles=4)
    assert [(v, s) for v, s, _ in groups] == [("[1,2]", 100)]


def test_slice_groups_by_value_ordered_with_null_last_when_no_values_given():
    f = pd.DataFrame({"lab": [3, 1, 2, 1, None]})
    assert _groups(f, column="lab") == [("1", 2, [1, 3]), ("2", 1, [2]), ("3", 1, [0]), ("null", 1, [4])]


def test_slice_groups_keeps_only_listed_values_when_values_given():
    f = pd.DataFrame({"lang": ["en", "de", "en", "fr"]})
    assert _groups(f, column="lang", values=["fr", "en", "ja"]) == [
        ("fr", 1, [3]), ("en", 2, [0, 2]), ("ja", 0, [])]


def test_slice_groups_puts_rest_in_other_when_more_than_max_groups():
    f = pd.DataFrame({"c": ["a"] * 5 + ["b"] * 4 + ["c"] * 3 + ["d"] * 2 + ["e"]})
    groups = _groups(f, column="c", max_groups=3)
    assert [(v, s) for v, s, _ in groups] == [("a", 5), ("b", 4), ("other", 6)]
    assert len(groups) == 3


def test_slice_groups_raises_naming_field_and_columns_when_column_missing():
    f = pd.DataFrame({"n_tokens": [1, 2], "label": [0, 1]})
    slices = [SliceSpec(name="len", column="n_tokens"), SliceSpec(name="lang", column="language")]
    with pytest.raises(InputError) as exc:
        slice_groups(f, slices)
    msg = str(exc.value)
    assert "slices.1.column" in msg and "'language'" in msg and "['n_tokens', 'label']" in msg


def test_slice_groups_raises_when_bins_on_text_column():
    with pytest.raises(InputError, match="slices.0.bins"):
        slice_groups(pd.DataFrame({"t": ["a", "b"]}), [SliceSpec(name="t", column="t", bins=[0, 1])])


def test_per_slice_table_aggregates_each_group_when_disagreements_are_planted():
    ref = np.zeros((8, 2), dtype=np.float32)
    ref[:, 0] = 1
    cand = ref.copy()
    cand[[0, 1], 1] = 5  # both disagreements are in group "a"
    frame = pd.DataFrame({"g": ["a", "a", "a", "a", "b", "b", "b", "b"]})
    ps = per_sample_metrics("classification", ref, cand)
    table = per_slice_table("classification", ps, slice_groups(frame, [SliceSpec(name="grp", column="g")]))
    assert list(table.columns) == ["slice", "value", "support",
                                   *[m for m in MODEL_TASK_METRICS["classification"] if "accuracy" not in m or
                                     m == "top1_agreement"]]
    assert table["top1_agreement"].tolist() == [0.5, 1.0]
    assert table["support"].tolist() == [4, 4]
    assert table["slice"].tolist() == ["grp", "grp"]
