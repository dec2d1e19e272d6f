"""TensorRT engines and ONNX Runtime's GPU execution providers (components/build/builders/tensorrt.py), on CPU.

This machine has no GPU and no TensorRT (neither has the GPU machine the project is lent now and then), so what is
tested here is everything around the GPU call, by the arguments it would be given (STYLE.md item 13):
- the optimization profile from the spec's named axes, the batch sizes and the data's lengths; the TensorRT EP's
  provider options; the engine build config (flags, pools, profiles, calibration and its cache key);
- the calibration batches (order, padding, the end) and the calibration cache file;
- the plan written before its manifest, and refused when it changed (real files, real sha256);
- the "skipped, with the reason" paths of a node without GPU / TensorRT / onnxruntime-gpu, end to end through the
  build-variant task.

Stand-ins, each at one seam and said where: `FakeTRT`, a stand-in for the `tensorrt` module, records the calls
`configure_builder` and `make_calibrator` make (the real module cannot be imported here); `build=` replaces the GPU
build `_build_serialized` by a function returning fixed bytes; `probe=` replaces the node's device facts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tailguard.components.build import profiles
from tailguard.components.build.builders import tensorrt as tb
from tailguard.components.build.engine import calibration_cache_key, fingerprint, verify_engine
from tailguard.core.artifacts import ArtifactMismatchError, manifest_path
from tailguard.core.data import Dataset, make_batch
from tailguard.core.errors import InputError, MissingDependencyError
from tailguard.core.spec.model import TensorSpec
from tailguard.core.spec.variants import VariantSpec
from tests.core.test_results import store  # noqa: F401 (fixture: sqlite MLflow store, experiment, parent run)

H100 = {"tensorrt_version": "10.8.0", "device_name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0",
        "cuda_version": "12.8"}
INPUTS = [TensorSpec(name="input_ids", dtype="int64", shape=["batch", "sequence"]),
          TensorSpec(name="attention_mask", dtype="int64", shape=["batch", "sequence"])]


class Model:
    """The slice of ModelSpec the build reads."""

    inputs = INPUTS
    pad_values = {"input_ids": 7}


def rows(lengths, *, offset: int = 1) -> Dataset:
    """Rows whose token ids are offset+row index (so a batch shows which rows it holds), mask ones."""
    ids = [np.full(n, offset + i, dtype=np.int64) for i, n in enumerate(lengths)]
    mask = [np.ones(n, dtype=np.int64) for n in lengths]
    return Dataset({"input_ids": ids, "attention_mask": mask}, pd.DataFrame({"n": lengths}),
                   np.asarray(lengths, dtype=np.int64), "memory://rows")


def variant(**kw) -> VariantSpec:
    return VariantSpec.model_validate({"name": "trt", "backend": "tensorrt", "precision": "fp16", **kw})


# --------------------------------------------------------------------------------------------- profile
def test_optimization_profile_spans_the_batches_and_the_longest_row_when_the_spec_sets_no_bounds():
    p = profiles.optimization_profile(INPUTS, batch_sizes=[1, 32, 16], opt_batch=1, validation=rows([3, 5, 9, 12]))
    assert p["input_ids"] == {"min": [1, 1], "opt": [1, 7], "max": [32, 12]}  # median of 3,5,9,12 = 7
    assert p["attention_mask"] == p["input_ids"]  # one named axis shared by both inputs


def test_optimization_profile_keeps_fixed_axes_and_takes_the_spec_bounds_when_set():
    specs = [TensorSpec(name="frames", dtype="float32", shape=["batch", "time", 80])]
    ds = Dataset({"frames": [np.zeros((n, 80), np.float32) for n in (4, 10)]}, pd.DataFrame({"n": [4, 10]}),
                 np.asarray([4, 10]), "memory://frames")
    p = profiles.optimization_profile(specs, batch_sizes=[1, 8], opt_batch=8, validation=ds, max_batch_size=64,
                                max_lengths={"time": 100})
    assert p["frames"] == {"min": [1, 1, 80], "opt": [8, 7, 80], "max": [64, 100, 80]}


@pytest.mark.parametrize("kw,match", [
    ({"max_batch_size": 16}, r"tensorrt\.max_batch_size: 16 is below batch size 32"),
    ({"max_lengths": {"sequence": 10}}, r"tensorrt\.max_lengths\.sequence: 10 is below the longest data row \(12\)"),
    ({"max_lengths": {"seq": 64}}, r"tensorrt\.max_lengths: seq is not a named axis of model\.inputs"),
])
def test_optimization_profile_names_the_field_when_the_spec_bound_is_too_small_or_unknown(kw, match):
    with pytest.raises(InputError, match=match):
        profiles.optimization_profile(INPUTS, batch_sizes=[1, 32], opt_batch=1, validation=rows([3, 12]), **kw)


def test_profile_strings_follow_the_tensorrt_ep_format_when_given_a_profile():
    p = profiles.optimization_profile(INPUTS, batch_sizes=[1, 32], opt_batch=1, validation=rows([4, 12]))
    assert profiles.profile_strings(p) == {"trt_profile_min_shapes": "input_ids:1x1,attention_mask:1x1",
                                     "trt_profile_opt_shapes": "input_ids:1x8,attention_mask:1x8",
                                     "trt_profile_max_shapes": "input_ids:32x12,attention_mask:32x12"}


# ---------------------------------------------------------------------------------- ORT GPU providers
def test_ort_providers_enable_fp16_caches_and_the_profile_when_on_the_tensorrt_ep():
    v = VariantSpec.model_validate({"name": "ort-trt", "backend": "onnxruntime", "precision": "fp16",
                                    "execution_provider": "TensorrtExecutionProvider",
                                    "tensorrt": {"workspace_mib": 2048, "builder_optimization_level": 5}})
    profile = profiles.optimization_profile(INPUTS, batch_sizes=[1, 32], opt_batch=1, validation=rows([4, 12]))
    (trt_name, trt), (cuda_name, cuda) = profiles.ort_providers(v, profile)
    assert (trt_name, cuda_name, cuda) == ("TensorrtExecutionProvider", "CUDAExecutionProvider", {"device_id": 0})
    assert trt["trt_fp16_enable"] is True and trt["trt_int8_enable"] is False
    assert trt["trt_engine_cache_enable"] is True and trt["trt_engine_cache_path"] == "trt_cache/engines"
    assert trt["trt_timing_cache_enable"] is True and trt["trt_timing_cache_path"] == "trt_cache/timing"
    assert trt["trt_max_workspace_size"] == 2048 << 20 and trt["trt_builder_optimization_level"] == 5
    assert trt["trt_profile_max_shapes"] == "input_ids:32x12,attention_mask:32x12"
    json.dumps([trt, cuda])  # recorded in build.json


@pytest.mark.parametrize("ep,precision,expected", [
    ("TensorrtExecutionProvider", "int8", {"trt_int8_enable": True, "trt_fp16_enable": False}),
    ("CUDAExecutionProvider", "fp16", None),
    ("CPUExecutionProvider", "fp32", None),
])
def test_ort_providers_match_the_execution_provider_when_built(ep, precision, expected):
    q = {"quantization": {"mode": "static"}} if precision == "int8" else {}
    v = VariantSpec.model_validate({"name": "v", "backend": "onnxruntime", "precision": precision,
                                    "execution_provider": ep, **q})
    got = profiles.ort_providers(v, None)
    if expected is None:
        assert got == [[ep, {"device_id": 0} if ep == "CUDAExecutionProvider" else {}]]
    else:
        assert {k: got[0][1][k] for k in expected} == expected and "trt_profile_min_shapes" not in got[0][1]


def test_variant_spec_refuses_the_tensorrt_section_when_the_variant_runs_on_the_cpu_provider():
    with pytest.raises(ValueError, match="tensorrt applies to backend tensorrt or to execution_provider "
                                         "TensorrtExecutionProvider"):
        VariantSpec.model_validate({"name": "v", "backend": "onnxruntime", "precision": "fp32",
                                    "tensorrt": {"workspace_mib": 1}})


# ------------------------------------------------------------------------------------------ build config
def test_engine_build_config_sets_fp16_and_the_profile_when_precision_is_fp16():
    profile = profiles.optimization_profile(INPUTS, batch_sizes=[1, 32], opt_batch=1, validation=rows([4, 12]))
    cfg = tb.engine_build_config(variant(tensorrt={"workspace_mib": 512}), profile, tensorrt_version="10.8.0",
                                 onnx_sha256="ab" * 32)
    assert cfg["builder_flags"] == ["FP16"] and cfg["network_flags"] == []
    assert cfg["memory_pool_limits"] == {"WORKSPACE": 512 << 20} and cfg["profiles"] == [profile]
    assert cfg["calibration"] is None and cfg["timing_cache"] is True


def test_engine_build_config_keys_the_calibration_cache_by_rows_and_shapes_when_precision_is_int8():
    calib = rows([3, 5, 9, 12, 4])
    profile = profiles.optimization_profile(INPUTS, batch_sizes=[1, 32], opt_batch=1, validation=calib)
    cfg = tb.engine_build_config(variant(precision="int8"), profile, tensorrt_version="10.8.0",
                                 onnx_sha256="ab" * 32, calibration=calib, model=Model, calibration_batch_size=2)
    c = cfg["calibration"]
    assert cfg["builder_flags"] == ["INT8", "FP16"]
    assert c["algorithm"] == "entropy2" and c["batches"] == 3 and c["rows"] == 5
    assert c["shapes"] == {"input_ids": [2, 12], "attention_mask": [2, 12]}
    assert c["cache_key"] == calibration_cache_key(
        onnx_sha256="ab" * 32, calibration_sha256=tb.dataset_sha256(calib, INPUTS), calibrator="entropy2",
        batch_size=2, tensorrt_version="10.8.0", input_shapes=c["shapes"])
    other = tb.engine_build_config(variant(precision="int8"), profile, tensorrt_version="10.8.0",
                                   onnx_sha256="ab" * 32, calibration=rows([3, 5, 9, 12, 4], offset=2), model=Model,
                                   calibration_batch_size=2)
    assert other["calibration"]["cache_key"] != c["cache_key"]  # other rows: other scales, never the stale file


def test_engine_build_config_refuses_int8_when_there_are_no_calibration_rows():
    profile = profiles.optimization_profile(INPUTS, batch_sizes=[1], opt_batch=1, validation=rows([4]))
    with pytest.raises(InputError, match="INT8 on backend tensorrt calibrates on data.calibration"):
        tb.engine_build_config(variant(precision="int8"), profile, tensorrt_version="10.8.0", onnx_sha256="ab")


# ------------------------------------------------------------------------------------------ calibration
def test_calibration_batches_feed_length_sorted_padded_batches_then_none_when_iterated():
    calib = rows([9, 3, 12, 5, 4])  # ids: row i holds the value i + 1
    b = tb.CalibrationBatches(calib, INPUTS, 2, pad_values={"input_ids": 7})
    assert [list(x) for x in b.batches] == [[1, 4], [3, 0], [2, 1]]  # lengths 3,4 | 5,9 | 12 + the first row again
    got = []
    while (batch := b.next(["attention_mask", "input_ids"])) is not None:
        got.append(batch)
    assert len(got) == 3 and b.next(["input_ids"]) is None
    for (mask, ids), idx in zip(got, b.batches):
        assert ids.shape == mask.shape == (2, 12) and ids.dtype == np.int64  # one fixed shape: the longest row
        ref = make_batch(calib, idx, INPUTS, pad_values={"input_ids": 7})  # padded like make_batch ...
        n = ref["input_ids"].shape[1]
        assert np.array_equal(ids[:, :n], ref["input_ids"]) and np.array_equal(mask[:, :n], ref["attention_mask"])
        assert (ids[:, n:] == 7).all() and (mask[:, n:] == 0).all()  # ... and on to the fixed length
    assert list(got[0][1][0][:5]) == [2, 2, 2, 7, 7]  # row 1 (length 3) first, padded with input_ids' pad value
    b.rewind()
    assert b.next(["input_ids"]) is not None


def test_calibration_batches_name_the_input_when_the_network_has_one_the_spec_lacks():
    b = tb.CalibrationBatches(rows([3]), INPUTS, 1)
    with pytest.raises(InputError, match="token_type_ids"):
        b.next(["input_ids", "token_type_ids"])


def test_calibration_cache_reads_back_what_was_written_under_its_key_when_present(tmp_path):
    cache = tb.CalibrationCache(tmp_path / "calibration", "k" * 32)
    assert cache.read() is None and cache.path.name == "k" * 32 + ".cache"
    cache.write(b"TRT-8601-EntropyCalibration2\ninput_ids: 3c010a14\n")
    assert tb.CalibrationCache(tmp_path / "calibration", "k" * 32).read().startswith(b"TRT-")
    assert tb.CalibrationCache(tmp_path / "calibration", "j" * 32).read() is None  # another key: calibrate again


class FakeTRT:
    """Stand-in for the `tensorrt` module (not importable here): records what configure_builder / make_calibrator
    ask of it. Its classes mimic the Python API's names only."""

    class IInt8EntropyCalibrator2:
        def __init__(self) -> None:
            self.base_initialised = True

    class ILogger:
        pass

    class BuilderFlag:
        FP16, INT8 = "BuilderFlag.FP16", "BuilderFlag.INT8"

    class MemoryPoolType:
        WORKSPACE = "MemoryPoolType.WORKSPACE"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def builder(self) -> "FakeTRT._Builder":
        return FakeTRT._Builder(self.calls)

    class _Recorder:
        def __init__(self, calls: list, name: str) -> None:
            self._calls, self._name = calls, name

        def __getattr__(self, attr: str):
            return lambda *a, **k: self._calls.append((f"{self._name}.{attr}", a, k)) or self

        def __setattr__(self, attr: str, value) -> None:
            if attr.startswith("_"):
                object.__setattr__(self, attr, value)
            else:
                self._calls.append((f"{self._name}.{attr} =", (value,), {}))

    class _Builder:
        def __init__(self, calls: list) -> None:
            self.calls, self.profiles = calls, 0

        def create_builder_config(self):
            return FakeTRT._Recorder(self.calls, "config")

        def create_optimization_profile(self):
            self.profiles += 1
            return FakeTRT._Recorder(self.calls, f"profile{self.profiles}")


