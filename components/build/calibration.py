"""Static INT8 calibration: the calibration rows as ONNX Runtime's data reader, the ranges (memoized per process)
and the `quantize_static` call that uses them.

`calibrate_ranges` runs ORT's calibrators itself (so the spec's num_bins reaches the histogram methods) and
`_memoized_calibration` keeps the ranges per `calibration_key`, so a search's static trials of one variant
calibrate once; `_write_calibration` saves the exact rows beside the artifact for `reproduce.sh`.
"""

from __future__ import annotations

import inspect
import json
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from tailguard.components.build.onnx_files import _graph, _has_contrib_ops, _jsonable, _large, _quant_type

if TYPE_CHECKING:  # tailguard.core.data imports pandas: a build that reads no calibration rows never loads it
    from tailguard.core.data import Dataset
    from tailguard.core.spec.model import ModelSpec, TensorSpec
    from tailguard.core.spec.variants import QuantizationSpec


class DatasetCalibrationReader:
    """`onnxruntime.quantization.CalibrationDataReader` over a tailguard Dataset.

    Yields feeds {input name: array (batch, sequence, ...)} in length-sorted batches of `batch_size` rows,
    padded per batch with `model.pad_values`, or all to `fixed_length` and to exactly `batch_size` rows
    (`equal_batches`: the last batch is filled with the first rows again), which ORT's histogram calibrators
    need when they stack every batch into one array.

    Args:
        ds: calibration rows.
        input_specs: `model.inputs`.
        batch_size: rows per batch.
        pad_values: pad value per input (default 0).
        fixed_length: pad every row to this length (None: the longest row of each batch).
        equal_batches: make every batch exactly `batch_size` rows.
        input_names: only these inputs are fed (the graph's inputs).
    """

    def __init__(self, ds: Dataset, input_specs: list[TensorSpec], batch_size: int, *,
                 pad_values: dict[str, float] | None = None, fixed_length: int | None = None,
                 equal_batches: bool = False, input_names: list[str] | None = None) -> None:
        self.ds, self.specs = ds, [s for s in input_specs if input_names is None or s.name in input_names]
        from tailguard.core.data import batch_indices

        self.batch_size, self.pad_values, self.fixed_length = batch_size, pad_values or {}, fixed_length
        self.batches = batch_indices(ds, batch_size)
        if equal_batches and self.batches and len(self.batches[-1]) < batch_size:
            need = batch_size - len(self.batches[-1])
            fill = np.resize(np.concatenate(self.batches), need)
            self.batches[-1] = np.concatenate([self.batches[-1], fill])
        self._it: Iterator[np.ndarray] = iter(self.batches)

    def get_next(self) -> dict[str, np.ndarray] | None:
        """The next batch of feeds, or None at the end."""
        from tailguard.core.data import make_batch

        idx = next(self._it, None)
        if idx is None:
            return None
        return make_batch(self.ds, idx, self.specs, pad_values=self.pad_values, fixed_length=self.fixed_length)

    def rewind(self) -> None:
        """Start again from the first batch."""
        self._it = iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _calibration_cache_supported() -> bool:
    """quantize_static takes precomputed ranges (calibration_cache_path) in onnxruntime >= 1.2x builds that have
    it; then tailguard runs the histogram calibrators itself, with the spec's num_bins."""
    from onnxruntime.quantization import quantize_static

    return "calibration_cache_path" in inspect.signature(quantize_static).parameters


