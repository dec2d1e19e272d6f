"""The `torch` backend: PyTorch-native variants (eager, inductor, AOTInductor), fp32 / fp16 / bf16, on CPU or CUDA,
optionally replayed as CUDA graphs.

What a torch variant is, per `compile` mode (the spec's `variants[].compile`):

    eager         the reference model captured by `torch.export` (an ATen-level ExportedProgram, no Python model
                  class needed to load it) in the variant's precision, saved with `torch.export.save` as
                  program.pt2 and run op by op (`ExportedProgram.module()`).
    inductor      the same program.pt2, compiled at load by `torch.compile` (TorchInductor: fused Triton kernels on
                  CUDA, C++/OpenMP on CPU) with dynamic shapes; the build compiles it (for a batch of the example and
                  for batch 1, which dynamo specialises: two graphs) to time it and to fail early, and inductor's
                  on-disk cache serves later loads on the same node.
    aot_inductor  `torch._inductor.aoti_compile_and_package` of the ExportedProgram: package.pt2, the compiled
                  kernels and their wrapper for one device kind and one PyTorch build, loaded with
                  `torch._inductor.aoti_load_package` without recompiling (PyTorch docs, "AOTInductor:
                  Ahead-Of-Time Compilation for Torch.Export-ed Models"). PyTorch's counterpart of a TensorRT plan.

Every artefact gets a manifest (`tailguard.core.artifacts`, the seam TensorRT engines use too) whose fingerprint is
the torch version, the device kind, for an AOTInductor package also the GPU's name, compute capability and CUDA
version (CUDA) or the CPU's kernel ISA flags (CPU), and the sha256 of the build settings and of the source model.
`TorchVariantRunner` checks it before loading: a package built for another GPU, CPU or torch version is refused
with the fields that differ.

Dynamic shapes: every named axis of the spec's `model.inputs` (e.g. [batch, sequence]) is exported as a dynamic
dimension (`torch.export.Dim.AUTO`: export infers its range and which axes are equal); an axis the model's
code fixes to the example's size is refused at build time with its name, since the variant would not serve other
batch sizes or lengths.

CUDA graphs (`cuda_graphs: true`, CUDA only): a CUDA graph replays a fixed sequence of kernels on fixed buffers,
removing per-kernel launch overhead (NVIDIA CUDA programming guide, "CUDA Graphs"; PyTorch `torch.cuda.graph`).
One graph is captured per distinct input signature (shape and dtype of every input), on first use, after two
warm-up runs on a side stream as PyTorch's documentation prescribes; at most `max_cuda_graphs` graphs are kept
(least recently used evicted), all in one memory pool. Replays copy the inputs into the graph's static buffers and
copy its outputs out, so callers never see a buffer the next replay overwrites.

torch is imported inside functions only: importing this module costs nothing on a node that builds ONNX variants.
"""

from __future__ import annotations

import collections
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from tailguard.core.artifacts import ArtifactMismatchError, config_sha256, verify_artifact, write_manifest
from tailguard.core.errors import InputError, MissingDependencyError, TailguardError
from tailguard.core.pt2_archive import SPEC_FIX, check_pt2_archive

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tailguard.core.spec.variants import VariantSpec

COMPILE_MODES = ("eager", "inductor", "aot_inductor")
PRECISIONS = ("fp32", "fp16", "bf16")
DEVICES = ("cpu", "cuda")
ARTIFACT_FILES = {"eager": "program.pt2", "inductor": "program.pt2", "aot_inductor": "package.pt2"}
ARTIFACT_KINDS = {"eager": "torch.export program", "inductor": "torch.export program",
                  "aot_inductor": "AOTInductor package"}
# CPU flags with bf16 matrix kernels in oneDNN / inductor (AVX512-BF16, AMX-BF16): without them torch emulates bf16
# in fp32 arithmetic with conversions, slower than fp32 (oneDNN docs, "Data types: bf16"; x86 ISA names as in
# /proc/cpuinfo).
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
DEFAULT_MAX_CUDA_GRAPHS = 64
_WARMUP_BEFORE_CAPTURE = 2  # PyTorch docs (torch.cuda.graph): warm up on a side stream before capturing


