"""The torch backend's variants of all-MiniLM-L6-v2 on one device: built, checked at the demo's gates, timed
interleaved against torch eager FP32; one JSON (benchmarks/results/gpu.json).

Needs only what the lent GPU machine has (PyTorch + CUDA, Triton, transformers, numpy/pandas/pyarrow/scipy,
matplotlib) plus tailguard and pydantic carried as wheels, and the bundle of benchmarks/gpu/prepare_bundle.py (the
demo's 2,500 WordNet validation rows, its spec and MiniLM's FP32 weights). No MLflow, no KFP, no network.

What runs, in order:
1. The FP32 reference outputs: the model in torch eager FP32 on the CPU, as the pipeline's reference pass computes
   them (components/reference), over every validation row.
2. The variants (`variant_catalogue`): torch eager FP32 on the device (the baseline); eager FP16/BF16; inductor FP16;
   AOTInductor FP16; each FP16 one also replayed as CUDA graphs. Each is built by the product's torch backend
   (tailguard.core.torch_backend: torch.export, the precision cast, inductor / AOTInductor, the manifest) and loaded
   through its manifest check, exactly as the pipeline's build and validate steps do; build seconds are recorded.
   A variant the node cannot run is skipped with the reason, one that fails to build or run is failed with it.
3. Parity and gates: `components.validate.logic.validate_variant` (the validate step's own code) against the
   reference outputs with the spec's gates: nn_top1_agreement >= 0.90, cosine_similarity.p01 >= 0.98, every
   lexicographer class's 95% Wilson lower bound on nn_top1_agreement >= 0.85, discovered slices, latency p99.
4. Timing: every built runner in interleaved rounds (`core.latency.interleaved_benchmark`: the same batch per round,
   alternating order, one clock per run; a run includes the host-to-device copy of the inputs and the copy of the
   outputs back, i.e. what a server pays) at batch sizes 1 and 32, with enough warm-up rounds that every batch of
   the pool was seen (and its CUDA graph captured) before timing; speed ratios of medians vs torch eager FP32 with
   paired-bootstrap 95% bounds (`core.latency.speed_ratio`).

`best_passing_speedup_vs_torch_eager` is, per batch size, the largest ratio among variants that passed every gate.

`--quick` (`run_quick`, issue 39) reorders this for a short device call: build, then timing at every batch size,
then parity on a subset of rows, each phase bounded and the report rewritten after every step.

Usage:
    python benchmarks/gpu/bench_gpu.py --bundle .gpu-bundle --quick --batch-sizes 1,8,32 --out gpu.json  # GPU call
    python benchmarks/gpu/bench_gpu.py --bundle .gpu-bundle --out benchmarks/results/gpu.json   # the GPU machine
    python benchmarks/gpu/bench_gpu.py --tiny --out /tmp/gpu-dry.json                           # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

BASELINE = "torch-eager-fp32"
ORT = "ort-fp32"  # the demo spec's fused ONNX Runtime FP32 variant, timed beside the torch variants on a CPU
TARGET_SPEEDUP = 3.0  # issue 28's target at batch 1 on an H100-class GPU
PACKAGES = ("torch", "triton", "transformers", "numpy", "onnx", "onnxruntime", "pydantic", "tailguard")


@dataclass(frozen=True)
class BenchVariant:
    """A variant of the benchmark: its name and the torch backend settings (None: the eager nn.Module baseline)."""

    name: str
    precision: str
    compile: str
    cuda_graphs: bool = False


def variant_catalogue(device: str) -> list[BenchVariant]:
    """The variants timed on `device`: FP16 is CUDA-only (torch has no fast FP16 CPU kernels), CUDA graphs too."""
    out = [BenchVariant(BASELINE, "fp32", "module")]
    if device == "cuda":
        out += [BenchVariant("torch-eager-fp16", "fp16", "eager"),
                BenchVariant("torch-eager-bf16", "bf16", "eager"),
                BenchVariant("torch-eager-fp16-cudagraphs", "fp16", "eager", True),
                BenchVariant("torch-inductor-fp16", "fp16", "inductor"),
                BenchVariant("torch-inductor-fp16-cudagraphs", "fp16", "inductor", True),
                BenchVariant("torch-aoti-fp16", "fp16", "aot_inductor"),
                BenchVariant("torch-aoti-fp16-cudagraphs", "fp16", "aot_inductor", True)]
    else:
        out += [BenchVariant("torch-export-fp32", "fp32", "eager"),
                BenchVariant("torch-eager-bf16", "bf16", "eager"),
                BenchVariant("torch-inductor-fp32", "fp32", "inductor"),
                BenchVariant("torch-aoti-fp32", "fp32", "aot_inductor")]
    return out


def quick_catalogue(device: str) -> list[BenchVariant]:
    """`--quick`'s variants: the catalogue without AOTInductor (a package that crashed at load on torch 2.11 is
    left to a second call, `--variants torch-aoti-...`), so the timing call is short and cannot lose its figures."""
    return [v for v in variant_catalogue(device) if v.compile != "aot_inductor"]


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------------------------- inputs
def write_tiny_bundle(out: Path, *, rows: int = 240, seed: int = 0) -> Path:
    """A bundle with a 2-layer random-weight MeanPooledEncoder (vocab 120, width 32) and `rows` synthetic rows with
    the demo's metadata columns, for the CPU dry run (tests/integration/test_gpu_bench.py), with the demo spec's
    parity gates (its latency gate is dropped: a p99 on a loaded test machine would decide the dry run). Returns the
    folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    import yaml
    from safetensors.torch import save_file

    from tailguard.demo.run import demo_spec_text
    from tailguard.models import MeanPooledEncoder

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    kwargs = {"vocab_size": 120, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 64, "max_position_embeddings": 64, "type_vocab_size": 2, "hidden_act": "gelu",
              "layer_norm_eps": 1e-12, "normalize": True}
    torch.manual_seed(seed)
    save_file(MeanPooledEncoder(**kwargs).state_dict(), str(out / "weights.safetensors"))
    lex = ["noun.act", "noun.animal", "verb.motion", "adj.all"]
    n_tok = rng.integers(3, 20, size=rows)
    ids = [[101, *rng.integers(103, 120, size=n - 2).tolist(), 102] for n in n_tok]
    table = pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.int64())),
                      "attention_mask": pa.array([[1] * len(r) for r in ids], type=pa.list_(pa.int64())),
                      "lexname": [lex[i % len(lex)] for i in range(rows)],
                      "pos": [lex[i % len(lex)].split(".")[0] for i in range(rows)],
                      "n_tokens": n_tok.astype(np.int64), "rare_token_rate": rng.uniform(0, 0.3, size=rows),
                      "synset_id": [f"{i:08d}-n" for i in range(rows)]})
    pq.write_table(table, out / "validation.parquet")
    doc = yaml.safe_load(demo_spec_text())
    doc["data"]["validation"]["uri"] = doc["data"]["calibration"]["uri"] = "validation.parquet"
    doc["data"]["expectations"] = []
    doc["model"]["source"]["init_kwargs"] = kwargs
    doc["model"]["outputs"][0]["shape"] = ["batch", kwargs["hidden_size"]]
    # a latency gate on a dry run decides nothing and fails on a loaded machine: parity gates only
    doc["gates"] = [g for g in doc["gates"] if not str(g.get("metric", "")).startswith("latency_ms")]
    for v in doc["variants"]:  # the BERT fusion's attention shape is the tiny model's
        if (v.get("graph_optimization") or {}).get("num_heads"):
            v["graph_optimization"].update(num_heads=kwargs["num_attention_heads"], hidden_size=kwargs["hidden_size"])
    (out / "spec.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    (out / "bundle.json").write_text(json.dumps({"model": "tiny random MeanPooledEncoder (CPU dry run)",
                                                 "init_kwargs": kwargs, "validation_rows": rows}))
    return out


