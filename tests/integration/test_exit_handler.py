"""The cluster form's exit handler (components/finalize) closes the parent MLflow run when a pipeline fails.

Runs a real KFP pipeline with kfp.local (SubprocessRunner, no Docker) and the real `finalize_run` component inside
a real `dsl.ExitHandler`: KFP itself computes the final status and the job id placeholder. The two tasks before it
stand in for resolve (opens the parent run tagged with the KFP job id) and a failing step (a `task_entry` task
that raises a TailguardError); the full tailguard DAG's exit handler is checked in the compiled IR.
"""

import warnings
from pathlib import Path

import mlflow
import pytest
import yaml

from tailguard.core.contract import FAILURE_MESSAGE_TAG, KFP_RUN_TAG, NOTE_TAG
from tailguard.core.spec import load_spec
from tailguard.pipeline import build_pipeline

ROOT = Path(__file__).resolve().parents[2]
TINY_SPEC = ROOT / "tests" / "data" / "tiny_spec.yaml"


def _components():
    from kfp import dsl

    @dsl.component(base_image="python:3.11", install_kfp_package=False)
    def open_parent(tracking_uri: str, experiment: str, kfp_run: str) -> str:
        import mlflow

        mlflow.set_tracking_uri(tracking_uri)
        client = mlflow.MlflowClient()
        exp = client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
        parent = client.create_run(exp_id, tags={"tailguard.kfp_run": kfp_run})
        client.create_run(exp_id, tags={"mlflow.parentRunId": parent.info.run_id})  # a variant run, RUNNING
        return parent.info.run_id

    @dsl.component(base_image="python:3.11", install_kfp_package=False)
    def step(tracking_uri: str, parent_run_id: str, fail: bool) -> None:
        from tailguard.core.errors import InputError
        from tailguard.core.taskio import task_entry

        @task_entry("validate")
        def main(*, tracking_uri: str, parent_run_id: str, variant_name: str) -> None:
            if fail:
                raise InputError("column 'image' is not convertible to float32")
            import mlflow

            mlflow.MlflowClient(tracking_uri).set_terminated(parent_run_id, "FINISHED")  # as register does

        main(tracking_uri=tracking_uri, parent_run_id=parent_run_id, variant_name="ort-int8")

    return open_parent, step


def run_with_exit_handler(tmp_path: Path, uri: str, spec_yaml: str, experiment: str, fail: bool) -> None:
    from kfp import dsl, local

    from tailguard.components.finalize.component import finalize_run

    open_parent, step = _components()

    @dsl.pipeline(name="exit-handler-check")
    def pipeline(fail: bool):
        fin = finalize_run(spec_yaml=spec_yaml, tracking_uri=uri, kfp_run=dsl.PIPELINE_JOB_ID_PLACEHOLDER)
        with dsl.ExitHandler(fin):
            parent = open_parent(tracking_uri=uri, experiment=experiment, kfp_run=dsl.PIPELINE_JOB_ID_PLACEHOLDER)
            step(tracking_uri=uri, parent_run_id=parent.output, fail=fail)

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "kfp"),
               raise_on_error=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipeline(fail=fail)


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = load_spec(TINY_SPEC)
    from tailguard.core.tracking import configure, experiment_name_for

    configure(uri, experiment_name_for(spec))
    return uri, TINY_SPEC.read_text(), experiment_name_for(spec)


def only_parent(uri: str, experiment: str):
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if KFP_RUN_TAG in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 1
    return parents[0], children[0]


def test_finalize_marks_parent_failed_with_the_task_error_as_description_when_a_task_fails(tmp_path, store):
    uri, spec_yaml, experiment = store
    run_with_exit_handler(tmp_path, uri, spec_yaml, experiment, fail=True)
    parent, child = only_parent(uri, experiment)
    assert parent.info.status == "FAILED"
    assert child.info.status == "FAILED"
    assert "validate (ort-int8): column 'image' is not convertible to float32" in parent.data.tags[
        FAILURE_MESSAGE_TAG]
    note = parent.data.tags[NOTE_TAG]
    assert note.startswith("Failed: validate (ort-int8): column 'image'")
    assert "exit handler" in note and "No alias moved" in note
    assert parent.data.tags["tailguard.failure"] == "kfp_failed"


def test_finalize_leaves_a_closed_parent_finished_when_the_pipeline_succeeds(tmp_path, store):
    uri, spec_yaml, experiment = store
    run_with_exit_handler(tmp_path, uri, spec_yaml, experiment, fail=False)
    parent, _ = only_parent(uri, experiment)
    assert parent.info.status == "FINISHED"
    assert NOTE_TAG not in parent.data.tags and "tailguard.failure" not in parent.data.tags


def test_cluster_pipeline_wraps_every_task_after_check_data_in_the_exit_handler_when_compiled(tmp_path):
    from kfp import compiler

    spec = load_spec(TINY_SPEC)
    out = tmp_path / "p.yaml"
    compiler.Compiler().compile(build_pipeline(spec, cluster=True), package_path=str(out))
    ir = next(yaml.safe_load_all(out.read_text()))
    root = ir["root"]["dag"]["tasks"]
    assert set(root) == {"check-data", "exit-handler-1", "finalize-run"}
    assert root["finalize-run"]["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    inner = set(ir["components"]["comp-exit-handler-1"]["dag"]["tasks"])
    assert {"resolve", "export", "reference-pass", "register-and-promote"} <= inner
    assert {f"{step}-{v.name}" for v in spec.variants for step in ("build", "validate")} <= inner
    resolve_in = ir["components"]["comp-exit-handler-1"]["dag"]["tasks"]["resolve"]["inputs"]["parameters"]
    assert resolve_in["kfp_run"]["runtimeValue"]["constant"] == "{{$.pipeline_job_uuid}}"


def test_local_pipeline_keeps_its_summary_output_and_no_exit_handler_when_built_for_kfp_local():
    import tempfile

    from kfp import compiler

    spec = load_spec(TINY_SPEC)
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "p.yaml"
        compiler.Compiler().compile(build_pipeline(spec, cluster=False), package_path=str(out))
        ir = next(yaml.safe_load_all(out.read_text()))
    assert "finalize-run" not in ir["root"]["dag"]["tasks"]
    assert "Output" in ir["root"]["outputDefinitions"]["parameters"]