def test_make_calibrator_returns_device_pointers_in_the_order_of_names_then_none_when_fed(tmp_path):
    # stand-in tensorrt module (FakeTRT) and device copies (to_device records the arrays): no GPU here
    copies = []

    def to_device(name, host):
        copies.append((name, host.copy()))
        return 1000 + len(copies)

    cache = tb.CalibrationCache(tmp_path, "key")
    cal = tb.make_calibrator(FakeTRT, tb.CalibrationBatches(rows([3, 5, 4]), INPUTS, 2), cache, to_device)
    assert isinstance(cal, FakeTRT.IInt8EntropyCalibrator2) and cal.base_initialised and cal.get_batch_size() == 1
    assert cal.get_batch(["attention_mask", "input_ids"]) == [1001, 1002]
    assert [n for n, _ in copies] == ["attention_mask", "input_ids"] and copies[1][1].shape == (2, 5)
    assert cal.get_batch(["attention_mask", "input_ids"]) == [1003, 1004]
    assert cal.get_batch(["attention_mask", "input_ids"]) is None and cal.fed == 2
    assert cal.read_calibration_cache() is None
    cal.write_calibration_cache(memoryview(b"scales"))
    assert cal.read_calibration_cache() == b"scales" and cache.path.read_bytes() == b"scales"


