"""Inputs of any fixed rank (issue 13 item 2): a CNN on scikit-learn digits with `image: [batch, 1, 8, 8]` and an
audio-like classifier with `frames: [batch, sequence, 80]` (variable length) plus `frame_mask: [batch, sequence]`.

Real parts only: models trained for a few epochs (tests/helpers/user_models.py), Parquet files written with pyarrow as
nested lists and as Arrow fixed-shape tensors, Great Expectations, torch.onnx export, ONNX Runtime quantization
and sessions. Each step's logic is called directly, as the pipeline's tasks call it.
"""

from __future__ import annotations

import numpy as np
import onnx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tailguard.components.build.calibration import DatasetCalibrationReader
from tailguard.components.build.logic import build_variant
from tailguard.components.check_data.logic import check_datasets
from tailguard.components.export.logic import check_export, dummy_feeds, export_onnx
from tailguard.core.data import load_dataset, make_batch, read_parquet
from tailguard.core.errors import DataCheckError, InputError, SpecError
from tailguard.core.latency import benchmark
from tailguard.core.parity import aggregate, per_sample_metrics
from tailguard.core.runtime import OrtRunner, TorchRunner, run_dataset
from tailguard.core.spec import parse_spec
from tailguard.core.spec.benchmark import BenchmarkSpec
from tailguard.core.spec.model import ModelSpec
from tailguard.core.spec.variants import VariantSpec
from tests.conftest import MLFLOW_URI_VARS
from tests.helpers.user_models import (
    DIGITS_SHAPE,
    N_BANDS,
    digits_model_doc,
    digits_spec,
    frames_frame,
    frames_model_doc,
    frames_spec,
    train_digits_cnn,
    train_frame_classifier,
    write_digits,
    write_frames,
)

