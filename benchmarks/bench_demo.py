"""The demo's wall time, the current tree against a baseline commit, interleaved (issues 15 and 25: the demo target).

Run (not part of the test suite; about 6 minutes a run on 2 cores, more when other jobs share them):

    .venv/bin/python benchmarks/bench_demo.py [--out benchmarks/results/demo.json] [--rounds 1] [--baseline 0a29fd2]
        [--repeats 0] [--work DIR]

What it does: the two trees are assembled as importable `tailguard` packages exactly as bench_pipeline.py does
("current" = a copy of this working tree when the benchmark starts; "baseline" = `git archive <baseline>`). Each
tree and round runs `PYTHONPATH=<tree> python -m tailguard.cli demo` (the whole `make demo`: WordNet -> Parquet,
register MiniLM, the kfp.local pipeline, the monitor replay) in a fresh `$TAILGUARD_HOME`, so the local cache
starts empty: this is a first run, not a re-run. Rounds interleave the trees (round 0: baseline then current;
round 1 the other way), so a load drift on a shared machine hits both alike. `--repeats N` then runs the current
tree N more times alone (fresh homes) to check that every run promotes the same variant (issue 25's stability
target); those runs do not enter the ratio.

Per run: wall seconds, exit code, the load average (1, 5, 15 min) before and after, the pipeline's per-task timings
(`$TAILGUARD_HOME/runs/<run>/pipeline.log`), the promoted variant and the promotion rule, each variant's gate
statuses and rows scored (`summary.json`), and `comparable_wall_s`: the wall time less the tasks of variants the
baseline's demo spec does not have (e.g. torch variants added to the example spec later; issue 25's target is stated
that way), computed from the task names `build-<v>` / `validate-<v>` / `search-<v>`.

JSON: header (command, machine, the node's CPU model and ISA flags, packages), `runs`, `summary` (median wall and
median comparable wall per tree; the promoted variants of every current run and whether they are all the same;
whether each variant's gate outcomes are the same in both trees), `ratio_current_to_baseline` (median comparable
wall, current / baseline; the target is <= 0.60) and `target_met`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import median, snapshot_trees, tree_env
from common import report_header

REPO = Path(__file__).resolve().parents[1]
TARGET_RATIO = 0.60
_VARIANT_TASK = re.compile(r"^(build|validate|search)-(.+)$")


def spec_variants(tree: Path) -> set[str]:
    """The variant names of a tree's demo spec (tailguard/demo/spec.yaml; tailguard/demo_spec.yaml in a tree
    older than the `tailguard.demo` package)."""
    import yaml

    path = tree / "tailguard" / "demo" / "spec.yaml"
    if not path.exists():
        path = tree / "tailguard" / "demo_spec.yaml"
    doc = yaml.safe_load(path.read_text())
    return {v["name"] for v in doc.get("variants") or []}


def comparable_wall(wall: float, tasks: list[dict[str, Any]], baseline_variants: set[str]) -> float:
    """`wall` less the wall seconds of the tasks of variants the baseline's spec does not have."""
    extra = 0.0
    for t in tasks:
        m = _VARIANT_TASK.match(str(t.get("task", "")))
        if m and m.group(2) not in baseline_variants and t.get("wall_s"):
            extra += float(t["wall_s"])
    return round(wall - extra, 3)