class TorchBuildError(TailguardError):
    """A torch variant could not be built from this model (torch.export cannot capture it, an op has no kernel
    for the device or precision, a dynamic axis is fixed by the model's code). Exit code 1 (runtime): the variant
    fails with this reason; the run goes on with the other variants."""


@dataclass(frozen=True)
class TorchBuildConfig:
    """What a torch variant is built as (the spec's torch variant fields).

    Attributes:
        precision: "fp32" | "fp16" | "bf16": the dtype of the weights and of floating inputs and compute;
            outputs are returned as float32.
        compile: "eager" | "inductor" | "aot_inductor" (module docstring).
        device: "cpu" | "cuda" (CUDA device 0 of the node).
        cuda_graphs: replay captured CUDA graphs (CUDA only).
        max_cuda_graphs: most captured graphs kept (one per input signature), least recently used evicted.
    """

    precision: str = "fp32"
    compile: str = "eager"
    device: str = "cpu"
    cuda_graphs: bool = False
    max_cuda_graphs: int = DEFAULT_MAX_CUDA_GRAPHS

    def __post_init__(self) -> None:
        for name, value, allowed in (("precision", self.precision, PRECISIONS),
                                     ("compile", self.compile, COMPILE_MODES), ("device", self.device, DEVICES)):
            if value not in allowed:
                raise InputError(f"torch backend: {name} {value!r} is not one of {list(allowed)}")
        if self.cuda_graphs and self.device != "cuda":
            raise InputError("torch backend: cuda_graphs needs device cuda", hint="set device: cuda or drop "
                             "cuda_graphs")
        if self.max_cuda_graphs < 1:
            raise InputError(f"torch backend: max_cuda_graphs must be >= 1, got {self.max_cuda_graphs}")

    @property
    def artifact_file(self) -> str:
        """The artefact's file name: program.pt2 (eager, inductor) or package.pt2 (aot_inductor)."""
        return ARTIFACT_FILES[self.compile]

    @property
    def artifact_kind(self) -> str:
        """What the artefact is, for messages and the manifest."""
        return ARTIFACT_KINDS[self.compile]

    def build_settings(self) -> dict[str, Any]:
        """The settings the artefact depends on (cuda_graphs is a load-time choice: the same file serves both)."""
        return {"precision": self.precision, "compile": self.compile, "device": self.device}


def config_of(variant: VariantSpec) -> TorchBuildConfig:
    """The TorchBuildConfig of a spec's torch variant (`VariantSpec`: precision, torch_compile, torch_device,
    cuda_graphs)."""
    return TorchBuildConfig(precision=variant.precision, compile=variant.torch_compile, device=variant.torch_device,
                            cuda_graphs=variant.cuda_graphs)


def loads_trusted(variant: VariantSpec, source_trusted: bool) -> bool:
    """Whether a torch variant's artefact built by this run's build step loads without the archive's code check
    (tailguard.core.pt2_archive): an AOTInductor package holds native code tailguard compiled itself (its manifest
    fingerprint and source digest are still checked); a program.pt2 is read for code first unless the spec trusts
    the model's source (`model.source.trusted`). The validate step and the promotion's paired rounds both ask
    here, so a variant that validated is timed too."""
    return config_of(variant).compile == "aot_inductor" or source_trusted


@dataclass
class TorchBuild:
    """A built torch variant.

    Attributes:
        path: the artefact (program.pt2 or package.pt2); its manifest is `<path>.json`.
        manifest: the manifest written beside it.
        export_seconds: wall seconds of torch.export (and the precision cast).
        compile_seconds: wall seconds of the compilation: AOTInductor packaging, or inductor's first compile and
            run on the example batch; 0 for eager.
        dynamic_axes: {input: {axis index: "name [min, max]"}} as exported.
        details: other facts (torch version, device name, ...), for build.json.
    """

    path: Path
    manifest: dict[str, Any]
    export_seconds: float
    compile_seconds: float
    dynamic_axes: dict[str, dict[int, str]] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ the node