def test_make_calibrator_ends_calibration_and_keeps_the_error_when_feeding_fails(tmp_path):
    # stand-in tensorrt module (FakeTRT): an exception must not unwind through TensorRT's C++ caller
    cal = tb.make_calibrator(FakeTRT, tb.CalibrationBatches(rows([3]), INPUTS, 1), tb.CalibrationCache(tmp_path, "k"),
                             lambda name, host: 1)
    assert cal.get_batch(["input_ids", "token_type_ids"]) is None
    assert isinstance(cal.error, InputError) and "token_type_ids" in str(cal.error) and cal.fed == 0


def test_configure_builder_applies_flags_pool_profiles_calibration_and_timing_cache_when_int8():
    # stand-in tensorrt module (FakeTRT): records the IBuilderConfig / IOptimizationProfile calls; no TensorRT here
    calib = rows([3, 5, 12])
    profile = profiles.optimization_profile(INPUTS, batch_sizes=[1, 32], opt_batch=1, validation=calib)
    cfg = tb.engine_build_config(variant(precision="int8", tensorrt={"workspace_mib": 64,
                                                                      "builder_optimization_level": 4}),
                                 profile, tensorrt_version="10.8.0", onnx_sha256="ab", calibration=calib,
                                 model=Model, calibration_batch_size=2)
    trt = FakeTRT()
    calibrator = object()
    tb.configure_builder(trt, trt.builder(), None, cfg, calibrator=calibrator, timing_cache=b"old-cache")
    calls = [(name, args, kw) for name, args, kw in trt.calls]
    assert ("config.set_flag", ("BuilderFlag.INT8",), {}) in calls
    assert ("config.set_flag", ("BuilderFlag.FP16",), {}) in calls
    assert ("config.set_memory_pool_limit", ("MemoryPoolType.WORKSPACE", 64 << 20), {}) in calls
    assert ("config.builder_optimization_level =", (4,), {}) in calls
    assert ("profile1.set_shape", ("input_ids", (1, 1), (1, 5), (32, 12)), {}) in calls
    assert ("config.add_optimization_profile",) == calls[[c[0] for c in calls].index(
        "config.add_optimization_profile")][:1]
    assert ("config.int8_calibrator =", (calibrator,), {}) in calls
    assert ("profile2.set_shape", ("input_ids", (2, 12), (2, 12), (2, 12)), {}) in calls  # calibration profile
    assert [c[0] for c in calls].count("config.set_calibration_profile") == 1
    assert ("config.create_timing_cache", (b"old-cache",), {}) in calls
    assert ("config.set_timing_cache", calls[[c[0] for c in calls].index("config.set_timing_cache")][1],
            {"ignore_mismatch": False}) in calls


