"""Calibration coverage per slice: are the declared slices represented in the calibration sample?

Static INT8 sets each activation's range from the calibration rows only. A slice that is rare or absent there (a
long-tail class, unusually long inputs) is quantized with ranges that never saw it, which is one way the tail drifts
while the aggregate holds. `calibration_coverage` compares, per declared slice group, the calibration sample's share
with the validation set's share; `data.calibration.stratify_by` is the remedy when rare groups are missing.

Quantile slices get their edges from the validation and calibration rows together, so both sets are cut the same.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from tailguard.core.data import Dataset


def calibration_coverage(slices: list, calibration: Dataset, validation: Dataset) -> pd.DataFrame:
    """Rows and shares of each declared slice group in the calibration sample vs the validation set.

    Args:
        slices: the spec's `slices` (SliceSpec list).
        calibration: the calibration rows actually used (after max_samples / stratify_by).
        validation: the validation rows.

    Returns:
        DataFrame, one row per slice group (groups of `tailguard.core.slices.slice_groups` over both sets):
        slice, value (str), calibration_rows, validation_rows (int), calibration_share, validation_share (float in
        [0, 1], NaN for an empty set), coverage_ratio (calibration_share / validation_share; NaN when the group has
        no validation rows; 0 = the group is missing from calibration), missing (bool: validation rows but no
        calibration row). Columns a set does not have count as no rows.
    """
    from tailguard.core.slices import slice_groups

    slices = [s for s in slices if s.data_column is not None]  # derived slices: not computed on calibration rows
    cols = sorted({s.data_column for s in slices})
    n_cal, n_val = calibration.n_rows, validation.n_rows

    def part(ds: Dataset) -> pd.DataFrame:
        return pd.DataFrame({c: (ds.frame[c].to_numpy() if c in ds.frame.columns else np.full(ds.n_rows, None))
                             for c in cols}, index=range(ds.n_rows))

    both = pd.concat([part(calibration), part(validation)], ignore_index=True)
    is_cal = np.arange(len(both)) < n_cal
    records = []
    for g in slice_groups(both, slices) if cols else []:
        c_rows, v_rows = int((g.mask & is_cal).sum()), int((g.mask & ~is_cal).sum())
        c_share = c_rows / n_cal if n_cal else float("nan")
        v_share = v_rows / n_val if n_val else float("nan")
        records.append({"slice": g.slice, "value": g.value, "calibration_rows": c_rows, "validation_rows": v_rows,
                        "calibration_share": c_share, "validation_share": v_share,
                        "coverage_ratio": c_share / v_share if v_rows else float("nan"),
                        "missing": bool(v_rows and not c_rows)})
    return pd.DataFrame.from_records(records, columns=[
        "slice", "value", "calibration_rows", "validation_rows", "calibration_share", "validation_share",
        "coverage_ratio", "missing"])
