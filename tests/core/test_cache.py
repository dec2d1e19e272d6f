"""The local cache of pure steps (tailguard.core.cache) and KFP caching of the pure tasks in the compiled pipeline.

Real parts: a tiny ONNX MLP (the digits shape, 65 -> 128 -> 10, built with onnx.helper), the real build-variant
task body (ONNX Runtime dynamic INT8 quantization), a cache under tmp_path.

Seams (named): `tailguard.components.build.task._build` is wrapped by a counter that calls the real build, to
count builds; `tailguard.core.cache._copy_file` is replaced by one that fails on the second file, to interrupt a store.
The reference-pass tests run the real task (ONNX Runtime, real timings) and, once, two real `tailguard run`s
(kfp.local, a SQLite MLflow store under tmp_path).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from tailguard.components.build import task as build_task
from tailguard.core import cache


def write_mlp(folder: Path) -> Path:
    """model.onnx: x float32 [batch, 65] -> Relu(x W1 + b1) W2 + b2 -> logits float32 [batch, 10]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=(65, 128)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.normal(size=128).astype(np.float32), "b1"),
             numpy_helper.from_array(rng.normal(size=(128, 10)).astype(np.float32), "w2"),
             numpy_helper.from_array(rng.normal(size=10).astype(np.float32), "b2")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h0"], name="fc1"),
             helper.make_node("Add", ["h0", "b1"], ["h1"], name="fc1_bias"),
             helper.make_node("Relu", ["h1"], ["h"], name="relu"),
             helper.make_node("MatMul", ["h", "w2"], ["o0"], name="fc2"),
             helper.make_node("Add", ["o0", "b2"], ["logits"], name="fc2_bias")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 65])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(folder / "model.onnx"))
    return folder