def load_bundle(folder: Path) -> tuple[Any, dict[str, Any], Any]:
    """(spec, bundle.json, model factory) of a bundle folder."""
    from tailguard.core.spec import load_spec

    meta = json.loads((folder / "bundle.json").read_text())
    spec = load_spec(folder / "spec.yaml")

    def factory() -> Any:
        from safetensors.torch import load_file

        from tailguard.models import MeanPooledEncoder

        model = MeanPooledEncoder(**meta["init_kwargs"])
        model.load_state_dict(load_file(str(folder / "weights.safetensors")), strict=True)
        return model.eval()

    return spec, meta, factory


# --------------------------------------------------------------------------------------------- the run
def _failure(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:500]


def _example(validation: Any, input_specs: Any, pad_values: Any) -> dict[str, np.ndarray]:
    """An export example: the 4 longest rows, padded together (>= 2 along every named axis)."""
    from tailguard.core.data import make_batch

    idx = np.argsort(-validation.lengths, kind="stable")[:4]
    return make_batch(validation, idx, input_specs, pad_values=pad_values)


def ort_fp32_runner(factory: Any, spec: Any, example: dict[str, np.ndarray], out: Path) -> Any:
    """The spec's `ort-fp32` variant as the pipeline builds it: the export step's ONNX export (checked against torch
    elsewhere; here only written), then the `onnxruntime` builder (BERT fusion), in an ONNX Runtime session
    whose workers never spin-wait (`OrtRunner(allow_spinning=False)`: spinning workers slow the torch runs timed in
    the same rounds; the validate step times torch variants beside the same kind of session)."""
    from tailguard.components.build.registry import get_builder
    from tailguard.components.export.logic import export_onnx
    from tailguard.core.runtime import OrtRunner

    variant = next(v for v in spec.variants if v.name == ORT)
    export_onnx(factory(), spec.model, example, out / "fp32" / "model.onnx")
    built = get_builder("onnxruntime").build(variant, out / "fp32" / "model.onnx", out / "built", calibration=None,
                                             model=spec.model)
    if built.status != "ok":
        raise RuntimeError(f"{ORT} build {built.status}: {built.reason}")
    return OrtRunner(built.artifact, allow_spinning=False)


