"""Data-driven blow-ups (issue 22 item 7): a sampled read streams the Parquet file instead of reading it whole, and
one very long variable-length row cannot pad a whole batch to its length.

Real parts: Parquet files written with pyarrow (several row groups, list and fixed-shape tensor columns, a stored
pandas index, a dictionary-encoded column), pyarrow's own memory pool for the memory figures (measured in a fresh
process, so its peak is this read's), numpy batches.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tailguard.core import data
from tailguard.core.data import iter_batches, load_dataset, make_batch, read_parquet
from tailguard.core.errors import InputError
from tailguard.core.spec.model import TensorSpec

IDS = [TensorSpec(name="ids", dtype="int64", shape=["batch", "sequence"])]
FEATURES = [TensorSpec(name="feat", dtype="float32", shape=["batch", 2, 3])]


def _reference_sample(df: pd.DataFrame, n: int, seed: int, stratify_by: str | None) -> pd.DataFrame:
    """The sample load_dataset drew before streaming (whole frame in memory; kept here as the semantics to keep)."""
    rng = np.random.default_rng(seed)
    if stratify_by is None:
        return df.iloc[np.sort(rng.choice(len(df), size=n, replace=False))]
    groups = {k: np.asarray(v) for k, v in df.groupby(stratify_by, sort=True).indices.items()}
    quota = {k: 0 for k in groups}
    remaining, open_groups = n, sorted(groups, key=lambda k: len(groups[k]))
    while open_groups and remaining > 0:
        share = max(remaining // len(open_groups), 1)
        k = open_groups.pop(0)
        take = min(len(groups[k]) - quota[k], share)
        quota[k] += take
        remaining -= take
    chosen = np.concatenate([rng.choice(groups[k], size=q, replace=False) for k, q in quota.items() if q > 0])
    return df.iloc[np.sort(chosen)]


def _mixed_file(path, n=1000) -> str:
    """n rows in row groups of 97: variable-length ids, a (2, 3) fixed-shape tensor, a skewed class column with
    missing values, a categorical, and a named pandas index (stored as a column)."""
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 40, size=n)
    cls = np.array(["common"] * (n - 60) + ["rare"] * 40 + [None] * 20, dtype=object)
    rng.shuffle(cls)
    df = pd.DataFrame({"ids": [np.arange(k, dtype=np.int64) + i for i, k in enumerate(lengths)], "cls": cls,
                       "n": lengths, "tier": pd.Categorical(rng.choice(["a", "b", "c"], size=n))},
                      index=pd.Index(np.arange(n) * 3, name="row_id"))
    table = pa.Table.from_pandas(df)
    feat = rng.normal(size=(n, 2, 3)).astype(np.float32)
    tensor = pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(pa.float32(), (2, 3)),
                                            pa.FixedSizeListArray.from_arrays(pa.array(feat.ravel()), 6))
    table = table.append_column("feat", tensor)
    pq.write_table(table, path, row_group_size=97)
    return str(path)


@pytest.mark.parametrize("stratify_by", [None, "cls"])
def test_load_dataset_keeps_the_rows_a_whole_file_read_kept_when_the_sample_is_streamed(tmp_path, stratify_by):
    uri = _mixed_file(tmp_path / "mixed.parquet")
    specs = IDS + FEATURES
    whole = read_parquet(uri).reset_index(drop=True)
    want = _reference_sample(whole, 150, 3, stratify_by).reset_index(drop=True)
    ds = load_dataset(uri, specs, max_samples=150, seed=3, stratify_by=stratify_by)
    assert ds.n_rows == 150
    pd.testing.assert_frame_equal(ds.frame, want.drop(columns=["ids", "feat"]), check_categorical=False)
    for got, ref in zip(ds.inputs["ids"], want["ids"]):
        np.testing.assert_array_equal(got, ref)
    for got, ref in zip(ds.inputs["feat"], want["feat"]):
        np.testing.assert_array_equal(got, ref)
    assert ds.source_rows is not None and list(ds.frame["n"]) == list(whole["n"].iloc[ds.source_rows])
    if stratify_by:
        assert (ds.frame["cls"] == "rare").sum() == 40  # water-filling: the rare group keeps every row


def test_load_dataset_reads_the_whole_file_when_it_has_no_more_rows_than_max_samples(tmp_path):
    uri = _mixed_file(tmp_path / "mixed.parquet", n=120)
    ds = load_dataset(uri, IDS, max_samples=500, seed=0, stratify_by="cls")
    pd.testing.assert_frame_equal(ds.frame, read_parquet(uri).reset_index(drop=True).drop(columns=["ids"]))


def test_load_dataset_names_the_stratify_field_when_the_column_is_missing_and_the_sample_is_streamed(tmp_path):
    uri = _mixed_file(tmp_path / "mixed.parquet", n=200)
    with pytest.raises(InputError, match=r"data\.calibration\.stratify_by: no column 'nope'"):
        load_dataset(uri, IDS, field="data.calibration", max_samples=10, stratify_by="nope")
    with pytest.raises(InputError, match=r"no column\(s\) \['missing'\]"):
        load_dataset(uri, [TensorSpec(name="missing", dtype="int64", shape=["batch", "sequence"])], max_samples=10)


_MEASURE = textwrap.dedent("""
    import json, sys
    import pyarrow as pa
    from tailguard.core import data
    from tailguard.core.spec.model import TensorSpec

    data.STREAM_BATCH_BYTES = 1 << 20  # the bound's parameter (the default is 8 MiB)
    spec = TensorSpec(name="x", dtype="float32", shape=["batch", 256])
    ds = data.load_dataset(sys.argv[1], [spec], max_samples=100, seed=0,
                           stratify_by=sys.argv[2] if len(sys.argv) > 2 else None)
    print(json.dumps({"rows": ds.n_rows, "peak": pa.default_memory_pool().max_memory()}))
