"""Benchmark: the accuracy-driven search on the demo model (all-MiniLM-L6-v2, WordNet glosses), in one run.

Issue 3's target, checked in one `tailguard run` through kfp.local on this machine (batch 1, 2 threads): the variant
the pipeline promotes is at least 3x torch eager FP32 (p50) with nearest-neighbour top-1 agreement with FP32 of at
least 0.99 overall and a one-sided 95% Wilson lower bound of at least 0.97 in every lexicographer class with enough
support (min_support rows). Those are the run's gates, so the promotion decision is the check:

    gates: nn_top1_agreement >= 0.99 (overall)
           nn_top1_agreement lower bound (95%) >= 0.97 in every lexname with >= --min-support rows
           nn_top1_agreement lower bound (95%) >= 0.90 in every discovered slice
           speedup_vs_torch >= 3 at batch size 1 (torch eager FP32 timed in the same run, same inputs)

A class needs at least 88 rows before even 100% agreement can show a 95% lower bound of 0.97 (Wilson: n / (n +
1.645^2)), so the validation set here is larger than the demo's: up to --max-per-class rows per class.

Variants: ort-fp32 (BERT-fused FP32 graph, the accurate baseline) and ort-int8-dynamic (per-channel dynamic INT8)
with a search. The JSON records every variant, every search trial (Pareto table), the sensitivity ranking, and
the promoted variant's figures.

    .venv/bin/python benchmarks/bench_search.py --out benchmarks/results/search.json
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
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/search.json"))
    ap.add_argument("--home", type=Path, default=Path("benchmarks/out/search-home"),
                    help="TAILGUARD_HOME for this benchmark (a fresh MLflow store is fine)")
    ap.add_argument("--n-validation", type=int, default=9000)
    ap.add_argument("--max-per-class", type=int, default=200)
    ap.add_argument("--min-support", type=int, default=100)
    ap.add_argument("--n-calibration", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads for every backend")
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--max-trials", type=int, default=10)
    ap.add_argument("--max-minutes", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--exclude-counts", default="0,2,4,6,8,12,16,20",
                    help="search.space.exclude_most_sensitive, comma-separated")
    ap.add_argument("--per-channel", default="true,false", help="search.space.per_channel, comma-separated")
    args = ap.parse_args()

    t0 = time.monotonic()
    spec_path, data = prepare_minilm(args.home, n_validation=args.n_validation, n_calibration=args.n_calibration,
                                     max_per_class=args.max_per_class)
    doc = yaml.safe_load(spec_path.read_text())
    fused = {"level": "all", "fusion": "bert", "num_heads": 12, "hidden_size": 384}
    doc["variants"] = [
        {"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32", "graph_optimization": fused},
        {"name": "ort-int8-dynamic", "backend": "onnxruntime", "precision": "int8", "graph_optimization": fused,
         "quantization": {"mode": "dynamic", "per_channel": True},
         "search": {"max_trials": args.max_trials, "max_minutes": args.max_minutes, "seed": args.seed,
                    "sensitivity_samples": 64,
                    "space": {"exclude_most_sensitive": [int(k) for k in args.exclude_counts.split(",")],
                              "per_channel": [p.strip().lower() == "true" for p in args.per_channel.split(",")],
                              "float_op_types": [[]]}}},
    ]
    doc["gates"] = [
        {"metric": "nn_top1_agreement", "min": 0.99},
        {"metric": "nn_top1_agreement", "scope": "per_slice", "slice": "lexname", "min": 0.97,
         "confidence": 0.95, "min_support": args.min_support},
        {"metric": "nn_top1_agreement", "scope": "discovered", "min": 0.90, "confidence": 0.95},
        {"metric": "speedup_vs_torch", "min": 3.0, "batch_size": 1},
    ]
    doc["benchmark"].update(batch_sizes=[1], intra_op_num_threads=args.threads, iterations=args.iterations,
                            max_seconds=60)
    doc.pop("monitoring", None)
    spec, model_version, summary, client, parent = run_minilm(spec_path, doc)
    uri = client.tracking_uri
    torch_p50 = parent.get("baseline.torch.bs1.latency_ms.p50")
    report = {
        **report_header("minilm-wordnet-search", args.threads,
                         ("torch", "onnxruntime", "onnx", "mlflow", "kfp", "scipy")),
        "model": f"{spec.model.registered_name} v{model_version} (all-MiniLM-L6-v2, mean-pooled)",
        "validation_rows": None, "lexname_support": None, "min_support": args.min_support,
        "gates": [g.key for g in spec.gates], "iterations": args.iterations,
        "baselines_ms": {name: {q: parent.get(f"baseline.{name}.bs1.latency_ms.{q}") for q in ("p50", "p99")}
                         for name in ("torch", "onnx_fp32")},
        "variants": [], "searches": getattr(summary, "searches", []), "promoted": summary.promoted_variant,
        "mlflow": uri, "parent_run_id": summary.parent_run_id,
    }
    import pandas as pd

    val = pd.read_parquet(data["validation"], columns=["lexname"])
    counts = val["lexname"].value_counts()
    report["validation_rows"] = int(len(val))
    report["lexname_support"] = {"classes": int(len(counts)), "judged (>= min_support)":
                                 int((counts >= args.min_support).sum()), "min": int(counts.min()),
                                 "max": int(counts.max())}
    for v in summary.variants:
        row = {"variant": v.variant, "status": v.status, "reason": v.reason, "passed_gates": v.passed,
               "promoted": v.promoted, "worst_slice": v.worst_slice, "gates": v.gates}
        if v.run_id and v.status == "ok":
            run = client.get_run(v.run_id)
            m = run.data.metrics
            for key in ("nn_top1_agreement", "nn_top5_agreement", "cosine_similarity.mean", "cosine_similarity.p01",
                        "discovered.count", "model_size_mb"):
                row[key] = m.get(key)
            p50, p99 = m.get("bs1.latency_ms.p50"), m.get("bs1.latency_ms.p99")
            row["bs1"] = {"p50_ms": p50, "p99_ms": p99, "p50_ratio_vs_torch": ratio(torch_p50, p50),
                          "p50_ratio_vs_onnx_fp32": ratio(report["baselines_ms"]["onnx_fp32"]["p50"], p50)}
            row["lexname_worst_lower_bound"] = _worst_lexname_bound(run)
        report["variants"].append(row)
    promoted = next((r for r in report["variants"] if r["promoted"]), None)
    report["target"] = {
        "wanted": "promoted variant: >= 3x torch eager p50 at bs1; nn_top1 >= 0.99 overall; 95% lower bound "
                  ">= 0.97 in every lexname with enough support",
        "promoted": promoted and {k: promoted.get(k) for k in ("variant", "bs1", "nn_top1_agreement",
                                                               "lexname_worst_lower_bound")},
        "met": bool(promoted and promoted["passed_gates"]),
    }
    report["seconds"] = round(time.monotonic() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(json.dumps({"target": report["target"], "variants": [
        {k: r.get(k) for k in ("variant", "bs1", "nn_top1_agreement", "lexname_worst_lower_bound", "passed_gates",
                               "promoted")} for r in report["variants"]]}, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


def _worst_lexname_bound(run) -> dict | None:
    """The per-slice lexname gate's observed worst bound and group, from the run's result.json."""
    import mlflow

    try:
        path = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="result.json")
    except Exception:  # noqa: BLE001 - an older run layout: leave the figure out rather than fail the benchmark
        return None
    result = json.loads(Path(path).read_text())
    for g in result.get("gates", []):
        if g.get("scope") == "per_slice" and g.get("slice") == "lexname":
            judged = [j for j in g.get("detail", {}).get("failing", [])]
            return {"observed_bound": g.get("observed"), "status": g.get("status"),
                    "judged": g.get("detail", {}).get("judged"), "failing": judged[:10],
                    "insufficient": len(g.get("detail", {}).get("insufficient", []))}
    return None



if __name__ == "__main__":
    raise SystemExit(main())