def _build_child(bundle: str, example_npz: str, config: dict[str, Any], out_dir: str, source_sha: str,
                 result: str) -> None:
    """Child process of `build_isolated`: build (and, with `load`, only load and run once), write facts to
    `result`."""
    import faulthandler

    faulthandler.enable()  # a crash in a compiler or loader prints the Python stack before the process dies
    from tailguard.core.torch_backend import TorchBuildConfig, TorchVariantRunner, build_torch_variant

    spec, _, factory = load_bundle(Path(bundle))
    example = dict(np.load(example_npz))
    load = config.pop("load", False)
    cfg = TorchBuildConfig(**config)
    if load:
        t0 = time.perf_counter()
        TorchVariantRunner(Path(out_dir) / cfg.artifact_file, cfg, spec.model.inputs,
                           source_sha256=source_sha).run(example)
        Path(result).write_text(json.dumps({"load_and_run_seconds": round(time.perf_counter() - t0, 3)}))
        return
    t0 = time.perf_counter()
    b = build_torch_variant(factory(), example, spec.model.inputs, cfg, out_dir, source_sha256=source_sha)
    wall = time.perf_counter() - t0
    Path(result).write_text(json.dumps({"path": str(b.path), "artifact_bytes": b.details["artifact_bytes"],
                                        "export_seconds": round(b.export_seconds, 3),
                                        "compile_seconds": round(b.compile_seconds, 3),
                                        "wall_seconds": round(wall, 3), "dynamic_axes": b.details["dynamic_axes"]}))


def _child(bundle: Path, npz: Path, config: dict[str, Any], out_dir: Path, source_sha: str, result: Path,
           what: str, timeout: float | None = None) -> dict[str, Any]:
    import multiprocessing

    result.unlink(missing_ok=True)
    proc = multiprocessing.get_context("spawn").Process(
        target=_build_child, args=(str(bundle), str(npz), config, str(out_dir), source_sha, str(result)))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():  # past its deadline: killed, so the phases after it still run
        proc.kill()
        proc.join()
        raise RuntimeError(f"the {what} process was stopped at its deadline ({timeout:.0f} s)")
    if proc.exitcode != 0 or not result.is_file():
        how = f"signal {-proc.exitcode}" if proc.exitcode and proc.exitcode < 0 else f"exit code {proc.exitcode}"
        raise RuntimeError(f"the {what} process ended with {how} (its stack and error are in the log)")
    return json.loads(result.read_text())


def build_isolated(bundle: Path, example: dict[str, np.ndarray], config: Any, out_dir: Path,
                   source_sha: str, *, timeout: float | None = None, load_check: bool = True) -> dict[str, Any]:
    """Build a variant in a child process (spawned), then load and run it once in another, so that a compiler or
    loader that crashes the interpreter (a segfault, an abort in a CUDA library) fails that variant, with the
    signal and the child's stack on stderr, instead of ending the benchmark. Two processes, as in the pipeline,
    where the build step and the validate step are separate tasks.

    `timeout` (s) bounds the build child, which is killed past it; `load_check=False` skips the load-and-run
    child (`--quick`: an eager or inductor program loads through torch.export.load, which has never crashed; only
    AOTInductor's native loader has).

    Raises:
        RuntimeError: a child failed (its exit code or signal), ran past `timeout`, or wrote no result.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    npz, result = out_dir / "example.npz", out_dir / "child-result.json"
    np.savez(npz, **example)
    what = f"{config.compile} {config.precision}"
    facts = _child(bundle, npz, asdict_config(config), out_dir, source_sha, result, f"{what} build", timeout)
    if load_check:
        facts.update(_child(bundle, npz, {**asdict_config(config), "load": True}, out_dir, source_sha, result,
                            f"{what} load-and-run"))
    return facts


def asdict_config(config: Any) -> dict[str, Any]:
    """The TorchBuildConfig's fields as a dict (picklable across the spawn)."""
    return asdict(config)


def _start_variant(v: BenchVariant, device: str, row: dict[str, Any], runners: dict[str, Any], factory: Any,
                   inputs: Any) -> Any:
    """The first step of every variant in `run` and `run_quick`: the eager nn.Module baseline gets its runner
    (row status ok), a variant this node cannot run is skipped with the reason; returns the TorchBuildConfig of a
    variant to build, or None when there is nothing to build."""
    from tailguard.core.torch_backend import EagerModuleRunner, TorchBuildConfig, unavailable_reason

    if v.compile == "module":
        runners[v.name] = EagerModuleRunner(factory(), inputs, precision=v.precision, device=device)
        row.update(status="ok", build=None)
        return None
    config = TorchBuildConfig(precision=v.precision, compile=v.compile, device=device, cuda_graphs=v.cuda_graphs)
    reason = unavailable_reason(config)
    if reason:
        row.update(status="skipped", reason=reason)
        return None
    return config


