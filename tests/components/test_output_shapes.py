"""Declared outputs (`model.outputs`: dtype, rank, fixed sizes) checked against the model: at export (always), at
`tailguard register --spec`, and at `tailguard spec check` against the signature `register` recorded.

Real parts: torch modules exported with tailguard's exporter, torch.export programs, ONNX graphs built with
onnx.helper, ONNX Runtime sessions, the export task's `main`, a SQLite MLflow store in tmp_path and the typer CLI
in-process. Nothing is mocked.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from typer.testing import CliRunner

from tailguard.cli import app
from tailguard.components.export.logic import check_declared_outputs
from tailguard.core.errors import EXIT_USAGE, SpecError
from tailguard.core.spec.model import ModelSpec
from tests.helpers.tiny_models import export_tiny, tiny_feeds

runner = CliRunner()
N_IN, N_CLASSES = 8, 15


def _with_outputs(spec: ModelSpec, outputs: list[dict]) -> ModelSpec:
    return ModelSpec.model_validate({**spec.model_dump(mode="json"), "outputs": outputs})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(module, spec, path) of the tiny encoder: logits [batch, 4], pooled [batch, 16]."""
    return export_tiny(tmp_path_factory.mktemp("tiny"))


# ------------------------------------------------------------------------------------ check_declared_outputs
def test_check_declared_outputs_raises_spec_error_naming_the_output_and_the_fix_when_the_width_is_wrong(tiny):
    _, spec, path = tiny
    wrong = _with_outputs(spec, [{"name": "logits", "dtype": "float32", "shape": ["batch", 5]},
                                 {"name": "pooled", "dtype": "float16", "shape": ["batch", 16]}])

    with pytest.raises(SpecError) as info:
        check_declared_outputs(path, wrong, tiny_feeds(3, 5))

    err = info.value
    assert err.exit_code == EXIT_USAGE
    assert [e.loc for e in err.errors] == ["model.outputs.0.shape", "model.outputs.1.dtype"]
    assert "logits is declared [batch, 5] but the ONNX graph gives [batch, 4]" in err.message
    assert "pooled is declared float16 but the ONNX graph gives float32" in err.message
    assert "declare logits: [batch, 4]" in err.hint and "declare pooled dtype: float32" in err.hint


def test_check_declared_outputs_passes_when_named_axes_take_any_size_and_an_extra_output_is_undeclared(tiny):
    _, spec, path = tiny
    only_logits = _with_outputs(spec, [{"name": "logits", "dtype": "float32", "shape": ["rows", 4]}])

    facts = check_declared_outputs(path, only_logits, tiny_feeds(3, 5))

    assert facts["rows"] == 3
    assert {"name": "logits", "dtype": "float32", "shape": [3, 4]} in facts["batch"]


def test_check_declared_outputs_names_the_missing_output_when_the_graph_lacks_it(tiny):
    _, spec, path = tiny
    renamed = _with_outputs(spec, [{"name": "scores", "dtype": "float32", "shape": ["batch", 4]}])

    with pytest.raises(SpecError) as info:
        check_declared_outputs(path, renamed, tiny_feeds(2, 4))

    assert info.value.errors[0].loc == "model.outputs.0.name"
    assert "'scores' is declared but the ONNX graph has no output of that name" in info.value.message
    assert "logits, pooled" in info.value.hint


