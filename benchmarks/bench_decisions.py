"""Are the sequential decisions as good as the all-rows ones? Issue 25's decisions table, on the demo's variants.

Run (not part of the test suite; about 15 minutes on 2 cores, plus a demo run when no --home is given):

    .venv/bin/python benchmarks/bench_decisions.py [--home DIR] [--shuffles 20] [--latency-repeats 2]
        [--out benchmarks/results/decisions.json] [--work DIR]

Inputs: the artefacts of a finished `tailguard demo` (`--home`: its $TAILGUARD_HOME; without it the demo is run into
<work>/home first): the demo spec and data, the exported FP32 ONNX model, every ONNX Runtime variant the pipeline
built (build-<v>/variant_model/<v>.onnx) and the search's chosen model (search-<v>/searched_model/model.onnx, judged
by <v>'s gates as the search judges it).

Parity decisions. Per variant, its first output over all validation rows is computed once (ONNX Runtime, the spec's
batch size) and the FP32 reference's once (the exported ONNX model). The all-rows decision is `validate_variant` with
`analysis.sequential.enabled: false`; the sequential decision of shuffle s is `validate_variant` with
`analysis.sequential.seed: s` and those outputs handed in as stored measurements (`measurements.Measurements`, every
row in the seeded order), so the gates are decided exactly as the validate step decides them, block by block with the
same stopping rule, on the same per-row values (the batch-composition effect of running rows in blocks, a few rows
for a dynamic-INT8 variant, is left out here on purpose: the table measures the decision rule). Per gate and shuffle:
the sequential status, the all-rows status, the rows at which it was decided; per variant: rows scored. Both stopping
rules are reported: `verdict` (the default: stop once the verdict is known; gates still open are `undecided`) and
`all_gates` (stop once every gate is decided). The latency gate is not a parity gate and is left out of the table.

Latency intervals. Per variant and benchmark batch size: `--latency-repeats` timings interleaved with the FP32
reference to `benchmark.precision` (the corrected 95% bounds of the speed ratio, the rounds used) and one timing of
the full budget (precision off); each precision interval is checked to cover the full-budget ratio.

JSON: header, inputs, `method`, `parity` ({variant: {rows, all_rows: {gate: status}, verdict/all_gates: {gate:
{same, differs, undecided, decided_at_median}, rows_used: [per shuffle]}}}), `latency` ({variant: {bs: {full_budget:
{ratio, rounds}, precision: [{ratio, lower, upper, rounds, stopped_by, covers}]}}}), `summary` (gates with >= 19 of
20 shuffles equal, every interval covering).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import report_header

REPO = Path(__file__).resolve().parents[1]


def run_demo(home: Path) -> None:
    """`tailguard demo` into `home` (this working tree's package)."""
    env = {**os.environ, "TAILGUARD_HOME": str(home), "MLFLOW_DISABLE_TELEMETRY": "true",
           "GX_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
    subprocess.run([sys.executable, "-m", "tailguard.cli", "demo"], env=env, check=True, capture_output=True,
                   timeout=7200)


def artefacts(home: Path) -> dict[str, Any]:
    """The demo run's spec, FP32 model and variant models: {"spec": path, "fp32": path, "variants": {name:
    (model path, the spec variant whose gates judge it)}}."""
    import yaml

    spec_path = home / "demo" / "spec.yaml"
    runs = sorted((home / "kfp").iterdir(), key=lambda p: p.stat().st_mtime)
    run = runs[-1]
    doc = yaml.safe_load(spec_path.read_text())
    out: dict[str, Any] = {"spec": spec_path, "fp32": run / "export" / "onnx_model" / "model.onnx", "variants": {}}
    for v in doc["variants"]:
        f = run / f"build-{v['name']}" / "variant_model" / f"{v['name']}.onnx"
        if v["backend"] == "onnxruntime" and f.is_file():
            out["variants"][v["name"]] = (f, v["name"])
        searched = run / f"search-{v['name']}" / "searched_model" / "model.onnx"
        if searched.is_file():
            out["variants"][f"{v['name']}-searched"] = (searched, v["name"])
    return out


def parity_table(spec: Any, ds: Any, ref: np.ndarray, name: str, model: Path, judged_as: str, shuffles: int,
                 work: Path) -> dict[str, Any]:
    """All-rows and sequential gate outcomes of one variant over `shuffles` seeded orders (module docstring)."""
    from tailguard.components.validate.logic import validate_variant
    from tailguard.components.validate.measurements import Measurements
    from tailguard.core.runtime import OrtRunner, run_dataset
    from tailguard.core.spec.gates import PERF_METRICS

    variant = next(v for v in spec.variants if v.name == judged_as)
    runner = OrtRunner(model, providers=[variant.execution_provider],
                       intra_op_num_threads=spec.benchmark.intra_op_num_threads)
    t0 = time.perf_counter()
    full = run_dataset(runner, ds, spec.model.inputs, batch_size=spec.data.validation.batch_size,
                       pad_values=spec.model.pad_values)[0]
    run_s = time.perf_counter() - t0
    n = ds.n_rows
    bench = spec.benchmark.model_copy(update={"batch_sizes": [spec.benchmark.batch_sizes[0]], "iterations": 2,
                                              "warmup": 0, "precision": None})
    parity_gates = [g.key for g in spec.gates if g.metric not in PERF_METRICS]

    def with_seq(**kw: Any) -> Any:
        seq = spec.analysis.sequential.model_copy(update=kw)
        return spec.model_copy(update={"benchmark": bench,
                                       "analysis": spec.analysis.model_copy(update={"sequential": seq})})

    def statuses(result: Any) -> dict[str, str]:
        return {g.gate: g.status for g in result.gates if g.gate in parity_gates}

    full_res = validate_variant(with_seq(enabled=False), judged_as, runner, [ref], ds, work / f"{name}-all",
                                measurements=Measurements(order=np.arange(n), outputs=full, block_sizes=[n]))
    all_rows = statuses(full_res)
    table: dict[str, Any] = {"rows": n, "seconds_all_rows_inference": round(run_s, 2), "all_rows": all_rows,
                             "all_rows_passed": bool(full_res.passed)}
    for stop in ("verdict", "all_gates"):
        per_gate: dict[str, dict[str, Any]] = {g: {"same": 0, "differs": 0, "undecided": 0, "decided_at": []}
                                               for g in parity_gates}
        used, verdicts = [], []
        for seed in range(shuffles):
            spec_s = with_seq(seed=seed, stop=stop)
            perm = np.random.default_rng(seed).permutation(n).astype(np.int64)
            block = spec_s.analysis.sequential.block_rows
            sizes = [min(block, n - i) for i in range(0, n, block)]
            m = Measurements(order=perm, outputs=full[perm], block_sizes=sizes)
            res = validate_variant(spec_s, judged_as, runner, [ref], ds, work / f"{name}-{stop}-{seed}",
                                   measurements=m)
            used.append(int(res.rows_used))
            verdicts.append(bool(res.passed) == bool(full_res.passed))
            seq_rec = {g["gate"]: g for g in (res.sequential or {}).get("gates", [])}
            for g, status in statuses(res).items():
                if status == "undecided":
                    per_gate[g]["undecided"] += 1
                elif status == all_rows[g]:
                    per_gate[g]["same"] += 1
                else:
                    per_gate[g]["differs"] += 1
                at = (seq_rec.get(g) or {}).get("decided_at")
                per_gate[g]["decided_at"].append(at if at is not None else None)
        for rec in per_gate.values():
            ats = [a for a in rec["decided_at"] if a is not None]
            rec["decided_at_median"] = float(np.median(ats)) if ats else None
        table[stop] = {"gates": per_gate, "rows_used": used, "rows_used_median": float(np.median(used)),
                       "verdict_same_as_all_rows": sum(verdicts)}
    return table


def latency_table(spec: Any, ds: Any, fp32: Path, name: str, model: Path, judged_as: str,
                  repeats: int) -> dict[str, Any]:
    """Precision-stopped timings vs one full-budget timing of the variant against the FP32 reference (module
    docstring)."""
    from tailguard.components.validate.timing import timing_rule
    from tailguard.core.latency import add_speed_ratios, interleaved_benchmark
    from tailguard.core.runtime import OrtRunner

    variant = next(v for v in spec.variants if v.name == judged_as)
    threads = spec.benchmark.intra_op_num_threads
    runners = {"variant": OrtRunner(model, providers=[variant.execution_provider], intra_op_num_threads=threads),
               "onnx_fp32": OrtRunner(fp32, intra_op_num_threads=threads)}

    def timed(bench: Any, decide: Any) -> dict[int, dict[str, Any]]:
        out = interleaved_benchmark(runners, ds, spec.model.inputs, bench, pad_values=spec.model.pad_values,
                                    decide=decide)
        perf = out.pop("variant")
        add_speed_ratios(perf, out, samples=spec.analysis.bootstrap.samples, seed=spec.analysis.bootstrap.seed)
        return perf

    table: dict[str, Any] = {}
    for bs in spec.benchmark.batch_sizes:
        bench = spec.benchmark.model_copy(update={"batch_sizes": [bs]})
        spec_bs = spec.model_copy(update={"benchmark": bench})
        precise = []

        def one(bench=bench, spec_bs=spec_bs, bs=bs, precise=precise) -> None:
            t0 = time.perf_counter()
            row = timed(bench, timing_rule(spec_bs, judged_as, baseline="onnx_fp32", target="variant"))[bs]
            precise.append({"ratio": row["speedup_vs_onnx_fp32"], "lower": row.get("speedup_vs_onnx_fp32.lb95"),
                            "upper": row.get("speedup_vs_onnx_fp32.ub95"), "rounds": row["n_iterations"],
                            "stopped_by": row.get("stopped_by"), "seconds": round(time.perf_counter() - t0, 2)})

        # precision-stopped timings on both sides of the full-budget one (a load drift hits both alike)
        for _ in range((repeats + 1) // 2):
            one()
        t0 = time.perf_counter()
        full = timed(spec.benchmark.model_copy(update={"batch_sizes": [bs], "precision": None}), None)[bs]
        full_rec = {"ratio": full["speedup_vs_onnx_fp32"], "lower": full.get("speedup_vs_onnx_fp32.lb95"),
                    "upper": full.get("speedup_vs_onnx_fp32.ub95"), "rounds": full["n_iterations"],
                    "seconds": round(time.perf_counter() - t0, 2)}
        for _ in range(repeats // 2):
            one()
        for p in precise:
            p["covers"] = p["lower"] is not None and p["upper"] is not None and \
                p["lower"] <= full_rec["ratio"] <= p["upper"]
        table[str(bs)] = {"full_budget": full_rec, "precision": precise}
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--home", default=None, help="TAILGUARD_HOME of a finished `tailguard demo` (default: run one)")
    ap.add_argument("--shuffles", type=int, default=20)
    ap.add_argument("--latency-repeats", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "decisions.json"))
    ap.add_argument("--work", default=None)
    args = ap.parse_args()

    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-decisions-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started, load_start = time.time(), os.getloadavg()
    home = Path(args.home).resolve() if args.home else work / "home"
    if not args.home:
        run_demo(home)
    os.environ["TAILGUARD_HOME"] = str(home)

    from tailguard.core.data import load_validation
    from tailguard.core.runtime import OrtRunner, run_dataset
    from tailguard.core.spec import load_spec

    found = artefacts(home)
    spec = load_spec(found["spec"])
    ds = load_validation(spec)
    ref = run_dataset(OrtRunner(found["fp32"], intra_op_num_threads=spec.benchmark.intra_op_num_threads), ds,
                      spec.model.inputs, batch_size=spec.data.validation.batch_size,
                      pad_values=spec.model.pad_values)[0]
    parity, latency = {}, {}
    for name, (model, judged_as) in found["variants"].items():
        t0 = time.perf_counter()
        parity[name] = parity_table(spec, ds, ref, name, model, judged_as, args.shuffles, work / "parity")
        print(f"parity {name}: all rows {parity[name]['all_rows']}; rows used (verdict) "
              f"{parity[name]['verdict']['rows_used']} ({time.perf_counter() - t0:.0f} s)", flush=True)
    for name, (model, judged_as) in found["variants"].items():
        latency[name] = latency_table(spec, ds, found["fp32"], name, model, judged_as, args.latency_repeats)
        print(f"latency {name}: {json.dumps(latency[name])}", flush=True)

    need = int(np.ceil(0.95 * args.shuffles))  # 19 of 20
    gates_ok = {f"{v}/{stop}/{g}": rec["same"] >= need or (rec["same"] + rec["undecided"] >= need and
                                                            rec["differs"] == 0)
                for v, t in parity.items() for stop in ("verdict", "all_gates") for g, rec in t[stop]["gates"].items()}
    covers = [p["covers"] for t in latency.values() for rec in t.values() for p in rec["precision"]]
    report = {
        **report_header("decisions", threads=0, packages=("onnxruntime", "numpy", "scipy")),
        "home": str(home), "spec": str(found["spec"]),
        "variants": {n: str(m) for n, (m, _) in found["variants"].items()},
        "shuffles": args.shuffles, "load_average_at_start": load_start,
        "method": ("parity: per variant, outputs over all rows computed once; all-rows = validate_variant with "
                   "analysis.sequential.enabled false; shuffle s = validate_variant with sequential.seed s on those "
                   "outputs (measurements.Measurements), the validate step's stopping rule and decisions; latency: "
                   "precision-stopped interleaved timings vs one full-budget timing, per batch size"),
        "parity": parity, "latency": latency,
        "summary": {"gates_with_19_of_20_same_or_undecided_never_differing": gates_ok,
                    "every_gate_ok": all(gates_ok.values()),
                    "differs_total": sum(rec["differs"] for t in parity.values() for stop in ("verdict", "all_gates")
                                         for rec in t[stop]["gates"].values()),
                    "latency_intervals_covering_full_budget_ratio": f"{sum(covers)}/{len(covers)}"},
        "load_average_at_end": os.getloadavg(), "elapsed_s": round(time.time() - started, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report["summary"], indent=1))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