""")


@pytest.mark.parametrize("stratify", [False, True])
def test_load_dataset_holds_a_bounded_part_of_the_file_when_max_samples_is_small(tmp_path, stratify):
    n, d = 20_000, 256
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, d)).astype(np.float32)
    path = tmp_path / "wide.parquet"
    pq.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), d).cast(
        pa.list_(pa.float32())), "cls": pa.array(rng.integers(0, 5, n).astype(str))}), path, row_group_size=2048)
    decoded = x.nbytes  # 20.5 MB of values; a whole-file read holds all of them in Arrow's pool at once
    args = [sys.executable, "-c", _MEASURE, str(path)] + (["cls"] if stratify else [])
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["rows"] == 100
    # measured: 7.0 MiB streamed with 1 MiB batches (reader buffer, one batch, its copy); 103 MiB whole for 2x rows
    assert got["peak"] < decoded / 2, f"Arrow pool peaked at {got['peak'] / 2**20:.1f} MiB for a 100-row sample"


# ------------------------------------------------------------------------------------------------ padding
def _long_row_file(path, long_at: int, n=200, long_len=400_000) -> str:
    lengths = [8 + (i % 57) for i in range(n)]
    lengths[long_at] = long_len
    pd.DataFrame({"ids": [np.ones(k, dtype=np.int64) for k in lengths], "i": range(n)}).to_parquet(path)
    return str(path)


def test_make_batch_refuses_a_batch_one_long_row_would_pad_naming_its_file_row_and_column(tmp_path):
    chosen = np.sort(np.random.default_rng(0).choice(200, size=100, replace=False))  # the seeded sample's rows
    long_at = int(chosen[10])
    ds = load_dataset(_long_row_file(tmp_path / "long.parquet", long_at), IDS, max_samples=100, seed=0)
    assert int(ds.lengths.max()) == 400_000  # the long row is in the sample, at sample position 10
    with pytest.raises(InputError) as ei:
        for _ in iter_batches(ds, IDS, 25):  # length-sorted: it shares the last batch with the next-longest rows
            pass
    msg = ei.value.message
    assert "column 'ids'" in msg and f"row {long_at}:" in msg and "(400000,)" in msg, msg
    assert "drop, truncate or split that row" in ei.value.hint


def test_make_batch_pads_long_tailed_text_lengths_when_batches_are_random(tmp_path):
    rng = np.random.default_rng(1)
    lengths = np.minimum(rng.geometric(1 / 40, size=2000), 512)  # token counts up to a model's 512
    lengths[:3] = 512
    ds = data.Dataset({"ids": [np.ones(k, dtype=np.int64) for k in lengths]}, pd.DataFrame({"i": range(2000)}),
                      lengths.astype(np.int64), "mem://text")
    for _ in range(20):  # random batches, as the latency pools draw them
        feeds = make_batch(ds, rng.choice(2000, size=64), IDS)
        assert feeds["ids"].shape[0] == 64 and feeds["ids"].shape[1] <= 512
    feeds = make_batch(ds, np.arange(64), IDS)  # three 512-token rows among short ones: padded, not refused
    assert feeds["ids"].shape == (64, 512)


def test_make_batch_pads_to_a_fixed_length_the_spec_asks_for_even_when_large(tmp_path):
    ds = data.Dataset({"ids": [np.ones(k, dtype=np.int64) for k in (3, 5)]}, pd.DataFrame({"i": [0, 1]}),
                      np.array([3, 5]), "mem://fixed")
    feeds = make_batch(ds, np.arange(2), IDS, fixed_length=16)
    assert feeds["ids"].shape == (2, 16)
