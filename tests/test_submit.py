"""`tailguard submit`: idempotent per (model, version, spec hash). No KFP cluster runs here, so the kfp.Client is
replaced at its one seam (tailguard.submit.make_client) by an in-memory stand-in that records calls; the pipeline
package it receives is the real compiled IR."""

from types import SimpleNamespace

import pytest
import yaml

import tailguard.submit as submit_mod
from tailguard.errors import InputError
from tailguard.spec import load_spec

from tests.test_spec import TINY


class FakeKfp:
    """Records experiments and runs like the KFP v2beta1 API (display_name filter only)."""

    def __init__(self):
        self.experiments, self.runs, self.packages = {}, [], []

    def get_experiment(self, experiment_name=None, experiment_id=None):
        if experiment_name not in self.experiments:
            raise ValueError("not found")
        return self.experiments[experiment_name]

    def create_experiment(self, name):
        self.experiments[name] = SimpleNamespace(experiment_id=f"exp-{len(self.experiments)}")
        return self.experiments[name]

    def list_runs(self, experiment_id=None, filter=None, page_size=50):
        import json

        name = json.loads(filter)["predicates"][0]["string_value"]
        return SimpleNamespace(runs=[r for r in self.runs if r.display_name == name
                                     and r.experiment_id == experiment_id])

    def create_run_from_pipeline_package(self, package, arguments, run_name, experiment_id, enable_caching):
        self.packages.append((open(package).read(), arguments))
        run = SimpleNamespace(run_id=f"run-{len(self.runs)}", display_name=run_name, experiment_id=experiment_id,
                              state="RUNNING")
        self.runs.append(run)
        return run


@pytest.fixture
def fake(monkeypatch):
    client = FakeKfp()
    monkeypatch.setattr(submit_mod, "make_client", lambda host: client)
    return client


def test_submit_returns_the_existing_run_when_the_same_model_version_and_spec_are_resubmitted(fake):
    spec = load_spec(TINY)
    a = submit_mod.submit(spec, host="http://kfp", model_version="3", tracking_uri="http://mlflow:5000")
    b = submit_mod.submit(spec, host="http://kfp", model_version="3", tracking_uri="http://mlflow:5000")
    c = submit_mod.submit(spec, host="http://kfp", model_version="4", tracking_uri="http://mlflow:5000")
    assert a == b != c
    assert len(fake.runs) == 2
    ir_text, args = fake.packages[0]
    assert args["model_version"] == "3"
    assert yaml.safe_load_all(ir_text)


def test_submit_starts_a_new_run_when_the_previous_one_failed(fake):
    spec = load_spec(TINY)
    a = submit_mod.submit(spec, host="http://kfp", model_version="3", tracking_uri="http://mlflow:5000")
    fake.runs[0].state = "FAILED"
    b = submit_mod.submit(spec, host="http://kfp", model_version="3", tracking_uri="http://mlflow:5000")
    assert a != b


def test_submit_refuses_a_local_tracking_store_when_targeting_a_cluster(fake, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(InputError) as ei:
        submit_mod.submit(load_spec(TINY), host="http://kfp", tracking_uri="sqlite:///x.db")
    assert "mlflow.tracking_uri" in str(ei.value)
    assert not fake.runs
