"""Run lifecycle and races with real processes: a `tailguard run` stopped by SIGINT / SIGTERM or killed with
SIGKILL leaves its parent MLflow run FAILED with a description; two processes promoting at once leave the alias on
the right version with truthful tags; several processes opening a fresh SQLite store at once all succeed.
"""

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import mlflow
import pytest
import torch

from tests.integration.test_pipeline_local import TINY_KWARGS, make_rows, write_spec

PARENT_WAIT_S = 300  # generous: a loaded 2-core machine starts the KFP tasks slowly


# ------------------------------------------------------------------------------------- local run signals
@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("lifecycle")
    home = root / "home"
    make_rows(120, 0).to_parquet(root / "validation.parquet")
    make_rows(40, 1).to_parquet(root / "calibration.parquet")
    old = os.environ.get("TAILGUARD_HOME")
    os.environ["TAILGUARD_HOME"] = str(home)
    from tailguard.core.home import default_tracking_uri
    from tailguard.core.tracking import configure
    from tailguard.models import MeanPooledEncoder
    from tailguard.registration import register_reference

    uri = default_tracking_uri()
    configure(uri, "registration")
    torch.manual_seed(0)
    register_reference("tiny-encoder", state_dict=MeanPooledEncoder(**TINY_KWARGS).state_dict(),
                       class_path="tailguard.models:MeanPooledEncoder", init_kwargs=TINY_KWARGS)
    yield {"root": root, "env": {**os.environ, "TAILGUARD_HOME": str(home)}, "uri": uri}
    if old is None:
        os.environ.pop("TAILGUARD_HOME", None)
    else:
        os.environ["TAILGUARD_HOME"] = old


