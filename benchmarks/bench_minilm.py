"""Benchmark: the demo model (all-MiniLM-L6-v2 on WordNet glosses) through the real pipeline, in one run.

For every variant of examples/minilm/spec.yaml it reports p50/p99 latency at each benchmark batch size,
the ratio to torch eager FP32 and to ONNX Runtime FP32 measured in the same run on the same inputs
(reference-pass task), and the parity figures (overall, worst lexicographer class). Writes JSON.

    .venv/bin/python benchmarks/bench_minilm.py --out benchmarks/results/minilm.json

Ratios are baseline / variant (> 1 = faster than the baseline); all timings are medians/percentiles over
the iterations of one run on this machine: quote ratios, not absolute ms, across machines.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import yaml
from common import prepare_minilm, ratio, report_header, run_minilm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/minilm.json"))
    ap.add_argument("--home", type=Path, default=Path("benchmarks/out/home"),
                    help="TAILGUARD_HOME for this benchmark (a fresh MLflow store is fine)")
    ap.add_argument("--n-validation", type=int, default=2500)
    ap.add_argument("--n-calibration", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads for every backend")
    ap.add_argument("--iterations", type=int, default=200)
    args = ap.parse_args()

    t0 = time.monotonic()
    spec_path, data = prepare_minilm(args.home, n_validation=args.n_validation, n_calibration=args.n_calibration)
    doc = yaml.safe_load(spec_path.read_text())
    doc["benchmark"].update(intra_op_num_threads=args.threads, iterations=args.iterations, max_seconds=60)
    spec, model_version, summary, client, parent = run_minilm(spec_path, doc)
    uri = client.tracking_uri
    report = {
        **report_header("minilm-wordnet", args.threads,
                         ("torch", "onnxruntime", "onnx", "transformers", "mlflow", "kfp")),
        "model": f"{spec.model.registered_name} v{model_version} (all-MiniLM-L6-v2, mean-pooled)",
        "validation_rows": args.n_validation, "batch_sizes": spec.benchmark.batch_sizes,
        "iterations": args.iterations,
        "baselines_ms": {name: {f"bs{bs}": {q: parent.get(f"baseline.{name}.bs{bs}.latency_ms.{q}")
                                            for q in ("p50", "p99")} for bs in spec.benchmark.batch_sizes}
                         for name in ("torch", "onnx_fp32")},
        "variants": [], "promoted": summary.promoted_variant, "mlflow": uri,
        "parent_run_id": summary.parent_run_id,
    }
    for v in summary.variants:
        row = {"variant": v.variant, "status": v.status, "reason": v.reason, "passed_gates": v.passed,
               "promoted": v.promoted, "worst_slice": v.worst_slice, "gates": v.gates}
        if v.run_id and v.status == "ok":
            m = client.get_run(v.run_id).data.metrics
            for key in ("nn_top1_agreement", "nn_top5_agreement", "cosine_similarity.mean", "cosine_similarity.p01",
                        "cosine_similarity.min", "peak_rss_mb", "model_size_mb"):
                row[key] = m.get(key)
            for bs in spec.benchmark.batch_sizes:
                p50, p99 = m.get(f"bs{bs}.latency_ms.p50"), m.get(f"bs{bs}.latency_ms.p99")
                row[f"bs{bs}"] = {"p50_ms": p50, "p99_ms": p99}
                for name in ("torch", "onnx_fp32"):
                    base = report["baselines_ms"][name][f"bs{bs}"]
                    row[f"bs{bs}"][f"p50_ratio_vs_{name}"] = ratio(base["p50"], p50)
                    row[f"bs{bs}"][f"p99_ratio_vs_{name}"] = ratio(base["p99"], p99)
        report["variants"].append(row)
    passing = [r for r in report["variants"] if r["passed_gates"]]
    bs0 = spec.benchmark.batch_sizes[0]
    report["best_passing_p50_ratio_vs_torch_bs%d" % bs0] = max(
        (r[f"bs{bs0}"]["p50_ratio_vs_torch"] for r in passing), default=None)
    report["seconds"] = round(time.monotonic() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(json.dumps({r["variant"]: {k: r.get(k) for k in (f"bs{bs0}", "nn_top1_agreement", "cosine_similarity.p01",
                                                               "passed_gates")} for r in report["variants"]},
                     indent=1, default=str))
    print(f"wrote {args.out}")
    return 0



if __name__ == "__main__":
    raise SystemExit(main())