def test_configure_builder_sets_no_precision_flag_when_fp32():
    trt = FakeTRT()
    profile = profiles.optimization_profile(INPUTS, batch_sizes=[1], opt_batch=1, validation=rows([4]))
    tb.configure_builder(trt, trt.builder(), None, tb.engine_build_config(
        variant(precision="fp32"), profile, tensorrt_version="10.8.0", onnx_sha256="ab"))
    names = [c[0] for c in trt.calls]
    assert "config.set_flag" not in names and "config.int8_calibrator =" not in names
    assert "config.set_memory_pool_limit" not in names and "config.create_timing_cache" in names


# ---------------------------------------------------------------------------------- the engine build
@pytest.fixture
def onnx_file(tmp_path):
    f = tmp_path / "model.onnx"
    f.write_bytes(b"an onnx model")
    return f


def _profile():
    return profiles.optimization_profile(INPUTS, batch_sizes=[1, 32], opt_batch=1, validation=rows([4, 12]))


def test_build_tensorrt_engine_writes_the_plan_then_its_manifest_when_the_gpu_build_succeeds(
        onnx_file, tmp_path, monkeypatch):
    # `build` stands in for the GPU build (_build_serialized); `probe` for the node's device facts
    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))
    seen = {}

    def gpu_build(trt, onnx, cfg, calibrator_factory, timing, log):
        seen.update(onnx=onnx, cfg=cfg, calibrator=calibrator_factory, timing=timing)
        assert not list((tmp_path / "out").glob("*.json"))  # no manifest before the plan exists
        return b"PLAN" * 64, b"timing-cache", ["WARNING: something"]

    res = tb.build_tensorrt_engine(variant(), onnx_file, tmp_path / "out", None, Model, profile=_profile(),
                                   probe=lambda: dict(H100), trt=FakeTRT, build=gpu_build)
    assert res.status == "ok", res.reason
    plan = Path(res.artifact)
    assert plan.name == "trt.plan" and plan.read_bytes() == b"PLAN" * 64
    assert seen["onnx"] == onnx_file and seen["calibrator"] is None and seen["timing"] is None
    cfg = res.details["build_config"]
    manifest = verify_engine(plan, fingerprint(onnx_file, cfg, probe=lambda: dict(H100)))
    assert manifest["fingerprint"]["device_name"] == H100["device_name"]
    assert Path(res.details["timing_cache"]["path"]).read_bytes() == b"timing-cache"
    assert res.details["warnings"] == ["WARNING: something"]
    again = tb.build_tensorrt_engine(variant(), onnx_file, tmp_path / "out2", None, Model, profile=_profile(),
                                     probe=lambda: dict(H100), trt=FakeTRT, build=gpu_build)
    assert seen["timing"] == b"timing-cache" and again.details["timing_cache"]["reused"] is True


