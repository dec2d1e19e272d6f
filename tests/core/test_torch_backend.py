"""The torch backend's kernel (tailguard.core.torch_backend): export, the artefact and its manifest, the runner, the
reasons a node cannot build a variant, and the errors a model torch.export cannot capture gets.

All on the CPU with a 2-layer MeanPooledEncoder (random weights). CUDA-only behaviour (CUDA graphs, fp16) runs in
tests marked requires_gpu, skipped here; the decision logic around it (`unavailable_reason`, the config checks) is
tested on the CPU by the arguments it is given.
"""

from __future__ import annotations

import json
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

from tailguard.core.artifacts import ArtifactMismatchError, manifest_path
from tailguard.core.errors import InputError
from tailguard.core.torch_backend import (
    CudaGraphCache,
    EagerModuleRunner,
    TorchBuildConfig,
    TorchBuildError,
    TorchVariantRunner,
    build_torch_variant,
    unavailable_reason,
)
from tailguard.models import MeanPooledEncoder

SPECS = [NS(name="input_ids", dtype="int64", shape=["batch", "sequence"]),
         NS(name="attention_mask", dtype="int64", shape=["batch", "sequence"])]
TINY = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64)


def _model() -> MeanPooledEncoder:
    torch.manual_seed(0)
    return MeanPooledEncoder(**TINY).eval()


def _batch(rows: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 100, size=(rows, length)).astype(np.int64)
    mask = np.ones_like(ids)
    if rows > 1:
        mask[0, length // 2:] = 0  # a padded row
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture(scope="module")
def eager_build(tmp_path_factory):
    out = tmp_path_factory.mktemp("eager")
    cfg = TorchBuildConfig(precision="fp32", compile="eager", device="cpu")
    return cfg, build_torch_variant(_model(), _batch(4, 12), SPECS, cfg, out, source_sha256="a" * 64)


def test_torch_eager_build_matches_the_module_exactly_when_batch_and_length_differ_from_the_example(eager_build):
    cfg, build = eager_build
    runner = TorchVariantRunner(build.path, cfg, SPECS, source_sha256="a" * 64)
    reference = EagerModuleRunner(_model(), SPECS)
    for rows, length in ((1, 5), (1, 1), (7, 40), (4, 12)):
        feeds = _batch(rows, length, seed=rows * 100 + length)
        got, want = runner.run(feeds)[0], reference.run(feeds)[0]
        assert got.shape == (rows, 32) and got.dtype == np.float32
        np.testing.assert_array_equal(got, want)
    assert build.path.name == "program.pt2" and manifest_path(build.path).is_file()
    assert build.dynamic_axes["input_ids"][0].startswith("batch [") and "sequence [" in build.dynamic_axes[
        "attention_mask"][1]
    assert not list(build.path.parent.glob(".partial*")), "no half-written artefact left"


def test_torch_runner_refuses_with_the_field_when_the_manifest_names_another_torch_or_device(eager_build, tmp_path):
    cfg, build = eager_build
    copy = tmp_path / build.path.name
    copy.write_bytes(build.path.read_bytes())
    manifest = json.loads(manifest_path(build.path).read_text())
    manifest["fingerprint"]["torch_version"] = "2.11.0+cu130"
    manifest["fingerprint"]["device"] = "cuda"
    manifest_path(copy).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactMismatchError, match=r"device: 'cuda' != 'cpu'.*torch_version: "
                                                    r"'2.11.0\+cu130' != "):
        TorchVariantRunner(copy, cfg, SPECS, source_sha256="a" * 64)


def test_torch_runner_refuses_when_the_source_model_or_the_settings_differ(eager_build):
    cfg, build = eager_build
    with pytest.raises(ArtifactMismatchError, match="source_sha256"):
        TorchVariantRunner(build.path, cfg, SPECS, source_sha256="b" * 64)
    with pytest.raises(ArtifactMismatchError, match="build_config_sha256"):
        TorchVariantRunner(build.path, TorchBuildConfig(precision="bf16", compile="eager"), SPECS,
                           source_sha256="a" * 64)


def test_torch_runner_refuses_a_file_changed_after_the_build(eager_build, tmp_path):
    cfg, build = eager_build
    copy = tmp_path / build.path.name
    copy.write_bytes(build.path.read_bytes() + b"\0")
    manifest_path(copy).write_text(manifest_path(build.path).read_text())
    with pytest.raises(ArtifactMismatchError, match="changed after it was built"):
        TorchVariantRunner(copy, cfg, SPECS, source_sha256="a" * 64)


class _DataDependent(torch.nn.Module):
    def forward(self, input_ids, attention_mask):
        if input_ids.sum() > 10:  # branches on a tensor value: torch.export cannot capture it
            return input_ids.float()
        return attention_mask.float()


class _FixedBatch(torch.nn.Module):
    def forward(self, input_ids, attention_mask):
        return input_ids.float().reshape(4, -1)[:, :1] * attention_mask[:, :1]  # assumes batch 4


def test_torch_build_fails_with_torchs_reason_when_the_model_has_data_dependent_control_flow(tmp_path):
    with pytest.raises(TorchBuildError, match="torch.export cannot capture the model") as exc:
        build_torch_variant(_DataDependent(), _batch(4, 12), SPECS, TorchBuildConfig(), tmp_path,
                            source_sha256="a" * 64)
    assert exc.value.hint and "torch.cond" in exc.value.hint
    assert not list(tmp_path.iterdir()), "nothing written for a failed build"