def _quantize_static(q: QuantizationSpec, src: Path, dst: Path, excluded: list[str], calibration: Dataset,
                     model: ModelSpec, batch_size: int, tmp: Path, details: dict[str, Any]) -> None:
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, quantize_static

    method = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
              "percentile": CalibrationMethod.Percentile}[q.calibration_method]
    graph_inputs = [i.name for i in _graph(src).graph.input]
    extra: dict[str, Any] = {}
    if _has_contrib_ops(src):
        extra["DefaultTensorType"] = onnx.TensorProto.FLOAT  # see _quantize_dynamic
    calib_info: dict[str, Any] = {"method": q.calibration_method, "rows": calibration.n_rows,
                                  "batch_size": batch_size}
    kwargs: dict[str, Any] = {}
    if q.calibration_method == "percentile":
        extra["CalibPercentile"] = q.percentile
        calib_info["percentile"] = q.percentile
    if _calibration_cache_supported():
        # tailguard calibrates (calibrate_ranges) and hands the ranges over as a calibration cache: the ranges
        # are memoized per process (a search's static trials of one variant calibrate once), and quantize_static
        # does not forward num_bins to the histogram calibrators (onnxruntime/quantization/quantize.py passes only
        # CalibTensorRangeSymmetric/MovingAverage/MaxIntermediateOutputs/Percentile), which create_calibrator
        # (extra_options={"num_bins": ...}) gets here. One collect_data call per batch for the histogram methods:
        # they stack the batches of one call into one array, which fails on variable-length batches.
        cache = tmp / "calibration_cache.json"
        n_batches, reused = _memoized_calibration(src, q, method, calibration, model, batch_size, graph_inputs,
                                                  cache, tmp)
        kwargs["calibration_cache_path"] = str(cache)
        calib_info.update(batches=n_batches, padding="per batch", ranges_reused=reused)
        if q.calibration_method != "minmax":
            calib_info.update(num_bins=q.num_bins, num_bins_applied=True)
    elif q.calibration_method == "minmax":
        reader = DatasetCalibrationReader(calibration, model.inputs, batch_size, pad_values=model.pad_values,
                                          input_names=graph_inputs)
        kwargs["calibration_data_reader"] = reader
        calib_info.update(batches=len(reader), padding="per batch")
    else:
        fixed = int(calibration.lengths.max())
        reader = DatasetCalibrationReader(calibration, model.inputs, batch_size, pad_values=model.pad_values,
                                          fixed_length=fixed, equal_batches=True, input_names=graph_inputs)
        kwargs["calibration_data_reader"] = reader
        calib_info.update(batches=len(reader), padding=f"fixed length {fixed}", num_bins=q.num_bins,
                          num_bins_applied=False,
                          note="this onnxruntime's quantize_static cannot take num_bins; its default was used")
    quantize_static(str(src), str(dst), quant_format=QuantFormat.QDQ if q.format == "qdq" else QuantFormat.QOperator,
                    op_types_to_quantize=q.op_types or None, per_channel=q.per_channel, reduce_range=q.reduce_range,
                    activation_type=_quant_type(q.activation_type), weight_type=_quant_type(q.weight_type),
                    nodes_to_exclude=excluded, use_external_data_format=_large(src), calibrate_method=method,
                    calibration_providers=["CPUExecutionProvider"], extra_options=extra, **kwargs)
    details["calibration"] = calib_info
    details["quantization"] = {"mode": "static", "format": q.format, "per_channel": q.per_channel,
                               "reduce_range": q.reduce_range, "weight_type": q.weight_type,
                               "activation_type": q.activation_type, "op_types": q.op_types or "all supported",
                               "extra_options": _jsonable(extra)}


# Calibration ranges memoized per process: {key: (TensorsData, batches)}, least recently used first.
_RANGES: "OrderedDict[str, tuple[Any, int]]" = OrderedDict()


_RANGES_MAX = 8  # entries kept (a search's variants x calibration methods); histograms are num_bins per tensor