def run(bundle: Path, device: str, variants: list[BenchVariant], work: Path, *, rounds: int,
        max_seconds: float, batch_sizes: list[int], checkpoint: Any = None,
        build_deadline: float = float("inf"), validate_deadline: float = float("inf"),
        with_ort: bool = False) -> dict[str, Any]:
    """Build, validate and time `variants` on `device`; returns the JSON report (module docstring).
    `checkpoint(rows)`, when given, is called with the variant rows after the builds and after validation (so a
    run cut short by a time limit still leaves what it measured); no build starts after `build_deadline` seconds
    (the variants left are skipped, so that validation and timing of the others still fit a time limit), and no
    validation after `validate_deadline` seconds (those variants are skipped and not timed); with
    `with_ort`, the spec's ort-fp32 variant (exported and BERT-fused by the pipeline's own export and build steps)
    is validated and timed in the same rounds, and every ratio is also given against it (speedup_vs_ort_fp32)."""
    import torch

    from tailguard.components.validate.logic import validate_variant
    from tailguard.core.data import load_dataset
    from tailguard.core.digests import file_sha256
    from tailguard.core.latency import POOL_SIZE, interleaved_benchmark
    from tailguard.core.runtime import run_dataset
    from tailguard.core.spec.benchmark import BenchmarkSpec
    from tailguard.core.torch_backend import EagerModuleRunner, TorchVariantRunner

    t_start = time.perf_counter()
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device {device}"
          + (f" ({torch.cuda.get_device_name(0)})" if device == "cuda" else ""), flush=True)
    spec, meta, factory = load_bundle(bundle)
    inputs, pad = spec.model.inputs, spec.model.pad_values
    validation = load_dataset(spec.data.validation.uri, inputs, field="data.validation")
    source_sha = file_sha256(bundle / "weights.safetensors")

    t0 = time.perf_counter()
    reference = run_dataset(EagerModuleRunner(factory(), inputs, device="cpu"), validation, inputs,
                            batch_size=spec.data.validation.batch_size, pad_values=pad)
    reference_seconds = time.perf_counter() - t0
    example = _example(validation, inputs, pad)

    # the validate step's own benchmark only decides the spec's latency gate (p99 <= 100 ms at batch 1): short
    quick = spec.benchmark.model_copy(update={"batch_sizes": [1], "warmup": POOL_SIZE, "iterations": 50,
                                               "max_seconds": 2.0})
    vspec = spec.model_copy(update={"benchmark": quick})

    rows: dict[str, dict[str, Any]] = {}
    runners: dict[str, Any] = {}
    builds: dict[str, dict[str, Any]] = {}
    for v in variants:
        row: dict[str, Any] = {"name": v.name, "precision": v.precision, "compile": v.compile,
                               "cuda_graphs": v.cuda_graphs, "device": device}
        rows[v.name] = row
        try:
            config = _start_variant(v, device, row, runners, factory, inputs)
            if config is None:
                continue
            key = json.dumps(config.build_settings(), sort_keys=True)
            if key not in builds:  # cuda_graphs is a load-time choice: one artefact serves both
                if time.perf_counter() - t_start > build_deadline:
                    row.update(status="skipped", reason=f"not built: past --build-deadline ({build_deadline:g} s)")
                    continue
                try:
                    builds[key] = build_isolated(bundle, example, config, work / v.name, source_sha)
                except Exception as exc:  # remembered: the twin with(out) CUDA graphs is not rebuilt
                    builds[key] = {"error": _failure(exc)}
                    traceback.print_exc()
            b = builds[key]
            if "error" in b:
                row.update(status="failed", reason=b["error"])
                continue
            t0 = time.perf_counter()
            runners[v.name] = TorchVariantRunner(b["path"], config, inputs, source_sha256=source_sha)
            row.update(status="ok", build={**{k: b[k] for k in ("artifact_bytes", "export_seconds",
                                                                 "compile_seconds", "wall_seconds", "dynamic_axes")},
                                           "artifact": Path(b["path"]).name,
                                           "load_seconds": round(time.perf_counter() - t0, 3)})
        except Exception as exc:  # a variant that fails is reported, the run goes on
            row.update(status="failed", reason=_failure(exc))
            runners.pop(v.name, None)
            traceback.print_exc()
        print(f"[{time.perf_counter() - t_start:7.1f}s] built {v.name}: {row['status']} {row.get('reason', '')}",
              flush=True)

    if with_ort:  # the pipeline's promoted ORT FP32 (BERT-fused) variant, timed in the same rounds
        t0 = time.perf_counter()
        rows[ORT] = {"name": ORT, "backend": "onnxruntime", "precision": "fp32", "compile": "ort-bert-fusion",
                     "cuda_graphs": False, "device": "cpu"}
        try:
            runners[ORT] = ort_fp32_runner(factory, spec, example, work / ORT)
            rows[ORT].update(status="ok", build={"wall_seconds": round(time.perf_counter() - t0, 3)})
        except Exception as exc:
            rows[ORT].update(status="failed", reason=_failure(exc))
            traceback.print_exc()
    if checkpoint:
        checkpoint(rows)
    for name in list(runners):
        row = rows[name]
        if name != BASELINE and time.perf_counter() - t_start > validate_deadline:
            row.update(status="skipped", reason=f"not validated: past --validate-deadline ({validate_deadline:g} s)")
            runners.pop(name)
            continue
        try:
            t0 = time.perf_counter()
            res = validate_variant(vspec, name, runners[name], reference, validation, work / "validate" / name)
            row.update(passed=bool(res.passed), validate_seconds=round(time.perf_counter() - t0, 3),
                       gates=[{"gate": g.gate, "status": str(g.status), "observed": g.observed,
                               "threshold": g.threshold} for g in res.gates],
                       parity={k: res.overall.get(k) for k in ("nn_top1_agreement", "cosine_similarity.p01",
                                                               "cosine_similarity.mean", "abs_error.max",
                                                               "nn_top5_agreement")},
                       worst_slice=res.worst_slice,
                       non_finite_rows=res.non_finite_rows)
            if getattr(runners[name], "graphs", None) is not None:
                row["cuda_graphs_captured"] = runners[name].graphs.captures
        except Exception as exc:
            row.update(status="failed", passed=False, reason=_failure(exc))
            runners.pop(name)
            traceback.print_exc()
        print(f"[{time.perf_counter() - t_start:7.1f}s] validated {name}: passed={row.get('passed')} "
              f"{row.get('parity', {})}", flush=True)

    if checkpoint:
        checkpoint(rows)
    timed: dict[str, Any] = {}
    if BASELINE in runners:
        bench = BenchmarkSpec(batch_sizes=batch_sizes, warmup=POOL_SIZE + 2, iterations=rounds,
                              max_seconds=max_seconds, seed=0)
        t0 = time.perf_counter()
        timed = interleaved_benchmark(runners, validation, inputs, bench, pad_values=pad)
        timing_seconds = time.perf_counter() - t0
        add_perf(rows, timed)
        timing_method = next(iter(timed[BASELINE].values()))["method"]
    else:
        timing_seconds, timing_method = 0.0, "not timed: the baseline failed"

    best = best_passing(rows, batch_sizes)
    first = str(batch_sizes[0])
    return {
        **device_header(device, meta),
        "validation_rows": validation.n_rows,
        "reference": f"torch eager FP32 on the CPU over every validation row ({reference_seconds:.1f} s), as the "
                     "pipeline's reference pass",
        "gates": [g.model_dump(exclude_none=True) for g in spec.gates],
        "timing": {"batch_sizes": batch_sizes, "rounds": rounds, "max_seconds_per_batch_size": max_seconds,
                   "method": timing_method, "seconds": round(timing_seconds, 1),
                   "what_a_run_includes": "host-to-device copy of the inputs, the model, device-to-host copy of "
                                          "the outputs (synchronous)"},
        "variants": list(rows.values()),
        "best_passing_speedup_vs_torch_eager": best,
        "target": {"metric": f"best_passing_speedup_vs_torch_eager at batch {first}", "min": TARGET_SPEEDUP,
                   "met": bool(best.get(first) and best[first]["speedup"] >= TARGET_SPEEDUP),
                   "applies_to": "an H100-class GPU (issue 28)"},
        "total_seconds": round(time.perf_counter() - t_start, 1),
    }