def test_build_tensorrt_engine_leaves_no_plan_and_no_manifest_when_the_gpu_build_fails(onnx_file, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))

    def gpu_build(*a):
        raise RuntimeError("TensorRT's ONNX parser refused model.onnx: In node 3 (importMatMul): bad shape")

    res = tb.build_tensorrt_engine(variant(), onnx_file, tmp_path / "out", None, Model, profile=_profile(),
                                   probe=lambda: dict(H100), trt=FakeTRT, build=gpu_build)
    assert res.status == "failed" and "importMatMul" in res.reason and "build.log" in res.reason
    assert not list((tmp_path / "out").glob("*.plan*")) and not list((tmp_path / "out").glob("*.json"))


def test_build_tensorrt_engine_passes_a_calibrator_factory_when_int8(onnx_file, tmp_path, monkeypatch):
    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))
    got = {}

    def gpu_build(trt, onnx, cfg, calibrator_factory, timing, log):
        cal = calibrator_factory(lambda name, host: 1)  # stand-in device copy
        got["pointers"] = cal.get_batch(["input_ids", "attention_mask"])
        cal.write_calibration_cache(b"scales")
        return b"PLAN", None, []

    res = tb.build_tensorrt_engine(variant(precision="int8"), onnx_file, tmp_path / "out", rows([3, 5, 4]), Model,
                                   profile=_profile(), calibration_batch_size=2, probe=lambda: dict(H100),
                                   trt=FakeTRT, build=gpu_build)
    assert res.status == "ok" and got["pointers"] == [1, 1]
    key = res.details["build_config"]["calibration"]["cache_key"]
    assert Path(res.details["calibration_cache"]["path"]).name == f"{key}.cache"
    assert Path(res.details["calibration_cache"]["path"]).read_bytes() == b"scales"


