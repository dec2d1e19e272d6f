"""The facts of this node that change kernels, numerics and timings: CPU model and ISA flags, cores, GPU, library
versions (issue 23, item 1). Recorded in every benchmark JSON, each variant's build.json, the variant's MLflow tags
(`hardware_tags`) and the run summary, so a figure always names the machine it ran on.

Why these flags: ONNX Runtime picks its INT8 and FP32 kernels by them. On x86 without VNNI the u8s8 MatMulInteger
kernel adds pairs of 8-bit products in int16 with saturation (AVX2 `vpmaddubsw`); `avx512_vnni` / `avx_vnni`
accumulate in int32 (`vpdpbusd`); AMX (`amx_tile`, `amx_int8`) adds tile kernels; `avx512f`, `avx2`, `fma` and
`f16c` choose the FP32 / FP16 GEMM paths (MLAS platform dispatch, onnxruntime/core/mlas/lib/platform.cpp);
`avx512_bf16` and `amx_bf16` decide whether torch's bf16 kernels (oneDNN, inductor) run natively or emulated. An INT8
result or a speed ratio measured with one set may not hold on a node with another.

Source of the CPU facts: /proc/cpuinfo (Linux; the first processor's `vendor_id`, `model name` and `flags`). Where it
cannot be read (macOS, a sandbox), the model is `platform.processor()` or `platform.machine()` and the flags are
unknown (`isa` None, `isa_source` "unknown"), never guessed.

Nothing here imports torch or initialises CUDA unless a GPU is visible (/dev/nvidia0 or nvidia-smi) and torch is
installed: a build task on a CPU node stays free of the torch import (components/build/task.py).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
from importlib import metadata
from pathlib import Path
from typing import Any

from tailguard.core.contract import HW_CORES_TAG, HW_CPU_TAG, HW_GPU_TAG, HW_ISA_TAG

# The ISA flags (as /proc/cpuinfo spells them) that change which ONNX Runtime / torch CPU kernels run; the order is
# the order they are reported in.
KERNEL_ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8",
                    "amx_bf16")
LIBRARIES = ("onnxruntime", "onnx", "torch", "numpy")
CPUINFO = Path("/proc/cpuinfo")


def _cpuinfo(path: Path) -> dict[str, str]:
    """The first processor block of /proc/cpuinfo as {key: value} ({} when unreadable)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # end of the first processor's block
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    return fields


def cpu_facts(cpuinfo: str | Path = CPUINFO) -> dict[str, Any]:
    """The CPU: vendor, model name, the kernel-relevant ISA flags and the core counts.

    Args:
        cpuinfo: the file to read (default /proc/cpuinfo; tests pass a copy of another machine's).

    Returns:
        {"vendor": str | None (e.g. "GenuineIntel", "AuthenticAMD"), "model": str (e.g. "AMD EPYC 7B13"),
         "isa": list[str] | None (the KERNEL_ISA_FLAGS present, in that order; None when the flags are unknown),
         "isa_source": "/proc/cpuinfo" | "unknown", "cores": int (CPUs this process may run on,
         os.sched_getaffinity), "logical_cpus": int | None (os.cpu_count()), "machine": str (platform.machine())}.
    """
    info = _cpuinfo(Path(cpuinfo))
    flags = info.get("flags")
    model = info.get("model name") or platform.processor() or platform.machine() or "unknown"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    present = set(flags.split()) if flags is not None else None
    return {"vendor": info.get("vendor_id"), "model": model,
            "isa": [f for f in KERNEL_ISA_FLAGS if f in present] if present is not None else None,
            "isa_source": str(cpuinfo) if present is not None else "unknown",
            "cores": cores, "logical_cpus": os.cpu_count(), "machine": platform.machine()}


def gpu_unavailable_reason() -> str | None:
    """None when an NVIDIA GPU is visible, else why not (no import of CUDA libraries)."""
    if shutil.which("nvidia-smi") is None and not Path("/dev/nvidia0").exists():
        return "no NVIDIA GPU on this node (no /dev/nvidia0, no nvidia-smi)"
    return None