def _onnx_with_symbolic_width(path: Path) -> Path:
    """x [batch, 8] -> logits [batch, "classes"] (a symbolic dim in the graph; really 15)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.linspace(-1, 1, N_IN * N_CLASSES, dtype=np.float32).reshape(N_IN, N_CLASSES), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["logits"], name="fc")], "lin",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", N_IN])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "classes"])],
                              [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_check_declared_outputs_fails_on_the_real_output_when_the_graph_leaves_the_width_symbolic(tmp_path):
    path = _onnx_with_symbolic_width(tmp_path / "sym.onnx")
    spec = ModelSpec.model_validate({
        "registered_name": "lin", "task": "classification",
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", N_IN]}],
        "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", 16]}]})

    with pytest.raises(SpecError) as info:
        check_declared_outputs(path, spec, {"x": np.zeros((2, N_IN), np.float32)})

    assert "logits is declared [batch, 16] but the ONNX model's output on a batch of 2 rows gives [2, 15]" \
        in info.value.message
    assert "declare logits: [batch, 15]" in info.value.hint


# --------------------------------------------------------------------------------------------- export task
class Linear15(torch.nn.Module):
    """x: (batch, 8) float32 -> logits: (batch, 15) float32."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(N_IN, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _spec_doc(root: Path, width: int, *, name: str = "lin15", tracking_uri: str | None = None) -> dict:
    doc = {
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "lin15"},
        "model": {"registered_name": name, "task": "classification",
                  "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", N_IN]}],
                  "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", width]}]},
        "data": {"calibration": {"uri": str(root / "rows.parquet")}, "validation": {"uri": str(root / "rows.parquet")}},
        "variants": [{"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"}],
        "gates": [{"metric": "top1_agreement", "min": 0.9}],
    }
    if tracking_uri:
        doc["mlflow"] = {"tracking_uri": tracking_uri}
    return doc


def _write_rows(root: Path, n: int = 12) -> None:
    rng = np.random.default_rng(0)
    pd.DataFrame({"x": [rng.normal(size=N_IN).astype(np.float32).tolist() for _ in range(n)]}).to_parquet(
        root / "rows.parquet")


def test_export_task_exits_2_naming_the_output_and_the_fix_when_a_torch_model_declares_the_wrong_width(
        tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from tailguard.components.export import task as export_task
    from tailguard.core.digests import file_sha256

    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))
    _write_rows(tmp_path)
    ref = tmp_path / "reference"
    ref.mkdir()
    save_file(Linear15().state_dict(), str(ref / "model.safetensors"))
    resolved = {"registered_name": "lin15", "version": "1", "run_id": None, "format": "state_dict",
                "local_dir": str(ref), "source_uri": "models:/lin15/1", "model_file": "model.safetensors",
                "class_path": "tests.components.test_output_shapes:Linear15", "init_kwargs": {},
                "sha256": file_sha256(ref / "model.safetensors"), "artifact_subdir": "."}

    def export(width: int, out: str) -> dict:
        doc = _spec_doc(tmp_path, width)
        doc["model"]["source"] = {"class_path": resolved["class_path"]}  # a run imports only a class the spec names
        return json.loads(export_task.main(spec_yaml=yaml.safe_dump(doc),
                                           resolved_json=json.dumps(resolved), reference_dir=str(ref),
                                           out_dir=str(tmp_path / out)))

    with pytest.raises(SpecError) as info:
        export(16, "bad")
    facts = export(15, "good")

    assert info.value.exit_code == EXIT_USAGE
    assert "logits is declared [batch, 16] but the ONNX graph gives [batch, 15]" in info.value.message
    assert info.value.hint == "declare logits: [batch, 15]"
    assert facts["outputs_check"]["graph"] == [{"name": "logits", "dtype": "float32", "shape": ["batch", 15]}]
    assert json.loads((tmp_path / "good" / "export.json").read_text())["outputs_check"]["rows"] >= 1


