"""Breakage that used to be silent is a warning in build.json, the variant result and the run summary: `fusion:
bert` that fused no attention, INT8 that quantized attention MatMuls (both inputs activations) without fused
attention, and the torch exporter's warnings (a value traced as a constant).

Real parts: the tiny attention-like encoder of tests/helpers/tiny_models.py (its score and context MatMuls take two
activations) and small torch modules exported with tailguard's exporter, ONNX Runtime's optimizer and quantizer
through `build_variant`, the rich console of the summary. Nothing is mocked.
"""

from __future__ import annotations

import json

import pytest
import torch

from tailguard.components.build.diagnostics import attention_matmuls
from tailguard.components.build.logic import build_variant
from tailguard.components.export.logic import export_onnx
from tailguard.core.contract import EXPORT_FACTS_FILE
from tailguard.core.results import VariantResult
from tailguard.core.spec.variants import VariantSpec
from tests.helpers.tiny_models import export_tiny, tiny_dataset, tiny_feeds, tiny_model_spec


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(module, spec, path) of the tiny encoder exported with the legacy exporter."""
    return export_tiny(tmp_path_factory.mktemp("tiny"))


def _build(tiny, out, **variant):
    _, spec, path = tiny
    v = VariantSpec.model_validate({"name": "v", "backend": "onnxruntime", **variant})
    return build_variant(v, path, out, calibration=tiny_dataset(), model=spec)


def test_attention_matmuls_finds_the_two_matmuls_whose_inputs_are_both_activations(tiny):
    assert attention_matmuls(tiny[2]) == ["/MatMul", "/MatMul_1"]


def test_static_int8_build_warns_with_the_exclusion_when_it_quantizes_attention_matmuls_without_fused_attention(
        tiny, tmp_path):
    result = _build(tiny, tmp_path, precision="int8", quantization={"mode": "static"})

    assert result.status == "ok", result.reason
    assert result.details["attention_matmuls"] == {"nodes": ["/MatMul", "/MatMul_1"],
                                                   "quantized": ["/MatMul", "/MatMul_1"], "fused_attention": 0}
    (warning,) = [w for w in result.details["warnings"] if "attention MatMul" in w]
    assert "INT8 static quantized 2 attention MatMul(s)" in warning
    assert 'quantization: {preset: transformer-static, exclude_nodes: ["/MatMul", "/MatMul_1"]}' in warning


def test_static_int8_build_has_no_attention_warning_when_the_warnings_fix_is_applied(tiny, tmp_path):
    result = _build(tiny, tmp_path, precision="int8",
                    quantization={"preset": "transformer-static", "exclude_nodes": ["/MatMul", "/MatMul_1"]})

    assert result.status == "ok", result.reason
    assert result.details["attention_matmuls"]["quantized"] == []
    assert not [w for w in result.details["warnings"] if "attention MatMul" in w]


def test_bert_fusion_build_warns_listing_what_was_fused_when_no_attention_was_fused(tiny, tmp_path):
    result = _build(tiny, tmp_path, precision="fp32", graph_optimization={"fusion": "bert"})

    assert result.status == "ok", result.reason
    (warning,) = result.details["warnings"]
    assert warning.startswith("fusion: bert fused no attention (expected Attention or MultiHeadAttention; found ")
    assert "SkipLayerNormalization 1" in warning and "num_heads and hidden_size" in warning


class BranchOnMask(torch.nn.Module):
    """A model whose trace turns a data-dependent branch into a constant (a TracerWarning at export)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(64, 4)

    def forward(self, input_ids, attention_mask):
        x = self.emb(input_ids).mean(1)
        if attention_mask.sum() > 0:  # traced as a constant
            x = x * 2.0
        return x, x.sum(-1, keepdim=True)


def test_exporter_warnings_are_recorded_and_reach_the_build_warnings_when_the_trace_takes_a_constant(tmp_path):
    spec = tiny_model_spec()
    spec = spec.model_copy(update={"outputs": [o.model_copy(update={"shape": ["batch", 4] if o.name == "logits"
                                                                     else ["batch", 1]}) for o in spec.outputs]})
    facts = export_onnx(BranchOnMask().eval(), spec, tiny_feeds(2, 5), tmp_path / "export" / "model.onnx")
    (tmp_path / "export" / EXPORT_FACTS_FILE).write_text(json.dumps(facts))

    v = VariantSpec.model_validate({"name": "fp32", "backend": "onnxruntime", "precision": "fp32"})
    result = build_variant(v, tmp_path / "export" / "model.onnx", tmp_path / "build", calibration=None, model=spec)

    (recorded,) = facts["warnings"]
    assert recorded["category"] == "TracerWarning" and recorded["where"].startswith("test_fusion_warnings.py:")
    assert recorded["message"].startswith("Converting a tensor to a Python boolean might cause the trace")
    assert all("legacy TorchScript" not in w["message"] for w in facts["warnings"])  # API deprecations left out
    assert result.details["warnings"] == [f"export: TracerWarning at {recorded['where']}: {recorded['message']}"]


def test_variant_result_keeps_build_warnings_and_reads_older_files_without_them():
    result = VariantResult(variant="v", backend="onnxruntime", precision="int8", status="ok", warnings=["w1"])

    again = VariantResult.from_dict(json.loads(json.dumps(result.to_dict())))
    old = {k: v for k, v in result.to_dict().items() if k != "warnings"}

    assert again.warnings == ["w1"] and VariantResult.from_dict(old).warnings == []


def test_print_summary_prints_a_warning_shared_by_variants_once_naming_them(tmp_path):
    from tailguard.components.register.summary import RunSummary, VariantSummary
    from tailguard.terminal import console, print_summary

    shared = "export: TracerWarning at model.py:7: Converting a tensor to a Python boolean [x] might be wrong."
    summary = RunSummary(parent_run_id="p", experiment_id="e", source_model="m", source_version="1",
                         optimized_model="m-optimized", alias="production", promotion_enabled=True, batch_size=1,
                         variants=[VariantSummary("ort-fp32", "onnxruntime", "fp32", "ok", warnings=[shared]),
                                   VariantSummary("ort-int8", "onnxruntime", "int8", "ok", warnings=[shared])])
    with console.capture() as capture:
        print_summary(summary)
    text = " ".join(capture.get().split())

    assert text.count("TracerWarning") == 1
    assert "! ort-fp32, ort-int8: export: TracerWarning at model.py:7" in text and "[x]" in text
