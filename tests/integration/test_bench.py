"""`tailguard bench MODEL` (issue 37, item 4): a registered version timed against torch eager and the ONNX FP32
export in one interleaved run, printed as the run table's row with every speed-up's bounds.

Real parts: an MLflow sqlite store, a torch.export reference registered with `tailguard.register_model`, an ONNX
variant registered as a run registers one (the tags register-and-promote sets), the real fetch-reference and
export steps, ONNX Runtime and torch timing. Nothing asserts a duration.
"""

import numpy as np
import pytest
import torch

from tailguard.core.contract import (
    BACKEND_TAG,
    PRECISION_TAG,
    SHA256_TAG,
    SOURCE_SHA256_TAG,
    SOURCE_VERSION_TAG,
    VARIANT_TAG,
)

CLASS_PATH = "tests.helpers.resolve_models:TinyClassifier"


@pytest.fixture
def bench_env(tmp_path, monkeypatch):
    import mlflow
    import onnx
    import pyarrow as pa
    import pyarrow.parquet as pq

    import tailguard
    from tailguard.core.spec import parse_spec
    from tailguard.core.tracking import configure

    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    from tests.helpers.resolve_models import make_tiny

    model = make_tiny(0, hidden=64)
    x = torch.randn(2, 4)
    weights = tmp_path / "ref.pt"
    torch.save(model.state_dict(), weights)
    ref = tailguard.register_model("tiny-ref", weights, class_path=CLASS_PATH, init_kwargs={"hidden": 64},
                                   tracking_uri=uri)
    onnx_file = tmp_path / "variant.onnx"
    torch.onnx.export(model, (x,), str(onnx_file), input_names=["x"], output_names=["logits"],
                      dynamic_axes={"x": {0: "batch"}}, dynamo=False)
    configure(uri, "bench")
    with mlflow.start_run():
        info = mlflow.onnx.log_model(onnx.load(str(onnx_file)), name="model", pip_requirements=["onnx"],
                                     save_as_external_data=False)
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    ref_tags = client.get_model_version("tiny-ref", str(ref.version)).tags
    mlflow.register_model(info.model_uri, "tiny-ref-optimized", tags={
        VARIANT_TAG: "ort-fp32", BACKEND_TAG: "onnxruntime", PRECISION_TAG: "fp32",
        SOURCE_VERSION_TAG: str(ref.version), SOURCE_SHA256_TAG: ref_tags[SHA256_TAG]})
    rng = np.random.default_rng(0)
    pq.write_table(pa.table({"x": pa.array([r.tolist() for r in rng.normal(size=(64, 4)).astype(np.float32)],
                                           type=pa.list_(pa.float32()))}), tmp_path / "v.parquet")
    spec = parse_spec({
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "b"},
        "model": {"registered_name": "tiny-ref", "task": "generic", "source": {"class_path": CLASS_PATH},
                  "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
                  "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", 3]}]},
        "data": {"calibration": {"uri": str(tmp_path / "v.parquet")},
                 "validation": {"uri": str(tmp_path / "v.parquet")}},
        "variants": [{"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"}],
        "gates": [{"metric": "abs_error.max", "max": 1.0}],
        "benchmark": {"batch_sizes": [1], "warmup": 5, "iterations": 60, "max_seconds": 30,
                      "intra_op_num_threads": 1}})
    return {"uri": uri, "spec": spec}


def test_bench_model_times_a_registered_version_against_torch_and_onnx_fp32_in_one_interleaved_run(bench_env,
                                                                                                    capsys):
    from tailguard.bench import bench_model
    from tailguard.terminal import print_summary

    summary = bench_model("tiny-ref-optimized/1", bench_env["spec"], tracking_uri=bench_env["uri"])
    comp = summary.promotion_comparison
    assert comp["baselines"] == ["torch", "onnx_fp32"] and comp["rounds"] >= 30
    [row] = summary.variants
    assert row.variant == "ort-fp32" and row.version == "1"
    for key in ("speedup_vs_torch", "speedup_vs_onnx_fp32"):
        r = row.paired[key]
        assert r["lower"] <= r["ratio"] <= r["upper"]
    print_summary(summary)
    out = capsys.readouterr().out
    r = row.paired["speedup_vs_torch"]
    assert f"[{r['lower']:.2f},{r['upper']:.2f}]" in out and "paired rounds at batch 1" in out
    assert "bench of tiny-ref-optimized v1 (ort-fp32)" in out


def test_bench_model_refuses_a_version_without_its_source_tags_naming_them(bench_env):
    import mlflow

    from tailguard.bench import bench_model
    from tailguard.core.errors import InputError

    client = mlflow.MlflowClient(tracking_uri=bench_env["uri"], registry_uri=bench_env["uri"])
    client.delete_model_version_tag("tiny-ref-optimized", "1", SOURCE_VERSION_TAG)
    with pytest.raises(InputError, match=SOURCE_VERSION_TAG):
        bench_model("tiny-ref-optimized/1", bench_env["spec"], tracking_uri=bench_env["uri"])
    with pytest.raises(InputError, match="no version 7"):
        bench_model("tiny-ref-optimized/7", bench_env["spec"], tracking_uri=bench_env["uri"])