def start_run(env, name: str, *args) -> subprocess.Popen:
    spec = write_spec(env["root"], metadata={"name": name})
    return subprocess.Popen([sys.executable, "-m", "tailguard.cli", "run", str(spec), *args], env=env["env"],
                            cwd=env["root"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def parent_runs(env, name: str) -> list:
    client = mlflow.MlflowClient(env["uri"])
    exp = client.get_experiment_by_name(f"tailguard/{name}")
    if exp is None:
        return []
    return client.search_runs([exp.experiment_id], "tags.`tailguard.pipeline_run` != ''")


def wait_for_parent_run(env, name: str, proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + PARENT_WAIT_S
    while time.monotonic() < deadline:
        try:
            runs = parent_runs(env, name)
        except mlflow.exceptions.MlflowException:  # the store is busy: try again
            runs = []
        if runs:
            return runs[0].info.run_id
        assert proc.poll() is None, "the run ended before its parent run appeared:\n" + "".join(proc.communicate())
        time.sleep(0.2)
    pytest.fail(f"no parent run within {PARENT_WAIT_S} s")


def kill_group(proc: subprocess.Popen) -> None:
    """Stop whatever is left of a run started by start_run (its own session: the runner and its tasks)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.returncode is None:
        proc.communicate(timeout=60)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_run_marks_parent_failed_with_reason_and_exits_1_when_interrupted(env, sig):
    name = f"interrupted-{sig.name.lower()}"
    proc = start_run(env, name)
    try:
        run_id = wait_for_parent_run(env, name, proc)
        os.kill(proc.pid, sig)
        out, err = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    assert proc.returncode == 1, out + err
    assert "Traceback" not in out + err
    assert f"interrupted by {sig.name}" in err
    run = mlflow.MlflowClient(env["uri"]).get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["mlflow.note.content"].startswith(f"Interrupted by {sig.name}")
    assert run.data.tags["tailguard.outcome"] == "failed"
    assert run.data.tags["tailguard.failure"] == "interrupted"


@pytest.mark.integration
@pytest.mark.slow
def test_next_run_marks_parent_failed_with_died_note_when_runner_was_killed(env):
    name = "killed"
    proc = start_run(env, name)
    try:
        run_id = wait_for_parent_run(env, name, proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        kill_group(proc)
    client = mlflow.MlflowClient(env["uri"])
    assert client.get_run(run_id).info.status == "RUNNING"  # nobody closed it
    # The next run of the same model (a missing version: it ends right after the check) finds it.
    second = start_run(env, name, "--model-version", "999")
    try:
        out, err = second.communicate(timeout=600)
    finally:
        kill_group(second)
    assert second.returncode == 2, out + err
    run = client.get_run(run_id)
    assert run.info.status == "FAILED"
    note = run.data.tags["mlflow.note.content"]
    assert "died" in note and f"pid {proc.pid}" in note
    assert run.data.tags["tailguard.failure"] == "runner_died"


# ------------------------------------------------------------------------------------------- races
def _promote_worker(uri, parent_run_id, version, barrier, results):
    from tailguard.components.register.promotion import promote
    from tailguard.core.tracking import configure

    configure(uri)
    client = mlflow.MlflowClient()
    barrier.wait(timeout=120)
    r = promote(client, model_name="m-optimized", alias="production", version=version, parent_run_id=parent_run_id,
                batch_size=1, expected=None, tracking_uri=uri)
    results.put((version, r.outcome, r.alias_version))


def _candidates(tmp_path, specs):
    """A store with one parent run + validation run + registered version per (label, p50 ms, source version)."""
    from tailguard.core.contract import VARIANT_RESULT_FILE
    from tailguard.core.results import VariantResult
    from tailguard.core.tracking import configure

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp_id = configure(uri, "race")
    client = mlflow.MlflowClient()
    client.create_registered_model("m-optimized")
    out = {}
    for label, p50, source in specs:
        parent = client.create_run(exp_id, tags={"tailguard.pipeline_run": label})
        child = client.create_run(exp_id, tags={"mlflow.parentRunId": parent.info.run_id})
        client.log_metric(child.info.run_id, "bs1.latency_ms.p50", p50)
        # what promote compares: the validate step's variant_result.json (passed, p50 at batch size 1)
        client.log_dict(child.info.run_id, VariantResult(label, "onnxruntime", "fp32", "ok", passed=True,
                                                         run_id=child.info.run_id,
                                                         perf={1: {"latency_ms.p50": p50}}).to_dict(),
                        VARIANT_RESULT_FILE)
        mv = client.create_model_version("m-optimized", str(tmp_path / label), run_id=child.info.run_id,
                                         tags={"tailguard.source_version": str(source), "tailguard.gates": "passed",
                                               "tailguard.run_id": child.info.run_id})
        out[label] = (parent.info.run_id, str(mv.version))
    return uri, client, out


@pytest.fixture
def private_home(tmp_path, monkeypatch):
    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))
    yield tmp_path


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("source_of_slow", [1, 2], ids=["same-source", "slow-is-newer-source"])
def test_promote_leaves_alias_on_the_winner_with_truthful_tags_when_two_processes_race(private_home, source_of_slow):
    uri, client, c = _candidates(private_home, [("slow", 5.0, source_of_slow), ("fast", 3.0, 1)])
    winner = "slow" if source_of_slow == 2 else "fast"
    loser = "fast" if winner == "slow" else "slow"
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_promote_worker, args=(uri, *c[label], barrier, results)) for label in c]
    for p in procs:
        p.start()
    outcomes = {results.get(timeout=300)[0]: None for _ in procs}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(outcomes) == 2
    alias = str(client.get_model_version_by_alias("m-optimized", "production").version)
    assert alias == c[winner][1]
    won, lost = client.get_run(c[winner][0]).data.tags, client.get_run(c[loser][0]).data.tags
    assert won["tailguard.promotion"] == "promoted" and won["tailguard.alias_version"] == alias
    assert lost["tailguard.promotion"] == "superseded" and lost["tailguard.alias_version"] == alias


def test_promote_keeps_the_faster_holder_when_the_alias_moved_during_the_run(private_home):
    from tailguard.components.register.promotion import promote

    uri, client, c = _candidates(private_home, [("slow", 5.0, 1), ("fast", 3.0, 1), ("faster", 1.0, 1)])
    kw = dict(model_name="m-optimized", alias="production", batch_size=1, tracking_uri=uri)
    # all three decided while the alias pointed nowhere; they finish in the order fast, slow, faster
    assert promote(client, parent_run_id=c["fast"][0], version=c["fast"][1], expected=None, **kw).outcome == "promoted"
    r = promote(client, parent_run_id=c["slow"][0], version=c["slow"][1], expected=None, **kw)
    assert (r.outcome, r.alias_version) == ("superseded", c["fast"][1])
    r = promote(client, parent_run_id=c["faster"][0], version=c["faster"][1], expected=None, **kw)
    assert (r.outcome, r.alias_version) == ("promoted", c["faster"][1])
    fast = client.get_run(c["fast"][0]).data.tags
    assert fast["tailguard.promotion"] == "superseded" and fast["tailguard.superseded_by"] == c["faster"][0]
    # a run that decided after the alias moved (expected = the holder) replaces it, as runs one after another do
    r = promote(client, parent_run_id=c["slow"][0], version=c["slow"][1], expected=c["faster"][1], **kw)
    assert (r.outcome, r.alias_version) == ("promoted", c["slow"][1])


def test_promote_keeps_the_holder_when_its_variant_result_says_not_passed_although_its_tag_says_passed(private_home):
    """The re-decision reads the holder's variant_result.json, not the version's tailguard.gates tag: a holder
    whose file says not passed has no passing latency to compare, so it keeps the alias (it is never beaten on a
    tag)."""
    from tailguard.components.register.promotion import promote
    from tailguard.core.contract import VARIANT_RESULT_FILE
    from tailguard.core.results import VariantResult

    uri, client, c = _candidates(private_home, [("fast", 3.0, 1), ("faster", 1.0, 1)])
    kw = dict(model_name="m-optimized", alias="production", batch_size=1, tracking_uri=uri)
    assert promote(client, parent_run_id=c["fast"][0], version=c["fast"][1], expected=None, **kw).outcome == "promoted"
    holder_run = client.get_model_version("m-optimized", c["fast"][1]).tags["tailguard.run_id"]
    client.log_dict(holder_run, VariantResult("fast", "onnxruntime", "fp32", "ok", passed=False, run_id=holder_run,
                                              perf={1: {"latency_ms.p50": 3.0}}).to_dict(), VARIANT_RESULT_FILE)
    r = promote(client, parent_run_id=c["faster"][0], version=c["faster"][1], expected=None, **kw)
    assert (r.outcome, r.alias_version) == ("superseded", c["fast"][1])
    assert "no passing latency" in r.reason


def _init_worker(uri, barrier, results):
    try:
        from tailguard.core.tracking import configure

        barrier.wait(timeout=120)
        results.put(("ok", configure(uri, "tailguard/fresh")))
    except Exception as exc:  # reported to the test
        results.put(("error", f"{type(exc).__name__}: {exc}"))


@pytest.mark.integration
@pytest.mark.slow
def test_configure_succeeds_in_every_process_when_three_open_a_fresh_store_at_once(private_home):
    uri = f"sqlite:///{private_home / 'fresh.db'}"
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_init_worker, args=(uri, barrier, results)) for _ in range(3)]
    for p in procs:
        p.start()
    got = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert [g[0] for g in got] == ["ok"] * 3, got
    assert len({g[1] for g in got}) == 1  # one experiment, created once


@pytest.mark.integration
@pytest.mark.slow
def test_run_marks_parent_failed_with_the_error_as_description_when_a_task_fails(env):
    outputs = [{"name": "embedding", "dtype": "float32", "shape": ["batch", 32]},
               {"name": "extra", "dtype": "float32", "shape": ["batch", 32]}]
    doc_name = "task-fails"
    spec = write_spec(env["root"], metadata={"name": doc_name})
    import yaml

    doc = yaml.safe_load(spec.read_text())
    doc["model"]["outputs"] = outputs  # the module returns one output: export (after resolve) fails
    spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = subprocess.run([sys.executable, "-m", "tailguard.cli", "run", str(spec)], env=env["env"], cwd=env["root"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode in (1, 2), r.stdout + r.stderr
    (run,) = parent_runs(env, doc_name)
    assert run.info.status == "FAILED"
    note = run.data.tags["mlflow.note.content"]
    assert note.startswith("Failed: ") and "export" in note
    assert note.splitlines()[0][len("Failed: "):][:60] in r.stderr  # the message the user saw
    assert run.data.tags["tailguard.failure"] == "error"