def test_build_tensorrt_engine_skips_with_the_version_when_tensorrt_is_not_10(onnx_file, tmp_path):
    res = tb.build_tensorrt_engine(variant(), onnx_file, tmp_path / "out", None, Model, profile=_profile(),
                                   probe=lambda: {**H100, "tensorrt_version": "11.4.0"}, trt=FakeTRT,
                                   build=lambda *a: pytest.fail("must not build"))
    assert res.status == "skipped" and "TensorRT 11.4.0 is installed" in res.reason
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------- runners on this CPU
def test_tensorrt_runner_refuses_a_changed_plan_before_importing_tensorrt_when_loaded(onnx_file, tmp_path,
                                                                                    monkeypatch):
    from tailguard.core.runtime import TensorRTRunner

    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))
    res = tb.build_tensorrt_engine(variant(), onnx_file, tmp_path / "out", None, Model, profile=_profile(),
                                   probe=lambda: dict(H100), trt=FakeTRT, build=lambda *a: (b"PLAN" * 8, None, []))
    plan = Path(res.artifact)
    expected = dict(res.details["fingerprint"])
    with pytest.raises(ArtifactMismatchError, match="compute_capability: '9.0' != '8.9'"):
        TensorRTRunner(plan, {**expected, "compute_capability": "8.9"})
    plan.write_bytes(b"PLAN" * 7)
    with pytest.raises(ArtifactMismatchError, match="changed after it was built"):
        TensorRTRunner(plan, expected)
    assert "tensorrt" not in sys.modules


def test_tensorrt_runner_says_tensorrt_is_missing_when_the_plan_checks_out_on_a_cpu_node(onnx_file, tmp_path,
                                                                                       monkeypatch):
    from tailguard.core.runtime import TensorRTRunner, tensorrt_unavailable_reason

    if tensorrt_unavailable_reason() is None:
        pytest.skip("TensorRT is installed here")
    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))
    res = tb.build_tensorrt_engine(variant(), onnx_file, tmp_path / "out", None, Model, profile=_profile(),
                                   probe=lambda: dict(H100), trt=FakeTRT, build=lambda *a: (b"PLAN", None, []))
    with pytest.raises(MissingDependencyError, match="tensorrt"):
        TensorRTRunner(res.artifact, res.details["fingerprint"])
    assert manifest_path(res.artifact).is_file()


def test_ort_runner_refuses_a_session_when_onnxruntime_drops_the_gpu_provider(tmp_path):
    from tailguard.core.runtime import OrtRunner, ProviderFallbackError, ort_providers_unavailable_reason
    from tests.helpers.tiny_models import export_tiny

    if ort_providers_unavailable_reason("CUDAExecutionProvider") is None:
        pytest.skip("onnxruntime-gpu with CUDA is installed here")
    _, _, path = export_tiny(tmp_path)
    # ONNX Runtime itself only warns and runs on the CPU: the runner must not
    with pytest.raises(ProviderFallbackError, match="did not activate CUDAExecutionProvider"):
        OrtRunner(path, providers=[("CUDAExecutionProvider", {"device_id": 0})])
    assert OrtRunner(path, providers=[("CPUExecutionProvider", {})]).session.get_providers() == ["CPUExecutionProvider"]


