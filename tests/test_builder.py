"""The pipeline builder: one DAG for local runs and the cluster; GPU settings only on GPU variants' tasks."""

import yaml

from tailguard.builder import build_pipeline, compile_pipeline
from tailguard.core.spec import load_spec

from tests.test_spec import TINY


def load_ir(path) -> dict:
    """The pipeline spec, with the platform spec (second YAML document, when present) under "platforms"."""
    docs = list(yaml.safe_load_all(path.read_text()))
    ir = docs[0]
    if len(docs) > 1:
        ir["platforms"] = docs[1]["platforms"]
    return ir


def executors(ir: dict) -> dict:
    return ir["deploymentSpec"]["executors"]


def k8s_config(ir: dict) -> dict:
    return ir.get("platforms", {}).get("kubernetes", {}).get("deploymentSpec", {}).get("executors", {})


def test_compile_pipeline_requests_gpus_only_for_gpu_variants_when_compiled_for_the_cluster(tmp_path):
    spec = load_spec(TINY)
    out = tmp_path / "p.yaml"
    compile_pipeline(spec, str(out))
    ir = load_ir(out)
    with_gpu = {name for name, ex in executors(ir).items()
                if ex["container"].get("resources", {}).get("accelerator")}
    # the trt-fp16 variant's build and validate tasks, nothing else
    assert len(with_gpu) == 2
    images = {ex["container"]["image"] for ex in executors(ir).values()}
    assert images == {"reg/tg:1", "reg/tg-gpu:1"}
    k8s = k8s_config(ir)
    selectors = [name for name, c in k8s.items() if c.get("nodeSelector")]
    assert sorted(selectors) == sorted(with_gpu)
    assert all(c.get("secretAsEnv") for c in k8s.values())


def test_compile_pipeline_keeps_secret_values_out_of_parameters_when_secrets_are_referenced(tmp_path):
    spec = load_spec(TINY)
    out = tmp_path / "p.yaml"
    compile_pipeline(spec, str(out))
    ir = load_ir(out)
    params = ir["root"]["inputDefinitions"]["parameters"]
    assert set(params) == {"spec_yaml", "tracking_uri", "model_version", "pipeline_run"}
    assert "mlflow-creds" in out.read_text()  # only the secret's name and key, as a reference


def test_build_pipeline_unrolls_two_tasks_per_variant_when_built(tmp_path):
    from kfp import compiler

    spec = load_spec(TINY)
    out = tmp_path / "local.yaml"
    compiler.Compiler().compile(build_pipeline(spec, cluster=False), package_path=str(out))
    ir = load_ir(out)
    tasks = ir["root"]["dag"]["tasks"]
    assert len(tasks) == 5 + 2 * len(spec.variants)
    assert not k8s_config(ir)
    names = {t["taskInfo"]["name"] for t in tasks.values()}
    assert {"build-ort-fp32", "validate-trt-fp16", "register-and-promote"} <= names


def test_compiled_yaml_contains_no_secret_value_when_secrets_are_in_the_compiling_environment(tmp_path, monkeypatch):
    secret_values = {"MLFLOW_TRACKING_TOKEN": "tg-token-9f1c2e", "AWS_SECRET_ACCESS_KEY": "tg-aws-secret-77aa",
                     "MLFLOW_TRACKING_PASSWORD": "tg-password-31x"}
    for k, v in secret_values.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "p.yaml"
    compile_pipeline(load_spec(TINY), str(out))
    text = out.read_text()
    assert "MLFLOW_TRACKING_TOKEN" in text  # the env var is wired from the secret reference...
    for v in secret_values.values():
        assert v not in text  # ...but no secret value ever reaches the IR