VARIANTS = {
    "fp32": {"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"},
    "int8-dynamic": {"name": "ort-int8-dynamic", "backend": "onnxruntime", "precision": "int8",
                     "graph_optimization": {"level": "disabled"}, "quantization": {"mode": "dynamic"}},
    "int8-static": {"name": "ort-int8-static", "backend": "onnxruntime", "precision": "int8",
                    "graph_optimization": {"level": "disabled"},
                    "quantization": {"mode": "static", "calibration_method": "minmax"}},
    "int8-static-hist": {"name": "ort-int8-static-pct", "backend": "onnxruntime", "precision": "int8",
                         "graph_optimization": {"level": "disabled"},
                         "quantization": {"mode": "static", "calibration_method": "percentile", "num_bins": 512}},
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores; the models are tiny
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """The trained CNN, its ModelSpec, and the validation / calibration files in both layouts."""
    root = tmp_path_factory.mktemp("digits")
    model, split = train_digits_cnn()
    files = {}
    for layout in ("nested", "tensor"):
        for part in ("validation", "calibration"):
            files[layout, part] = str(write_digits(root / f"{part}-{layout}.parquet", *split[part], layout=layout))
    return {"root": root, "model": model, "split": split, "files": files,
            "spec": ModelSpec.model_validate(digits_model_doc("digits-cnn"))}


@pytest.fixture(scope="module")
def frames(tmp_path_factory):
    """The trained frame classifier, its ModelSpec, and validation / calibration files (nested lists)."""
    root = tmp_path_factory.mktemp("frames")
    model = train_frame_classifier(frames_frame(300, seed=0))
    val, cal = frames_frame(120, seed=1), frames_frame(40, seed=2)
    return {"root": root, "model": model, "frame": val,
            "validation": str(write_frames(root / "validation.parquet", val)),
            "calibration": str(write_frames(root / "calibration.parquet", cal)),
            "spec": ModelSpec.model_validate(frames_model_doc())}


def _exported(env, name: str, feeds: dict) -> str:
    path = env["root"] / f"{name}.onnx"
    if not path.exists():
        export_onnx(env["model"], env["spec"], feeds, path)
    return str(path)


def _digits_onnx(digits) -> str:
    ds = load_dataset(digits["files"]["nested", "validation"], digits["spec"].inputs)
    return _exported(digits, "digits", make_batch(ds, np.arange(4), digits["spec"].inputs))


def _frames_onnx(frames) -> str:
    ds = load_dataset(frames["validation"], frames["spec"].inputs)
    return _exported(frames, "frames", make_batch(ds, np.arange(4), frames["spec"].inputs))


# ------------------------------------------------------------------------------------------------- loading
def test_load_dataset_gives_identical_rows_when_images_are_nested_lists_or_fixed_shape_tensors(digits):
    inputs = digits["spec"].inputs
    nested = load_dataset(digits["files"]["nested", "validation"], inputs)
    tensor = load_dataset(digits["files"]["tensor", "validation"], inputs)
    images = digits["split"]["validation"][0]
    for ds in (nested, tensor):
        assert ds.n_rows == len(images) and list(ds.frame.columns) == ["label", "digit"]
        assert all(a.shape == DIGITS_SHAPE and a.dtype == np.float32 for a in ds.inputs["image"])
        batch = make_batch(ds, np.arange(5, 12), inputs)
        assert batch["image"].shape == (7, *DIGITS_SHAPE) and batch["image"].dtype == np.float32
        np.testing.assert_array_equal(batch["image"], images[5:12])
    # fixed axes are never padded, even when a calibration method asks for a fixed length
    assert make_batch(tensor, np.arange(3), inputs, fixed_length=50)["image"].shape == (3, *DIGITS_SHAPE)


def test_read_parquet_keeps_tensor_shape_when_column_is_fixed_shape_tensor(digits):
    df = read_parquet(digits["files"]["tensor", "calibration"])
    assert isinstance(pq.read_schema(digits["files"]["tensor", "calibration"]).field("image").type,
                      pa.FixedShapeTensorType)
    assert df["image"].iloc[0].shape == DIGITS_SHAPE  # pandas alone gives flat (64,) arrays


def test_make_batch_pads_only_the_sequence_axis_when_input_is_sequence_of_frames(frames):
    inputs = frames["spec"].inputs
    ds = load_dataset(frames["validation"], inputs)
    lengths = frames["frame"]["n_frames"].to_numpy()
    np.testing.assert_array_equal(ds.lengths, lengths)  # sort key: the sequence axis
    idx = np.array([0, 1, 2, 3])
    feeds = make_batch(ds, idx, inputs, pad_values={"frames": -1.0})
    longest = int(lengths[idx].max())
    assert feeds["frames"].shape == (4, longest, N_BANDS) and feeds["frame_mask"].shape == (4, longest)
    for j, i in enumerate(idx):
        n = lengths[i]
        np.testing.assert_array_equal(feeds["frames"][j, :n], frames["frame"]["frames"][i])
        assert (feeds["frames"][j, n:] == -1.0).all() and feeds["frame_mask"][j, n:].sum() == 0
    fixed = make_batch(ds, idx, inputs, fixed_length=30)
    assert fixed["frames"].shape == (4, 30, N_BANDS) and fixed["frame_mask"].shape == (4, 30)


def test_make_batch_pads_token_rows_as_before_when_input_is_batch_by_sequence(tmp_path):
    """[batch, sequence] rows: padded at the end to the batch's longest row, or cut/padded to fixed_length."""
    specs = ModelSpec.model_validate({
        "registered_name": "m", "task": "embedding",
        "inputs": [{"name": "ids", "dtype": "int64", "shape": ["batch", "sequence"]}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", 4]}]}).inputs
    pq.write_table(pa.table({"ids": [[5, 6, 7], [8], [9, 10]]}), tmp_path / "t.parquet")
    ds = load_dataset(str(tmp_path / "t.parquet"), specs)
    np.testing.assert_array_equal(ds.lengths, [3, 1, 2])
    np.testing.assert_array_equal(make_batch(ds, np.array([1, 2]), specs, pad_values={"ids": 1})["ids"],
                                  [[8, 1], [9, 10]])
    np.testing.assert_array_equal(make_batch(ds, np.array([0, 1]), specs, fixed_length=2)["ids"], [[5, 6], [8, 0]])


def test_load_dataset_names_column_rows_and_shapes_when_rows_have_wrong_shape(digits, tmp_path):
    images, labels = digits["split"]["calibration"]
    bad = images[:, :, :, :7].copy()  # (1, 8, 7)
    path = write_digits(tmp_path / "bad.parquet", bad[:12], labels[:12])
    with pytest.raises(InputError) as exc:
        load_dataset(str(path), digits["spec"].inputs, field="data.validation")
    msg = exc.value.message
    assert "data.validation" in msg and "'image'" in msg and str(path) in msg
    assert "(1, 8, 8)" in msg and "shape (1, 8, 7)" in msg and "row(s) [0, 1, 2, 3, 4] and 7 more" in msg
    assert exc.value.exit_code == 2


def test_load_dataset_names_the_row_when_nested_lists_are_ragged(digits, tmp_path):
    rows = [im.tolist() for im in digits["split"]["calibration"][0][:4]]
    rows[2][0][3] = rows[2][0][3][:5]  # one image row of 5 pixels instead of 8
    pq.write_table(pa.table({"image": rows}), tmp_path / "ragged.parquet")
    with pytest.raises(InputError, match=r"column 'image' .*row 2: .*ragged nested lists"):
        load_dataset(str(tmp_path / "ragged.parquet"), digits["spec"].inputs)


# --------------------------------------------------------------------------------------------- data check
@pytest.mark.parametrize("layout", ["nested", "tensor"])
def test_check_datasets_passes_when_images_have_the_spec_shape(digits, layout):
    doc = digits_spec(registered_name="digits-cnn", validation=digits["files"][layout, "validation"],
                      calibration=digits["files"][layout, "calibration"])
    report = check_datasets(parse_spec(doc))
    assert report.success
    shape_checks = [r for d in report.datasets for r in d.results if "shape (1, 8, 8)" in r.description]
    assert len(shape_checks) == 2 and all(r.column == "image" for r in shape_checks)


def test_check_datasets_names_rows_and_shapes_when_some_images_are_wrong(digits, tmp_path):
    images, labels = digits["split"]["calibration"]
    cells = [im.tolist() for im in images[:30]]
    cells[4] = images[4, :, :, :7].tolist()  # (1, 8, 7)
    cells[9] = images[9, :, :4, :].tolist()  # (1, 4, 8)
    pq.write_table(pa.table({"image": cells, "label": labels[:30], "digit": [str(v) for v in labels[:30]]}),
                   tmp_path / "bad.parquet")
    doc = digits_spec(registered_name="digits-cnn", validation=digits["files"]["nested", "validation"],
                      calibration=str(tmp_path / "bad.parquet"))
    with pytest.raises(DataCheckError) as exc:
        check_datasets(parse_spec(doc))
    (failure,) = exc.value.failures
    assert failure["dataset"] == "calibration" and failure["column"] == "image"
    assert failure["observed"]["unexpected_rows"] == [4, 9]
    assert failure["observed"]["partial_unexpected_list"] == ["shape (1, 8, 7)", "shape (1, 4, 8)"]
    assert "shape (1, 8, 8)" in failure["message"] and "[batch, 1, 8, 8]" in failure["message"]


def test_check_datasets_accepts_any_length_when_the_axis_is_named(frames, tmp_path):
    frame = frames_frame(20, seed=5)
    frame.at[3, "frames"] = frame.at[3, "frames"][:, :79]  # 79 bands instead of 80
    ragged = frame.at[7, "frames"].tolist()
    ragged[0] = ragged[0][:40]  # one frame of 40 bands
    frame.at[7, "frames"] = ragged
    bad = str(write_frames(tmp_path / "bad.parquet", frame))
    assert check_datasets(parse_spec(frames_spec(validation=frames["validation"],
                                                 calibration=frames["calibration"]))).success
    with pytest.raises(DataCheckError) as exc:
        check_datasets(parse_spec(frames_spec(validation=frames["validation"], calibration=bad)))
    (failure,) = exc.value.failures  # the shape check only: the finite check skips ragged rows
    assert failure["column"] == "frames" and failure["observed"]["unexpected_rows"] == [3, 7]
    n3 = int(frame.at[3, "n_frames"])
    assert failure["observed"]["partial_unexpected_list"] == [f"shape ({n3}, 79)", "ragged nested lists"]
    assert "(sequence, 80)" in failure["message"]


# ------------------------------------------------------------------------------------------------- spec
def test_parse_spec_accepts_image_and_frame_shapes_when_dims_are_names_or_positive_ints(digits, frames):
    spec = parse_spec(digits_spec(registered_name="d", validation="v.parquet", calibration="c.parquet"))
    assert spec.model.inputs[0].shape == ["batch", 1, 8, 8]
    assert parse_spec(frames_spec(validation="v.parquet", calibration="c.parquet")).model.inputs[0].shape == [
        "batch", "sequence", 80]


@pytest.mark.parametrize("shape, words", [([1, 1, 8, 8], "first axis is the batch axis"),
                                          (["batch", 1, 0, 8], "positive int"),
                                          (["batch", "8 px", 8], "dynamic axis name"),
                                          (["batch", 1.5], "positive int"),
                                          ([], "at least 1")])
def test_parse_spec_names_the_shape_field_when_dims_are_bad(shape, words):
    doc = digits_spec(registered_name="d", validation="v.parquet", calibration="c.parquet")
    doc["model"]["inputs"][0]["shape"] = shape
    with pytest.raises(SpecError) as exc:
        parse_spec(doc)
    (err,) = [e for e in exc.value.errors if e.loc.startswith("model.inputs.0.shape")]
    assert words in err.message


# ------------------------------------------------------------------------------------ export, build, parity
def test_export_onnx_keeps_fixed_image_axes_when_input_is_batch_by_1_by_8_by_8(digits):
    path = _digits_onnx(digits)
    dims = [d.dim_param or d.dim_value for d in onnx.load(path).graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", 1, 8, 8]
    ds = load_dataset(digits["files"]["tensor", "validation"], digits["spec"].inputs)
    feeds = [make_batch(ds, np.arange(1), digits["spec"].inputs), make_batch(ds, np.arange(9), digits["spec"].inputs)]
    diffs = check_export(TorchRunner(digits["model"], ["image"]), path, feeds, digits["spec"])
    assert diffs["logits"]["ok"] and diffs["logits"]["batches"] == 2 and diffs["logits"]["elements"] == 100


def test_export_onnx_makes_sequence_dynamic_when_frames_are_batch_by_sequence_by_80(frames):
    path = _frames_onnx(frames)
    graph = onnx.load(path).graph
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
    assert dims == {"frames": ["batch", "sequence", 80], "frame_mask": ["batch", "sequence"]}
    ds = load_dataset(frames["validation"], frames["spec"].inputs)
    order = np.argsort(ds.lengths, kind="stable")
    feeds = [make_batch(ds, order[:2], frames["spec"].inputs), make_batch(ds, order[-7:], frames["spec"].inputs)]
    assert feeds[0]["frames"].shape[1] != feeds[1]["frames"].shape[1]
    diffs = check_export(TorchRunner(frames["model"], ["frames", "frame_mask"]), path, feeds, frames["spec"])
    assert diffs["logits"]["ok"] and diffs["logits"]["batches"] == 2


def test_export_onnx_with_dynamo_traces_dummy_feeds_when_inputs_are_frames_and_mask(frames, tmp_path):
    doc = frames_model_doc()
    doc["export"] = {"dynamo": True}
    spec = ModelSpec.model_validate(doc)
    feeds = dummy_feeds(spec, batch=2, length=3)
    assert {k: (v.shape, v.dtype) for k, v in feeds.items()} == {
        "frames": ((2, 3, N_BANDS), np.float32), "frame_mask": ((2, 3), np.int64)}
    facts = export_onnx(frames["model"], spec, feeds, tmp_path / "frames-dynamo.onnx")
    assert facts["exporter"] == "dynamo"
    graph = onnx.load(str(tmp_path / "frames-dynamo.onnx")).graph
    assert [[d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input] == [
        ["batch", "sequence", N_BANDS], ["batch", "sequence"]]
    ds = load_dataset(frames["validation"], spec.inputs)
    order = np.argsort(ds.lengths, kind="stable")
    batches = [make_batch(ds, order[:1], spec.inputs), make_batch(ds, order[-5:], spec.inputs)]
    diffs = check_export(TorchRunner(frames["model"], ["frames", "frame_mask"]), tmp_path / "frames-dynamo.onnx",
                         batches, spec)
    assert diffs["logits"]["ok"]


def _parity(spec: ModelSpec, ds, reference: str, candidate: str, batch_size: int) -> dict[str, float]:
    ref = run_dataset(OrtRunner(reference), ds, spec.inputs, batch_size=batch_size)[0]
    cand = run_dataset(OrtRunner(candidate), ds, spec.inputs, batch_size=batch_size)[0]
    labels = ds.frame["label"].to_numpy()
    return aggregate("classification", per_sample_metrics("classification", ref, cand, labels=labels))


@pytest.mark.parametrize("variant", ["fp32", "int8-dynamic", "int8-static", "int8-static-hist"])
def test_build_variant_keeps_top1_when_cnn_input_is_an_image(digits, tmp_path, variant):
    inputs = digits["spec"].inputs
    calibration = load_dataset(digits["files"]["tensor", "calibration"], inputs, max_samples=64)
    result = build_variant(VariantSpec.model_validate(VARIANTS[variant]), _digits_onnx(digits), tmp_path,
                           calibration=calibration, model=digits["spec"], calibration_batch_size=16)
    assert result.status == "ok", result.reason
    if variant != "fp32":  # both convolutions and the linear layer compute in INT8
        q = result.details["quantized_by_op"]
        assert sum(v for k, v in q.items() if "Conv" in k) == 2, q
        assert sum(v for k, v in q.items() if "Gemm" in k or "MatMul" in k) == 1, q
    ds = load_dataset(digits["files"]["nested", "validation"], inputs)
    m = _parity(digits["spec"], ds, _digits_onnx(digits), result.artifact, 64)
    floor = 1.0 if variant == "fp32" else 0.95
    assert m["top1_agreement"] >= floor and m["reference_accuracy"] >= 0.9


@pytest.mark.parametrize("variant", ["fp32", "int8-dynamic", "int8-static", "int8-static-hist"])
def test_build_variant_keeps_top1_when_input_is_variable_length_frames(frames, tmp_path, variant):
    inputs = frames["spec"].inputs
    calibration = load_dataset(frames["calibration"], inputs)
    result = build_variant(VariantSpec.model_validate(VARIANTS[variant]), _frames_onnx(frames), tmp_path,
                           calibration=calibration, model=frames["spec"], calibration_batch_size=8)
    assert result.status == "ok", result.reason
    ds = load_dataset(frames["validation"], inputs)
    m = _parity(frames["spec"], ds, _frames_onnx(frames), result.artifact, 16)
    floor = 1.0 if variant == "fp32" else 0.95
    assert m["top1_agreement"] >= floor and m["reference_accuracy"] >= 0.9


def test_calibration_reader_gives_equal_shapes_when_fixed_length_and_equal_batches(frames):
    inputs = frames["spec"].inputs
    calibration = load_dataset(frames["calibration"], inputs)
    reader = DatasetCalibrationReader(calibration, inputs, 16, fixed_length=int(calibration.lengths.max()),
                                      equal_batches=True)
    shapes = {tuple(f["frames"].shape) for f in iter(reader.get_next, None)}
    assert shapes == {(16, int(calibration.lengths.max()), N_BANDS)}


def test_benchmark_draws_padded_batches_when_inputs_are_images_and_frames(digits, frames):
    bench = BenchmarkSpec.model_validate({"batch_sizes": [1, 8], "warmup": 1, "iterations": 3, "max_seconds": 1})
    for env, path in ((digits, _digits_onnx(digits)), (frames, _frames_onnx(frames))):
        file = env["files"]["tensor", "validation"] if "files" in env else env["validation"]
        ds = load_dataset(file, env["spec"].inputs)
        out = benchmark(OrtRunner(path), ds, env["spec"].inputs, bench)
        assert sorted(out) == [1, 8] and all(out[b]["n_iterations"] == 3 for b in out)


# ------------------------------------------------------------------------------------------- end to end
@pytest.mark.integration
@pytest.mark.slow
def test_run_validates_fp32_and_int8_variants_per_class_when_a_cnn_takes_images(digits, tmp_path, monkeypatch):
    """`tailguard register` the exported CNN, then `tailguard run` (kfp.local) with FP32, INT8 dynamic and INT8
    static variants and a per-class (per digit) top-1 agreement gate; images stored as fixed-shape tensors for
    calibration and as nested lists for validation."""
    import json
    import os
    import subprocess
    import sys

    import mlflow
    import yaml

    from tests.helpers.user_models import export_digits_onnx

    root = tmp_path
    split = digits["split"]
    write_digits(root / "validation.parquet", *split["validation"], layout="nested")
    write_digits(root / "calibration.parquet", *split["calibration"], layout="tensor")
    export_digits_onnx(digits["model"], root / "digits.onnx")
    # the run must use the home store: drop a tracking URI another module's fixture left in os.environ
    env = {**{k: v for k, v in os.environ.items() if k not in MLFLOW_URI_VARS},
           "TAILGUARD_HOME": str(root / "home")}

    def tailguard(*args):
        return subprocess.run([sys.executable, "-m", "tailguard.cli", *map(str, args)], env=env, cwd=root,
                              capture_output=True, text=True, timeout=900)

    r = tailguard("register", "digits-cnn", root / "digits.onnx")
    assert r.returncode == 0, r.stdout + r.stderr
    spec = root / "spec.yaml"
    spec.write_text(yaml.safe_dump(digits_spec(registered_name="digits-cnn", validation="validation.parquet",
                                               calibration="calibration.parquet", per_class_min=0.8),
                                   sort_keys=False))
    r = tailguard("run", spec, "--summary-json", root / "summary.json")
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((root / "summary.json").read_text())
    rows = {v["variant"]: v for v in summary["variants"]}
    assert set(rows) == {"ort-fp32", "ort-int8-dynamic", "ort-int8-static"}
    assert all(v["status"] == "ok" and v["passed"] for v in rows.values()), rows
    monkeypatch.setenv("TAILGUARD_HOME", env["TAILGUARD_HOME"])
    from tailguard.core.home import default_tracking_uri

    client = mlflow.MlflowClient(default_tracking_uri())
    children = client.search_runs([client.get_run(summary["parent_run_id"]).info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{summary['parent_run_id']}'")
    static = next(c for c in children if c.data.tags["tailguard.variant"] == "ort-int8-static")
    per_digit = {k for k in static.data.metrics if k.startswith("slice.digit.") and k.endswith(".top1_agreement")}
    assert len(per_digit) == 10
    # every MAC node of both INT8 variants quantized with the default graph optimization (quantize, then fuse)
    assert rows["ort-int8-dynamic"]["quantized_mac_fraction"] == 1.0
    assert rows["ort-int8-static"]["quantized_mac_fraction"] == 1.0
    # the run report and the decision in the parent run's description
    parent = client.get_run(summary["parent_run_id"])
    assert "report.html" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert parent.data.tags["mlflow.note.content"]
