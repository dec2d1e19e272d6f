"""benchmarks/gpu/bench_gpu.py on the CPU (its dry run), so the GPU benchmark cannot rot between GPU sessions.

A real process, the real torch backend, the real validate step and interleaved timing, with `--tiny` (a 2-layer
random-weight MeanPooledEncoder and 240 synthetic rows with the demo's metadata columns). What the lent GPU machine
adds (CUDA, FP16, CUDA graphs) is not exercised here; the variants the CPU cannot run are skipped with the reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_bench_writes_the_report_with_parity_gates_and_paired_speedups_when_run_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu/bench_gpu.py"), "--tiny", "--device", "cpu",
                           "--variants", "torch-eager-bf16", "--rounds", "12", "--max-seconds", "600",
                           "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["validation_rows"] == 240 and report["torch"]
    rows = {r["name"]: r for r in report["variants"]}
    assert set(rows) == {"torch-eager-fp32", "torch-eager-bf16"}
    base = rows["torch-eager-fp32"]
    assert base["status"] == "ok" and base["parity"]["nn_top1_agreement"] == 1.0
    assert {g["gate"].split("@")[0] for g in base["gates"]} >= {"nn_top1_agreement>=0.9", "cosine_similarity.p01>=0.98"}
    assert set(base["perf"]) == {"1", "32"} and base["perf"]["1"]["n_iterations"] == 12
    bf16 = rows["torch-eager-bf16"]
    if bf16["status"] == "skipped":  # a CPU without AVX512-BF16 / AMX
        assert "bf16 on this CPU" in bf16["reason"]
    else:
        assert bf16["status"] == "ok" and bf16["build"]["artifact"] == "program.pt2"
        assert 0.0 < bf16["parity"]["nn_top1_agreement"] <= 1.0
        for bs in ("1", "32"):  # ratios from the same interleaved rounds as the baseline's
            p = bf16["perf"][bs]
            assert p["speedup_vs_torch_eager.lb95"] <= p["speedup_vs_torch_eager"] <= p["speedup_vs_torch_eager.ub95"]
    assert set(report["best_passing_speedup_vs_torch_eager"]) == {"1", "32"}
    assert report["target"]["min"] == 3.0 and "met" in report["target"]
    assert not out.with_name("gpu.partial.json").exists()


def test_gpu_bench_exits_2_naming_the_known_variants_when_a_variant_is_unknown(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu/bench_gpu.py"), "--tiny", "--device", "cpu",
                           "--variants", "trt-int8", "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "unknown ['trt-int8']" in proc.stderr and "torch-aoti-fp32" in proc.stderr


def _quick(tmp_path, *extra):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu/bench_gpu.py"), "--tiny", "--quick",
                           "--device", "cpu", "--variants", "torch-export-fp32", "--batch-sizes", "1,8",
                           "--rounds", "12", "--max-seconds", "600", "--rows", "120", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_gpu_bench_quick_times_every_batch_size_before_parity_when_run_on_cpu(tmp_path):
    report = _quick(tmp_path)
    assert report["mode"] == "quick" and report["validation_rows"] == 120
    phases = report["phases"]  # seconds from the start at which each phase ended, in the order they ran
    assert list(phases) == ["setup", "build", "timing_batch_1", "timing_batch_8", "timing", "parity"]
    assert phases["timing_batch_8"] <= phases["parity"]
    rows = {r["name"]: r for r in report["variants"]}
    assert set(rows) == {"torch-eager-fp32", "torch-export-fp32"}
    export = rows["torch-export-fp32"]
    assert export["status"] == "ok" and export["passed"] is True and export["parity"]["nn_top1_agreement"] == 1.0
    for bs in ("1", "8"):
        p = export["perf"][bs]
        assert p["n_iterations"] == 12
        assert p["speedup_vs_torch_eager.lb95"] <= p["speedup_vs_torch_eager"] <= p["speedup_vs_torch_eager.ub95"]
    best = report["best_passing_speedup_vs_torch_eager"]
    assert set(best) == {"1", "8"} and best["1"]["variant"] == "torch-export-fp32"


def test_gpu_bench_quick_keeps_the_timings_when_the_parity_deadline_has_passed(tmp_path):
    report = _quick(tmp_path, "--parity-deadline", "0")
    rows = {r["name"]: r for r in report["variants"]}
    for row in rows.values():  # timed, then not validated: the figures written before the cut stay
        assert set(row["perf"]) == {"1", "8"}
        assert row["passed"] is None and "past the parity deadline" in row["parity_status"]
    assert report["best_passing_speedup_vs_torch_eager"] == {"1": None, "8": None}
    assert report["target"]["met"] is False