def spec_yaml(*, per_channel: bool = True, gate_min: float = 0.9) -> str:
    return yaml.safe_dump({
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "mlp"},
        "model": {"registered_name": "mlp", "task": "classification",
                  "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 65]}],
                  "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", 10]}]},
        "data": {"calibration": {"uri": "calibration.parquet"}, "validation": {"uri": "validation.parquet"}},
        "variants": [{"name": "ort-int8", "backend": "onnxruntime", "precision": "int8",
                      "quantization": {"mode": "dynamic", "per_channel": per_channel}}],
        "gates": [{"metric": "top1_agreement", "min": gate_min}],
    }, sort_keys=False)


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A private $TAILGUARD_HOME with the cache on, the FP32 MLP, and a counter around the real build."""
    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(cache.ENV_CACHE, "1")
    monkeypatch.delenv(cache.ENV_MAX_BYTES, raising=False)
    builds = []
    real = build_task._build

    def counting_build(*args, **kwargs):
        builds.append(args[1].name)
        return real(*args, **kwargs)

    monkeypatch.setattr(build_task, "_build", counting_build)
    return {"root": tmp_path, "onnx": write_mlp(tmp_path / "fp32"), "builds": builds}


def build(env, out: str, **spec_kw) -> dict:
    text = build_task.main(spec_yaml=spec_yaml(**spec_kw), variant_name="ort-int8", onnx_dir=str(env["onnx"]),
                           out_dir=str(env["root"] / out))
    return json.loads(text)


def test_build_step_reuses_the_cached_variant_when_run_again_with_only_a_gate_changed(env):
    first = build(env, "run1")
    second = build(env, "run2", gate_min=0.5)  # a gate is not a build input

    assert first["status"] == "ok" and first["cached"] is False
    assert second["status"] == "ok" and second["cached"] is True
    assert env["builds"] == ["ort-int8"]  # built once
    a, b = env["root"] / "run1" / first["artifact"], env["root"] / "run2" / second["artifact"]
    assert b.read_bytes() == a.read_bytes()
    assert json.loads((env["root"] / "run2" / "build.json").read_text())["cached"] is True
    # paths inside the output folder point into the new folder, not the run that built it
    assert str(env["root"] / "run1") not in json.dumps(second)
    [entry] = [e for e in cache.entries() if e.step == "build"]  # (beside the prepared-graph entries it made)
    assert entry.label == "build ort-int8" and entry.bytes > 0


def test_build_step_rebuilds_when_the_variants_quantization_section_changes(env):
    first = build(env, "run1", per_channel=True)
    second = build(env, "run2", per_channel=False)

    assert first["cached"] is False and second["cached"] is False
    assert env["builds"] == ["ort-int8", "ort-int8"]
    assert len([e for e in cache.entries() if e.step == "build"]) == 2


def test_build_step_rebuilds_when_the_fp32_model_bytes_change(env):
    build(env, "run1")
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(env["onnx"] / "model.onnx"))

    model.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.zeros(128, np.float32), "b1"))
    onnx.save(model, str(env["onnx"] / "model.onnx"))
    second = build(env, "run2")

    assert second["cached"] is False and env["builds"] == ["ort-int8", "ort-int8"]


def test_build_step_never_uses_the_cache_when_it_is_off(env, monkeypatch):
    monkeypatch.setenv(cache.ENV_CACHE, "0")
    build(env, "run1")
    second = build(env, "run2")

    assert second["cached"] is False and env["builds"] == ["ort-int8", "ort-int8"]
    assert cache.entries() == []


def export(env, reference: Path, out: str) -> dict:
    from tailguard.components.export import task as export_task
    from tailguard.core.digests import file_sha256

    resolved = {"registered_name": "mlp", "version": "1", "run_id": None, "format": "onnx",
                "local_dir": str(reference), "source_uri": "models:/mlp/1", "model_file": "model.onnx",
                "sha256": file_sha256(reference / "model.onnx"), "artifact_subdir": "."}
    text = export_task.main(spec_yaml=spec_yaml(), resolved_json=json.dumps(resolved), reference_dir=str(reference),
                            out_dir=str(env["root"] / out))
    return json.loads(text)


def test_export_step_reuses_the_cached_model_until_the_reference_bytes_change(env):
    first = export(env, env["onnx"], "exp1")
    second = export(env, env["onnx"], "exp2")
    other = write_mlp(env["root"] / "other")
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(other / "model.onnx"))
    model.graph.initializer[3].CopyFrom(numpy_helper.from_array(np.ones(10, np.float32), "b2"))
    onnx.save(model, str(other / "model.onnx"))
    third = export(env, other, "exp3")

    assert (first["cached"], second["cached"], third["cached"]) == (False, True, False)
    assert (env["root"] / "exp2" / "model.onnx").read_bytes() == (env["root"] / "exp1" / "model.onnx").read_bytes()
    assert (env["root"] / "exp3" / "model.onnx").read_bytes() != (env["root"] / "exp1" / "model.onnx").read_bytes()


def test_store_leaves_no_entry_when_interrupted_between_files(env, monkeypatch):
    src = env["root"] / "out"
    src.mkdir()
    for name in ("a.bin", "b.bin", "c.bin"):
        (src / name).write_bytes(os.urandom(1000))
    copied = []
    real_copy = cache._copy_file

    def copy_then_interrupt(a, b):
        if copied:
            raise KeyboardInterrupt
        copied.append(a)
        real_copy(a, b)

    monkeypatch.setattr(cache, "_copy_file", copy_then_interrupt)
    key = cache.cache_key("build", {"x": 1})
    with pytest.raises(KeyboardInterrupt):
        cache.store(key, src, {"status": "ok"}, step="build")

    assert cache.lookup(key) is None
    assert cache.entries() == []
    assert list((cache.cache_dir() / "tmp").iterdir()) == []  # the partial copy is gone too
    monkeypatch.setattr(cache, "_copy_file", real_copy)
    entry = cache.store(key, src, {"status": "ok"}, step="build")
    assert cache.lookup(key) == entry and entry.bytes == 3000


def test_prune_removes_partial_entries_of_dead_processes_and_lookup_never_sees_them(env):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    key = cache.cache_key("build", {"x": 2})
    partial = cache.cache_dir() / "tmp" / f"{key}.{int(dead.stdout)}.0000abcd"
    (partial / "files").mkdir(parents=True)
    (partial / "result.json").write_text("{}")

    assert cache.lookup(key) is None and cache.entries() == []
    cache.prune()
    assert not partial.exists()


def test_prune_removes_the_least_recently_used_entries_first_when_over_the_bound(env):
    src = env["root"] / "out"
    src.mkdir()
    (src / "f.bin").write_bytes(b"x" * 1000)
    keys = [cache.cache_key("build", {"i": i}) for i in range(3)]
    for i, key in enumerate(keys):
        entry = cache.store(key, src, {"status": "ok"}, step="build", label=f"e{i}")
        t = 1_000_000 + i * 1000  # last uses in the past, oldest first
        os.utime(Path(entry.path) / "entry.json", (t, t))
    cache.restore(cache.lookup(keys[0]), env["root"] / "restored")  # the oldest is now the most recently used

    removed = cache.prune(2000)

    assert [e.label for e in removed] == ["e1"]
    assert {e.label for e in cache.entries()} == {"e0", "e2"}
    assert cache.prune(0) and cache.entries() == []


def test_cache_ls_and_prune_commands_report_entries_when_run(env):
    build(env, "run1")
    environ = {**os.environ}
    ls = subprocess.run([sys.executable, "-m", "tailguard.cli", "cache", "ls", "--json"], env=environ,
                        capture_output=True, text=True, timeout=120)
    assert ls.returncode == 0, ls.stderr
    labels = [e["label"] for e in json.loads(ls.stdout)]
    assert "build ort-int8" in labels and len(labels) == len(cache.entries())  # with the prepared graphs
    pr = subprocess.run([sys.executable, "-m", "tailguard.cli", "cache", "prune", "--max-bytes", "0"],
                        env=environ, capture_output=True, text=True, timeout=120)
    assert pr.returncode == 0 and f"removed {len(labels)} entries" in pr.stdout
    bad = subprocess.run([sys.executable, "-m", "tailguard.cli", "cache", "prune"],
                         env={**environ, cache.ENV_MAX_BYTES: "lots"}, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and cache.ENV_MAX_BYTES in bad.stderr and "Traceback" not in bad.stderr


def _caching(ir_path: Path) -> dict[str, bool]:
    ir = yaml.safe_load_all(ir_path.read_text()).__next__()
    tasks = dict(ir["root"]["dag"]["tasks"])
    for t in list(tasks.values()):  # tasks inside an exit handler's sub-DAG
        comp = ir["components"].get(t.get("componentRef", {}).get("name", ""), {})
        tasks.update(comp.get("dag", {}).get("tasks", {}))
    return {t["taskInfo"]["name"]: bool(t.get("cachingOptions", {}).get("enableCache")) for t in tasks.values()
            if "dag" not in ir["components"].get(t["componentRef"]["name"], {})}


def test_compiled_pipeline_caches_only_the_pure_tasks_when_compiled_for_the_cluster(tmp_path):
    from tailguard.core.spec import load_spec
    from tailguard.pipeline import compile_pipeline
    from tests.core.test_spec import TINY

    spec = load_spec(TINY)
    compile_pipeline(spec, str(tmp_path / "on.yaml"))
    compile_pipeline(spec, str(tmp_path / "off.yaml"), cache=False)

    on = _caching(tmp_path / "on.yaml")
    assert {n for n, c in on.items() if c} == ({"fetch-reference", "export", "reference-pass"}
                                              | {f"build-{v.name}" for v in spec.variants})
    assert "resolve" in on and "register-and-promote" in on  # MLflow writers are present and uncached
    assert not any(_caching(tmp_path / "off.yaml").values())


def test_int8_build_task_never_imports_torch_or_mlflow_when_run_in_its_own_process(tmp_path):
    onnx_dir = write_mlp(tmp_path / "fp32")
    code = (
        "import json, sys\n"
        "from tailguard.components.build.task import main\n"
        f"r = json.loads(main(spec_yaml={spec_yaml()!r}, variant_name='ort-int8', onnx_dir={str(onnx_dir)!r}, "
        f"out_dir={str(tmp_path / 'out')!r}))\n"
        "print(json.dumps({'status': r['status'], 'heavy': [m for m in ('torch', 'mlflow') if m in sys.modules]}))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TAILGUARD_HOME": str(tmp_path / "home")})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"status": "ok", "heavy": []}


def test_reference_parts_refuse_to_cache_when_the_model_class_source_cannot_be_found(tmp_path):
    from tailguard.core.cache import reference_parts
    from tailguard.core.reference import ResolvedModel
    from tailguard.core.spec import spec_from_yaml

    (tmp_path / "model.safetensors").write_bytes(b"weights")
    spec = spec_from_yaml(spec_yaml())

    def parts(class_path):
        return reference_parts(ResolvedModel(registered_name="mlp", version="1", run_id=None, format="state_dict",
                                             local_dir=str(tmp_path), source_uri="models:/mlp/1",
                                             model_file="model.safetensors", class_path=class_path), spec)

    known = parts("tailguard.models:MeanPooledEncoder")
    assert known is not None and len(known["class_source"]) == 64
    assert parts("no_such_module_for_tailguard_tests:Model") is None


# ------------------------------------------------------------------------------------------- reference-pass
def write_rows(path: Path, n: int, seed: int) -> Path:
    """Parquet rows: x float32[65] (the MLP's input), label int (0..9), group str ("a" / "b", every 5th "rare")."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    pd.DataFrame({"x": [rng.normal(size=65).astype(np.float32) for _ in range(n)],
                  "label": rng.integers(0, 10, n), "group": ["rare" if i % 5 == 0 else "ab"[i % 2] for i in range(n)]}
                 ).to_parquet(path)
    return path


