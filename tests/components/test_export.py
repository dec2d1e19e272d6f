"""Export step: torch -> ONNX with dynamic axes, the parity check against torch, and ONNX file checks.

Real torch modules (tests/helpers/tiny_models.py) and real ONNX Runtime sessions; nothing is mocked.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tailguard.components.export.logic import check_export, check_onnx_file, export_onnx
from tailguard.core.errors import ExportMismatchError, InputError
from tailguard.core.runtime import TorchRunner
from tests.helpers.tiny_models import (
    HIDDEN,
    INPUT_NAMES,
    N_CLASSES,
    export_tiny,
    make_tiny_encoder,
    tiny_feeds,
    tiny_model_spec,
)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(module, spec, path) of the tiny encoder exported with the legacy exporter."""
    return export_tiny(tmp_path_factory.mktemp("export"))


class NoisyRunner:
    """Wraps a runner and adds `noise` to one output (by index) or sets it to NaN: a planted export error."""

    def __init__(self, inner, index: int, noise: float = 0.0, nan: bool = False) -> None:
        self.inner, self.index, self.noise, self.nan = inner, index, noise, nan

    def run(self, feeds):
        out = [o.copy() for o in self.inner.run(feeds)]
        out[self.index] = out[self.index] + self.noise
        if self.nan:
            out[self.index].flat[0] = np.nan
        return out


def _batches():
    return [tiny_feeds(1, 3, 1), tiny_feeds(5, 11, 2, pad_last=4)]