def test_torch_build_names_the_axis_when_the_models_code_fixes_a_dynamic_axis(tmp_path):
    with pytest.raises(TorchBuildError, match=r"fixed axis 0 \('batch'\) of input 'input_ids' to 4"):
        build_torch_variant(_FixedBatch(), _batch(4, 12), SPECS, TorchBuildConfig(), tmp_path,
                            source_sha256="a" * 64)


def test_torch_unavailable_reason_names_what_is_missing_when_the_node_cannot_run_the_variant(monkeypatch):
    assert "no CUDA device" in unavailable_reason(TorchBuildConfig(precision="fp16", device="cuda")) \
        if not torch.cuda.is_available() else True
    assert "fp16 on CPU" in unavailable_reason(TorchBuildConfig(precision="fp16", device="cpu"))
    assert "avx512_bf16" in unavailable_reason(TorchBuildConfig(precision="bf16", device="cpu"), cpu_isa=["avx2"])
    assert unavailable_reason(TorchBuildConfig(precision="bf16", device="cpu"), cpu_isa=["avx512_bf16"]) is None
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert "C++ compiler" in unavailable_reason(TorchBuildConfig(compile="aot_inductor", device="cpu"))
    assert unavailable_reason(TorchBuildConfig(compile="eager", device="cpu")) is None


def test_torch_build_config_refuses_cuda_graphs_on_cpu_and_unknown_modes():
    with pytest.raises(InputError, match="cuda_graphs needs device cuda"):
        TorchBuildConfig(device="cpu", cuda_graphs=True)
    with pytest.raises(InputError, match="compile 'tensorrt' is not one of"):
        TorchBuildConfig(compile="tensorrt")


def test_torch_aot_inductor_package_runs_on_cpu_close_to_the_module_when_batch_is_one_or_more(tmp_path):
    cfg = TorchBuildConfig(precision="fp32", compile="aot_inductor", device="cpu")
    build = build_torch_variant(_model(), _batch(4, 12), SPECS, cfg, tmp_path, source_sha256="c" * 64)
    assert build.path.name == "package.pt2" and build.compile_seconds > 0
    manifest = json.loads(manifest_path(build.path).read_text())
    assert manifest["kind"] == "AOTInductor package" and manifest["fingerprint"]["cpu_isa"]  # bound to the ISA
    runner = TorchVariantRunner(build.path, cfg, SPECS, source_sha256="c" * 64, trusted=True)  # built here
    reference = EagerModuleRunner(_model(), SPECS)
    for rows, length in ((1, 3), (9, 33)):
        feeds = _batch(rows, length, seed=rows)
        np.testing.assert_allclose(runner.run(feeds)[0], reference.run(feeds)[0], atol=1e-5)


@pytest.mark.requires_gpu
def test_cuda_graph_cache_replays_equal_outputs_and_keeps_at_most_max_graphs():
    model = _model().cuda()
    graphs = CudaGraphCache(lambda a, m: model(a, m), max_graphs=2)
    for rows, length in ((1, 5), (2, 7), (3, 9), (1, 5)):
        feeds = _batch(rows, length)
        args = [torch.from_numpy(feeds[k]).cuda() for k in ("input_ids", "attention_mask")]
        with torch.inference_mode():
            torch.testing.assert_close(graphs(*args)[0], model(*args))
    assert len(graphs.graphs) == 2 and graphs.captures == 4  # (1, 5) was evicted, then captured again


def test_torch_probe_load_reports_the_childs_exit_when_the_package_cannot_load(tmp_path):
    from tailguard.core.artifacts import write_manifest
    from tailguard.core.torch_backend import fingerprint, probe_load, signature

    cfg = TorchBuildConfig(precision="fp32", compile="aot_inductor", device="cpu")
    package = tmp_path / "package.pt2"
    package.write_bytes(b"not a zip archive")  # a manifest that matches the bytes: the loader itself fails
    write_manifest(package, fingerprint(cfg, "d" * 64, signature(SPECS)), kind=cfg.artifact_kind)
    reason = probe_load(package, cfg, SPECS, source_sha256="d" * 64, feeds=_batch(2, 5), trusted=True)
    assert reason is not None and "probe process ended with exit code 1" in reason


def test_validate_torch_runner_fails_the_variant_naming_the_field_when_built_for_another_node(eager_build,
                                                                                             tmp_path):
    from tailguard.components.validate.runners import VariantUnusable, torch_runner

    _, build = eager_build
    copy = tmp_path / build.path.name
    copy.write_bytes(build.path.read_bytes())
    manifest = json.loads(manifest_path(build.path).read_text())
    manifest["fingerprint"]["torch_version"] = "2.11.0+cu130"
    manifest_path(copy).write_text(json.dumps(manifest))
    variant = NS(precision="fp32", torch_compile="eager", torch_device="cpu", cuda_graphs=False)
    spec = NS(model=NS(inputs=SPECS, pad_values={}, source=NS(trusted=False)), benchmark=NS(intra_op_num_threads=0))
    with pytest.raises(VariantUnusable, match=r"torch_version: '2.11.0\+cu130' != "):
        torch_runner(spec, variant, copy, {"details": {"source_sha256": "a" * 64}}, None)
