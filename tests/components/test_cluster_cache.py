"""KFP's execution cache on a cluster: after a gate change the pure tasks (fetch-reference, export, reference-pass,
build-<variant>) keep the same cache key, so a re-run is served from KFP's cache.

KFP v2 computes a task's cache key from its input parameter values, its input artifacts (the artifacts its
producer tasks made), its output specs and its component (container image, command, arguments)
(kubeflow/pipelines backend/src/v2/cacheutils). The compiled IR states each of these: a task's `inputs`
(componentInputParameter: a pipeline parameter; runtimeValue.constant: a compile-time constant;
taskOutputParameter / taskOutputArtifact: a producer task's output) and its component and executor. The tests
compare exactly that view of each pure task between two compiled specs; and since an input artifact is only
reused when its producer is itself served from the cache, every producer of a pure task's artifacts must be pure.

Real parts: the real pipeline definition (tailguard.pipeline) and KFP compiler; the fetch-reference task body
against a real MLflow store (SQLite under tmp_path) holding a tiny ONNX MLP. No seams.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tailguard.core.spec import parse_spec, resolve_data_uris, spec_from_yaml
from tailguard.pipeline import compile_pipeline, is_pure, step_spec_yaml
from tests.core.test_spec import TINY
from tests.integration.test_pipeline import _dag_tasks, load_ir

ROOT = Path(__file__).resolve().parents[2]


def tiny(edit=None):
    """The tiny spec (three variants, two gates), with `edit(doc)` applied to its YAML document first."""
    doc = yaml.safe_load(TINY.read_text())
    if edit is not None:
        edit(doc)
    spec = parse_spec(doc)
    resolve_data_uris(spec, TINY)
    return spec


def cache_views(spec, path: Path) -> dict[str, dict]:
    """Per pure task of `spec` compiled to `path`: what KFP's cache key is computed from (inputs, component
    spec, executor), plus whether caching is on."""
    compile_pipeline(spec, str(path))
    ir = load_ir(path)
    views = {}
    for name, t in _dag_tasks(ir).items():
        if not is_pure(name):
            continue
        comp = ir["components"][t["componentRef"]["name"]]
        views[name] = {"inputs": t.get("inputs", {}), "component": comp,
                       "executor": ir["deploymentSpec"]["executors"][comp["executorLabel"]],
                       "cache": bool(t.get("cachingOptions", {}).get("enableCache"))}
    return views


def set_gate_min(doc):
    doc["gates"][0]["min"] = 0.5


def set_alias(doc):
    doc["promotion"] = {"alias": "staging"}


def set_per_channel(doc):
    doc["variants"][1]["quantization"]["per_channel"] = False


@pytest.mark.parametrize("edit", [set_gate_min, set_alias], ids=["gate-threshold", "promotion-alias"])
def test_pure_tasks_keep_their_kfp_cache_key_when_only_a_gate_or_the_promotion_alias_changes(tmp_path, edit):
    """Inputs, component spec and executor of every pure task are identical (so is KFP's cache key)."""
    before, after = cache_views(tiny(), tmp_path / "a.yaml"), cache_views(tiny(edit), tmp_path / "b.yaml")

    assert set(before) == {"fetch-reference", "export", "reference-pass", "build-ort-fp32", "build-ort-int8",
                           "build-trt-fp16"}
    for name in before:
        assert before[name] == after[name], name
        assert before[name]["cache"], name


def test_pure_tasks_read_no_pipeline_spec_and_no_artifact_of_an_uncached_task_when_compiled(tmp_path):
    """No pure task takes the `spec_yaml` pipeline parameter, and each input artifact comes from a pure task: an
    artifact of an uncached producer (resolve) is new on every run, and KFP keys on it."""
    compile_pipeline(tiny(), str(tmp_path / "p.yaml"))
    tasks = _dag_tasks(load_ir(tmp_path / "p.yaml"))
    pure = {n: t for n, t in tasks.items() if is_pure(n)}

    for name, t in pure.items():
        params = t.get("inputs", {}).get("parameters", {})
        assert not any(p.get("componentInputParameter", "").endswith("spec_yaml") for p in params.values()), name
        for art in t.get("inputs", {}).get("artifacts", {}).values():
            assert is_pure(art["taskOutputArtifact"]["producerTask"]), name
    fetch = pure["fetch-reference"]["inputs"]["parameters"]
    assert {k: v["taskOutputParameter"]["producerTask"] for k, v in fetch.items() if "taskOutputParameter" in v} == {
        "version": "resolve", "sha256": "resolve"}
    # the MLflow-writing tasks still get the whole spec
    validate = tasks["validate-ort-int8"]["inputs"]["parameters"]["spec_yaml"]
    assert validate["componentInputParameter"].endswith("spec_yaml")  # pipelinechannel--spec_yaml in the handler


def test_only_the_changed_variants_build_changes_its_kfp_cache_key_when_its_quantization_section_changes(tmp_path):
    before = cache_views(tiny(), tmp_path / "a.yaml")
    after = cache_views(tiny(set_per_channel), tmp_path / "b.yaml")

    assert before["build-ort-int8"]["inputs"] != after["build-ort-int8"]["inputs"]
    for name in ("fetch-reference", "export", "reference-pass", "build-ort-fp32", "build-trt-fp16"):
        assert before[name] == after[name], name


def test_step_spec_yaml_keeps_what_pure_tasks_read_and_canonicalizes_the_rest_when_given_a_variant():
    spec = tiny()
    build = spec_from_yaml(step_spec_yaml(spec, "ort-int8"))
    common = spec_from_yaml(step_spec_yaml(spec))

    assert [v.name for v in build.variants] == ["ort-int8"]
    assert build.variants[0] == spec.variants[1]
    assert len(common.variants) == 1 and common.variants[0].precision == "fp32"
    for s in (build, common):
        assert (s.model, s.data, s.slices, s.benchmark, s.analysis.sensitivity) == (
            spec.model.model_copy(update={"version": "latest"}), spec.data, spec.slices, spec.benchmark,
            spec.analysis.sensitivity)
        assert s.gates == [] and s.promotion.enabled is False and s.kubeflow.image is None
        assert s.metadata.name == spec.metadata.name
    with pytest.raises(KeyError, match="nope"):
        step_spec_yaml(spec, "nope")


# ----------------------------------------------------------------------------------------------- fetch-reference
@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A private $TAILGUARD_HOME (local cache on) whose MLflow store holds version 1 of the MLP "mlp"."""
    from tailguard.core import cache
    from tailguard.core.home import default_tracking_uri
    from tailguard.core.tracking import configure
    from tailguard.registration import register_reference
    from tests.core.test_cache import write_mlp

    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(cache.ENV_CACHE, "1")
    monkeypatch.delenv(cache.ENV_MAX_BYTES, raising=False)
    onnx_dir = write_mlp(tmp_path / "fp32")
    uri = default_tracking_uri()
    configure(uri, "registration")
    mv = register_reference("mlp", onnx_path=onnx_dir / "model.onnx")
    model_json = json.dumps({"registered_name": "mlp", "task": "classification",
                             "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 65]}],
                             "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", 10]}]})
    import mlflow

    from tailguard.core.contract import SHA256_TAG

    stored = mlflow.MlflowClient(uri).get_model_version("mlp", mv.version).tags[SHA256_TAG]  # of the stored file
    return {"root": tmp_path, "uri": uri, "version": str(mv.version), "model_json": model_json, "sha256": stored}


def fetch(registry, out: str, *, sha256: str | None = None) -> dict:
    from tailguard.components.resolve.task import fetch_main

    return json.loads(fetch_main(tracking_uri=registry["uri"], model_json=registry["model_json"],
                                 version=registry["version"], sha256=sha256 or registry["sha256"],
                                 out_dir=str(registry["root"] / out)))


def test_fetch_reference_refuses_the_download_when_its_sha256_differs_from_resolves(registry):
    from tailguard.core.errors import InputError

    with pytest.raises(InputError, match=f"version {registry['version']}.*SHA-256"):
        fetch(registry, "out", sha256="0" * 64)


def test_fetch_reference_is_served_from_the_local_cache_without_mlflow_when_run_again(registry):
    from tailguard.core.reference import load_resolved

    first = fetch(registry, "f1")
    code = ("import json, sys\n"
            "from tailguard.components.resolve.task import fetch_main\n"
            f"r = json.loads(fetch_main(tracking_uri={registry['uri']!r}, model_json={registry['model_json']!r}, "
            f"version={registry['version']!r}, sha256={registry['sha256']!r}, "
            f"out_dir={str(registry['root'] / 'f2')!r}))\n"
            "print('mlflow' in sys.modules, r['cached'])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ})
    assert r.returncode == 0, r.stderr[-3000:]

    assert first["cached"] is False and first["version"] == registry["version"]
    assert r.stdout.split()[-2:] == ["False", "True"]
    # the restored folder has the downloaded files where the resolved record says (artifact_subdir)
    resolved = load_resolved(json.dumps(first), str(registry["root"] / "f2"))
    assert resolved.format == "onnx" and Path(resolved.onnx_path).is_file()
    assert resolved.sha256 == registry["sha256"]
