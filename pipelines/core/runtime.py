"""Inference runners (the one seam every step runs models through) and the GPU availability seam; torch variants'
runners live in tailguard.core.torch_backend (`runner_for_file` picks one by the file).

A runner maps a feed {input name: (batch, ...) array} to the list of output arrays, in
`model.outputs` order. ONNX Runtime and torch are CPU-importable; TensorRT, CUDA and
onnxruntime-gpu are imported lazily in `tensorrt_unavailable_reason` / `require_tensorrt` /
`TensorRTRunner`.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

import numpy as np

from tailguard.core.errors import InputError, MissingDependencyError, TailguardError
from tailguard.core.hardware import gpu_unavailable_reason

if TYPE_CHECKING:  # tailguard.core.data imports pandas: a build task that reads no rows must not load it
    from tailguard.core.data import Dataset


class Runner(Protocol):
    """Anything that runs a batch: feeds -> outputs (list of arrays, model.outputs order)."""

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]: ...


def default_threads(requested: int = 0) -> int:
    """Threads for intra-op parallelism: `requested`, else the number of usable cores."""
    if requested:
        return requested
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class OrtRunner:
    """An ONNX Runtime InferenceSession.

    Args:
        path: .onnx file (external data beside it is found by ORT).
        providers: execution providers, in preference order (default CPU): names, or (name, {option: value})
            pairs (`resolve_provider_paths`, ONNX Runtime's `providers=[(name, options), ...]` form). The first one
            must be active in the session (`require_active_provider`): ONNX Runtime otherwise falls back to the
            next provider (down to the CPU) with a log line only.
        intra_op_num_threads: 0 = all cores.
        graph_optimization: ORT GraphOptimizationLevel name: disabled|basic|extended|all.
        stop_spinning_after_run: set the session option `session.force_spinning_stop` = "1": the intra-op
            workers spin-wait for work while a Run lasts (ORT's default speed) but stop spinning when Run returns,
            instead of holding the cores for a while after it. For a session timed in one process alternately with
            another runtime (torch eager in the reference pass), which otherwise waits on those spinning workers
            (issue 26: torch 2.9x slower on a 2-core node; components/reference/logic.py). Default False: ORT's own
            behaviour, what a server running one session gets.
        allow_spinning: False sets `session.intra_op.allow_spinning` = "0"
            (kOrtSessionOptionsConfigAllowIntraOpSpinning):
            the intra-op workers never spin-wait. For a session timed in rounds beside a torch runner: measured on a
            2-core Xeon (2026-11-26, a 2-layer encoder, batch 1, 30 alternating runs, 3 repeats) torch took
            6.6-7.5 ms per run beside a session with `stop_spinning_after_run` and 2.2-2.4 ms beside one without
            spinning, while the session itself stayed at 0.42-0.50 ms either way; beside a session that had not run
            yet (its workers spin from creation) torch took 100 ms.
        exact_int8_accumulation: set the session option `session.x64quantprecision` = "1"
            (kOrtSessionOptionsAvx2PrecisionMode in ORT's onnxruntime_session_options_config_keys.h): on x86
            CPUs without VNNI (SSE4.1/AVX2/AVX-512 without VNNI) the u8 x s8 integer GEMM kernels sum pairs of
            8-bit products in int16 with saturation; with the option ORT uses its slower u8 x u8 kernels, whose
            int32 accumulation is exact. Where the node's kernel is exact already (VNNI, ARM) it changes
            nothing. Default False: the node's own kernels, what a server gets. Used by the validate step's
            numerics check (components/validate/numerics.py `numerics_check`).

    Raises:
        InputError: the file is missing or not a loadable ONNX model (names the file).
        ProviderFallbackError: ONNX Runtime dropped the first requested provider.
    """

    def __init__(self, path: str | Path, *, providers: Sequence[Any] = ("CPUExecutionProvider",),
                 intra_op_num_threads: int = 0, graph_optimization: str = "all",
                 stop_spinning_after_run: bool = False, exact_int8_accumulation: bool = False,
                 allow_spinning: bool = True) -> None:
        import onnxruntime as ort

        path = Path(path)
        if not path.is_file():
            raise InputError(f"ONNX file not found: {path}")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = default_threads(intra_op_num_threads)
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = {
            "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}[graph_optimization]
        opts.log_severity_level = 3
        if stop_spinning_after_run:  # kOrtSessionOptionsConfigForceSpinningStop (session options config keys)
            opts.add_session_config_entry("session.force_spinning_stop", "1")
        if not allow_spinning:  # kOrtSessionOptionsConfigAllowIntraOpSpinning (session options config keys)
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if exact_int8_accumulation:  # kOrtSessionOptionsAvx2PrecisionMode (session options config keys)
            opts.add_session_config_entry("session.x64quantprecision", "1")
        providers = [p if isinstance(p, str) else (p[0], dict(p[1])) for p in providers]
        try:
            self.session = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
        except Exception as exc:  # ORT raises Fail/InvalidGraph/InvalidProtobuf/...; all mean the same to a user
            raise InputError(f"cannot load ONNX model {path}: {str(exc).splitlines()[0][:300]}",
                             hint="the file is corrupt or not an ONNX model; rebuild or re-register it") from None
        require_active_provider(self.session, providers)
        self.path = path
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Run one batch; feeds not used by the graph are ignored."""
        return self.session.run(self.output_names, {k: feeds[k] for k in self.input_names})


# One session configuration for every ONNX Runtime session timed in rounds beside other runners (issue 37, item 2):
# the reference pass (beside torch eager), the validate step (variant beside the ONNX FP32 export), the promotion's
# paired rounds (every passing variant beside torch eager and the export) and `tailguard bench`. The validate step
# used ORT's default (workers spin-wait after each Run) while the promotion set `session.force_spinning_stop`, and
# the same two models came out 1.7x apart between the two: measured on the shared 2-core EPYC (2026-11-27, a 12-layer
# 384-wide MatMul+Relu chain FP32 against its dynamic INT8 quantization, batch (1, 32, 384), 150 alternating
# rounds, 2 repeats), FP32/INT8 = 1.86 [1.71, 2.06] and 1.92 [1.83, 2.10] with spinning sessions (each one's
# spinning workers hold a core while the other runs), 3.58 [1.90, 4.49] and 3.29 [1.48, 3.70] with
# force_spinning_stop (the FP32 session's workers parked after every Run: 3.3-3.7 ms against 1.8), and 1.72
# [1.67, 1.76] and 1.72 [1.69, 1.76] with spinning off: the only setting whose ratio is the same in every repeat
# and whose interval is tight, because no session's time depends on which sessions it was timed beside. Its price:
# absolute times can be up to ~30% above a lone server session that spins (a 4-layer encoder, issue 26), alike
# for every ORT session timed this way, so ratios between them hold; `tailguard bench` says so in its method.
TIMED_ORT_SESSION = "session.intra_op.allow_spinning=0"  # how a timed session is built (method strings)


def timed_ort_runner(path: str | Path, *, providers: Sequence[Any] = ("CPUExecutionProvider",),
                     intra_op_num_threads: int = 0) -> "OrtRunner":
    """The ONNX Runtime session of a model timed in interleaved rounds beside other runners: `OrtRunner` with
    `allow_spinning=False` (TIMED_ORT_SESSION; why and the measurements: the comment above). Every step that times
    ONNX Runtime against anything builds its session here, so a ratio means the same in every step.

    Args:
        path: the .onnx file.
        providers: execution providers with options (`OrtRunner`).
        intra_op_num_threads: 0 = all cores (spec `benchmark.intra_op_num_threads`).

    Raises:
        InputError: the file is missing or not loadable (names the file).
        ProviderFallbackError: ONNX Runtime dropped the first requested provider.
    """
    return OrtRunner(path, providers=providers, intra_op_num_threads=intra_op_num_threads, allow_spinning=False)


class TorchRunner:
    """A torch.nn.Module (or an ExportedProgram's module) run in eval mode under torch.inference_mode.

    Args:
        module: the model; called with keyword arguments named like `input_names`.
        input_names: forward() argument names (model.inputs order).
        intra_op_num_threads: 0 = leave torch's setting.
    """

    def __init__(self, module: Any, input_names: Sequence[str], *, intra_op_num_threads: int = 0) -> None:
        import torch

        self.torch = torch
        if intra_op_num_threads:
            torch.set_num_threads(intra_op_num_threads)
        if hasattr(module, "eval"):
            module.eval()
        self.module = module
        self.input_names = list(input_names)

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Run one batch; returns outputs as float/int numpy arrays."""
        torch = self.torch
        with torch.inference_mode():
            out = self.module(**{k: torch.from_numpy(np.ascontiguousarray(feeds[k])) for k in self.input_names})
        if isinstance(out, torch.Tensor):
            out = (out,)
        elif isinstance(out, dict):
            out = tuple(out.values())
        return [o.detach().cpu().numpy() for o in out]


def runner_for_file(path: str | Path, input_specs: Sequence, *, intra_op_num_threads: int = 0, trusted: bool = False,
                    fix: str | None = None) -> Runner:
    """A runner for a model file given by path (the monitor's reference and candidate, `monitor replay`): an .onnx
    file runs on ONNX Runtime (CPU); a torch artefact (program.pt2 / package.pt2 with its `<file>.json` manifest,
    as `tailguard fetch` writes a torch variant) runs on the torch backend after its manifest check.

    Args:
        path: the model file.
        input_specs: the spec's model.inputs.
        intra_op_num_threads: CPU threads (0: all cores for ORT, torch's setting for torch).
        trusted: a torch artefact's source is trusted (the spec's model.source.trusted, the monitor's --trusted):
            its archive is not read for code first (tailguard.core.pt2_archive).
        fix: how the user marks the source trusted, for a refusal's hint (None: the spec's model.source.trusted).

    Raises:
        InputError: a missing file, or a file that is neither (names the file and what is accepted).
        ArtifactMismatchError: a torch artefact built for another node or torch version.
        UntrustedModelError: (exit 2) an untrusted torch artefact whose loading would run code from it.
    """
    p = Path(path)
    if p.suffix == ".onnx":
        return OrtRunner(p, intra_op_num_threads=intra_op_num_threads)
    if p.with_name(p.name + ".json").is_file():
        from tailguard.core.pt2_archive import SPEC_FIX
        from tailguard.core.torch_backend import runner_for_artifact

        return runner_for_artifact(p, input_specs, intra_op_num_threads=intra_op_num_threads, trusted=trusted,
                                   fix=fix or SPEC_FIX)
    if not p.is_file():
        raise InputError(f"model file not found: {p}")
    raise InputError(f"{p}: not a model tailguard can run: give an .onnx file, or a torch variant's .pt2 with its "
                     f"manifest {p.name}.json beside it", hint="`tailguard fetch MODEL@ALIAS -o DIR` writes both")


def run_dataset(runner: Runner, ds: Dataset, input_specs: Sequence, *, batch_size: int,
                pad_values: dict[str, float] | None = None) -> list[np.ndarray]:
    """Run every row of `ds` (length-sorted batches) and return outputs in the original row order.

    Returns:
        One array per model output, shape (n_rows, ...) (the per-row output shape must not depend on
        the padded length; sequence outputs should be pooled in the model).
    """
    outs: list[np.ndarray] | None = None
    from tailguard.core.data import iter_batches  # lazy: pandas only where a dataset is run

    for idx, feeds in iter_batches(ds, input_specs, batch_size, pad_values=pad_values):
        res = runner.run(feeds)
        if outs is None:
            outs = [np.empty((ds.n_rows, *r.shape[1:]), dtype=r.dtype) for r in res]
        for o, r in zip(outs, res):
            if r.shape[1:] != o.shape[1:]:
                raise InputError(f"output shape {r.shape} varies with the padded length; pool sequence outputs "
                                 f"in the model (expected (batch, {', '.join(map(str, o.shape[1:]))})), or for "
                                 "per-position (batch, time, classes) outputs use task: token_classification")
            o[idx] = r
    return outs or []


# ---------------------------------------------------------------------------------------------- GPU seam
def tensorrt_unavailable_reason() -> str | None:
    """None when TensorRT can build engines here, else the reason (GPU missing or package missing)."""
    reason = gpu_unavailable_reason()
    if reason:
        return reason
    if importlib.util.find_spec("tensorrt") is None:
        return "TensorRT is not installed (pip install 'tailguard[tensorrt]')"
    return None


def require_tensorrt() -> Any:
    """Import and return the tensorrt module.

    Raises:
        MissingDependencyError: TensorRT is not installed (names the `tensorrt` extra).
    """
    try:
        return importlib.import_module("tensorrt")
    except ImportError:
        raise MissingDependencyError("tensorrt", "tensorrt") from None


class ProviderFallbackError(TailguardError):
    """ONNX Runtime opened a session without the execution provider asked for first (it falls back to the next one,
    down to the CPU, logging only). Exit code 1 (runtime): the node lacks the provider's libraries (CUDA, cuDNN,
    TensorRT) or they do not match the onnxruntime-gpu build."""


def provider_name(entry: Any) -> str:
    """The provider name of a `providers` entry: "X" or ("X", {options})."""
    return entry if isinstance(entry, str) else entry[0]


def require_active_provider(session: Any, providers: Sequence[Any]) -> None:
    """Raise when the first requested provider is not among `session.get_providers()`.

    Raises:
        ProviderFallbackError: names the provider asked for and the ones ONNX Runtime activated.
    """
    if not providers:
        return
    wanted = provider_name(providers[0])
    active = list(session.get_providers())
    if wanted not in active:
        raise ProviderFallbackError(
            f"ONNX Runtime did not activate {wanted} (active: {', '.join(active)}): it would have run on "
            f"{active[0] if active else 'nothing'} instead",
            hint=f"{wanted} needs onnxruntime-gpu with matching CUDA/cuDNN"
                 f"{' and TensorRT' if 'Tensorrt' in wanted else ''} "
                 "libraries on a GPU node (the GPU image: manifests/images/gpu.Dockerfile)")


PATH_OPTIONS = ("trt_engine_cache_path", "trt_timing_cache_path")  # folders, relative to the model's folder


def resolve_provider_paths(providers: Sequence[Any], base_dir: str | Path) -> list[Any]:
    """`providers` as recorded in build.json (`[[name, {option: value}], ...]`, cache folders relative to the
    variant's folder) in ONNX Runtime's form `[(name, {option: value}), ...]` with the folders made absolute under
    `base_dir` and created. Plain names pass through."""
    out: list[Any] = []
    for entry in providers:
        if isinstance(entry, str):
            out.append(entry)
            continue
        name, opts = entry[0], dict(entry[1])
        for key in PATH_OPTIONS:
            if key in opts:
                folder = Path(base_dir) / str(opts[key])
                folder.mkdir(parents=True, exist_ok=True)
                opts[key] = str(folder)
        out.append((name, opts))
    return out


def ort_providers_unavailable_reason(provider: str) -> str | None:
    """None when ONNX Runtime offers `provider` here, else the reason."""
    import onnxruntime as ort

    if provider in ort.get_available_providers():
        return None
    if provider in ("CUDAExecutionProvider", "TensorrtExecutionProvider"):
        gpu = gpu_unavailable_reason()
        return f"{gpu + '; ' if gpu else ''}{provider} needs onnxruntime-gpu (pip install 'tailguard[gpu]')"
    return f"execution provider {provider} is not available; have {ort.get_available_providers()}"


# ----------------------------------------------------------------------------------------- TensorRT plans
TENSORRT_ENGINE_KIND = "TensorRT engine"  # the manifest's `kind` (tailguard.core.artifacts)


def tensorrt_device_facts() -> dict[str, str]:
    """This node's TensorRT version, GPU name, compute capability and CUDA version: the device half of a TensorRT
    engine's fingerprint (components/build/engine.py `EngineFingerprint`).

    Raises:
        MissingDependencyError: TensorRT or a CUDA-enabled torch is not importable (a CPU node).
    """
    trt = require_tensorrt()
    try:
        import torch
    except ImportError:
        raise MissingDependencyError("torch (CUDA build)", "gpu") from None
    if not torch.cuda.is_available():
        raise MissingDependencyError("a CUDA device for torch", "gpu")
    major, minor = torch.cuda.get_device_capability(0)
    return {"tensorrt_version": trt.__version__, "device_name": torch.cuda.get_device_name(0),
            "compute_capability": f"{major}.{minor}", "cuda_version": str(torch.version.cuda)}


class TensorRTRunner:
    """A serialized TensorRT engine (plan), checked against its manifest before it is deserialized.

    The check comes first (`tailguard.core.artifacts.verify_artifact`: the plan's sha256 and the fingerprint of the
    node it was built on, against `expected`), so a changed plan or one built for another GPU / TensorRT version is
    refused with the differing fields, on any node, before TensorRT is imported. Then the plan is deserialized
    (`trt.Runtime.deserialize_cuda_engine`) and each batch runs through one execution context: input shapes set
    (`set_input_shape`; the engine's optimization profile must cover them), inputs and outputs in torch CUDA tensors
    (`set_tensor_address`), `execute_async_v3` on the current torch stream, outputs copied back.

    Args:
        path: the .plan file (its manifest `<plan>.json` beside it).
        expected: the fingerprint this node would give the same build ({field: value}: the recorded one with this
            node's `tensorrt_device_facts`).
        output_names: output tensor names in model.outputs order (default: the engine's output order).

    Raises:
        ArtifactMismatchError: no manifest, a changed plan or another node's plan.
        MissingDependencyError: TensorRT or CUDA torch missing (after the manifest check).
        InputError: the plan cannot be deserialized.
    """

    def __init__(self, path: str | Path, expected: Mapping[str, Any], *,
                 output_names: Sequence[str] | None = None) -> None:
        from tailguard.core.artifacts import verify_artifact

        self.path = Path(path)
        self.manifest = verify_artifact(self.path, expected, kind=TENSORRT_ENGINE_KIND)
        trt = require_tensorrt()
        import torch

        self.trt, self.torch = trt, torch
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.engine = trt.Runtime(self.logger).deserialize_cuda_engine(self.path.read_bytes())
        if self.engine is None:
            raise InputError(f"TensorRT could not deserialize {self.path}",
                             hint="rebuild the engine on this node (tailguard run rebuilds it)")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.input_names = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.output_names = list(output_names) if output_names else [n for n in names if n not in self.input_names]

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Run one batch on the GPU; feeds not used by the engine are ignored."""
        trt, torch = self.trt, self.torch
        keep = []
        for name in self.input_names:
            host = np.ascontiguousarray(feeds[name], dtype=trt.nptype(self.engine.get_tensor_dtype(name)))
            dev = torch.from_numpy(host).cuda()
            keep.append(dev)
            self.context.set_input_shape(name, tuple(host.shape))
            self.context.set_tensor_address(name, int(dev.data_ptr()))
        outs = []
        for name in self.output_names:
            shape = tuple(self.context.get_tensor_shape(name))
            dtype = np.dtype(trt.nptype(self.engine.get_tensor_dtype(name)))
            dev = torch.empty(shape, dtype=getattr(torch, dtype.name), device="cuda")  # float32 -> torch.float32
            outs.append(dev)
            self.context.set_tensor_address(name, int(dev.data_ptr()))
        stream = torch.cuda.current_stream()
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError(f"TensorRT execute_async_v3 failed on {self.path.name}")
        stream.synchronize()
        return [o.cpu().numpy() for o in outs]