def demo_once(tree: Path, home: Path, cwd: Path) -> dict[str, Any]:
    """`python -m tailguard.cli demo` with `tree` on PYTHONPATH in a fresh `home`: wall seconds, exit code, load,
    per-task timings, the promotion and the gates of its pipeline run."""
    from tailguard.runner import task_timings

    home.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tailguard.cli", "demo"], env=tree_env(tree, home), cwd=cwd,
                          capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    runs = sorted((home / "runs").glob("*/pipeline.log"), key=lambda p: p.stat().st_mtime)
    timings = task_timings(runs[-1].read_text(errors="replace")) if runs else {"tasks": []}
    out: dict[str, Any] = {"wall_s": round(wall, 3), "exit_code": proc.returncode,
                           "load_average_before": list(load_before), "load_average_after": list(os.getloadavg()),
                           **timings, "cli_tail": [line.rstrip() for line in proc.stdout.splitlines()[-4:]]}
    summary = runs[-1].parent / "summary.json" if runs else None
    if summary is not None and summary.exists():
        d = json.loads(summary.read_text())
        out.update(promoted_variant=d.get("promoted_variant"), promotion_rule=d.get("promotion_rule"),
                   promotion_reason=d.get("promotion_reason"),
                   gates={v["variant"]: v.get("gates") or {} for v in d.get("variants") or []},
                   rows_used={v["variant"]: [v.get("rows_used"), v.get("rows")] for v in d.get("variants") or []},
                   # issue 37: the promotion's paired rounds (passing variants, torch eager, ONNX FP32 together)
                   paired={v["variant"]: v.get("paired") for v in d.get("variants") or [] if v.get("paired")},
                   paired_baselines_p50_ms={b: ((d.get("promotion_comparison") or {}).get("latency") or {})
                                            .get(b, {}).get("p50_ms")
                                            for b in (d.get("promotion_comparison") or {}).get("baselines") or []})
    if proc.returncode not in (0, 3):
        out["stderr_tail"] = (proc.stderr or proc.stdout)[-2000:]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "demo.json"))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--baseline", default="0a29fd2", help="the commit to compare with (git archive)")
    ap.add_argument("--repeats", type=int, default=0, help="more runs of the current tree alone (promotion check)")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one, removed)")
    args = ap.parse_args()

    work = Path(args.work or tempfile.mkdtemp(prefix="bench-demo-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started, load_at_start = time.time(), os.getloadavg()
    trees = snapshot_trees(work, args.baseline)
    base_variants = spec_variants(trees["baseline"])
    runs: list[dict[str, Any]] = []

    def record(name: str, rnd: int, kind: str) -> None:
        r = demo_once(trees[name], work / f"home-{name}-{kind}-{rnd}", work)
        r["comparable_wall_s"] = comparable_wall(r["wall_s"], r.get("tasks") or [], base_variants)
        runs.append({"tree": name, "round": rnd, "kind": kind, **r})
        print(f"{kind} {rnd} {name:8s} {r['wall_s']:7.1f} s (comparable {r['comparable_wall_s']:.1f} s)  exit "
              f"{r['exit_code']}  promoted {r.get('promoted_variant')}  load {r['load_average_before'][0]:.2f}"
              f"->{r['load_average_after'][0]:.2f}", flush=True)

    for rnd in range(args.rounds):
        for name in (["baseline", "current"] if rnd % 2 == 0 else ["current", "baseline"]):
            record(name, rnd, "interleaved")
    for rep in range(args.repeats):
        record("current", rep, "repeat")

    ok = [r for r in runs if r["exit_code"] in (0, 3)]
    inter = [r for r in ok if r["kind"] == "interleaved"]
    walls = {n: median([r["wall_s"] for r in inter if r["tree"] == n]) for n in ("baseline", "current")}
    comparable = {n: median([r["comparable_wall_s"] for r in inter if r["tree"] == n]) for n in ("baseline", "current")}
    ratio = round(comparable["current"] / comparable["baseline"], 3) \
        if comparable["current"] and comparable["baseline"] else None
    promoted = [r.get("promoted_variant") for r in ok if r["tree"] == "current"]
    base_gates = next((r.get("gates") for r in inter if r["tree"] == "baseline"), None) or {}
    same_gates = {}
    for r in (x for x in ok if x["tree"] == "current"):
        for v, gates in (r.get("gates") or {}).items():
            if v in base_gates:
                same_gates.setdefault(v, []).append(gates == base_gates[v])
    report = {
        **report_header("demo", threads=0, packages=("kfp", "mlflow", "onnxruntime", "onnx", "torch")),
        "baseline_commit": args.baseline,
        "current_tree": subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip() + " + working tree",
        "rounds": args.rounds, "repeats": args.repeats, "load_average_at_start": load_at_start,
        "baseline_variants": sorted(base_variants),
        "runs": runs,
        "summary": {"wall_s_median": walls, "comparable_wall_s_median": comparable,
                    "promoted_current": promoted, "same_promotion_current": len(set(promoted)) == 1,
                    "promoted_baseline": [r.get("promoted_variant") for r in ok if r["tree"] == "baseline"],
                    "gates_same_as_baseline": {v: all(x) for v, x in same_gates.items()}},
        "ratio_current_to_baseline": ratio,
        "target_ratio": TARGET_RATIO,
        "target_met": ratio is not None and ratio <= TARGET_RATIO,
        "load_average_at_end": os.getloadavg(),
        "elapsed_s": round(time.time() - started, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({"summary": report["summary"], "ratio": ratio, "target_met": report["target_met"]}, indent=2))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