def gpu_facts() -> list[dict[str, Any]] | None:
    """The visible NVIDIA GPUs as torch sees them, or None.

    None (without importing torch) when no GPU device is visible (no /dev/nvidia0, no nvidia-smi) or torch is not
    installed; torch is imported and CUDA initialised only when both are there.

    Returns:
        [{"index": int, "name": str (e.g. "NVIDIA H100 80GB HBM3"), "compute_capability": str ("9.0")}, ...],
        or None (no GPU, no torch, or torch.cuda.is_available() false).
    """
    if gpu_unavailable_reason() is not None or importlib.util.find_spec("torch") is None:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    gpus = []
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        gpus.append({"index": i, "name": torch.cuda.get_device_name(i), "compute_capability": f"{major}.{minor}"})
    return gpus


def library_versions(names: tuple[str, ...] = LIBRARIES) -> dict[str, str | None]:
    """Installed versions of `names` from the distributions' metadata (no import): {name: version | None}."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def node_facts(cpuinfo: str | Path = CPUINFO) -> dict[str, Any]:
    """This node's hardware and library facts, JSON-serialisable.

    Args:
        cpuinfo: the CPU description file (default /proc/cpuinfo).

    Returns:
        {"cpu": `cpu_facts()`, "gpus": `gpu_facts()` (list or None), "os": "Linux-6.1...-x86_64"
         (platform.platform()), "libraries": {"onnxruntime", "onnx", "torch", "numpy": version | None}}.
    """
    return {"cpu": cpu_facts(cpuinfo), "gpus": gpu_facts(), "os": platform.platform(),
            "libraries": library_versions()}


def isa_text(facts: dict[str, Any]) -> str:
    """The ISA flags of `node_facts()` as one string: "avx2 fma f16c avx512f avx512_vnni"; "none" when the CPU
    has none of KERNEL_ISA_FLAGS, "unknown" when the flags could not be read."""
    isa = (facts.get("cpu") or {}).get("isa")
    if isa is None:
        return "unknown"
    return " ".join(isa) or "none"


def ran_on_line(facts: dict[str, Any] | None) -> str:
    """The summary's line naming the machine: "ran on: Intel(R) Xeon(R) Processor (avx2 fma f16c avx512f
    avx512_vnni), 2 cores" plus ", GPU: <name> (sm <cc>)" per GPU; "" without facts."""
    if not facts or not facts.get("cpu"):
        return ""
    cpu = facts["cpu"]
    line = f"ran on: {cpu.get('model', 'unknown')} ({isa_text(facts)}), {cpu.get('cores', '?')} cores"
    for g in facts.get("gpus") or []:
        line += f", GPU: {g['name']} (sm {g['compute_capability']})"
    return line


def hardware_tags(facts: dict[str, Any]) -> dict[str, str]:
    """MLflow tags of `node_facts()` (names in tailguard.core.contract): tailguard.hw.cpu (model name),
    tailguard.hw.isa (`isa_text`), tailguard.hw.cores, and tailguard.hw.gpu ("<name> sm<cc>; ..." or "none")."""
    cpu = facts.get("cpu") or {}
    gpus = facts.get("gpus") or []
    return {HW_CPU_TAG: str(cpu.get("model", "unknown"))[:500], HW_ISA_TAG: isa_text(facts),
            HW_CORES_TAG: str(cpu.get("cores", "")),
            HW_GPU_TAG: "; ".join(f"{g['name']} sm{g['compute_capability']}" for g in gpus) or "none"}


