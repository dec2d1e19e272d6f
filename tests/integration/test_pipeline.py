"""The pipeline definition (tailguard.pipeline): one DAG for local runs and the cluster; GPU settings only on GPU
variants' tasks."""

import yaml

from tailguard.core.spec import load_spec
from tailguard.pipeline import build_pipeline, compile_pipeline
from tailguard.runner import task_count
from tests.core.test_spec import TINY


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
    assert len(tasks) == 6 + 2 * len(spec.variants)  # check-data, resolve, fetch-reference, export,
    # reference-pass, register-and-promote
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


def _dag_tasks(ir: dict) -> dict:
    """Every container task of the IR by task name (the exit handler's sub-DAG flattened), with its spec."""
    tasks = dict(ir["root"]["dag"]["tasks"])
    for t in list(tasks.values()):
        tasks.update(ir["components"].get(t["componentRef"]["name"], {}).get("dag", {}).get("tasks", {}))
    return {name: t for name, t in tasks.items() if "dag" not in ir["components"][t["componentRef"]["name"]]}


def test_compiled_pipeline_caches_exactly_fetch_export_builds_and_reference_pass_when_cache_is_on_or_off(tmp_path):
    spec = load_spec(TINY)
    compile_pipeline(spec, str(tmp_path / "on.yaml"))
    compile_pipeline(spec, str(tmp_path / "off.yaml"), cache=False)

    def cached(path):
        return {name for name, t in _dag_tasks(load_ir(path)).items() if t.get("cachingOptions", {}).get("enableCache")}

    assert cached(tmp_path / "on.yaml") == ({"fetch-reference", "export", "reference-pass"}
                                          | {f"build-{v.name}" for v in spec.variants})
    assert cached(tmp_path / "off.yaml") == set()


def test_task_names_are_the_same_locally_and_compiled_when_one_component_serves_every_variant(tmp_path):
    from kfp import compiler

    spec = load_spec(TINY)
    compiler.Compiler().compile(build_pipeline(spec, cluster=False), package_path=str(tmp_path / "local.yaml"))
    compile_pipeline(spec, str(tmp_path / "cluster.yaml"))
    local = _dag_tasks(load_ir(tmp_path / "local.yaml"))
    cluster = _dag_tasks(load_ir(tmp_path / "cluster.yaml"))

    per_variant = {f"{step}-{v.name}" for v in spec.variants for step in ("build", "validate")}
    per_variant |= {f"search-{v.name}" for v in spec.variants if v.search is not None}
    expected = {"check-data", "resolve", "fetch-reference", "export", "reference-pass",
                "register-and-promote"} | per_variant
    assert set(local) == expected and set(cluster) == expected | {"finalize-run"}
    assert len(local) == task_count(spec)  # the progress bar's total
    assert all(t["taskInfo"]["name"] == name for name, t in {**local, **cluster}.items())  # display = KFP name


def test_named_refuses_a_task_name_kfp_would_rename_when_it_is_not_a_dns_label():
    import pytest

    from tailguard.components.check_data.component import check_data
    from tailguard.pipeline import named

    assert named(check_data, "check-data-2").component_spec.name == "check-data-2"
    assert check_data.component_spec.name == "check-data"  # the original is untouched
    with pytest.raises(ValueError, match="DNS-1123"):
        named(check_data, "Build_Int8")