def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise MissingDependencyError("torch", "torch") from None
    return torch


def unavailable_reason(config: TorchBuildConfig, *, cpu_isa: Sequence[str] | None = None) -> str | None:
    """None when this node can build and run `config`, else why not (the variant is then skipped with it).

    Args:
        config: the variant's build settings.
        cpu_isa: this CPU's kernel ISA flags (default: read from /proc/cpuinfo by tailguard.core.hardware); a seam
            for tests.

    Returns:
        None, or the reason: torch missing, no CUDA device (device cuda), bf16 on a CPU without bf16 kernels, fp16
        on CPU, or no C++ compiler for inductor / AOTInductor on CPU.
    """
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    if config.device == "cuda":
        torch = _torch()
        if not torch.cuda.is_available():
            return (f"no CUDA device on this node (torch {torch.__version__}, CUDA build: "
                    f"{torch.version.cuda or 'none'}); the variant runs on a GPU node pool (kubeflow.gpu)")
        return None
    if config.precision == "fp16":
        return "fp16 on CPU: torch has no fast fp16 CPU kernels; use bf16 on a CPU with AVX512-BF16/AMX, or device cuda"
    if config.precision == "bf16":
        if cpu_isa is None:
            from tailguard.core.hardware import cpu_facts

            cpu_isa = cpu_facts().get("isa") or []
        if not any(f in cpu_isa for f in CPU_BF16_FLAGS):
            return (f"bf16 on this CPU: it has none of {list(CPU_BF16_FLAGS)} (bf16 would be emulated in fp32, "
                    "slower than fp32)")
    if config.compile != "eager" and not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        return f"compile {config.compile} on CPU needs a C++ compiler (c++/g++/clang++ on PATH); none found"
    return None


def node_fingerprint(config: TorchBuildConfig) -> dict[str, str]:
    """What an artefact built here for `config` is bound to, without the build hashes.

    Every artefact is bound to the torch version (the `torch.export` archive format and the ATen ops it names) and
    the device kind. An AOTInductor package holds machine code, so it is also bound to the GPU (name, compute
    capability, CUDA version) or to the CPU's kernel ISA flags (inductor's C++ uses the vector ISA it finds); an
    exported program (eager, inductor) is not: the same program.pt2 runs on any GPU or CPU of its device kind
    (inductor compiles it where it is loaded).

    Returns:
        {"torch_version", "device"} plus, for aot_inductor on CUDA, {"device_name" (e.g. "NVIDIA H100 80GB HBM3"),
        "compute_capability" ("9.0"), "cuda_version"}, and on CPU {"cpu_isa" (space-separated kernel ISA flags)}.
    """
    torch = _torch()
    out = {"torch_version": torch.__version__, "device": config.device}
    if config.compile != "aot_inductor":
        return out
    if config.device == "cuda":
        major, minor = torch.cuda.get_device_capability(0)
        return {**out, "device_name": torch.cuda.get_device_name(0), "compute_capability": f"{major}.{minor}",
                "cuda_version": str(torch.version.cuda)}
    from tailguard.core.hardware import cpu_facts

    return {**out, "cpu_isa": " ".join(cpu_facts().get("isa") or [])}


def fingerprint(config: TorchBuildConfig, source_sha256: str, input_signature: Sequence[Mapping[str, Any]]
                ) -> dict[str, str]:
    """The full fingerprint of an artefact built here from a source model with these settings and inputs.

    Args:
        config: the build settings.
        source_sha256: sha256 of the FP32 reference model's files (the registry version's digest).
        input_signature: [{"name", "dtype", "shape"}] of the model inputs (the spec's model.inputs).
    """
    return {**node_fingerprint(config),
            "build_config_sha256": config_sha256({**config.build_settings(), "inputs": list(input_signature)}),
            "source_sha256": source_sha256}