def expect_mismatches(facts: dict[str, Any], *, isa: Any = (), absent_isa: Any = (),
                      compute_capability: Any = ()) -> list[str]:
    """How this node differs from what a serving target expects (spec `serving_targets[].expect`), one line per
    difference; [] when it matches (issue 23, item 3).

    Args:
        facts: `node_facts()` of the node a validate task runs on.
        isa: ISA flags the node's CPU must have (names of KERNEL_ISA_FLAGS).
        absent_isa: ISA flags it must not have.
        compute_capability: GPU compute capabilities allowed ("8.9"); every visible GPU must have one of them.

    Returns:
        e.g. ["isa: the node lacks avx512_vnni (node: avx2 fma f16c)"]; a node whose ISA flags are unknown (no
        /proc/cpuinfo) does not match an `isa` / `absent_isa` expectation (unknown is never taken as a match).
    """
    out: list[str] = []
    node_isa = (facts.get("cpu") or {}).get("isa")
    if isa or absent_isa:
        if node_isa is None:
            out.append("isa: the node's ISA flags are unknown (no /proc/cpuinfo), so isa/absent_isa cannot hold")
        else:
            missing = [f for f in isa if f not in node_isa]
            extra = [f for f in absent_isa if f in node_isa]
            if missing:
                out.append(f"isa: the node lacks {' '.join(missing)} (node: {isa_text(facts)})")
            if extra:
                out.append(f"absent_isa: the node has {' '.join(extra)} (node: {isa_text(facts)})")
    if compute_capability:
        allowed = [str(c) for c in compute_capability]
        gpus = facts.get("gpus") or []
        if not gpus:
            out.append(f"compute_capability: no GPU is visible on the node (expected sm {', '.join(allowed)})")
        else:
            other = sorted({g["compute_capability"] for g in gpus if g["compute_capability"] not in allowed})
            if other:
                out.append(f"compute_capability: the node's GPU is sm {', '.join(other)} (expected sm "
                           f"{', '.join(allowed)})")
    return out


# The facts that choose INT8/FP16 kernels, compared between a monitor's node and the nodes a variant was validated
# on: the ISA flags (the CPU model name alone does not change ONNX Runtime's kernels) and the GPUs' compute
# capabilities. Keys of `kernel_facts`.
KERNEL_FACTS = ("isa", "gpu")


def kernel_facts(facts: dict[str, Any]) -> dict[str, str]:
    """The node's facts as the registry records the nodes a variant was validated on (the `tailguard.validated_on`
    version tag): {"cpu": model name, "isa": `isa_text` ("avx2 fma f16c" | "none" | "unknown"), "gpu":
    "sm8.9 sm8.9" (one compute capability per visible GPU) or "none"}."""
    gpus = facts.get("gpus") or []
    return {"cpu": str((facts.get("cpu") or {}).get("model", "unknown")), "isa": isa_text(facts),
            "gpu": " ".join(f"sm{g['compute_capability']}" for g in gpus) or "none"}


def gpu_capabilities(tag_value: str) -> str:
    """The compute capabilities of a `tailguard.hw.gpu` tag value ("NVIDIA L4 sm8.9; NVIDIA L4 sm8.9" or "none") in
    `kernel_facts` form ("sm8.9 sm8.9" or "none")."""
    caps = [part.strip().rsplit(" ", 1)[-1] for part in (tag_value or "").split(";")
            if part.strip() and part.strip() != "none"]
    return " ".join(c for c in caps if c.startswith("sm")) or "none"


def fact_differences(node: dict[str, str], validated: dict[str, str],
                     compare: tuple[str, ...] = KERNEL_FACTS) -> dict[str, dict[str, str]]:
    """The KERNEL_FACTS in `compare` in which `node` differs from `validated` (both in `kernel_facts` form).

    ISA flags are compared as sets, GPUs as sets of compute capabilities (how many GPUs does not change a
    kernel); "unknown" flags on either side count as a difference (a node that cannot be described is not known to
    match).

    Returns:
        {fact: {"node": value, "validated": value}}; {} when they match.
    """
    out: dict[str, dict[str, str]] = {}
    n_isa, v_isa = node.get("isa", "unknown"), validated.get("isa", "unknown")
    if "isa" in compare and ("unknown" in (n_isa, v_isa)
                             or set(n_isa.split()) - {"none"} != set(v_isa.split()) - {"none"}):
        out["isa"] = {"node": n_isa, "validated": v_isa}
    n_gpu, v_gpu = node.get("gpu", "none"), validated.get("gpu", "none")
    if "gpu" in compare and set(n_gpu.split()) != set(v_gpu.split()):
        out["gpu"] = {"node": n_gpu, "validated": v_gpu}
    return out