def test_export_onnx_runs_at_other_batch_sizes_and_lengths_when_axes_are_dynamic(exported):
    module, spec, path = exported
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch, seq in [(1, 3), (5, 11)]:
        logits, pooled = sess.run(["logits", "pooled"], tiny_feeds(batch, seq))
        assert logits.shape == (batch, N_CLASSES) and pooled.shape == (batch, HIDDEN)
    dims = [d.dim_param for d in onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", "sequence"]


def test_export_onnx_returns_facts_when_legacy_exporter_used(tmp_path):
    facts = export_onnx(make_tiny_encoder(), tiny_model_spec(opset=17), tiny_feeds(2, 7), tmp_path / "m.onnx")
    assert facts["exporter"] == "torchscript" and facts["opset"] == 17
    assert facts["bytes"] == (tmp_path / "m.onnx").stat().st_size and not facts["external_data"]
    assert facts["inputs"] == list(INPUT_NAMES) and facts["outputs"] == ["logits", "pooled"]
    assert facts["op_types"]["MatMul"] == 4 and facts["nodes"] == sum(facts["op_types"].values())


def test_check_export_passes_for_every_output_when_onnx_matches_torch(exported):
    module, spec, path = exported
    diffs = check_export(TorchRunner(module, INPUT_NAMES), path, _batches(), spec)
    assert set(diffs) == {"logits", "pooled"}
    for d in diffs.values():
        assert d["ok"] and d["batches"] == 2 and d["max_abs_diff"] < 1e-4 and d["non_finite"] == 0


def test_check_export_raises_listing_every_output_when_the_source_module_differs(exported):
    _, spec, path = exported
    other = TorchRunner(make_tiny_encoder(seed=1), INPUT_NAMES)
    with pytest.raises(ExportMismatchError) as err:
        check_export(other, path, _batches(), spec)
    diffs = err.value.diffs
    assert not diffs["logits"]["ok"] and not diffs["pooled"]["ok"]
    assert diffs["logits"]["max_abs_diff"] > 1e-2
    assert "logits" in str(err.value) and "pooled" in str(err.value)
    assert err.value.exit_code == 1


def test_check_export_reports_only_the_noisy_output_as_failed_when_noise_is_planted(exported):
    module, spec, path = exported
    noisy = NoisyRunner(TorchRunner(module, INPUT_NAMES), index=1, noise=0.01)
    with pytest.raises(ExportMismatchError) as err:
        check_export(noisy, path, _batches(), spec)
    diffs = err.value.diffs
    assert diffs["logits"]["ok"] and not diffs["pooled"]["ok"]
    assert diffs["pooled"]["max_abs_diff"] == pytest.approx(0.01, rel=1e-3)
    assert "pooled" in str(err.value) and "logits:" not in str(err.value)


def test_check_export_passes_when_the_output_tolerance_covers_the_difference(exported):
    module, _, path = exported
    spec = tiny_model_spec(tolerances={"pooled": {"atol": 0.02, "rtol": 0.0}})
    noisy = NoisyRunner(TorchRunner(module, INPUT_NAMES), index=1, noise=0.01)
    diffs = check_export(noisy, path, _batches(), spec)
    assert diffs["pooled"]["ok"] and diffs["pooled"]["atol"] == 0.02


def test_check_export_fails_when_tolerance_is_zero_and_outputs_differ_slightly(exported):
    module, _, path = exported
    spec = tiny_model_spec(default={"atol": 0.0, "rtol": 0.0})
    noisy = NoisyRunner(TorchRunner(module, INPUT_NAMES), index=0, noise=1e-6)
    with pytest.raises(ExportMismatchError) as err:
        check_export(noisy, path, _batches(), spec)
    assert not err.value.diffs["logits"]["ok"]


def test_check_export_fails_when_an_output_is_not_finite(exported):
    module, spec, path = exported
    nan = NoisyRunner(TorchRunner(module, INPUT_NAMES), index=0, nan=True)
    with pytest.raises(ExportMismatchError) as err:
        check_export(nan, path, _batches(), spec)
    assert err.value.diffs["logits"]["non_finite"] == 2 and not err.value.diffs["logits"]["ok"]


def test_export_onnx_raises_input_error_when_a_sample_input_is_missing(tmp_path):
    with pytest.raises(InputError, match="attention_mask"):
        export_onnx(make_tiny_encoder(), tiny_model_spec(), {"input_ids": tiny_feeds(2, 4)["input_ids"]},
                    tmp_path / "m.onnx")


def test_export_onnx_dynamo_stays_dynamic_and_named_when_names_clash_and_sample_is_one_row(tmp_path):
    # The dynamo exporter names internal values after aten ops: an output called "embedding" clashes with the
    # embedding lookup's value and, unhandled, gives "Duplicate definition of name (embedding)" in ORT.
    # Traced with batch 1 and sequence 1: torch.export would specialize those sizes; export_onnx repeats them.
    spec = tiny_model_spec(dynamo=True, opset=18)
    spec.outputs[1].name = "embedding"
    module = make_tiny_encoder()
    facts = export_onnx(module, spec, tiny_feeds(1, 1), tmp_path / "d.onnx")
    assert facts["exporter"] == "dynamo" and facts["outputs"] == ["logits", "embedding"]
    assert not facts["external_data"] and not list(tmp_path.glob("*.data"))
    diffs = check_export(TorchRunner(module, INPUT_NAMES), tmp_path / "d.onnx", _batches(), spec)
    assert diffs["embedding"]["ok"] and diffs["logits"]["ok"]


def test_check_onnx_file_raises_input_error_naming_the_file_when_truncated(exported, tmp_path):
    _, _, path = exported
    bad = tmp_path / "truncated.onnx"
    bad.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(InputError, match="truncated.onnx"):
        check_onnx_file(bad)


def test_check_onnx_file_raises_input_error_when_the_file_is_missing(tmp_path):
    with pytest.raises(InputError, match="nothing.onnx"):
        check_onnx_file(tmp_path / "nothing.onnx")


def test_check_onnx_file_returns_facts_when_weights_are_external_data(exported, tmp_path):
    _, _, path = exported
    ext = tmp_path / "ext.onnx"
    onnx.save_model(onnx.load(str(path)), str(ext), save_as_external_data=True, location="ext.onnx.data",
                    size_threshold=0)
    facts = check_onnx_file(ext)
    assert facts["external_data"] and facts["bytes"] > ext.stat().st_size
    assert facts["outputs"] == ["logits", "pooled"] and facts["opset"] == 17
