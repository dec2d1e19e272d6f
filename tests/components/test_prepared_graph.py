"""The prepared graph (graph optimization, then quant_pre_process) is made once per run and copied by the other
builds of the run (components/build/builders/onnxruntime.py `_prepared`, issue 25: time to a decision).

Real parts: the tiny attention-like encoder of tests/helpers/tiny_models.py, ONNX Runtime's optimizer, quantizer
and quant_pre_process through `build_variant`, the local cache under a temporary $TAILGUARD_HOME. Nothing is
mocked.
"""

from __future__ import annotations

import pytest

from tailguard.components.build.builders.onnxruntime import PREPARED_STEP
from tailguard.components.build.logic import build_variant
from tailguard.core import cache
from tailguard.core.spec.variants import VariantSpec
from tests.helpers.tiny_models import export_tiny, tiny_dataset


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return export_tiny(tmp_path_factory.mktemp("tiny"))


def _build(tiny, out, name, **variant):
    _, spec, path = tiny
    v = VariantSpec.model_validate({"name": name, "backend": "onnxruntime", "precision": "int8",
                                    "graph_optimization": {"level": "extended"}, **variant})
    result = build_variant(v, path, out, calibration=tiny_dataset(), model=spec)
    assert result.status == "ok", result.reason
    return result


def _prepared_entries():
    return sorted(e.label for e in cache.entries() if e.step == PREPARED_STEP)


def test_build_variant_prepares_the_graph_once_per_run_when_the_cache_is_on(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(cache.ENV_CACHE, "1")
    first = _build(tiny, tmp_path / "dyn", "dyn", quantization={"mode": "dynamic"})
    assert _prepared_entries() == ["optimize optimized.onnx", "preprocess preprocessed.onnx"]
    second = _build(tiny, tmp_path / "static", "static", quantization={"mode": "static"})
    assert _prepared_entries() == ["optimize optimized.onnx", "preprocess preprocessed.onnx"]  # copied, not made
    # what the copy gives is what preparing it again gives: the same bytes out, the same details recorded
    monkeypatch.setenv(cache.ENV_CACHE, "0")
    fresh = _build(tiny, tmp_path / "fresh", "static", quantization={"mode": "static"})
    assert (tmp_path / "static" / second.artifact).read_bytes() == (tmp_path / "fresh" / fresh.artifact).read_bytes()
    for key in ("graph_optimization", "preprocess", "warnings", "op_types_before"):
        assert second.details.get(key) == fresh.details.get(key), key
    assert first.details["preprocess"] == second.details["preprocess"]


def test_build_variant_prepares_its_own_graph_when_the_settings_differ(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(cache.ENV_CACHE, "1")
    _build(tiny, tmp_path / "a", "a", quantization={"mode": "dynamic"})
    _build(tiny, tmp_path / "b", "b", quantization={"mode": "dynamic"}, graph_optimization={"level": "basic"})
    labels = _prepared_entries()
    assert labels.count("optimize optimized.onnx") == 2  # another level: optimized again
    # quant_pre_process is keyed on its input's bytes: on this tiny graph both levels write the same graph, so
    # it ran once; a different graph would have its own entry
    assert labels.count("preprocess preprocessed.onnx") == 1


@pytest.mark.parametrize("quantization", [{"mode": "dynamic"}, {"mode": "static", "format": "qdq"}])
def test_build_variant_parses_each_graph_file_once_and_keeps_none_when_it_ends(tiny, tmp_path, monkeypatch,
                                                                               quantization):
    import collections

    import onnx

    from tailguard.components.build import onnx_files

    monkeypatch.delenv(cache.ENV_CACHE, raising=False)  # off the cache: the build prepares its own graph
    parses = collections.Counter()
    real = onnx.load

    def counting(f, *a, **kw):
        if kw.get("load_external_data", True) is False:  # the structural reads (full loads save a model)
            parses[str(f)] += 1
        return real(f, *a, **kw)

    monkeypatch.setattr(onnx, "load", counting)
    result = _build(tiny, tmp_path / "out", "i8", quantization=quantization)
    assert parses and max(parses.values()) == 1, parses  # op counts, checks, coverage, summary: one parse each
    assert not onnx_files._GRAPHS  # nothing parsed outlives the build
    assert result.details["quantized_mac_fraction"] is not None