# -------------------------------------------------------------------------------- register and spec check
@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _write_rows(tmp_path)
    onnx_file = tmp_path / "lin15.onnx"
    torch.onnx.export(Linear15().eval(), (torch.zeros(2, N_IN),), str(onnx_file), input_names=["x"],
                      output_names=["logits"], dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}},
                      dynamo=False)
    return {"root": tmp_path, "uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "onnx": onnx_file}


def _write_spec(store: dict, width: int, name: str = "spec.yaml") -> Path:
    path = store["root"] / name
    path.write_text(yaml.safe_dump(_spec_doc(store["root"], width, tracking_uri=store["uri"])))
    return path


def test_register_with_spec_exits_2_and_registers_nothing_when_the_declared_width_is_wrong(store):
    import mlflow

    bad = runner.invoke(app, ["register", "lin15", str(store["onnx"]), "--tracking-uri", store["uri"],
                              "--spec", str(_write_spec(store, 16))])
    good = runner.invoke(app, ["register", "lin15", str(store["onnx"]), "--tracking-uri", store["uri"],
                               "--spec", str(_write_spec(store, 15, "good.yaml"))])

    assert bad.exit_code == 2, bad.output
    assert "logits is declared [batch, 16] but the ONNX graph of lin15.onnx gives [batch, 15]" in bad.output
    assert "declare logits: [batch, 15]" in bad.output
    assert good.exit_code == 0, good.output and "version 1" in good.output  # the failed call wrote nothing
    mv = mlflow.MlflowClient(store["uri"]).get_model_version("lin15", "1")
    assert json.loads(mv.tags["tailguard.outputs"])["outputs"] == [
        {"name": "logits", "dtype": "float32", "shape": ["batch", 15]}]


def test_register_with_spec_exits_2_when_a_state_dicts_module_returns_another_width(store, tmp_path):
    module_dir = tmp_path / "models"
    module_dir.mkdir()
    (module_dir / "lin15_model.py").write_text(
        "import torch\n\n\nclass Linear15(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        f"        self.fc = torch.nn.Linear({N_IN}, {N_CLASSES})\n\n    def forward(self, x):\n"
        "        return self.fc(x)\n")
    weights = tmp_path / "lin15.pt"
    torch.save(Linear15().state_dict(), weights)

    result = runner.invoke(app, ["register", "lin15sd", str(weights), "--class-path", "lin15_model:Linear15",
                                 "--model-path", str(module_dir), "--tracking-uri", store["uri"],
                                 "--spec", str(_write_spec(store, 16))])

    assert result.exit_code == 2, result.output
    assert "logits is declared [batch, 16] but lin15_model:Linear15 with these weights on a batch of 2 rows " \
           "gives [2, 15]" in result.output
    assert "declare logits: [batch, 15]" in result.output


def test_spec_check_exits_2_when_model_outputs_differ_from_the_signature_recorded_at_registration(store):
    registered = runner.invoke(app, ["register", "lin15", str(store["onnx"]), "--tracking-uri", store["uri"]])
    assert registered.exit_code == 0, registered.output

    bad = runner.invoke(app, ["spec", "check", str(_write_spec(store, 16))])
    good = runner.invoke(app, ["spec", "check", str(_write_spec(store, 15, "good.yaml"))])

    assert bad.exit_code == 2, bad.output
    assert "model.outputs.0.shape: logits is declared [batch, 16] but the model (lin15 v1) gives [batch, 15]" \
        in " ".join(bad.output.split())
    assert "declare logits: [batch, 15]" in bad.output
    assert good.exit_code == 0, good.output
    assert "model.outputs checked against lin15 v1" in good.output


def test_spec_check_exits_2_naming_the_name_and_the_store_when_the_model_is_not_registered_there(store):
    registered = runner.invoke(app, ["register", "lin15", str(store["onnx"]), "--tracking-uri", store["uri"]])
    assert registered.exit_code == 0, registered.output
    path = store["root"] / "typo.yaml"
    doc = _spec_doc(store["root"], 15, tracking_uri=store["uri"])
    doc["model"]["registered_name"] = "lin16"
    path.write_text(yaml.safe_dump(doc))

    result = runner.invoke(app, ["spec", "check", str(path)])

    out = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "model.registered_name: no registered model 'lin16' in the registry" in out
    assert store["uri"] in out and "lin15" in out  # the store looked in, and the close name


def test_spec_check_accepts_an_integer_version_and_refuses_one_the_registry_lacks(store):
    registered = runner.invoke(app, ["register", "lin15", str(store["onnx"]), "--tracking-uri", store["uri"]])
    assert registered.exit_code == 0, registered.output
    results = {}
    for version in (1, 7):
        path = store["root"] / f"v{version}.yaml"
        doc = _spec_doc(store["root"], 15, tracking_uri=store["uri"])
        doc["model"]["version"] = version  # YAML `version: 1`, an int, as `tailguard register` prints it
        path.write_text(yaml.safe_dump(doc))
        results[version] = runner.invoke(app, ["spec", "check", str(path)])

    assert results[1].exit_code == 0, results[1].output
    assert "model.outputs checked against lin15 v1" in results[1].output
    assert results[7].exit_code == 2, results[7].output
    assert "model.version" in results[7].output and store["uri"] in " ".join(results[7].output.split())
