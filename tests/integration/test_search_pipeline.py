"""The search inside the pipeline: `tailguard run` with an INT8 variant carrying `search:` runs search-<variant>
after its validation (kfp.local SubprocessRunner, real SQLite MLflow store), logs one nested run per trial
under the variant's run, and hands the chosen trial to register-and-promote as '<variant>-searched'.

Model: tests/helpers/search_models.py's planted MLP (one MatMul, mm2, whose INT8 weights are ruined by a planted outlier
row), registered as an ONNX reference. INT8 dynamic as specified fails cosine_similarity.min >= 0.99; keeping
the most sensitive node in float passes it.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import numpy as np
import pytest
import yaml

from tests.helpers.search_models import IN, OUT, PLANTED, mlp_rows, planted_mlp

pytestmark = [pytest.mark.integration, pytest.mark.slow]

V = "mlp-int8"


def write_spec(root: Path, *, gates: list, search: dict | None = None) -> Path:
    # two families (per_channel true = the variant's own, false); the own family's k=0 is the variant itself,
    # known to fail, so the trials are: (true, k=1), then a binary search over (false, k in {0, 1})
    search = search or {"max_trials": 3, "when": "on_failure",
                        "space": {"exclude_most_sensitive": [0, 1], "per_channel": [True, False],
                                  "float_op_types": [[]]}}
    doc = {
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "planted-search"},
        "model": {"registered_name": "planted-mlp", "task": "embedding", "source": {"format": "onnx"},
                  "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", IN]}],
                  "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", OUT]}]},
        "data": {"calibration": {"uri": "calibration.parquet", "max_samples": 32, "batch_size": 8},
                 "validation": {"uri": "validation.parquet", "batch_size": 16}},
        "slices": [{"name": "group", "column": "group"}],
        "variants": [{"name": V, "backend": "onnxruntime", "precision": "int8",
                      "graph_optimization": {"level": "disabled"},
                      "quantization": {"mode": "dynamic", "per_channel": True}, "search": search}],
        "gates": gates,
        "analysis": {"discovery": {"enabled": False}},
        "benchmark": {"batch_sizes": [4], "warmup": 1, "iterations": 3, "max_seconds": 1.0},
        "promotion": {"alias": "production"},
    }
    path = root / f"spec-{len(list(root.glob('spec-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


# a gate that names the spec variant: trials must be judged as that variant, not as "<variant>-tNN"
COSINE_GATE = {"metric": "cosine_similarity.min", "min": 0.99, "variants": [V]}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("search-e2e")
    home = root / "home"
    mlp_rows(64, 0).to_parquet(root / "validation.parquet")
    mlp_rows(32, 1).to_parquet(root / "calibration.parquet")
    # configure() -> mlflow.set_tracking_uri also sets MLFLOW_TRACKING_URI / MLFLOW_REGISTRY_URI in os.environ:
    # restore all three afterwards, or later modules' subprocesses would use this module's store
    saved = {k: os.environ.get(k) for k in ("TAILGUARD_HOME", "MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    os.environ["TAILGUARD_HOME"] = str(home)
    from tailguard.core.home import default_tracking_uri
    from tailguard.core.tracking import configure
    from tailguard.registration import register_reference

    uri = default_tracking_uri()
    configure(uri, "registration")
    register_reference("planted-mlp", onnx_path=planted_mlp(root / "planted.onnx"))
    yield {"root": root, "env": {**os.environ, "TAILGUARD_HOME": str(home), "MLFLOW_TRACKING_URI": uri,
                                 "MLFLOW_REGISTRY_URI": uri}, "uri": uri}
    mlflow.set_tracking_uri(saved["MLFLOW_TRACKING_URI"])  # None: back to MLflow's default
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def tailguard(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tailguard.cli", *map(str, args)], env=env["env"],
                          capture_output=True, text=True, timeout=600, cwd=env["root"])


def alias_version(env, name="planted-mlp-optimized", alias="production"):
    try:
        return str(mlflow.MlflowClient(env["uri"], env["uri"]).get_model_version_by_alias(name, alias).version)
    except mlflow.exceptions.MlflowException:
        return None


def children(client, parent_run_id: str):
    exp = client.get_run(parent_run_id).info.experiment_id
    return client.search_runs([exp], f"tags.mlflow.parentRunId = '{parent_run_id}'")


def test_run_promotes_the_searched_variant_and_logs_trials_when_a_trial_passes_the_variants_gates(env):
    spec = write_spec(env["root"], gates=[COSINE_GATE])
    out = env["root"] / "summary-a.json"
    r = tailguard(env, "run", spec, "--summary-json", out)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads(out.read_text())
    rows = {v["variant"]: v for v in summary["variants"]}
    assert set(rows) == {V, f"{V}-searched"}
    assert rows[V]["status"] == "ok" and not rows[V]["passed"]
    assert rows[f"{V}-searched"]["passed"] and rows[f"{V}-searched"]["promoted"]
    assert summary["promoted_variant"] == f"{V}-searched"
    assert alias_version(env) == rows[f"{V}-searched"]["version"]

    [search] = summary["searches"]
    assert search["variant"] == V and search["stopped_by"] in ("space_exhausted", "max_trials")
    trials = {t["name"]: t for t in search["trials"]}
    unprotected = [t for t in search["trials"] if t["exclude_most_sensitive"] == 0]
    # mm2 quantized: judged by the gate that names V (not as "<V>-tNN", where that gate does not apply), it fails
    assert unprotected and not any(t["passed"] for t in unprotected)
    chosen = trials[search["chosen_name"]]
    assert chosen["passed"] and chosen["chosen"] and PLANTED in json.dumps(chosen["excluded_nodes"])
    assert f"search {V}" in r.stdout and "stopped by" in r.stdout  # the Pareto table was printed

    client = mlflow.MlflowClient(env["uri"])
    variant_run = client.get_run(rows[V]["run_id"])
    assert variant_run.data.tags["tailguard.search"] == search["chosen_name"]
    assert variant_run.data.tags["tailguard.search_stopped_by"] == search["stopped_by"]
    assert {"search/pareto.csv", "search/search.json"} <= {a.path for a in client.list_artifacts(
        variant_run.info.run_id, "search")}
    trial_runs = children(client, variant_run.info.run_id)
    assert len(trial_runs) == len(search["trials"])
    assert {t.data.tags["tailguard.search_of"] for t in trial_runs} == {V}
    assert all("tailguard.variant" not in t.data.tags for t in trial_runs)  # register never sees a trial
    assert {t.data.tags["tailguard.gates"] for t in trial_runs} == {"passed", "failed"}
    assert all("search.excluded_nodes" in t.data.params and "cosine_similarity.min" in t.data.metrics
               for t in trial_runs)

    searched = client.get_run(rows[f"{V}-searched"]["run_id"])
    assert searched.data.tags["mlflow.parentRunId"] == summary["parent_run_id"]
    assert searched.data.tags["tailguard.search_of"] == V
    assert searched.data.tags["tailguard.trial_run_id"] in {t.info.run_id for t in trial_runs}
    assert {"report.html", "slices.csv", "result.json", "variant_result.json"} <= {
        a.path for a in client.list_artifacts(searched.info.run_id)}
    # what register read: the chosen trial's typed result, and the logged result.json carrying the same verdict
    from tailguard.core.results import VariantResult

    dl = env["root"] / "downloaded"
    dl.mkdir(exist_ok=True)
    got = VariantResult.read(client.download_artifacts(searched.info.run_id, "variant_result.json", str(dl)))
    assert (got.variant, got.search_of, got.trial_run_id, got.passed) == (
        f"{V}-searched", V, searched.data.tags["tailguard.trial_run_id"], True)
    logged = json.loads(Path(client.download_artifacts(searched.info.run_id, "result.json", str(dl))).read_text())
    assert logged["passed"] is True and logged["variant"] == V
    [version] = client.search_model_versions(f"name = 'planted-mlp-optimized' and "
                                             f"version_number = {rows[f'{V}-searched']['version']}")
    assert version.tags["tailguard.search_of"] == V and len(version.tags["tailguard.sha256"]) == 64


def test_run_exits_3_with_the_pareto_table_and_moves_no_alias_when_no_trial_passes(env):
    before = alias_version(env)
    spec = write_spec(env["root"], gates=[COSINE_GATE, {"metric": "latency_ms.p50", "max": 0.0001}])
    out = env["root"] / "summary-b.json"
    r = tailguard(env, "run", spec, "--summary-json", out)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "no variant passed" in r.stderr and f"search {V}" in r.stdout
    summary = json.loads(out.read_text()) if out.exists() else None
    # --summary-json is written before the exit code is decided
    assert summary is not None and [v["variant"] for v in summary["variants"]] == [V]
    [search] = summary["searches"]
    assert search["chosen"] is None and search["trials"] and not any(t["passed"] for t in search["trials"])
    assert alias_version(env) == before
    client = mlflow.MlflowClient(env["uri"])
    assert client.get_run(summary["variants"][0]["run_id"]).data.tags["tailguard.search"] == "none"


# ------------------------------------------------------------------------------------------ quick units
def _spec_obj(tmp_path, **search):
    from tailguard.core.spec import load_spec

    return load_spec(write_spec(tmp_path, gates=[COSINE_GATE], search=search or None), resolve_paths=False)


def test_search_decision_runs_only_when_the_variant_failed_when_search_is_on_failure(tmp_path):
    from tailguard.components.search.task import search_decision

    v = _spec_obj(tmp_path).variants[0]
    assert search_decision(v, {"status": "ok", "passed": False}) == (None, "")
    assert search_decision(v, {"status": "failed", "passed": False}) == (None, "")
    assert search_decision(v, {"status": "ok", "passed": True})[0] == "not_needed"
    status, reason = search_decision(v, {"status": "skipped", "passed": False, "reason": "no CUDA EP"})
    assert status == "skipped" and "no CUDA EP" in reason


def test_search_decision_runs_a_passing_variant_when_search_is_always(tmp_path):
    from tailguard.components.search.task import search_decision

    v = _spec_obj(tmp_path, when="always").variants[0]
    assert search_decision(v, {"status": "ok", "passed": True}) == (None, "")


def _timed_spec(tmp_path, gates, promotion_bs=None):
    from tailguard.core.spec import load_spec

    path = write_spec(tmp_path, gates=[COSINE_GATE, *gates])
    doc = yaml.safe_load(path.read_text())
    doc["benchmark"]["batch_sizes"] = [1, 8, 32]
    if promotion_bs:
        doc["promotion"]["batch_size"] = promotion_bs
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return load_spec(path, resolve_paths=False)


def test_search_trials_are_timed_at_the_promotion_and_gate_batch_sizes_only_when_others_are_declared(tmp_path):
    from tailguard.components.search.task import decision_batch_sizes, decision_spec

    spec = _timed_spec(tmp_path, [{"metric": "latency_ms.p99", "max": 50, "batch_size": 32}], promotion_bs=8)
    assert decision_batch_sizes(spec) == [8, 32]
    trial = decision_spec(spec)
    assert trial.benchmark.batch_sizes == [8, 32] and spec.benchmark.batch_sizes == [1, 8, 32]
    assert trial.gates == spec.gates and trial.benchmark.max_seconds == spec.benchmark.max_seconds
    # no batched gate: the first batch size ('fastest' is judged there); a parity gate adds none
    assert decision_batch_sizes(_timed_spec(tmp_path, [])) == [1]


def test_search_trials_keep_the_spec_when_every_batch_size_is_read(tmp_path):
    from tailguard.components.search.task import decision_spec

    spec = _timed_spec(tmp_path, [{"metric": "latency_ms.p99", "max": 50, "batch_size": 8},
                                  {"metric": "throughput_per_s", "min": 1, "batch_size": 32}])
    assert decision_spec(spec) is spec


def test_build_pipeline_adds_a_search_task_after_validate_and_before_register_when_a_variant_searches(tmp_path):
    from kfp import compiler

    from tailguard.pipeline import build_pipeline

    out = tmp_path / "p.yaml"
    compiler.Compiler().compile(build_pipeline(_spec_obj(tmp_path), cluster=False), package_path=str(out))
    tasks = {t["taskInfo"]["name"]: t for t in yaml.safe_load(out.read_text())["root"]["dag"]["tasks"].values()}
    key = {t["taskInfo"]["name"]: k for k, t in
           yaml.safe_load(out.read_text())["root"]["dag"]["tasks"].items()}
    search = tasks[f"search-{V}"]
    assert key[f"validate-{V}"] in search["dependentTasks"]
    assert key[f"search-{V}"] in tasks["register-and-promote"]["dependentTasks"]


def test_run_summary_from_dict_reads_searches_as_empty_when_the_json_predates_search():
    from tailguard.components.register.summary import RunSummary

    old = {"parent_run_id": "p", "experiment_id": "1", "source_model": "m", "source_version": "1",
           "optimized_model": "m-optimized", "alias": "production", "promotion_enabled": True, "batch_size": 1,
           "variants": []}
    s = RunSummary.from_dict(old)
    assert s.searches == [] and RunSummary.from_dict(s.to_dict()) == s


def test_print_search_prints_each_trial_with_front_and_chosen_marks_when_given_a_search_json(capsys):
    from tailguard import terminal

    search = {"variant": V, "stopped_by": "max_trials", "chosen": 1, "chosen_name": f"{V}-t01", "trials": [
        {"index": 0, "name": f"{V}-t00", "excluded_nodes": [], "per_channel": True, "p50_ms": 0.5,
         "worst_slice_value": 0.31, "metric": "nn_top1_agreement", "passed": False, "status": "ok",
         "on_front": True, "chosen": False},
        {"index": 1, "name": f"{V}-t01", "excluded_nodes": ["[mm2]"], "per_channel": True, "p50_ms": 0.7,
         "worst_slice_value": 0.999, "passed": True, "status": "ok", "on_front": True, "chosen": True},
        {"index": 2, "name": f"{V}-t02", "excluded_nodes": [], "per_channel": False, "p50_ms": None,
         "worst_slice_value": None, "passed": False, "status": "failed", "on_front": False, "chosen": False}]}
    terminal.print_search(search)
    text = capsys.readouterr().out
    title = f"search {V}: 3 trials, chosen {V}-t01; stopped by max_trials (worst slice: nn_top1_agreement)"
    assert title in " ".join(text.split())  # the title may wrap
    lines = {ln.split("│")[1].strip(): ln for ln in text.splitlines() if ln.startswith("│") and "-t0" in ln}
    assert "[mm2]" in lines[f"{V}-t01"] and "<-" in lines[f"{V}-t01"] and "<-" not in lines[f"{V}-t00"]
    assert "failed" in lines[f"{V}-t02"]


def test_search_task_fails_alone_with_its_reason_when_the_search_raises(tmp_path, monkeypatch):
    from tailguard.components.search import task as search_task
    from tailguard.core.contract import SEARCH_JSON

    mlp_rows(64, 0).to_parquet(tmp_path / "validation.parquet")
    mlp_rows(32, 1).to_parquet(tmp_path / "calibration.parquet")
    spec = write_spec(tmp_path, gates=[COSINE_GATE], search={"when": "always"})
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):  # configure() sets them: restored after the test
        monkeypatch.setenv(k, uri)
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("search-fails", artifact_location=(tmp_path / "artifacts").as_uri())
    run_id = client.create_run(exp).info.run_id
    onnx_dir = tmp_path / "export"
    onnx_dir.mkdir()
    (onnx_dir / "model.onnx").write_bytes(b"not an ONNX model")  # what a broken export or opset leaves behind
    (tmp_path / "reference").mkdir()
    np.savez(tmp_path / "reference" / "reference_outputs.npz",
             y=np.zeros((64, OUT), dtype=np.float32))
    out = json.loads(search_task.main(
        spec_yaml=spec.read_text().replace("calibration.parquet", str(tmp_path / "calibration.parquet"))
        .replace("validation.parquet", str(tmp_path / "validation.parquet")),
        variant_name=V, validation_json=json.dumps({"variant": V, "status": "ok", "passed": False,
                                                    "run_id": run_id}),
        baselines_json="", parent_run_id=run_id, tracking_uri=uri, onnx_dir=str(onnx_dir),
        reference_dir=str(tmp_path / "reference"), out_dir=str(tmp_path / "out")))

    assert out["status"] == "failed" and out["reason"], out  # returned, not raised: the run goes on
    assert client.get_run(run_id).data.tags["tailguard.search"] == "failed"
    logged = json.loads(Path(client.download_artifacts(run_id, SEARCH_JSON, str(tmp_path / "dl"))).read_text())
    assert logged["status"] == "failed" and logged["reason"] == out["reason"]
