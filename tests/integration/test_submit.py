"""`tailguard submit`: idempotent per (model, version, spec hash). No KFP cluster runs here, so the kfp.Client is
replaced at its one seam (tailguard.submit.make_client) by an in-memory stand-in that records calls; the pipeline
package it receives is the real compiled IR."""

from types import SimpleNamespace

import pytest
import yaml

import tailguard.submit as submit_mod
from tailguard.core.errors import InputError
from tailguard.core.spec import load_spec
from tests.core.test_spec import TINY


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


def test_submit_starts_a_new_run_when_latest_names_a_new_model_version(fake, tmp_path):
    """`latest` / `@alias` resolve to the version number in a real (sqlite) MLflow registry before the key is made:
    a new version submitted as `latest` is a new run, started with that number."""
    from mlflow import MlflowClient

    registry = f"sqlite:///{tmp_path / 'registry.db'}"
    spec = load_spec(TINY)
    spec.mlflow.registry_uri = registry
    name = spec.model.registered_name
    mlf = MlflowClient(tracking_uri=registry, registry_uri=registry)
    mlf.create_registered_model(name)
    (tmp_path / "v1").mkdir()
    mlf.create_model_version(name, source=(tmp_path / "v1").as_uri())
    kw = dict(host="http://kfp", tracking_uri="http://mlflow:5000")

    a = submit_mod.submit(spec, model_version="latest", **kw)
    assert submit_mod.submit(spec, model_version="latest", **kw) == a and len(fake.runs) == 1
    assert fake.packages[0][1]["model_version"] == "1" and fake.runs[0].display_name == submit_mod.run_key(spec, "1")

    (tmp_path / "v2").mkdir()
    mlf.create_model_version(name, source=(tmp_path / "v2").as_uri())
    b = submit_mod.submit(spec, model_version="latest", **kw)
    assert b != a and len(fake.runs) == 2
    assert fake.packages[1][1]["model_version"] == "2" and fake.runs[1].display_name == submit_mod.run_key(spec, "2")

    mlf.set_registered_model_alias(name, "production", "1")
    assert submit_mod.submit(spec, model_version="@production", **kw) == a  # the alias names v1: its run
    assert submit_mod.submit(spec, model_version="2", **kw) == b and len(fake.runs) == 2
    with pytest.raises(InputError, match="no alias 'staging'"):
        submit_mod.submit(spec, model_version="@staging", **kw)
    assert len(fake.runs) == 2