# ------------------------------------------------------------------------------------------------ building
_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def torch_dtype(precision: str) -> "torch.dtype":
    """torch.float32 / float16 / bfloat16 for "fp32" / "fp16" / "bf16"."""
    return getattr(_torch(), _DTYPES[precision])


def _to_tensor(arr: np.ndarray, device: str, float_dtype: Any) -> "torch.Tensor":
    torch = _torch()
    t = torch.from_numpy(np.ascontiguousarray(arr))
    if t.is_floating_point():
        t = t.to(float_dtype)
    return t.to(device)


def signature(input_specs: Sequence[Any]) -> list[dict[str, Any]]:
    """[{"name", "dtype", "shape"}] of spec inputs (objects with .name, .dtype, .shape), JSON-ready."""
    return [{"name": s.name, "dtype": str(s.dtype), "shape": list(getattr(s, "shape", None) or [])}
            for s in input_specs]


def _dynamic_shapes(input_specs: Sequence[Any], example: Mapping[str, np.ndarray]) -> dict[str, dict[int, Any]]:
    """{input: {axis: Dim.AUTO}} for every named axis; refuses an example whose dynamic axes are < 2 long (torch
    specialises sizes 0 and 1, so such an axis could not be exported as dynamic)."""
    torch = _torch()
    shapes: dict[str, dict[int, Any]] = {}
    for s in input_specs:
        axes = {i: torch.export.Dim.AUTO for i, d in enumerate(getattr(s, "shape", None) or []) if isinstance(d, str)}
        for i in axes:
            if example[s.name].shape[i] < 2:
                raise InputError(f"torch build: the example batch's input {s.name!r} has size "
                                 f"{example[s.name].shape[i]} on dynamic axis {i}; export needs >= 2",
                                 hint="give the build at least 2 rows of at least 2 elements on each named axis")
        shapes[s.name] = axes
    return shapes


def _exported_axes(program: Any, input_specs: Sequence[Any]) -> dict[str, dict[int, str]]:
    """{input: {axis: "name [lo, hi]"}} of the exported program's inputs, checking every named axis stayed
    dynamic.

    Raises:
        TorchBuildError: the model's code fixed a named axis to the example's size (names the input and axis).
    """
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    user_inputs = [n for n in placeholders if n.name in set(program.graph_signature.user_inputs)]
    out: dict[str, dict[int, str]] = {}
    for s, node in zip(input_specs, user_inputs):
        val = node.meta.get("val")
        out[s.name] = {}
        for i, d in enumerate(getattr(s, "shape", None) or []):
            if not isinstance(d, str):
                continue
            size = val.shape[i] if val is not None else None
            expr = getattr(getattr(size, "node", None), "expr", None)
            if expr is None or getattr(expr, "is_number", False):  # an int, or a SymInt of a constant: specialised
                raise TorchBuildError(
                    f"torch.export fixed axis {i} ({d!r}) of input {s.name!r} to {size}: the model's code does not "
                    "allow other sizes there, so the variant could not serve them",
                    hint="make the model's shapes follow its inputs, or give that axis a fixed size in model.inputs")
            rng = program.range_constraints.get(expr)
            out[s.name][i] = f"{d} [{rng.lower}, {rng.upper}]" if rng is not None else d
    return out