def calibration_key(src: Path, q: QuantizationSpec, calibration: "Dataset", model: ModelSpec, batch_size: int) -> str:
    """SHA-256 over what the calibration ranges of `src` depend on: the graph given to the quantizer (bytes of
    `src`, after graph optimization and quant_pre_process), the method, num_bins (histogram methods), percentile
    (percentile), op_types, the calibration rows (every input array's dtype, shape and bytes, in row order), the
    batch size and pad values (they shape the batches) and the model inputs' names and dtypes. Not in it:
    exclude_nodes, per_channel, reduce_range, weight/activation types and format, which ORT applies after
    calibration (create_calibrator sees only the graph, op_types and the method's options)."""
    import hashlib

    h = hashlib.sha256()
    with open(src, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    meta = {"method": q.calibration_method, "op_types": sorted(q.op_types or []), "batch_size": batch_size,
            "num_bins": q.num_bins if q.calibration_method != "minmax" else None,
            "percentile": q.percentile if q.calibration_method == "percentile" else None,
            "pad_values": dict(sorted((model.pad_values or {}).items())),
            "inputs": [(s.name, str(s.dtype)) for s in model.inputs]}
    h.update(json.dumps(meta, sort_keys=True, default=str).encode())
    for s in model.inputs:
        for arr in calibration.inputs.get(s.name, []):
            a = np.ascontiguousarray(arr)
            h.update(f"{s.name}|{a.dtype.str}|{a.shape}".encode())
            h.update(a.tobytes())
    return h.hexdigest()


def _memoized_calibration(src: Path, q: QuantizationSpec, method: Any, calibration: "Dataset", model: ModelSpec,
                          batch_size: int, graph_inputs: list[str], cache: Path, tmp: Path) -> tuple[int, bool]:
    """Write the calibration ranges of `src` to `cache` (an ORT calibration cache, `save_tensors_data`): from the
    process memo when `calibration_key` matches an earlier calibration, else from `calibrate_ranges`.
    Graphs with external data (> 2 GB) are not memoized. Returns (batches, reused)."""
    from onnxruntime.quantization.calibrate import save_tensors_data

    key = None if _large(src) else calibration_key(src, q, calibration, model, batch_size)
    if key is not None and key in _RANGES:
        _RANGES.move_to_end(key)
        ranges, n_batches = _RANGES[key]
        save_tensors_data(ranges, cache)
        return n_batches, True
    ranges, n_batches = calibrate_ranges(src, q, method, calibration, model, batch_size, graph_inputs, tmp)
    save_tensors_data(ranges, cache)
    if key is not None:
        _RANGES[key] = (ranges, n_batches)
        while len(_RANGES) > _RANGES_MAX:
            _RANGES.popitem(last=False)
    return n_batches, False


def calibrate_ranges(src: Path, q: QuantizationSpec, method: Any, calibration: "Dataset", model: ModelSpec,
                     batch_size: int, graph_inputs: list[str], tmp: Path) -> tuple[Any, int]:
    """Calibrate `src` on the calibration rows: ORT's `create_calibrator` (op_types, `method`, num_bins /
    percentile for the histogram methods) fed length-sorted batches of `batch_size` rows padded per batch.
    Min-max gets every batch in one collect_data call (as quantize_static does; the per-batch reductions are
    merged with nanmin / nanmax); the histogram methods one call per batch (their histograms merge across calls,
    while one call stacks its batches into one array, which fails on variable-length batches).

    Returns:
        (TensorsData: {tensor name: range}, batches). The seam that counts calibrations.
    """
    from onnxruntime.quantization.calibrate import create_calibrator

    from tailguard.core.data import make_batch

    extra: dict[str, Any] = {}
    if q.calibration_method != "minmax":
        extra["num_bins"] = q.num_bins
    if q.calibration_method == "percentile":
        extra["percentile"] = q.percentile
    calibrator = create_calibrator(src, q.op_types or None, augmented_model_path=str(tmp / "augmented.onnx"),
                                   calibrate_method=method, use_external_data_format=_large(src),
                                   providers=["CPUExecutionProvider"], extra_options=extra)
    reader = DatasetCalibrationReader(calibration, model.inputs, batch_size, pad_values=model.pad_values,
                                      input_names=graph_inputs)
    if q.calibration_method == "minmax":
        calibrator.collect_data(reader)
    else:
        for idx in reader.batches:
            calibrator.collect_data(_OneBatch(make_batch(calibration, idx, reader.specs,
                                                         pad_values=reader.pad_values)))
    return calibrator.compute_data(), len(reader.batches)


class _OneBatch:
    """A calibration data reader of exactly one batch."""

    def __init__(self, feeds: dict[str, np.ndarray]) -> None:
        self.feeds: dict[str, np.ndarray] | None = feeds

    def get_next(self) -> dict[str, np.ndarray] | None:
        feeds, self.feeds = self.feeds, None
        return feeds


def _write_calibration(calibration: Dataset | None, model: ModelSpec, out: Path) -> None:
    """Keep the exact calibration rows beside the variant (reproduce.sh reads them)."""
    if calibration is None:
        return
    import pandas as pd

    frame = pd.DataFrame({s.name: [np.asarray(a).tolist() for a in calibration.inputs[s.name]]
                          for s in model.inputs if s.name in calibration.inputs})
    for c in calibration.frame.columns:
        if c not in frame.columns:
            frame[c] = calibration.frame[c].to_numpy()
    frame.to_parquet(out / "calibration.parquet")