def sliced_spec(root: Path, *, gate_min: float) -> dict:
    """The MLP spec with data under `root`, a slice over `group`, a small benchmark and one FP32 variant."""
    doc = yaml.safe_load(spec_yaml(gate_min=gate_min))
    doc["data"] = {"calibration": {"uri": str(root / "calibration.parquet")},
                   "validation": {"uri": str(root / "validation.parquet"), "batch_size": 16}}
    doc["slices"] = [{"name": "group", "column": "group"}]
    doc["variants"] = [{"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"}]
    doc["benchmark"] = {"batch_sizes": [1, 4], "warmup": 1, "iterations": 5, "max_seconds": 1}
    return doc


def reference_pass(env, doc: dict, out: str) -> dict:
    from tailguard.components.reference import task as reference_task
    from tailguard.core.digests import file_sha256

    resolved = {"registered_name": "mlp", "version": "1", "run_id": None, "format": "onnx",
                "local_dir": str(env["onnx"]), "source_uri": "models:/mlp/1", "model_file": "model.onnx",
                "sha256": file_sha256(env["onnx"] / "model.onnx"), "artifact_subdir": "."}
    return json.loads(reference_task.main(spec_yaml=yaml.safe_dump(doc), resolved_json=json.dumps(resolved),
                                          reference_dir=str(env["onnx"]), onnx_dir=str(env["onnx"]),
                                          out_dir=str(env["root"] / out)))


