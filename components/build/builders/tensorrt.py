"""The `tensorrt` builder: TensorRT engines from the FP32 ONNX export; every setting assembled as data, one GPU seam.

Written for the cluster's GPU image (manifests/images/gpu.Dockerfile) and "skipped, with the reason" on a node
without a GPU or TensorRT (`compile_tensorrt`, the registered entry, then `build_tensorrt_engine`): the FP32 ONNX
file is parsed by TensorRT's ONNX parser (`trt.OnnxParser.parse_from_file`) into a network, built with an
`IBuilderConfig` (FP16 / INT8 flags, workspace memory pool limit, builder optimization level, one optimization
profile (`profiles.spec_profile`, computed by the build task), a timing cache, for INT8 an `IInt8EntropyCalibrator2`
over the calibration rows and a calibration profile) by `IBuilder.build_serialized_network`, and the plan is
written atomically with its manifest (`engine.write_manifest`: the plan's sha256 and the node's fingerprint,
checked by `engine.verify_engine` before any load). The other way onto TensorRT, an `onnxruntime` variant on
TensorrtExecutionProvider, is the onnxruntime builder with `profiles.ort_providers`.

Targets TensorRT 10.x. TensorRT 10 deprecated implicit quantization (calibrators, the INT8 flag: 10.1) and weak
typing (the FP16 flag: 10.12); TensorRT 11 removed them ("TensorRT 10.x to 11.x Python API migration": BuilderFlag
FP16/INT8 and IBuilderConfig.int8_calibrator are gone). A TensorRT 11 node skips the variant with that reason
rather than building something else than the spec asked for. Explicit batch is the only mode since TensorRT 10
(NetworkDefinitionCreationFlag.EXPLICIT_BATCH is deprecated and ignored), so the network is created with no flag.

What can run without a GPU is plain Python over numpy and is tested on CPU (tests/components/test_tensorrt_build.py):
`profiles.optimization_profile` (shapes from the spec's named axes, the benchmark batch sizes and the data's lengths),
`engine_build_config` (flags, pools, profiles, calibration as a dict: what `configure_builder` applies and what the
fingerprint hashes), `CalibrationBatches` (the rows fed in order, padded like `tailguard.core.data.make_batch`, then
None), the calibration cache file named by `engine.calibration_cache_key`, the skip reasons, and
`configure_builder` against a stand-in for the tensorrt module. What has not run anywhere: `_build_serialized` and
the device copies of the calibrator (no GPU with TensorRT has been lent to this project).

Sources: TensorRT Python API (tensorrt.Builder, INetworkDefinition, OnnxParser, IBuilderConfig, IOptimizationProfile,
IInt8EntropyCalibrator2, ITimingCache); NVIDIA's Polygraphy calibrator (tools/Polygraphy/polygraphy/backend/trt/
calibrator.py: the trampoline class built inside a function, `get_batch_size` 1 for explicit-batch networks).
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from tailguard.components.build.onnx_files import _check_inputs
from tailguard.components.build.profiles import MIB, Profile, axis_sizes
from tailguard.components.build.registry import register_builder
from tailguard.core.errors import InputError
from tailguard.core.results import BuildResult

if TYPE_CHECKING:  # tailguard.core.data imports pandas
    from tailguard.core.data import Dataset
    from tailguard.core.spec.model import ModelSpec
    from tailguard.core.spec.variants import VariantSpec

SUPPORTED_TENSORRT_MAJOR = 10
CALIBRATOR = "entropy2"  # IInt8EntropyCalibrator2: TensorRT's recommended calibrator (its Python API docs)
ENGINE_SUFFIX = ".plan"


# ------------------------------------------------------------------------------------------ calibration shapes
def calibration_shapes(input_specs: Sequence[Any], calibration: "Dataset", batch_size: int) -> dict[str, list[int]]:
    """The fixed shape of every calibration batch: (batch_size, the longest calibration row along each named axis,
    the spec's size along fixed axes). TensorRT calibrates at one shape per input, the calibration profile's opt
    (Polygraphy: "calibration will use fixed input shapes")."""
    sizes = axis_sizes(calibration, input_specs)
    return {s.name: [int(batch_size)] + [max(sizes.get(d) or [1]) if isinstance(d, str) else int(d)
                                         for d in list(s.shape)[1:]] for s in input_specs}


# --------------------------------------------------------------------------------- engine build config
def engine_build_config(variant: VariantSpec, profile: Profile, *, tensorrt_version: str, onnx_sha256: str,
                        calibration: "Dataset | None" = None, model: ModelSpec | None = None,
                        calibration_batch_size: int = 8) -> dict[str, Any]:
    """Everything the engine build sets, as data: what `configure_builder` applies, what build.json records and
    what the engine's fingerprint hashes (`engine.fingerprint(..., build_config)`).

    Keys:
        precision: the variant's.
        network_flags: NetworkDefinitionCreationFlag names ([]: explicit batch is TensorRT 10's only mode; weakly
            typed, so that the FP16 / INT8 builder flags choose precisions).
        builder_flags: BuilderFlag names: fp16 -> ["FP16"]; int8 -> ["INT8", "FP16"] (layers TensorRT cannot run
            in INT8 fall back to FP16 rather than FP32, as trtexec --int8 --fp16); fp32 -> [] (TensorRT's default
            TF32 for matrix multiplies on Ampere+ stays on).
        memory_pool_limits: {"WORKSPACE": bytes} from tensorrt.workspace_mib, or {} (TensorRT's default).
        builder_optimization_level: the spec's, or None (TensorRT's default, 3).
        profiles: [the optimization profile] (`optimization_profile`).
        calibration: INT8 only: {"algorithm": "entropy2", "batch_size", "batches", "rows", "shapes" (the
            calibration profile: min = opt = max), "cache_key" (`engine.calibration_cache_key`)}; else None.
        timing_cache: True (read from and written back to the node's timing cache file).

    Raises:
        InputError: precision int8 without calibration rows.
    """
    from tailguard.components.build.engine import calibration_cache_key

    flags = {"fp32": [], "fp16": ["FP16"], "int8": ["INT8", "FP16"]}.get(variant.precision)
    if flags is None:
        raise InputError(f"variant {variant.name}: precision {variant.precision} is not offered on backend tensorrt",
                         hint="use fp32, fp16 or int8")
    settings = variant.tensorrt
    cfg: dict[str, Any] = {
        "precision": variant.precision, "network_flags": [], "builder_flags": flags,
        "memory_pool_limits": ({"WORKSPACE": settings.workspace_mib * MIB}
                               if settings is not None and settings.workspace_mib else {}),
        "builder_optimization_level": settings.builder_optimization_level if settings is not None else None,
        "profiles": [profile], "calibration": None, "timing_cache": True,
    }
    if variant.precision == "int8":
        if calibration is None or calibration.n_rows == 0 or model is None:
            raise InputError(f"variants.{variant.name}: INT8 on backend tensorrt calibrates on data.calibration, "
                             "which gave no rows", hint="set data.calibration (a Parquet file with the model inputs)")
        batches = CalibrationBatches(calibration, model.inputs, calibration_batch_size, pad_values=model.pad_values)
        shapes = batches.shapes
        cfg["calibration"] = {
            "algorithm": CALIBRATOR, "batch_size": calibration_batch_size, "batches": len(batches),
            "rows": calibration.n_rows, "shapes": shapes,
            "cache_key": calibration_cache_key(onnx_sha256=onnx_sha256, calibration_sha256=dataset_sha256(
                calibration, model.inputs), calibrator=CALIBRATOR, batch_size=calibration_batch_size,
                tensorrt_version=tensorrt_version, input_shapes=shapes)}
    return cfg


def dataset_sha256(ds: "Dataset", input_specs: Sequence[Any]) -> str:
    """sha256 (hex) over the model-input arrays of `ds`, row by row (dtype, shape, bytes): the calibration rows'
    identity in the calibration cache key."""
    import hashlib

    h = hashlib.sha256()
    for s in input_specs:
        for arr in ds.inputs.get(s.name, []):
            a = np.ascontiguousarray(arr)
            h.update(f"{s.name}|{a.dtype.str}|{a.shape}".encode())
            h.update(a.tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------ calibration
class CalibrationBatches:
    """The calibration rows as the batches an INT8 calibrator feeds TensorRT, in order, then None.

    Rows go in length-sorted batches of `batch_size` (`tailguard.core.data.batch_indices`, stable, as the ONNX
    Runtime calibration reader), the last batch filled to `batch_size` with the first rows again; each batch is
    stacked and padded by `tailguard.core.data.make_batch` (pad values per input, at the end), then padded on to the
    fixed calibration shape (`calibration_shapes`: TensorRT calibrates at one shape per input).

    Args:
        ds: calibration rows.
        input_specs: `model.inputs`.
        batch_size: rows per batch (data.calibration.batch_size).
        pad_values: pad value per input (model.pad_values; default 0).

    Attributes:
        shapes: {input name: [batch_size, ...]} the shape of every batch of that input.
        batches: the row indices of each batch, in feeding order.
    """

    def __init__(self, ds: "Dataset", input_specs: Sequence[Any], batch_size: int, *,
                 pad_values: Mapping[str, float] | None = None) -> None:
        from tailguard.core.data import batch_indices

        if ds.n_rows == 0:
            raise InputError("data.calibration: no calibration rows", hint="point data.calibration at a Parquet file "
                             "with the model inputs")
        self.ds, self.specs, self.batch_size = ds, list(input_specs), int(batch_size)
        self.pad_values = dict(pad_values or {})
        self.shapes = calibration_shapes(self.specs, ds, self.batch_size)
        self.batches = batch_indices(ds, self.batch_size)
        if len(self.batches[-1]) < self.batch_size:
            fill = np.resize(np.concatenate(self.batches), self.batch_size - len(self.batches[-1]))
            self.batches[-1] = np.concatenate([self.batches[-1], fill])
        self._next = 0

    def __len__(self) -> int:
        return len(self.batches)

    def batch(self, i: int) -> dict[str, np.ndarray]:
        """Batch `i`: {input name: array of shape `shapes[name]`, the input's dtype}."""
        from tailguard.core.data import make_batch

        feeds = make_batch(self.ds, self.batches[i], self.specs, pad_values=self.pad_values)
        out = {}
        for name, arr in feeds.items():
            want = self.shapes[name]
            pad = [(0, w - n) for n, w in zip(arr.shape, want)]
            out[name] = np.ascontiguousarray(np.pad(arr, pad, constant_values=self.pad_values.get(name, 0))
                                             if any(p for _, p in pad) else arr)
        return out

    def next(self, names: Sequence[str]) -> list[np.ndarray] | None:
        """The next batch as arrays in the order of `names` (the network's input names TensorRT passes to
        get_batch), or None when every batch was fed."""
        if self._next >= len(self.batches):
            return None
        feeds = self.batch(self._next)
        self._next += 1
        missing = [n for n in names if n not in feeds]
        if missing:
            raise InputError(f"the TensorRT network has input(s) {missing} that model.inputs does not name",
                             hint="list every ONNX graph input in model.inputs")
        return [feeds[n] for n in names]

    def rewind(self) -> None:
        """Start again from the first batch."""
        self._next = 0


class CalibrationCache:
    """An INT8 calibration cache file, named by `engine.calibration_cache_key`: read back only for the same
    network, rows, calibrator, batch size, TensorRT version and shapes (any change names another file).

    Args:
        folder: where cache files live (`cache_root() / "calibration"`).
        key: `engine_build_config(...)["calibration"]["cache_key"]`.
    """

    def __init__(self, folder: str | Path, key: str) -> None:
        self.path = Path(folder) / f"{key}.cache"

    def read(self) -> bytes | None:
        """The cached scales, or None (no file, or an empty one: then TensorRT calibrates)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        return data or None

    def write(self, data: bytes) -> None:
        """Store the scales (temp file + rename: a reader never sees half a cache)."""
        atomic_write(self.path, data)


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temp file and a rename (folders created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_bytes(bytes(data))
    tmp.replace(path)


def make_calibrator(trt: Any, batches: CalibrationBatches, cache: CalibrationCache,
                    to_device: Callable[[str, np.ndarray], int]) -> Any:
    """An `IInt8EntropyCalibrator2` feeding `batches`, reading and writing `cache`.

    The class derives from the tensorrt module's trampoline, so it is made here, after the lazy import (as NVIDIA's
    Polygraphy does); `BaseClass.__init__(self)` must run (Polygraphy: "Will mysteriously segfault without this").

    Args:
        trt: the tensorrt module.
        batches: the calibration batches.
        cache: the calibration cache file.
        to_device: (input name, host array) -> device pointer (int) holding a copy of the array; the GPU half.

    Returns:
        The calibrator (get_batch_size 1: explicit batch, the batch axis is in each buffer's shape, as Polygraphy's
        default; get_batch -> [pointer per name] or None at the end, or None with `.error` set when feeding failed;
        read/write_calibration_cache -> `cache`).
    """
    base = trt.IInt8EntropyCalibrator2

    class EntropyCalibrator(base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            base.__init__(self)
            self.fed = 0
            self.error: BaseException | None = None  # raised by the caller after the build (never into TensorRT)

        def get_batch_size(self) -> int:
            return 1

        def get_batch(self, names: list[str]) -> list[int] | None:
            try:
                arrays = batches.next(list(names))
                if arrays is None:
                    return None
                pointers = [int(to_device(n, a)) for n, a in zip(names, arrays)]
            except Exception as exc:  # an exception must not unwind through TensorRT's C++ caller: end calibration
                self.error = exc
                return None
            self.fed += 1
            return pointers

        def read_calibration_cache(self) -> bytes | None:
            return cache.read()

        def write_calibration_cache(self, data: Any) -> None:
            cache.write(bytes(data))

    return EntropyCalibrator()


# -------------------------------------------------------------------------------------- builder config
def configure_builder(trt: Any, builder: Any, network: Any, cfg: Mapping[str, Any], *,
                      calibrator: Any = None, timing_cache: bytes | None = None) -> Any:
    """Turn `engine_build_config`'s dict into an `IBuilderConfig` (the only place its keys become API calls).

    Calls: create_builder_config; set_flag(BuilderFlag.<name>) per builder flag; set_memory_pool_limit(
    MemoryPoolType.<name>, bytes); builder_optimization_level; per profile create_optimization_profile +
    set_shape(name, min, opt, max) + add_optimization_profile; INT8: int8_calibrator and a calibration profile
    (set_shape(name, s, s, s) at the calibration shape + set_calibration_profile); create_timing_cache(bytes or b"")
    + set_timing_cache(cache, ignore_mismatch=False) (a cache from another device or version is refused by
    TensorRT, not silently used).

    Returns:
        The IBuilderConfig.
    """
    config = builder.create_builder_config()
    for name in cfg["builder_flags"]:
        config.set_flag(getattr(trt.BuilderFlag, name))
    for pool, size in cfg["memory_pool_limits"].items():
        config.set_memory_pool_limit(getattr(trt.MemoryPoolType, pool), int(size))
    if cfg.get("builder_optimization_level") is not None:
        config.builder_optimization_level = int(cfg["builder_optimization_level"])
    for prof in cfg["profiles"]:
        p = builder.create_optimization_profile()
        for name, r in prof.items():
            p.set_shape(name, tuple(r["min"]), tuple(r["opt"]), tuple(r["max"]))
        config.add_optimization_profile(p)
    calib = cfg.get("calibration")
    if calib is not None:
        if calibrator is None:
            raise ValueError("an INT8 build config needs a calibrator")
        config.int8_calibrator = calibrator
        p = builder.create_optimization_profile()
        for name, shape in calib["shapes"].items():
            p.set_shape(name, tuple(shape), tuple(shape), tuple(shape))
        config.set_calibration_profile(p)
    if cfg.get("timing_cache"):
        cache = config.create_timing_cache(timing_cache or b"")
        config.set_timing_cache(cache, ignore_mismatch=False)
    return config


# ------------------------------------------------------------------------------------------ the build
def cache_root() -> Path:
    """Where TensorRT timing and calibration caches live on this node: `$TAILGUARD_HOME/cache/tensorrt`."""
    from tailguard.core.cache import cache_dir

    return cache_dir() / "tensorrt"


def timing_cache_path(root: Path, device: Mapping[str, str]) -> Path:
    """The node's timing cache file: one per TensorRT version, GPU and compute capability (a timing cache is only
    valid on the device kind it was measured on)."""
    import re

    tag = "-".join(re.sub(r"[^A-Za-z0-9.]+", "_", device[k]) for k in ("tensorrt_version", "device_name",
                                                                      "compute_capability"))
    return root / f"timing-{tag}.cache"


def tensorrt_skip_reason(variant: VariantSpec, trt_version: str) -> str | None:
    """Why this node's TensorRT cannot build `variant` the way tailguard builds it, or None."""
    try:
        major = int(str(trt_version).split(".")[0])
    except ValueError:
        return f"TensorRT variant {variant.name}: unreadable TensorRT version {trt_version!r}"
    if major != SUPPORTED_TENSORRT_MAJOR:
        return (f"TensorRT variant {variant.name}: TensorRT {trt_version} is installed; tailguard builds engines with "
                f"TensorRT {SUPPORTED_TENSORRT_MAJOR}.x (TensorRT 11 removed the FP16/INT8 builder flags and the "
                "INT8 calibrators it uses); use the GPU image (manifests/images/gpu.Dockerfile)")
    return None


def build_tensorrt_engine(variant: VariantSpec, fp32_onnx: Path, out_dir: Path, calibration: "Dataset | None",
                          model: ModelSpec, *, profile: Profile | None, calibration_batch_size: int = 8,
                          probe: Callable[[], dict[str, str]] | None = None, trt: Any = None,
                          build: Callable[..., tuple[bytes, bytes | None, list[str]]] | None = None) -> BuildResult:
    """Build `variant`'s TensorRT engine into `out_dir/<variant>.plan` with its manifest (the `tensorrt`
    builder, `compile_tensorrt`, calls this once TensorRT and a GPU are present).

    Order: TensorRT version check -> build config (`engine_build_config`) -> the GPU build (`build`, default
    `_build_serialized`) -> plan written to a temp file and renamed -> manifest (`engine.write_manifest`, after the
    plan is complete) -> timing cache written back. A failure leaves no plan and no manifest.

    Args:
        variant: the spec's variant (backend tensorrt).
        fp32_onnx: the checked FP32 ONNX export.
        out_dir: the variant's folder (created).
        calibration: calibration rows (INT8 only).
        model: the spec's model section.
        profile: `spec_profile(...)` (computed by the build task from the spec and the data).
        calibration_batch_size: rows per calibration batch.
        probe: the node's facts (`engine.probe_device`); tests pass a dict-returning function.
        trt: the tensorrt module (default: `require_tensorrt()`).
        build: (trt, onnx path, cfg, calibrator_factory, timing cache bytes, log) -> (plan bytes, timing cache
            bytes or None, warnings); default `_build_serialized`, the GPU seam.

    Returns:
        BuildResult ok (artifact = the plan; details: build_config, fingerprint, build_seconds, timing_cache,
        calibration_cache), skipped (TensorRT major version not 10) or failed (parser / builder errors; build.log).

    Raises:
        InputError: no profile (the build task computes it), or INT8 without calibration rows.
    """
    from tailguard.components.build.engine import fingerprint, probe_device, write_manifest
    from tailguard.core.digests import file_sha256

    if profile is None:
        raise InputError(f"variant {variant.name}: a TensorRT build needs its optimization profile",
                         hint="build through the build-variant task, which computes it from the spec and data")
    if trt is None:
        from tailguard.core.runtime import require_tensorrt

        trt = require_tensorrt()
    probe = probe or probe_device
    device = probe()
    details: dict[str, Any] = {"backend": "tensorrt", "precision": variant.precision,
                               "tensorrt_version": device["tensorrt_version"]}
    reason = tensorrt_skip_reason(variant, device["tensorrt_version"])
    if reason:
        return BuildResult("skipped", reason=reason, details=details)
    out_dir.mkdir(parents=True, exist_ok=True)
    onnx_sha = file_sha256(fp32_onnx)
    cfg = engine_build_config(variant, profile, tensorrt_version=device["tensorrt_version"], onnx_sha256=onnx_sha,
                              calibration=calibration, model=model, calibration_batch_size=calibration_batch_size)
    details["build_config"] = cfg
    root = cache_root()
    timing = timing_cache_path(root, device)
    details["timing_cache"] = {"path": str(timing), "reused": timing.is_file()}
    calib_cache = None
    if cfg["calibration"] is not None:
        calib_cache = CalibrationCache(root / "calibration", cfg["calibration"]["cache_key"])
        details["calibration_cache"] = {"path": str(calib_cache.path), "reused": calib_cache.path.is_file()}

    def calibrator_factory(to_device: Callable[[str, np.ndarray], int]) -> Any:
        batches = CalibrationBatches(calibration, model.inputs, calibration_batch_size, pad_values=model.pad_values)
        return make_calibrator(trt, batches, calib_cache, to_device)

    target = out_dir / f"{variant.name}{ENGINE_SUFFIX}"
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    log_lines: list[str] = []
    t0 = time.perf_counter()
    try:
        plan, timing_bytes, warnings = (build or _build_serialized)(
            trt, fp32_onnx, cfg, calibrator_factory if calib_cache else None,
            timing.read_bytes() if timing.is_file() else None, log_lines)
        tmp.write_bytes(plan)
        tmp.replace(target)
    except InputError:
        raise
    except Exception as exc:  # TensorRT raises RuntimeError/TypeError/...; the parser's errors come as our own
        tmp.unlink(missing_ok=True)
        log = out_dir / "build.log"
        log.write_text("\n".join(log_lines) + f"\n\n{traceback.format_exc()}")
        details["build_seconds"] = round(time.perf_counter() - t0, 3)
        first = (str(exc).splitlines() or [""])[0][:600]
        return BuildResult("failed", reason=f"TensorRT variant {variant.name}: engine build failed: "
                                           f"{type(exc).__name__}: {first} (log: {log})", details=details)
    details["build_seconds"] = round(time.perf_counter() - t0, 3)
    fp = fingerprint(fp32_onnx, cfg, probe=lambda: device)
    details["fingerprint"] = asdict(fp)
    details["manifest"] = str(write_manifest(target, fp))
    (out_dir / "build.log").write_text("\n".join(log_lines))
    if timing_bytes:
        atomic_write(timing, timing_bytes)
    details["warnings"] = list(warnings)
    details["bytes"] = target.stat().st_size
    return BuildResult("ok", artifact=str(target), details=details)


def _build_serialized(trt: Any, onnx_path: Path, cfg: Mapping[str, Any],
                      calibrator_factory: Callable[[Callable[[str, np.ndarray], int]], Any] | None,
                      timing_cache: bytes | None, log_lines: list[str]) -> tuple[bytes, bytes | None, list[str]]:
    """The GPU seam: parse, configure, build. Not run on any machine of this project yet (no GPU with TensorRT).

    Returns:
        (serialized plan bytes, the updated timing cache bytes, warnings).

    Raises:
        RuntimeError: the ONNX parser's errors (each one), or build_serialized_network returned None.
    """
    logger = _collecting_logger(trt, log_lines)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # TensorRT 10: explicit batch always; no flag (EXPLICIT_BATCH is ignored)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # from the file: external data beside it is found
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise RuntimeError(f"TensorRT's ONNX parser refused {onnx_path.name}: {'; '.join(errors) or 'no detail'}")
    buffers: dict[str, Any] = {}
    calibrator = None
    if calibrator_factory is not None:
        import torch

        def to_device(name: str, host: np.ndarray) -> int:
            buf = buffers.get(name)
            if buf is None or tuple(buf.shape) != host.shape:
                buf = buffers[name] = torch.empty(host.shape, dtype=_torch_dtype(torch, host.dtype), device="cuda")
            buf.copy_(torch.from_numpy(host))
            return int(buf.data_ptr())

        calibrator = calibrator_factory(to_device)
    config = configure_builder(trt, builder, network, cfg, calibrator=calibrator, timing_cache=timing_cache)
    plan = builder.build_serialized_network(network, config)
    if calibrator is not None and calibrator.error is not None:
        raise calibrator.error
    if plan is None:
        raise RuntimeError("IBuilder.build_serialized_network returned None (see the TensorRT log in build.log)")
    cache = config.get_timing_cache()
    warnings = [line for line in log_lines if line.startswith("WARNING")][:20]
    return bytes(plan), (bytes(cache.serialize()) if cache is not None else None), warnings


def _collecting_logger(trt: Any, lines: list[str]) -> Any:
    """A trt.ILogger that keeps TensorRT's messages (warning and above) for build.log."""

    class CollectingLogger(trt.ILogger):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity: Any, msg: str) -> None:
            if int(severity) <= int(trt.ILogger.Severity.WARNING):  # INTERNAL_ERROR 0 .. VERBOSE 4
                lines.append(f"{getattr(severity, 'name', severity)}: {msg}")

    return CollectingLogger()