def export_program(module: "torch.nn.Module", example: Mapping[str, np.ndarray], input_specs: Sequence[Any],
                   config: TorchBuildConfig) -> tuple[Any, dict[str, dict[int, str]], float]:
    """The reference module in the variant's precision on its device, captured by torch.export.

    Args:
        module: the FP32 reference (torch.nn.Module), inputs named like `input_specs` in forward's order.
        example: {input name: (batch, ...) array}, at least 2 along every named axis (data.calibration rows).
        input_specs: the spec's model.inputs.
        config: the build settings.

    Returns:
        (ExportedProgram, dynamic axes as exported, seconds).

    Raises:
        TorchBuildError: torch.export cannot capture the model (data-dependent control flow, unsupported ops...)
            or fixed a dynamic axis: the message names torch's reason.
    """
    torch = _torch()
    dtype = torch_dtype(config.precision)
    t0 = time.perf_counter()
    module = module.eval().to(device=config.device, dtype=dtype)
    args = tuple(_to_tensor(example[s.name], config.device, dtype) for s in input_specs)
    dyn = _dynamic_shapes(input_specs, example)
    try:
        with torch.no_grad():
            program = torch.export.export(module, args, dynamic_shapes=tuple(dyn[s.name] for s in input_specs),
                                          strict=False)
    except Exception as exc:  # torch raises many types (UserError, GuardOnDataDependentSymNode, Unsupported...)
        first = str(exc).strip().splitlines()[0][:400] if str(exc).strip() else type(exc).__name__
        raise TorchBuildError(f"torch.export cannot capture the model: {type(exc).__name__}: {first}",
                              hint="data-dependent control flow (if on tensor values) and Python side effects "
                                   "cannot be exported: use torch.cond, or build this model with the onnxruntime "
                                   "backend") from None
    axes = _exported_axes(program, input_specs)
    return program, axes, time.perf_counter() - t0


def build_torch_variant(module: "torch.nn.Module", example: Mapping[str, np.ndarray], input_specs: Sequence[Any],
                        config: TorchBuildConfig, out_dir: str | Path, *, source_sha256: str) -> TorchBuild:
    """Build a torch variant: export, (compile), save the artefact and its manifest into `out_dir`.

    Args:
        module: the FP32 reference model (modified in place: cast to the precision and moved to the device).
        example: {input name: (batch, ...) array} example batch (>= 2 along each named axis).
        input_specs: the spec's model.inputs (name, dtype, shape with axis names).
        config: precision, compile mode, device.
        out_dir: folder for the artefact (program.pt2 or package.pt2) and `<artefact>.json` (created).
        source_sha256: the reference model's digest (recorded in the fingerprint).

    Returns:
        The TorchBuild (paths, seconds, dynamic axes, facts).

    Raises:
        TorchBuildError: export or compilation failed (the reason in the message; nothing is left in out_dir).
        MissingDependencyError: torch is not installed.
    """
    torch = _torch()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    program, axes, export_s = export_program(module, example, input_specs, config)
    target = out / config.artifact_file
    partial = target.with_name(f".partial-{target.name}")  # torch wants the .pt2 suffix
    compile_s = 0.0
    try:
        t0 = time.perf_counter()
        if config.compile == "aot_inductor":
            try:
                torch._inductor.aoti_compile_and_package(program, package_path=str(partial))
            except Exception as exc:
                raise TorchBuildError(f"AOTInductor could not compile the model for {config.device}: "
                                      f"{type(exc).__name__}: "
                                      f"{str(exc).strip().splitlines()[0][:400] if str(exc).strip() else ''}",
                                      hint="an op without a kernel for this device/precision, or a compiler error; "
                                           "try compile: inductor or eager") from None
            compile_s = time.perf_counter() - t0
        else:
            torch.export.save(program, str(partial))
            if config.compile == "inductor":  # compile here: time it, fail at build rather than at load, and
                t0 = time.perf_counter()     # leave inductor's on-disk cache warm for the loads on this node
                fn = _compiled_call(program.module())
                dtype = torch_dtype(config.precision)
                for rows in (None, 1):  # batch >= 2 and batch 1: dynamo specialises size 1, a second graph
                    fn(*[_to_tensor(example[s.name][:rows], config.device, dtype) for s in input_specs])
                if config.device == "cuda":
                    torch.cuda.synchronize()
                compile_s = time.perf_counter() - t0
        partial.replace(target)
    except TorchBuildError:
        partial.unlink(missing_ok=True)
        raise
    except Exception as exc:
        partial.unlink(missing_ok=True)
        raise TorchBuildError(f"torch {config.compile} build failed: {type(exc).__name__}: "
                              f"{str(exc).strip().splitlines()[0][:400] if str(exc).strip() else ''}") from None
    fp = fingerprint(config, source_sha256, signature(input_specs))
    facts = {"export_seconds": round(export_s, 3), "compile_seconds": round(compile_s, 3),
             "dynamic_axes": {k: {str(i): v for i, v in d.items()} for k, d in axes.items()},
             "config": asdict(config)}
    manifest_file = write_manifest(target, fp, kind=config.artifact_kind, extra=facts)
    import json

    return TorchBuild(path=target, manifest=json.loads(manifest_file.read_text()), export_seconds=export_s,
                      compile_seconds=compile_s, dynamic_axes=axes,
                      details={**fp, **facts, "artifact_bytes": target.stat().st_size})