def test_reference_pass_serves_outputs_timings_and_coverage_from_the_cache_until_the_benchmark_changes(env):
    write_rows(env["root"] / "validation.parquet", 40, 0)
    write_rows(env["root"] / "calibration.parquet", 20, 1)
    first = reference_pass(env, sliced_spec(env["root"], gate_min=0.9), "ref1")
    second = reference_pass(env, sliced_spec(env["root"], gate_min=0.5), "ref2")  # a gate is not an input
    changed = sliced_spec(env["root"], gate_min=0.5)
    changed["benchmark"]["batch_sizes"] = [2]
    third = reference_pass(env, changed, "ref3")

    assert (first["cached"], second["cached"], third["cached"]) == (False, True, False)
    assert second["onnx_fp32"] == first["onnx_fp32"]  # the timings of the first run
    assert first["torch"] is None and set(third["onnx_fp32"]) == {"2"} and first["rows"] == 40  # JSON: str keys
    names = {"reference_outputs.npz", "baselines.json", "calibration_coverage.csv", "calibration_coverage.json"}
    for out in ("ref1", "ref2"):
        assert {p.name for p in (env["root"] / out).iterdir()} == names
    assert ((env["root"] / "ref2" / "calibration_coverage.csv").read_text()
            == (env["root"] / "ref1" / "calibration_coverage.csv").read_text())
    coverage = json.loads((env["root"] / "ref1" / "calibration_coverage.json").read_text())
    assert set(coverage) == {"calibration.groups_missing", "calibration.min_coverage_ratio"}
    assert coverage["calibration.groups_missing"] == 0.0
    assert np.load(env["root"] / "ref2" / "reference_outputs.npz")["logits"].shape == (40, 10)


