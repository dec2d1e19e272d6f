"""The demo's wall time, the current tree against a baseline commit, back to back (issue 15's demo target).

Run (not part of the test suite; about 10 minutes a round on 2 cores):

    .venv/bin/python benchmarks/bench_demo.py [--out benchmarks/results/demo.json] [--rounds 1] [--baseline 5a349da]

What it does: the two trees are assembled as importable `tailguard` packages exactly as bench_pipeline.py does
("current" = a copy of this working tree when the benchmark starts; "baseline" = `git archive <baseline>`). Each
tree and round runs `PYTHONPATH=<tree> python -m tailguard.cli demo` (the whole `make demo`: WordNet -> Parquet,
register MiniLM, the kfp.local pipeline, the monitor replay) in a fresh `$TAILGUARD_HOME`, so the local cache
starts empty: this is a first run, not a re-run. Rounds interleave the trees (round 0: baseline then current;
round 1 the other way), so a load drift on a shared machine hits both alike.

JSON: header (command, machine, packages), `runs` (tree, round, wall_s, exit code, the CLI's last lines, the
pipeline's per-task timings from `$TAILGUARD_HOME/runs/<run>/pipeline.log`), `summary` (median wall per tree),
`ratio` (current / baseline median wall; the target is <= 0.60) and `target_met`.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import median, snapshot_trees, tree_env  # noqa: E402
from common import report_header  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TARGET_RATIO = 0.60


def demo_once(tree: Path, home: Path, cwd: Path) -> dict[str, Any]:
    """`python -m tailguard.cli demo` with `tree` on PYTHONPATH in a fresh `home`: wall seconds, exit code,
    per-task timings of its pipeline run."""
    from tailguard.runner import task_timings

    home.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tailguard.cli", "demo"], env=tree_env(tree, home), cwd=cwd,
                          capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    logs = sorted((home / "runs").glob("*/pipeline.log"), key=lambda p: p.stat().st_mtime)
    timings = task_timings(logs[-1].read_text(errors="replace")) if logs else {"tasks": []}
    out = {"wall_s": round(wall, 3), "exit_code": proc.returncode, **timings,
           "cli_tail": [line.rstrip() for line in proc.stdout.splitlines()[-4:]]}
    if proc.returncode not in (0, 3):
        out["stderr_tail"] = (proc.stderr or proc.stdout)[-2000:]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "demo.json"))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--baseline", default="5a349da", help="the commit to compare with (git archive)")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one, removed)")
    args = ap.parse_args()

    work = Path(args.work or tempfile.mkdtemp(prefix="bench-demo-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started, load_at_start = time.time(), os.getloadavg()
    trees = snapshot_trees(work, args.baseline)
    runs: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        order = ["baseline", "current"] if rnd % 2 == 0 else ["current", "baseline"]
        for name in order:
            r = demo_once(trees[name], work / f"home-{name}-{rnd}", work)
            runs.append({"tree": name, "round": rnd, **r})
            print(f"round {rnd} {name:8s} {r['wall_s']:7.1f} s  exit {r['exit_code']}", flush=True)
    walls = {name: median([r["wall_s"] for r in runs if r["tree"] == name and r["exit_code"] in (0, 3)])
             for name in ("baseline", "current")}
    ratio = round(walls["current"] / walls["baseline"], 3) if walls["current"] and walls["baseline"] else None
    report = {
        **report_header("demo", threads=0, packages=("kfp", "mlflow", "onnxruntime", "onnx", "torch")),
        "baseline_commit": args.baseline,
        "current_tree": subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip() + " + working tree",
        "rounds": args.rounds, "load_average_at_start": load_at_start,
        "runs": runs,
        "summary": {"wall_s_median": walls},
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