# ------------------------------------------------------------------------------------------------ running
def _compiled_call(module: Any) -> Callable[..., Any]:
    """torch.compile (inductor, dynamic shapes) of an exported program's module."""
    return _torch().compile(module, backend="inductor", dynamic=True)


def load_callable(path: str | Path, config: TorchBuildConfig, input_specs: Sequence[Any], *, trusted: bool = False,
                  fix: str = SPEC_FIX) -> Callable[..., Any]:
    """The artefact as a callable on tensors (positional, model.inputs order), without the manifest check
    (`TorchVariantRunner` does it first).

    A .pt2 is code unless proven otherwise (tailguard.core.pt2_archive): unless `trusted`, the archive is read
    first and refused when loading it would run code from it (a pickled weight or constant, a custom or opaque
    object, an expression or guard torch evaluates, or an AOTInductor package's native code).

    Raises:
        UntrustedModelError: (exit 2) the archive holds code and `trusted` is False; the hint is `fix`.
    """
    torch = _torch()
    check_pt2_archive(path, trusted=trusted, fix=fix)
    if config.compile == "aot_inductor":
        return torch._inductor.aoti_load_package(str(path))
    program = torch.export.load(str(path))
    module = program.module()
    if config.compile == "inductor":
        return _compiled_call(module)
    return module


def _flatten(out: Any) -> list[Any]:
    """Model outputs (tensor, tuple/list, dict, or a ModelOutput) as a list of tensors, in order."""
    if isinstance(out, dict):
        return list(out.values())
    if isinstance(out, (tuple, list)):
        return list(out)
    return [out]


class CudaGraphCache:
    """Replays `fn` as CUDA graphs, one per input signature (module docstring, "CUDA graphs").

    Args:
        fn: callable on CUDA tensors (positional), returning tensors (or a tuple/list/dict of them).
        max_graphs: most graphs kept; the least recently used is dropped beyond it.

    Thread-safe: replays are serialised with a lock (the graph's static buffers are shared).
    """

    def __init__(self, fn: Callable[..., Any], max_graphs: int = DEFAULT_MAX_CUDA_GRAPHS) -> None:
        torch = _torch()
        self.torch = torch
        self.fn = fn
        self.max_graphs = max_graphs
        self.graphs: "collections.OrderedDict[tuple, tuple[Any, list[Any], list[Any]]]" = collections.OrderedDict()
        self.pool = torch.cuda.graph_pool_handle()
        self.lock = threading.Lock()
        self.captures = 0

    def _capture(self, args: Sequence["torch.Tensor"]) -> tuple[Any, list[Any], list[Any]]:
        torch = self.torch
        static_in = [a.clone() for a in args]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(_WARMUP_BEFORE_CAPTURE):
                self.fn(*static_in)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            static_out = _flatten(self.fn(*static_in))
        self.captures += 1
        return graph, static_in, static_out

    def __call__(self, *args: "torch.Tensor") -> list["torch.Tensor"]:
        """Outputs of `fn(*args)` (copies, owned by the caller)."""
        key = tuple((tuple(a.shape), str(a.dtype)) for a in args)
        with self.lock:
            entry = self.graphs.get(key)
            if entry is None:
                entry = self._capture(args)
                self.graphs[key] = entry
                while len(self.graphs) > self.max_graphs:
                    self.graphs.popitem(last=False)
            else:
                self.graphs.move_to_end(key)
            graph, static_in, static_out = entry
            for dst, src in zip(static_in, args):
                dst.copy_(src, non_blocking=True)
            graph.replay()
            return [o.clone() for o in static_out]