# ------------------------------------------------------------------------------------------ CPU contention
# Linux pressure stall information (PSI, kernel >= 4.20, Documentation/accounting/psi.rst): the `some` line of
# cpu.pressure counts, in microseconds (`total=`), the wall time during which at least one runnable task waited for a
# CPU. Its growth over a timed window divided by the window's length is the share of that window in which the
# node (or, with cgroup v2, this process' cgroup) was short of CPU: timings taken then are not representative
# of the node at rest.
PROC_CPU_PRESSURE = Path("/proc/pressure/cpu")
CGROUP_ROOTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))


def cpu_pressure_file(proc_cgroup: str | Path = "/proc/self/cgroup", *, roots: tuple[Path, ...] = CGROUP_ROOTS,
                      node: Path = PROC_CPU_PRESSURE) -> Path | None:
    """The PSI file that covers this process: its cgroup v2 `cpu.pressure` (a pod's own stalls) when the unified
    hierarchy (`0::<path>` in /proc/self/cgroup, under one of `roots`) has one, else the node-wide `node`
    (/proc/pressure/cpu); None where neither exists (not Linux, PSI off)."""
    try:
        for line in Path(proc_cgroup).read_text().splitlines():
            if line.startswith("0::"):
                rel = line[3:].strip().lstrip("/")
                for root in roots:
                    if rel and (root / rel / "cpu.pressure").is_file():
                        return root / rel / "cpu.pressure"
    except OSError:
        pass
    return node if node.is_file() else None


def cpu_stall_us(path: str | Path | None) -> int | None:
    """The `some total=` counter of a PSI cpu.pressure file: microseconds (cumulative since boot or cgroup
    creation) during which at least one runnable task waited for a CPU; None when it cannot be read."""
    if path is None:
        return None
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("some "):
                for field in line.split():
                    if field.startswith("total="):
                        return int(field[6:])
    except (OSError, ValueError):
        return None
    return None


class CpuPressure:
    """The share of a timed window in which this node (or this process' cgroup) was short of CPU (PSI `some`).

    Use: `with CpuPressure() as p: ...timing...`, then `p.share` (float in [0, 1], e.g. 0.02 on an idle 2-core
    node; None where PSI cannot be read) and `p.source` (the file read). The share is the `some total` growth
    (`cpu_stall_us`, microseconds) over the window's wall time (time.monotonic_ns), clipped to [0, 1].

    Args:
        path: the PSI file (default `cpu_pressure_file()`); a test passes its own.
    """

    def __init__(self, path: str | Path | None = None) -> None:
        import time

        self._clock = time.monotonic_ns
        self.source = Path(path) if path is not None else cpu_pressure_file()
        self.share: float | None = None
        self._start: tuple[int, int | None] | None = None

    def __enter__(self) -> "CpuPressure":
        self._start = (self._clock(), cpu_stall_us(self.source))
        return self

    def __exit__(self, *exc: object) -> None:
        t1, s1 = self._clock(), cpu_stall_us(self.source)
        t0, s0 = self._start or (t1, None)
        wall_us = (t1 - t0) / 1e3
        if s0 is None or s1 is None or wall_us <= 0:
            self.share = None
        else:
            self.share = min(1.0, max(0.0, (s1 - s0) / wall_us))

    def to_dict(self) -> dict[str, Any]:
        """{"some_share": share or None, "source": the file or None} for JSON and MLflow params."""
        return {"some_share": self.share, "source": str(self.source) if self.source else None}