def run_quick(bundle: Path, device: str, variants: list[BenchVariant], work: Path, *, rows_subset: int,
              rounds: int, max_seconds: float, batch_sizes: list[int], write: Any,
              build_deadline: float, parity_deadline: float, build_timeout: float) -> dict[str, Any]:
    """`--quick`: timing first, then parity, each phase bounded, the report rewritten after every step (issue 39).

    Phases, in order (seconds counted from the start of this function):
    1. setup: the bundle, the first `rows_subset` validation rows (a fixed subset: the file's order), and their FP32
       reference outputs (torch eager FP32 on the CPU, as the pipeline's reference pass).
    2. build: every variant with the product's torch backend; an inductor or AOTInductor build in a child process
       killed after `build_timeout` s (an AOTInductor package is also loaded and run once in a second child, since
       its native loader crashed on torch 2.11), then loaded here and run for batch >= 2 and batch 1 (inductor
       compiles then, its cache warm); eager programs are exported here (no child: torch.export.load has never
       crashed). No build starts after `build_deadline` s; a twin with(out) CUDA graphs reuses the artefact.
    3. timing: every built runner in interleaved rounds (`core.latency.interleaved_benchmark`), one batch size at
       a time (`rounds` rounds or `max_seconds`), the report written after each batch size.
    4. parity: `validate_variant` (the validate step's own code and the spec's gates) on the subset, one variant at
       a time, none started after `parity_deadline` s, the report written after each.
    The report's `phases` says which phases completed; a cut call keeps every figure written before the cut.

    Args:
        write: called with the report (dict) after every step; it must replace the file atomically.

    Returns:
        The final report (also passed to `write`).
    """
    from tailguard.components.validate.logic import validate_variant
    from tailguard.core.data import load_dataset
    from tailguard.core.digests import file_sha256
    from tailguard.core.latency import POOL_SIZE, interleaved_benchmark
    from tailguard.core.runtime import run_dataset
    from tailguard.core.spec.benchmark import BenchmarkSpec
    from tailguard.core.torch_backend import EagerModuleRunner, TorchVariantRunner, build_torch_variant

    t_start = time.perf_counter()

    def clock() -> float:
        return round(time.perf_counter() - t_start, 1)

    spec, meta, factory = load_bundle(bundle)
    inputs, pad = spec.model.inputs, spec.model.pad_values
    full = load_dataset(spec.data.validation.uri, inputs, field="data.validation")
    validation = full.subset(np.arange(min(rows_subset, full.n_rows)))
    source_sha = file_sha256(bundle / "weights.safetensors")
    reference = run_dataset(EagerModuleRunner(factory(), inputs, device="cpu"), validation, inputs,
                            batch_size=spec.data.validation.batch_size, pad_values=pad)
    example = _example(validation, inputs, pad)
    rows: dict[str, dict[str, Any]] = {}
    report = {**device_header(device, meta), "mode": "quick", "validation_rows": validation.n_rows,
              "validation_rows_in_bundle": full.n_rows,
              "reference": "torch eager FP32 on the CPU over the subset's rows, as the pipeline's reference pass",
              "gates": [g.model_dump(exclude_none=True) for g in spec.gates],
              "timing": {"batch_sizes": batch_sizes, "rounds": rounds, "max_seconds_per_batch_size": max_seconds,
                         "clock": "time.perf_counter around runner.run, which copies the inputs to the device, "
                                  "runs the model and copies the outputs back (a synchronising copy): what a server "
                                  "pays per request, not kernel time alone"},
              "phases": {"setup": clock()}, "variants": [], "best_passing_speedup_vs_torch_eager": {}}

    def emit(phase: str | None = None) -> None:
        if phase:
            report["phases"][phase] = clock()
        report["variants"] = list(rows.values())
        best = best_passing(rows, batch_sizes)
        report["best_passing_speedup_vs_torch_eager"] = best
        first = str(batch_sizes[0])
        report["target"] = {"metric": f"best_passing_speedup_vs_torch_eager at batch {first}",
                            "min": TARGET_SPEEDUP,
                            "met": bool(best.get(first) and best[first]["speedup"] >= TARGET_SPEEDUP)}
        report["total_seconds"] = clock()
        write(report)

    emit("setup")
    runners: dict[str, Any] = {}
    failed_builds: dict[str, str] = {}  # artefact folder -> reason: its twin is not loaded (a crash would end the run)
    for v in variants:
        row: dict[str, Any] = {"name": v.name, "precision": v.precision, "compile": v.compile,
                               "cuda_graphs": v.cuda_graphs, "device": device}
        rows[v.name] = row
        try:
            config = _start_variant(v, device, row, runners, factory, inputs)
            if config is None:
                continue
            out_dir = work / f"{v.compile}-{v.precision}"
            path = out_dir / config.artifact_file
            t0 = time.perf_counter()
            if str(out_dir) in failed_builds:  # the twin with(out) CUDA graphs failed to build or to load
                row.update(status="failed", reason=failed_builds[str(out_dir)])
                continue
            if not path.is_file():  # the twin with(out) CUDA graphs shares the artefact
                if time.perf_counter() - t_start > build_deadline:
                    row.update(status="skipped", reason=f"not built: past the build deadline ({build_deadline:g} s)")
                    continue
                if v.compile != "eager":  # a compiler or native loader may crash: child processes
                    facts = build_isolated(bundle, example, config, out_dir, source_sha, timeout=build_timeout,
                                           load_check=v.compile == "aot_inductor")
                    row["build"] = {k: facts[k] for k in ("export_seconds", "compile_seconds", "wall_seconds",
                                                          "load_and_run_seconds") if k in facts}
                else:
                    b = build_torch_variant(factory(), example, inputs, config, out_dir, source_sha256=source_sha)
                    row["build"] = {"export_seconds": round(b.export_seconds, 3),
                                    "wall_seconds": round(time.perf_counter() - t0, 3)}
            runner = TorchVariantRunner(path, config, inputs, source_sha256=source_sha)
            t1 = time.perf_counter()
            runner.run({k: a[:2] for k, a in example.items()})  # inductor compiles here (warm cache): batch >= 2
            runner.run({k: a[:1] for k, a in example.items()})  # and batch 1, which dynamo specialises
            row.setdefault("build", {})["first_runs_seconds"] = round(time.perf_counter() - t1, 3)
            runners[v.name] = runner
            row.update(status="ok")
        except Exception as exc:  # a variant that fails is reported, the run goes on
            row.update(status="failed", reason=_failure(exc))
            runners.pop(v.name, None)
            if v.compile != "module":
                failed_builds[str(work / f"{v.compile}-{v.precision}")] = row["reason"]
            traceback.print_exc()
        finally:
            print(f"[{clock():7.1f}s] built {v.name}: {row['status']} {row.get('reason', '')}", flush=True)
            emit()
    emit("build")

    if BASELINE in runners:
        for bs in batch_sizes:
            bench = BenchmarkSpec(batch_sizes=[bs], warmup=POOL_SIZE + 2, iterations=rounds,
                                  max_seconds=max_seconds, seed=0)
            try:
                timed = interleaved_benchmark(runners, validation, inputs, bench, pad_values=pad)
                add_perf(rows, timed)
                report["timing"]["method"] = next(iter(timed[BASELINE].values()))["method"]
            except Exception as exc:
                report["timing"][f"error_batch_{bs}"] = _failure(exc)
                traceback.print_exc()
            print(f"[{clock():7.1f}s] timed batch {bs}", flush=True)
            emit(f"timing_batch_{bs}")
    emit("timing")

    quick = spec.benchmark.model_copy(update={"batch_sizes": [1], "warmup": 4, "iterations": 20,
                                               "max_seconds": 1.0})
    vspec = spec.model_copy(update={"benchmark": quick})
    for name in list(runners):
        row = rows[name]
        if time.perf_counter() - t_start > parity_deadline:
            row.update(passed=None, parity_status=f"not validated: past the parity deadline ({parity_deadline:g} s)")
            continue
        try:
            t0 = time.perf_counter()
            res = validate_variant(vspec, name, runners[name], reference, validation, work / "validate" / name)
            row.update(passed=bool(res.passed), validate_seconds=round(time.perf_counter() - t0, 3),
                       gates=[{"gate": g.gate, "status": str(g.status), "observed": g.observed,
                               "threshold": g.threshold} for g in res.gates],
                       parity={k: res.overall.get(k) for k in ("nn_top1_agreement", "cosine_similarity.p01",
                                                               "cosine_similarity.mean", "abs_error.max")},
                       worst_slice=res.worst_slice, non_finite_rows=res.non_finite_rows)
        except Exception as exc:
            row.update(passed=False, parity_status=f"failed: {_failure(exc)}")
            traceback.print_exc()
        print(f"[{clock():7.1f}s] validated {name}: passed={row.get('passed')} {row.get('parity', {})}", flush=True)
        emit()
    emit("parity")
    return report