def _torch_dtype(torch: Any, dtype: np.dtype) -> Any:
    return {np.dtype("float32"): torch.float32, np.dtype("float16"): torch.float16, np.dtype("int64"): torch.int64,
            np.dtype("int32"): torch.int32, np.dtype("bool"): torch.bool}[np.dtype(dtype)]


# ------------------------------------------------------------------------------- the registered builder
@register_builder("tensorrt", source="onnx")
def compile_tensorrt(variant: VariantSpec, fp32_onnx: str | Path, out_dir: str | Path, *,
                     calibration: Dataset | None = None, model: ModelSpec | None = None,
                     calibration_batch_size: int = 8, profile: dict | None = None) -> BuildResult:
    """Build a TensorRT engine for `variant`: skipped with the reason where no GPU or TensorRT is present.

    TensorRT is never imported at module level; `tailguard.core.runtime.tensorrt_unavailable_reason` is the seam.
    Arguments and result as `build_variant`.

    Raises:
        InputError: `fp32_onnx` is missing.
    """
    _check_inputs(variant, fp32_onnx, None)
    from tailguard.core.runtime import tensorrt_unavailable_reason  # tailguard.core.runtime imports pandas

    reason = tensorrt_unavailable_reason()
    if reason:
        return BuildResult("skipped", reason=f"TensorRT variant {variant.name} needs a GPU with TensorRT: {reason}",
                          details={"backend": "tensorrt", "precision": variant.precision})
    return build_tensorrt_engine(variant, Path(fp32_onnx), Path(out_dir), calibration, model, profile=profile,
                                 calibration_batch_size=calibration_batch_size)
