"""The build cache key of ONNX Runtime and TensorRT builds holds the node facts the artefact depends on (issue 36
item 12): a TensorRT plan built on one GPU is never served from the cache to another GPU, an offline-optimized
CPU graph never to a CPU with other vector ISA flags. The GPU and the other CPU cannot be had here: the two facts
functions of tailguard.core.hardware are the one seam replaced (monkeypatch), everything else is real."""

from __future__ import annotations

import pytest

from tailguard.components.build.task import cache_parts
from tailguard.core import cache, hardware
from tailguard.core.spec import parse_spec
from tailguard.monitoring import testing as T

H100 = [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}]
A100 = [{"index": 0, "name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0"}]


@pytest.fixture
def setup(tmp_path):
    T.linear_classifier(tmp_path / "model.onnx")
    d = T.spec_dict()
    d["variants"] = [
        {"name": "trt-fp16", "backend": "tensorrt", "precision": "fp16"},
        {"name": "ort-all", "backend": "onnxruntime", "precision": "fp32", "graph_optimization": {"level": "all"}},
        {"name": "ort-plain", "backend": "onnxruntime", "precision": "fp32",
         "graph_optimization": {"level": "disabled"}},
    ]
    spec = parse_spec(d)
    return spec, {v.name: v for v in spec.variants}, tmp_path


def _key(spec, variant, onnx_dir) -> str:
    return cache.cache_key("build", cache_parts(spec, variant, onnx_dir))


def test_build_cache_key_differs_when_a_tensorrt_build_is_asked_on_another_gpu(setup, monkeypatch):
    spec, v, d = setup
    monkeypatch.setattr(hardware, "gpu_facts", lambda: H100)
    on_h100 = _key(spec, v["trt-fp16"], d)
    assert cache_parts(spec, v["trt-fp16"], d)["node"]["gpus"] == [{"name": H100[0]["name"],
                                                                    "compute_capability": "9.0"}]
    monkeypatch.setattr(hardware, "gpu_facts", lambda: A100)
    assert _key(spec, v["trt-fp16"], d) != on_h100
    assert _key(spec, v["ort-plain"], d) == _key(spec, v["ort-plain"], d)


def test_build_cache_key_differs_only_for_offline_optimized_cpu_graphs_when_the_cpu_isa_differs(setup,
                                                                                                 monkeypatch):
    spec, v, d = setup
    real = hardware.cpu_facts()
    monkeypatch.setattr(hardware, "cpu_facts", lambda: {**real, "isa": ["avx2", "fma"]})
    avx2 = {n: _key(spec, v[n], d) for n in ("ort-all", "ort-plain")}
    monkeypatch.setattr(hardware, "cpu_facts", lambda: {**real, "isa": ["avx2", "fma", "avx512f", "avx512_vnni"]})
    avx512 = {n: _key(spec, v[n], d) for n in ("ort-all", "ort-plain")}
    assert avx2["ort-all"] != avx512["ort-all"]  # layout optimizations follow the vector ISA
    assert avx2["ort-plain"] == avx512["ort-plain"]  # a graph saved without them runs anywhere