def test_reference_pass_imports_no_mlflow_when_run_in_its_own_process(env):
    write_rows(env["root"] / "validation.parquet", 20, 0)
    write_rows(env["root"] / "calibration.parquet", 10, 1)
    code = (
        "import sys\n"
        "from tests.core.test_cache import reference_pass\n"
        "from pathlib import Path\n"
        f"root = Path({str(env['root'])!r})\n"
        "from tests.core.test_cache import sliced_spec\n"
        "r = reference_pass({'root': root, 'onnx': root / 'fp32'}, sliced_spec(root, gate_min=0.9), 'out')\n"
        "print('mlflow' in sys.modules, r['cached'])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[2], env={**os.environ, cache.ENV_CACHE: "0"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-2:] == ["False", "False"]


@pytest.mark.integration
@pytest.mark.slow
def test_local_rerun_with_one_gate_changed_serves_reference_pass_and_measurements_from_the_cache(env):
    from tailguard.core.home import default_tracking_uri
    from tailguard.core.tracking import configure

    try:
        from tailguard.registration import register_reference
    except ImportError:  # before register_reference moved out of core.reference
        from tailguard.core.reference import register_reference
    import mlflow

    root = env["root"]
    write_rows(root / "validation.parquet", 40, 0)
    write_rows(root / "calibration.parquet", 20, 1)
    configure(default_tracking_uri(), "registration")
    register_reference("mlp", onnx_path=env["onnx"] / "model.onnx")
    runs = []
    # 0.9, then a gate-only change (decided in one task on the stored measurements: components/redecide), then a
    # label added too (not only gates: the whole pipeline, whose pure steps and validations the cache serves)
    for i, (gate_min, labels) in enumerate(((0.9, {}), (0.5, {}), (0.5, {"team": "a"}))):
        doc = sliced_spec(root, gate_min=gate_min)
        doc["metadata"]["labels"] = labels
        doc["data"]["validation"]["label_column"] = "label"
        (root / f"spec{i}.yaml").write_text(yaml.safe_dump(doc))
        r = subprocess.run([sys.executable, "-m", "tailguard.cli", "run", str(root / f"spec{i}.yaml"),
                            "--summary-json", str(root / f"summary{i}.json")], capture_output=True, text=True,
                           timeout=600, cwd=root, env={**os.environ})
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        runs.append(json.loads((root / f"summary{i}.json").read_text()))

    cached = [{t["task"]: t["cached"] for t in s["tasks"]["tasks"]} for s in runs]
    assert cached[0]["reference-pass"] is False and cached[2]["reference-pass"] is True
    assert cached[2]["export"] is True and cached[2]["build-ort-fp32"] is True
    assert cached[0]["fetch-reference"] is False and cached[2]["fetch-reference"] is True
    # issue 25 item 4: a gate change decides again on the variant's stored outputs and timing rounds: in one task
    # when only gates changed, in the validate task when the whole pipeline runs
    assert list(cached[1]) == ["redecide"] and runs[1]["tasks"]["redecide"]["used"] is True
    assert runs[2]["tasks"]["redecide"]["used"] is False
    assert cached[0]["validate-ort-fp32"] is False and cached[2]["validate-ort-fp32"] is True
    rows = [next(v for v in s["variants"] if v["variant"] == "ort-fp32") for s in runs]
    for row in rows[1:]:
        assert row["p50_ms"] == rows[0]["p50_ms"] and row["p99_ms"] == rows[0]["p99_ms"]  # the same rounds
        assert row["rows_used"] == rows[0]["rows_used"] and row["gates"] == {"top1_agreement>=0.5": "passed"}
    assert rows[0]["rows"] == 40 and rows[0]["gates"] == {"top1_agreement>=0.9": "passed"}
    client = mlflow.MlflowClient(default_tracking_uri())
    parents = [client.get_run(s["parent_run_id"]) for s in runs]
    for parent in parents:
        assert {f"baseline.onnx_fp32.bs{bs}.latency_ms.{p}" for bs in (1, 4) for p in ("p50", "p95", "p99")} <= set(
            parent.data.metrics)
        assert parent.data.metrics["calibration.groups_missing"] == 0.0
        assert "calibration.min_coverage_ratio" in parent.data.metrics
        assert "calibration_coverage.csv" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    key = "baseline.onnx_fp32.bs1.latency_ms.p50"  # the cached timing, logged again
    assert parents[1].data.metrics[key] == parents[2].data.metrics[key] == parents[0].data.metrics[key]


def test_register_logs_the_reference_pass_baselines_and_coverage_on_the_parent_run_when_given_its_outputs(env):
    import mlflow

    from tailguard.components.register.finish import log_reference

    write_rows(env["root"] / "validation.parquet", 30, 0)
    write_rows(env["root"] / "calibration.parquet", 12, 1)
    baselines = reference_pass(env, sliced_spec(env["root"], gate_min=0.9), "ref")
    client = mlflow.MlflowClient(f"sqlite:///{env['root'] / 'mlflow.db'}")
    experiment = client.create_experiment("parent", artifact_location=(env["root"] / "artifacts").as_uri())
    parent = client.create_run(experiment).info.run_id

    log_reference(client, parent, json.dumps(baselines), str(env["root"] / "ref"))

    metrics = client.get_run(parent).data.metrics
    expected = {f"baseline.onnx_fp32.bs{bs}.latency_ms.{p}" for bs in (1, 4) for p in ("p50", "p95", "p99")}
    assert set(metrics) == expected | {"calibration.groups_missing", "calibration.min_coverage_ratio"}
    assert metrics["baseline.onnx_fp32.bs4.latency_ms.p99"] == baselines["onnx_fp32"]["4"]["latency_ms.p99"]
    assert [a.path for a in client.list_artifacts(parent)] == ["calibration_coverage.csv"]