def test_resolve_provider_paths_puts_the_caches_in_the_variant_folder_when_opened(tmp_path):
    from tailguard.core.runtime import resolve_provider_paths

    v = VariantSpec.model_validate({"name": "v", "backend": "onnxruntime", "precision": "fp16",
                                    "execution_provider": "TensorrtExecutionProvider"})
    resolved = resolve_provider_paths(profiles.ort_providers(v, None), tmp_path / "variant")
    name, opts = resolved[0]
    assert name == "TensorrtExecutionProvider"
    assert opts["trt_engine_cache_path"] == str(tmp_path / "variant" / "trt_cache" / "engines")
    assert Path(opts["trt_timing_cache_path"]).is_dir() and resolved[1] == ("CUDAExecutionProvider", {"device_id": 0})


# ----------------------------------------------------- the build and validate tasks on this CPU node
def _task_spec(tmp_path, variants) -> str:
    """A spec for the 65 -> 10 MLP of tests/core/test_cache.py with validation rows written to tmp_path (absolute
    URIs)."""
    import yaml

    rng = np.random.default_rng(0)
    frame = pd.DataFrame({"x": [rng.normal(size=65).astype(np.float32).tolist() for _ in range(12)],
                          "label": rng.integers(0, 10, size=12)})
    for name in ("validation", "calibration"):
        frame.to_parquet(tmp_path / f"{name}.parquet")
    return yaml.safe_dump({
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "mlp"},
        "model": {"registered_name": "mlp", "task": "classification",
                  "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 65]}],
                  "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", 10]}]},
        "data": {"calibration": {"uri": str(tmp_path / "calibration.parquet")},
                 "validation": {"uri": str(tmp_path / "validation.parquet"), "batch_size": 4}},
        "variants": variants, "gates": [{"metric": "top1_agreement", "min": 0.9}],
        "benchmark": {"batch_sizes": [1, 16]},
    }, sort_keys=False)


GPU_VARIANTS = [
    {"name": "ort-cuda-fp16", "backend": "onnxruntime", "precision": "fp16",
     "execution_provider": "CUDAExecutionProvider"},
    {"name": "ort-trt-fp16", "backend": "onnxruntime", "precision": "fp16",
     "execution_provider": "TensorrtExecutionProvider", "tensorrt": {"max_batch_size": 64}},
    {"name": "trt-int8", "backend": "tensorrt", "precision": "int8"},
]


@pytest.mark.parametrize("name,says", [("ort-cuda-fp16", "CUDAExecutionProvider needs onnxruntime-gpu"),
                                       ("ort-trt-fp16", "TensorrtExecutionProvider needs onnxruntime-gpu"),
                                       ("trt-int8", "needs a GPU with TensorRT")])
def test_build_task_result_says_skipped_with_the_reason_when_the_node_lacks_the_gpu_runtime(tmp_path, monkeypatch,
                                                                                          name, says):
    from tailguard.components.build import task as build_task
    from tailguard.core.runtime import ort_providers_unavailable_reason, tensorrt_unavailable_reason
    from tests.core.test_cache import write_mlp

    if tensorrt_unavailable_reason() is None or ort_providers_unavailable_reason("CUDAExecutionProvider") is None:
        pytest.skip("this node has the GPU runtime")
    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))
    out = json.loads(build_task.main(spec_yaml=_task_spec(tmp_path, GPU_VARIANTS), variant_name=name,
                                     onnx_dir=str(write_mlp(tmp_path / "fp32")), out_dir=str(tmp_path / name)))
    assert out["status"] == "skipped" and says in out["reason"], out["reason"]
    assert json.loads((tmp_path / name / "build.json").read_text())["reason"] == out["reason"]
    assert not list((tmp_path / name).glob("*.onnx")) and not list((tmp_path / name).glob("*.plan"))