def add_perf(rows: dict[str, dict[str, Any]], timed: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> None:
    """Merge interleaved timings ({runner: {batch size: row}}) into `rows[name]["perf"][str(batch size)]`:
    p50/p95/p99/mean (ms), throughput (rows/s), rounds, and the speed ratio of medians against torch eager FP32 (and
    ORT FP32 when timed) with paired-bootstrap 95% bounds from the same rounds (`core.latency.speed_ratio`)."""
    from tailguard.core.latency import speed_ratio

    for name, per_bs in timed.items():
        perf = rows[name].setdefault("perf", {})
        for bs, r in per_bs.items():
            entry = {k: r[k] for k in ("latency_ms.p50", "latency_ms.p95", "latency_ms.p99", "latency_ms.mean",
                                       "throughput_per_s", "n_iterations")}
            for base, key in ((BASELINE, "speedup_vs_torch_eager"), (ORT, "speedup_vs_ort_fp32")):
                if name != base and base in timed:
                    s = speed_ratio(timed[base][bs]["samples_ms"], r["samples_ms"], 0.95)
                    entry.update({key: s["ratio"], f"{key}.lb95": s["lower"], f"{key}.ub95": s["upper"]})
            perf[str(bs)] = entry


def best_passing(rows: Mapping[str, Mapping[str, Any]], batch_sizes: Sequence[int]) -> dict[str, Any]:
    """Per batch size (str), the variant with the largest speed-up vs torch eager FP32 among those that passed
    every gate (with its bounds and p50s), or None where none passed or none was timed."""
    best: dict[str, Any] = {}
    for bs in batch_sizes:
        cands = [(r["perf"][str(bs)]["speedup_vs_torch_eager"], n) for n, r in rows.items()
                 if n not in (BASELINE, ORT) and r.get("passed") and str(bs) in r.get("perf", {})
                 and "speedup_vs_torch_eager" in r["perf"][str(bs)]]
        if cands:
            ratio, name = max(cands)
            p = rows[name]["perf"][str(bs)]
            best[str(bs)] = {"variant": name, "speedup": ratio, "lb95": p["speedup_vs_torch_eager.lb95"],
                             "ub95": p["speedup_vs_torch_eager.ub95"], "latency_ms.p50": p["latency_ms.p50"],
                             "baseline_latency_ms.p50": rows[BASELINE]["perf"][str(bs)]["latency_ms.p50"],
                             **({k: p[k] for k in ("speedup_vs_ort_fp32", "speedup_vs_ort_fp32.lb95",
                                                   "speedup_vs_ort_fp32.ub95") if k in p})}
        else:
            best[str(bs)] = None
    return best


def device_header(device: str, meta: Mapping[str, Any]) -> dict[str, Any]:
    """The report's identity fields: command, device (GPU name, compute capability, CUDA/cuDNN versions, TF32),
    node facts, package versions, model and bundle."""
    import torch

    from tailguard.core.hardware import node_facts

    gpu = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        major, minor = torch.cuda.get_device_capability(0)
        gpu = {"name": torch.cuda.get_device_name(0), "compute_capability": f"{major}.{minor}",
               "multiprocessors": props.multi_processor_count, "memory_bytes": props.total_memory,
               "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
               "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32}
    facts = node_facts()
    return {"benchmark": "gpu", "command": " ".join([sys.executable, *sys.argv]),
            "device": device, "device_name": gpu["name"] if gpu else facts["cpu"]["model"], "gpu": gpu,
            "hardware": facts, "platform": platform.platform(), "cpus": os.cpu_count(),
            "packages": {p: _version(p) for p in PACKAGES}, "torch": torch.__version__,
            "model": meta.get("model"), "bundle": {k: v for k, v in meta.items() if k != "init_kwargs"}}


def _write(path: Path, doc: dict[str, Any]) -> None:
    """Write JSON atomically (temp file + rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(path)


def print_table(report: dict[str, Any]) -> None:
    """One line per variant: status, gates, parity, p50 per batch size and speedup vs torch eager FP32."""
    print(f"\n{report['device_name']} | torch {report['torch']} | {report['validation_rows']} rows")
    for r in report["variants"]:
        perf = r.get("perf", {})
        cells = []
        for bs, p in perf.items():
            sp = p.get("speedup_vs_torch_eager")
            cells.append(f"bs{bs} p50 {p['latency_ms.p50']:.3f} ms" + (f" x{sp:.2f}" if sp else ""))
        par = r.get("parity") or {}
        nn = par.get("nn_top1_agreement")
        build = r.get("build") or {}
        print(f"{r['name']:32s} {r['status']:8s} passed={r.get('passed')!s:5s} "
              f"nn_top1={nn if nn is None else round(nn, 4)!s:7s} "
              f"compile={build.get('compile_seconds', '-')!s:7s} {' | '.join(cells)} {r.get('reason', '')}")
    print("best passing speedup vs torch eager:", json.dumps(report["best_passing_speedup_vs_torch_eager"]))


def main(argv: list[str] | None = None) -> int:
    """CLI entry; returns 0 when the report was written (whatever the variants' outcomes), 2 on bad arguments."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--bundle", type=Path, help="folder written by benchmarks/gpu/prepare_bundle.py")
    src.add_argument("--tiny", action="store_true", help="a tiny random model and synthetic rows (CPU dry run)")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--variants", default="", help="comma-separated subset of the catalogue's names")
    ap.add_argument("--rounds", type=int, default=300, help="timed interleaved rounds per batch size")
    ap.add_argument("--max-seconds", type=float, default=30.0, help="timing budget per batch size (s)")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--out", type=Path, required=True, help="the JSON report")
    ap.add_argument("--work", type=Path, default=None, help="folder for artefacts (default: a temporary one)")
    ap.add_argument("--validate-deadline", type=float, default=float("inf"),
                    help="seconds after which no further variant is validated (the rest are skipped, not timed)")
    ap.add_argument("--with-ort", action="store_true",
                    help="also build the spec's ort-fp32 (export + BERT fusion, CPU) and time it in the same rounds")
    ap.add_argument("--build-deadline", type=float, default=None,
                    help="seconds after which no further variant is built (the rest are skipped); --quick: 100")
    ap.add_argument("--quick", action="store_true",
                    help="timing first, then parity on a subset, every phase bounded, the report written after "
                         "every step (no AOTInductor unless --variants names it)")
    ap.add_argument("--rows", type=int, default=600, help="--quick: validation rows checked for parity")
    ap.add_argument("--parity-deadline", type=float, default=230.0,
                    help="--quick: seconds after which no further variant is validated")
    ap.add_argument("--build-timeout", type=float, default=120.0,
                    help="--quick: seconds an inductor build child may take before it is killed")
    args = ap.parse_args(argv)
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    catalogue = variant_catalogue(device)
    if args.quick and not args.variants:
        catalogue = quick_catalogue(device)
    if args.variants:
        wanted = [w.strip() for w in args.variants.split(",") if w.strip()]
        unknown = sorted(set(wanted) - {v.name for v in catalogue})
        if unknown:
            print(f"--variants: unknown {unknown}; known on {device}: {[v.name for v in catalogue]}",
                  file=sys.stderr)
            return 2
        catalogue = [v for v in catalogue if v.name in wanted or v.name == BASELINE]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        bundle = write_tiny_bundle(work / "tiny-bundle") if args.tiny else args.bundle
        if not (bundle / "bundle.json").is_file():
            print(f"--bundle {bundle}: no bundle.json (write it with benchmarks/gpu/prepare_bundle.py)",
                  file=sys.stderr)
            return 2
        args.out.parent.mkdir(parents=True, exist_ok=True)
        if args.quick:
            report = run_quick(bundle, device, catalogue, work, rows_subset=args.rows, rounds=args.rounds,
                               max_seconds=args.max_seconds, batch_sizes=batch_sizes,
                               write=lambda doc: _write(args.out, doc),
                               build_deadline=100.0 if args.build_deadline is None else args.build_deadline,
                               parity_deadline=args.parity_deadline, build_timeout=args.build_timeout)
            print_table(report)
            return 0
        report = run(bundle, device, catalogue, work, rounds=args.rounds, max_seconds=args.max_seconds,
                     batch_sizes=batch_sizes,
                     build_deadline=float("inf") if args.build_deadline is None else args.build_deadline,
                     validate_deadline=args.validate_deadline, with_ort=args.with_ort,
                     checkpoint=lambda rows: _write(args.out.with_name(args.out.stem + ".partial.json"),
                                                    {"partial": True, "variants": list(rows.values())}))
    _write(args.out, report)
    args.out.with_name(args.out.stem + ".partial.json").unlink(missing_ok=True)
    print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
