"""Static INT8 calibration ranges are computed once per graph, method and calibration rows, and reused by every
build that differs only in what ORT applies after calibration (excluded nodes, per_channel): a search's static
trials calibrate once per calibration method (components/build/calibration.py `calibration_key`).

Real ONNX Runtime calibration and quantization throughout. The one seam: `calibration.calibrate_ranges` is wrapped
(it still runs) to count the calibrations.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from tailguard.components.build import calibration
from tailguard.components.build.logic import build_variant
from tailguard.components.search.logic import run_search
from tailguard.components.validate.logic import validate_variant
from tailguard.core.runtime import OrtRunner, run_dataset
from tailguard.core.spec.variants import VariantSpec
from tests.helpers.search_models import mlp_dataset, mlp_spec, mlp_variant, planted_mlp
from tests.helpers.tiny_models import export_tiny, tiny_dataset

MATMULS = ["MatMul", "Gemm"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(ModelSpec, fp32 .onnx path, 24 calibration rows of variable length)."""
    _, spec, path = export_tiny(tmp_path_factory.mktemp("fp32"))
    return spec, path, tiny_dataset(24, min_len=3, max_len=12)


@pytest.fixture
def calibrations(monkeypatch):
    """A list that grows by one entry (the calibration method) per real calibration; the memo starts empty."""
    monkeypatch.setattr(calibration, "_RANGES", type(calibration._RANGES)())
    calls: list[str] = []
    real = calibration.calibrate_ranges

    def counting(src, q, *args, **kwargs):
        calls.append(q.calibration_method)
        return real(src, q, *args, **kwargs)

    monkeypatch.setattr(calibration, "calibrate_ranges", counting)
    return calls


def _build(tiny, out, calibration=None, **quantization):
    spec, path, rows = tiny
    variant = VariantSpec.model_validate({"name": out.name, "backend": "onnxruntime", "precision": "int8",
                                         "quantization": {"mode": "static", "op_types": MATMULS, **quantization}})
    res = build_variant(variant, path, out, calibration=rows if calibration is None else calibration, model=spec)
    assert res.status == "ok", res.reason
    return res


def _scales(artifact) -> dict[str, np.ndarray]:
    """Every activation / weight scale and zero point of a QDQ model, by initializer name."""
    model = onnx.load(str(artifact))
    return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer
            if t.name.endswith(("_scale", "_zero_point"))}


def test_build_variant_calibrates_once_when_static_builds_differ_only_in_excluded_nodes_and_per_channel(
        tiny, tmp_path, calibrations):
    first = _build(tiny, tmp_path / "a", calibration_method="minmax")
    excluded = _build(tiny, tmp_path / "b", calibration_method="minmax", exclude_nodes=["/l2/MatMul"])
    per_channel = _build(tiny, tmp_path / "c", calibration_method="minmax", per_channel=True)
    assert calibrations == ["minmax"]
    assert [r.details["calibration"]["ranges_reused"] for r in (first, excluded, per_channel)] == [False, True, True]
    assert "/l2/MatMul" in excluded.details["excluded_nodes"]


def test_build_variant_calibrates_again_when_the_method_num_bins_or_calibration_rows_change(tiny, tmp_path,
                                                                                            calibrations):
    _build(tiny, tmp_path / "a", calibration_method="minmax")
    _build(tiny, tmp_path / "b", calibration_method="percentile", num_bins=256)
    _build(tiny, tmp_path / "c", calibration_method="percentile", num_bins=256, per_channel=True)  # reused
    _build(tiny, tmp_path / "d", calibration_method="percentile", num_bins=512)
    _build(tiny, tmp_path / "e", calibration_method="percentile", num_bins=512, percentile=99.9)
    fewer = tiny[2].subset(np.arange(20))
    _build(tiny, tmp_path / "f", calibration=fewer, calibration_method="minmax")
    assert calibrations == ["minmax", "percentile", "percentile", "percentile", "minmax"]


def test_reused_ranges_give_the_same_scales_as_a_fresh_calibration_when_a_build_is_repeated(tiny, tmp_path,
                                                                                              calibrations):
    _build(tiny, tmp_path / "first", calibration_method="percentile", num_bins=256)
    reused = _build(tiny, tmp_path / "reused", calibration_method="percentile", num_bins=256,
                    exclude_nodes=["/l2/MatMul"])
    calibration._RANGES.clear()
    fresh = _build(tiny, tmp_path / "fresh", calibration_method="percentile", num_bins=256,
                   exclude_nodes=["/l2/MatMul"])
    assert calibrations == ["percentile", "percentile"] and reused.details["calibration"]["ranges_reused"]
    a, b = _scales(reused.artifact), _scales(fresh.artifact)
    assert a.keys() == b.keys() and a
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_minmax_ranges_match_onnxruntimes_own_calibration_when_tailguard_calibrates(tiny, tmp_path, calibrations,
                                                                                      monkeypatch):
    ours = _build(tiny, tmp_path / "ours", calibration_method="minmax")
    # Narrow seam: the ORT version probe; False makes quantize_static calibrate itself from the reader.
    monkeypatch.setattr(calibration, "_calibration_cache_supported", lambda: False)
    theirs = _build(tiny, tmp_path / "theirs", calibration_method="minmax")
    assert calibrations == ["minmax"] and "ranges_reused" not in theirs.details["calibration"]
    a, b = _scales(ours.artifact), _scales(theirs.artifact)
    assert a.keys() == b.keys() and a
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, err_msg=name)


def test_run_search_calibrates_once_per_calibration_method_when_static_trials_share_the_variant(tmp_path,
                                                                                               calibrations):
    fp32 = planted_mlp(tmp_path / "mlp.onnx")
    rows, validation = mlp_dataset(32, seed=1), mlp_dataset(64, seed=7)
    space = {"exclude_most_sensitive": [0, 1], "per_channel": [False], "calibration_methods": ["minmax", "percentile"],
             "float_op_types": [[]]}
    variant = mlp_variant(mode="static", op_types=["MatMul"], search={"space": space, "when": "always"})
    spec = mlp_spec(variant, min_cosine=0.95)
    reference = run_dataset(OrtRunner(fp32), validation, spec.model.inputs, batch_size=16)

    def evaluate(trial_variant, model_path):
        return validate_variant(spec, variant.name, OrtRunner(model_path), reference, validation,
                                tmp_path / "eval" / trial_variant.name, model_path=model_path)

    res = run_search(spec, variant, fp32, tmp_path / "search", calibration=rows, sensitivity_data=rows,
                     evaluate=evaluate)
    assert len(res.trials) == 4 and all(t.status == "ok" for t in res.trials)
    assert sorted(calibrations) == ["minmax", "percentile"]