class TorchVariantRunner:
    """Runs a built torch variant (the `Runner` protocol of tailguard.core.runtime): numpy feeds in, float32 numpy
    outputs out, after checking the artefact's manifest against this node.

    Args:
        path: the artefact (program.pt2 or package.pt2) with its `<path>.json` manifest.
        config: the variant's settings (must be those it was built with; cuda_graphs may differ).
        input_specs: the spec's model.inputs (forward's positional order).
        source_sha256: the reference model's digest the artefact must have been built from.
        intra_op_num_threads: CPU threads (0: leave torch's setting).
        trusted: load without reading the archive first (`load_callable`): a source the caller trusts
            (`model.source.trusted`, the monitor's `--trusted`, or a package this run built itself).
        fix: how the user marks the source trusted, for the refusal's hint.

    Raises:
        ArtifactMismatchError: the file changed, or was built for another torch version, device, GPU, CPU ISA,
            settings or source model (every differing field named).
        UntrustedModelError: (exit 2) not `trusted` and loading the archive would run code from it.
        MissingDependencyError: torch is not installed.
    """

    def __init__(self, path: str | Path, config: TorchBuildConfig, input_specs: Sequence[Any], *,
                 source_sha256: str, intra_op_num_threads: int = 0, trusted: bool = False,
                 fix: str = SPEC_FIX) -> None:
        torch = _torch()
        self.torch = torch
        self.config = config
        self.input_names = [s.name for s in input_specs]
        if intra_op_num_threads:
            torch.set_num_threads(intra_op_num_threads)
        self.manifest = verify_artifact(path, fingerprint(config, source_sha256, signature(input_specs)),
                                        kind=config.artifact_kind)
        self.path = Path(path)
        self.dtype = torch_dtype(config.precision)
        fn = load_callable(path, config, input_specs, trusted=trusted, fix=fix)
        self.graphs = CudaGraphCache(fn, config.max_cuda_graphs) if config.cuda_graphs else None
        self.fn = fn

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Run one batch: {input: (batch, ...) array} -> outputs as float32 (floating) numpy arrays, in order."""
        torch = self.torch
        args = [_to_tensor(feeds[n], self.config.device, self.dtype) for n in self.input_names]
        with torch.inference_mode():
            outs = self.graphs(*args) if self.graphs is not None else _flatten(self.fn(*args))
        return [(o.float() if o.is_floating_point() else o).cpu().numpy() for o in outs]


def _probe_child(path: str, config: dict[str, Any], input_specs: list[dict[str, Any]], source_sha256: str,
                 feeds: dict[str, np.ndarray], trusted: bool = False) -> None:
    """Child process of `probe_load`: load the artefact and run one batch (a crash ends only this process)."""
    import faulthandler
    from types import SimpleNamespace

    faulthandler.enable()
    specs = [SimpleNamespace(**s) for s in input_specs]
    TorchVariantRunner(path, TorchBuildConfig(**config), specs, source_sha256=source_sha256,
                       trusted=trusted).run(feeds)


def probe_load(path: str | Path, config: TorchBuildConfig, input_specs: Sequence[Any], *, source_sha256: str,
               feeds: Mapping[str, np.ndarray], timeout_s: float = 600.0, trusted: bool = False,
               fix: str = SPEC_FIX) -> str | None:
    """Load and run an artefact once in a child process (spawned) before this process loads it: a native loader
    that crashes the interpreter (seen: SIGSEGV in `aoti_load_package`, torch 2.11 on an H200, 2026-11-26) then
    fails the variant with the reason instead of ending the task.

    Args:
        path, config, input_specs, source_sha256, trusted, fix: as `TorchVariantRunner`.
        feeds: one batch {input: (batch, ...) array}.
        timeout_s: seconds before the child is killed (a hang counts as a failure).

    Returns:
        None when the child loaded and ran the batch; else the reason (its exit code or signal, or the timeout).
        A manifest mismatch in the child is a non-zero exit: the caller's own load then raises the full message.

    Raises:
        UntrustedModelError: (exit 2) not `trusted` and the archive holds code: checked here before the child is
            started, and again by the child's own load.
    """
    import multiprocessing

    check_pt2_archive(path, trusted=trusted, fix=fix)
    proc = multiprocessing.get_context("spawn").Process(
        target=_probe_child, args=(str(path), asdict(config), signature(input_specs), source_sha256, dict(feeds),
                                   trusted))
    proc.start()
    proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return f"loading {config.artifact_kind} {Path(path).name} did not finish within {timeout_s:g} s"
    if proc.exitcode == 0:
        return None
    how = f"signal {-proc.exitcode}" if proc.exitcode < 0 else f"exit code {proc.exitcode}"
    return (f"loading and running {config.artifact_kind} {Path(path).name} in a probe process ended with {how} "
            f"(torch {_torch().__version__}; its stack is in the task log)")


def runner_for_artifact(path: str | Path, input_specs: Sequence[Any], *, intra_op_num_threads: int = 0,
                        cuda_graphs: bool | None = None, trusted: bool = False,
                        fix: str = SPEC_FIX) -> TorchVariantRunner:
    """A TorchVariantRunner for an artefact found on its own (a registry download, the monitor's candidate): the
    settings and the source digest come from its manifest, the node check from this node.

    Args:
        path: program.pt2 or package.pt2 with its `<path>.json` manifest beside it.
        input_specs: the spec's model.inputs (their signature is part of the fingerprint).
        intra_op_num_threads: CPU threads (0: leave torch's setting).
        cuda_graphs: override the recorded CUDA-graph setting (None: as built).
        trusted, fix: as `TorchVariantRunner` (a registry download or a monitor candidate is untrusted unless the
            spec's model.source.trusted or the monitor's --trusted says otherwise).

    Raises:
        ArtifactMismatchError: no or unreadable manifest, a changed file, or another node / torch build.
        UntrustedModelError: (exit 2) not `trusted` and loading the archive would run code from it.
    """
    from tailguard.core.artifacts import read_manifest

    manifest = read_manifest(path, kind="torch artefact")
    recorded = dict((manifest.get("facts") or {}).get("config") or {})
    if not recorded:
        raise ArtifactMismatchError(f"torch artefact {path}: its manifest records no build settings",
                                    hint="rebuild it with this tailguard version")
    if cuda_graphs is not None:
        recorded["cuda_graphs"] = cuda_graphs
    config = TorchBuildConfig(**recorded)
    return TorchVariantRunner(path, config, input_specs, source_sha256=manifest["fingerprint"].get("source_sha256", ""),
                              intra_op_num_threads=intra_op_num_threads, trusted=trusted, fix=fix)


class EagerModuleRunner:
    """A torch.nn.Module run eagerly on a device in a precision (the baseline the torch variants are timed
    against, e.g. the FP32 reference on the GPU): numpy feeds in, float32 numpy outputs out.

    Args:
        module: the model (cast and moved in place).
        input_specs: the spec's model.inputs (forward's positional order).
        precision: "fp32" | "fp16" | "bf16".
        device: "cpu" | "cuda".
    """

    def __init__(self, module: "torch.nn.Module", input_specs: Sequence[Any], *, precision: str = "fp32",
                 device: str = "cpu") -> None:
        torch = _torch()
        self.torch = torch
        self.dtype = torch_dtype(precision)
        self.device = device
        self.module = module.eval().to(device=device, dtype=self.dtype)
        self.input_names = [s.name for s in input_specs]

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Run one batch: {input: (batch, ...) array} -> float32 numpy outputs, in order."""
        torch = self.torch
        args = [_to_tensor(feeds[n], self.device, self.dtype) for n in self.input_names]
        with torch.inference_mode():
            outs = _flatten(self.module(*args))
        return [(o.float() if o.is_floating_point() else o).cpu().numpy() for o in outs]