def test_build_task_profile_comes_from_the_spec_and_enters_the_cache_key_when_the_variant_uses_tensorrt(tmp_path):
    from tailguard.components.build import task as build_task
    from tailguard.core.spec import spec_from_yaml
    from tests.core.test_cache import write_mlp

    spec = spec_from_yaml(_task_spec(tmp_path, GPU_VARIANTS))
    by = {v.name: v for v in spec.variants}
    assert build_task.tensorrt_profile(spec, by["ort-cuda-fp16"]) is None  # no TensorRT: no rows read
    prof = build_task.tensorrt_profile(spec, by["ort-trt-fp16"])
    assert prof == {"x": {"min": [1, 65], "opt": [1, 65], "max": [64, 65]}}  # tensorrt.max_batch_size: 64
    assert build_task.tensorrt_profile(spec, by["trt-int8"])["x"]["max"] == [16, 65]  # benchmark's largest batch
    onnx_dir = write_mlp(tmp_path / "fp32")
    parts = build_task.cache_parts(spec, by["ort-trt-fp16"], onnx_dir, prof)
    assert parts["tensorrt_profile"] == prof
    assert "calibration" in build_task.cache_parts(spec, by["trt-int8"], onnx_dir, prof)  # INT8 calibrates


def test_validated_tensorrt_plan_is_registered_with_its_manifest_and_fingerprint_when_logged_as_files(
        onnx_file, tmp_path, monkeypatch, store):
    # real MLflow store (sqlite under tmp_path, tests/core/test_results.py's fixture), the validate step's own
    # log_validated_model and the register step's register_artifact_folder; the plan's bytes come from a stand-in
    # GPU build
    import mlflow

    from tailguard.components.register.versions import backend_tags, register_artifact_folder
    from tailguard.components.validate.result import ValidationResult
    from tailguard.components.validate.run_log import log_validated_model

    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))
    res = tb.build_tensorrt_engine(variant(), onnx_file, tmp_path / "out", None, Model, profile=_profile(),
                                   probe=lambda: dict(H100), trt=FakeTRT, build=lambda *a: (b"PLAN" * 8, None, []))
    client, _, run_id = store
    work = tmp_path / "work"
    work.mkdir()
    result = ValidationResult("trt", "classification", 10, {"top1_agreement": 1.0},
                              {1: {"latency_ms.p50": 1.0, "latency_ms.p99": 2.0}}, [], [], True, 0, [1])
    out = log_validated_model(client, run_id, result, work_dir=work, model_file=Path(res.artifact),
                              execution_provider="CUDAExecutionProvider", onnx=False)
    tags = backend_tags(variant(), client.get_run(run_id).data.tags)
    assert json.loads(tags["tailguard.artifact_fingerprint"])["device_name"] == H100["device_name"]
    mv = register_artifact_folder(client, "mlp-optimized", out["model_uri"], run_id, tags)
    got = Path(mlflow.artifacts.download_artifacts(f"models:/mlp-optimized/{mv.version}",
                                                   dst_path=str(tmp_path / "dl")))
    assert sorted(p.name for p in got.iterdir()) == ["trt.plan", "trt.plan.json"]
    assert verify_engine(got / "trt.plan", fingerprint(onnx_file, res.details["build_config"],
                                                       probe=lambda: dict(H100)))


def test_validate_expects_the_recorded_build_on_this_node_when_it_opens_a_plan(onnx_file, tmp_path, monkeypatch):
    from tailguard.components.validate.runners import tensorrt_expected_fingerprint, variant_runner
    from tailguard.core.spec import spec_from_yaml

    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))
    res = tb.build_tensorrt_engine(variant(), onnx_file, tmp_path / "out", None, Model, profile=_profile(),
                                   probe=lambda: dict(H100), trt=FakeTRT, build=lambda *a: (b"PLAN" * 8, None, []))
    build = {**res.to_dict(), "artifact": Path(res.artifact).name}
    ref_dir = onnx_file.parent  # the export's folder: model.onnx
    same = tensorrt_expected_fingerprint(build, ref_dir, facts=lambda: dict(H100))
    assert same == res.details["fingerprint"]
    other = tensorrt_expected_fingerprint(build, ref_dir, facts=lambda: {**H100, "device_name": "NVIDIA L4",
                                                                        "compute_capability": "8.9"})
    with pytest.raises(ArtifactMismatchError, match="device_name: 'NVIDIA H100 80GB HBM3' != 'NVIDIA L4'"):
        from tailguard.core.runtime import TensorRTRunner

        TensorRTRunner(res.artifact, other)
    spec = spec_from_yaml(_task_spec(tmp_path, [{"name": "trt", "backend": "tensorrt", "precision": "fp16"}]))
    (tmp_path / "out" / "trt.plan").write_bytes(b"tampered")
    with pytest.raises((ArtifactMismatchError, MissingDependencyError)):  # CPU node: the facts or the file refuse
        variant_runner(spec, spec.variants[0], build, tmp_path / "out", ref_dir)
