""".pt2 files are code unless proven otherwise (tailguard.core.pt2_archive; issue 36 item 1).

Each plant is a real torch.export.save archive of a small module with one entry rewritten by hand the way torch
writes it (torch/export/pt2_archive/_package.py): a weight or constant whose payload config says `use_pickle`
(torch writes that for a tensor subclass), an opaque constant, a legacy pickled weights file, pickled sample inputs,
a symbolic size expression (sympy.sympify evaluates it) or guard code (exec'd by `.module()`). Each payload writes a
marker file when torch runs it, and the pickled ones return a real parameter, so a load that runs them does not even
fail. The first test proves each plant runs under plain torch.export.load; the others go through tailguard's load
paths (monitor candidate, registry reference, `tailguard register`, `monitor serve`) and must refuse with exit 2
naming the file and `trusted`, the marker never written.
"""

from __future__ import annotations

import io
import json
import pickle
import zipfile
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
from typer.testing import CliRunner

from tailguard.core.errors import UntrustedModelError
from tailguard.core.pt2_archive import check_pt2_archive

SPECS = [NS(name="x", dtype="float32", shape=["batch", 4])]
X = torch.ones(2, 4)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.register_buffer("shift", torch.ones(3))
        self.scale = torch.tensor([1.0, 2.0, 3.0])  # a tensor constant (data/constants/tensor_0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) + self.shift * self.scale


def _save_program(path: Path, *, dynamic: bool = False) -> Path:
    torch.manual_seed(0)
    shapes = ({0: torch.export.Dim.AUTO},) if dynamic else None
    ep = torch.export.export(_Net().eval(), (torch.randn(2, 4),), dynamic_shapes=shapes)
    torch.export.save(ep, str(path))
    return path


_T = "__import__('torch')"


class _Payload:
    """Unpickles as eval(code): touches the marker, then returns `value` (default: a real (3, 4) parameter)."""

    def __init__(self, marker: Path, value: str = f"{_T}.nn.Parameter({_T}.zeros(3, 4))") -> None:
        self.code = f"(__import__('pathlib').Path({str(marker)!r}).touch(), {value})[1]"

    def __reduce__(self):
        return (eval, (self.code,))


def _torch_saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _rewrite(src: Path, dst: Path, edit, add: dict[str, bytes] | None = None) -> Path:
    """Copy the archive entry by entry (stored, as torch writes it), `edit(name, bytes)` -> bytes; add entries."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        root = zin.namelist()[0].split("/", 1)[0]
        for info in zin.infolist():
            zout.writestr(info.filename, edit(info.filename[len(root) + 1:], zin.read(info.filename)))
        for rel, data in (add or {}).items():
            zout.writestr(f"{root}/{rel}", data)
    return dst


def _json_edit(target: str, change):
    def edit(rel: str, data: bytes) -> bytes:
        if rel != target:
            return data
        doc = json.loads(data)
        change(doc)
        return json.dumps(doc).encode()
    return edit


def plant(kind: str, folder: Path, marker: Path) -> Path:
    """A real program.pt2 whose loading runs a payload that touches `marker` (module docstring)."""
    folder.mkdir(parents=True, exist_ok=True)
    src = _save_program(folder / "clean.pt2", dynamic=kind == "sympy_expression")
    dst = folder / "program.pt2"
    if kind == "pickled_weight":  # a tensor-subclass weight: use_pickle, torch.load(weights_only=False)
        def change(doc):
            doc["config"]["lin.weight"].update(path_name="weight_9", use_pickle=True)
        return _rewrite(src, dst, _json_edit("data/weights/model_weights_config.json", change),
                        {"data/weights/weight_9": _torch_saved(_Payload(marker))})
    if kind == "pickled_constant":
        def change(doc):
            doc["config"]["scale"].update(path_name="tensor_9", use_pickle=True)
        return _rewrite(src, dst, _json_edit("data/constants/model_constants_config.json", change),
                        {"data/constants/tensor_9": _torch_saved(_Payload(marker, f"{_T}.ones(3)"))})
    if kind == "opaque_constant":  # an opaque Python value: pickle.loads
        def change(doc):
            doc["config"]["scale"].update(path_name="opaque_obj_0", use_pickle=True, tensor_meta=None)
        return _rewrite(src, dst, _json_edit("data/constants/model_constants_config.json", change),
                        {"data/constants/opaque_obj_0": pickle.dumps(_Payload(marker, f"{_T}.ones(3)"))})
    if kind == "legacy_weights":  # data/weights/model.pt wins over the config; weights_only=False fallback
        weights = {"lin.weight": _Payload(marker), "lin.bias": torch.zeros(3), "shift": torch.ones(3)}
        return _rewrite(src, dst, lambda rel, data: data, {"data/weights/model.pt": _torch_saved(weights)})
    if kind == "sample_inputs":  # torch.load(weights_only=True) fails, then weights_only=False runs it
        def edit(rel, data):
            return _torch_saved(((_Payload(marker, f"{_T}.ones(3, 4)"),), {})) if rel.startswith(
                "data/sample_inputs/") else data
        return _rewrite(src, dst, edit)
    if kind == "guard_code":  # exec'd by .module(), runs on every call
        def change(doc):
            doc["guards_code"] = [f"__import__('pathlib').Path({str(marker)!r}).touch() is None"]
        return _rewrite(src, dst, _json_edit("models/model.json", change))
    if kind == "sympy_expression":  # sympy.sympify evals every expr_str at load
        payload = f"__import__('pathlib').Path({str(marker)!r}).touch() or 1"

        def edit(rel, data):
            if rel != "models/model.json":
                return data
            text = data.decode()
            first = text.index('"expr_str": "') + len('"expr_str": "')
            end = text.index('"', first)
            return (text[:first] + f"Mul({text[first:end]}, {payload})" + text[end:]).encode()
        return _rewrite(src, dst, edit)
    raise AssertionError(kind)


KINDS = ["pickled_weight", "pickled_constant", "opaque_constant", "legacy_weights", "sample_inputs", "guard_code",
         "sympy_expression"]


def _with_manifest(path: Path) -> Path:
    """The `<file>.json` manifest `tailguard fetch` writes beside a torch variant (matching this node)."""
    from tailguard.core.artifacts import write_manifest
    from tailguard.core.torch_backend import TorchBuildConfig, fingerprint, signature

    cfg = TorchBuildConfig()
    write_manifest(path, fingerprint(cfg, "f" * 64, signature(SPECS)), kind=cfg.artifact_kind,
                   extra={"config": asdict(cfg)})
    return path


def _assert_refused(err: BaseException, path: Path, fix: str = "trusted") -> None:
    assert isinstance(err, UntrustedModelError) and err.exit_code == 2
    assert str(path) in err.message and fix in err.hint


# ------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("kind", KINDS)
def test_pt2_plant_runs_its_payload_when_torch_export_loads_it_directly(kind, tmp_path):
    marker = tmp_path / "ran"
    program = plant(kind, tmp_path / "m", marker)
    try:
        torch.export.load(str(program)).module()(X)
    except Exception:  # noqa: BLE001 - a payload may break the load after it ran; what matters is that it ran
        pass
    assert marker.exists(), f"the {kind} plant did not run under torch.export.load: the test proves nothing"


@pytest.mark.parametrize("kind", KINDS)
def test_runner_for_file_refuses_exit_2_and_never_runs_the_payload_when_the_pt2_holds_code(kind, tmp_path):
    from tailguard.core.runtime import runner_for_file

    marker = tmp_path / "ran"
    program = _with_manifest(plant(kind, tmp_path / "m", marker))
    with pytest.raises(UntrustedModelError) as info:
        runner_for_file(program, SPECS).run({"x": X.numpy()})  # the monitor's / replay's candidate load
    _assert_refused(info.value, program)
    assert not marker.exists()


def test_runner_for_file_loads_a_clean_program_and_a_trusted_plant_when_told_so(tmp_path):
    from tailguard.core.runtime import runner_for_file

    (tmp_path / "c").mkdir()
    clean = _with_manifest(_save_program(tmp_path / "c" / "program.pt2"))
    assert runner_for_file(clean, SPECS).run({"x": X.numpy()})[0].shape == (2, 3)
    marker = tmp_path / "ran"
    program = _with_manifest(plant("pickled_weight", tmp_path / "m", marker))
    runner_for_file(program, SPECS, trusted=True).run({"x": X.numpy()})  # trusted: the user's call
    assert marker.exists()


def test_check_pt2_archive_refuses_an_aot_inductor_package_unless_trusted(tmp_path):
    src = _save_program(tmp_path / "clean.pt2")
    package = _rewrite(src, tmp_path / "package.pt2", lambda rel, data: data,
                       {"data/aotinductor/model/model.so": b"\x7fELF native code"})
    with pytest.raises(UntrustedModelError) as info:
        check_pt2_archive(package)
    _assert_refused(info.value, package)
    assert "AOTInductor package" in info.value.message and "data/aotinductor/model/model.so" in info.value.message
    assert check_pt2_archive(package, trusted=True).checked is False


def test_check_pt2_archive_refuses_names_torchs_reader_would_read_differently(tmp_path):
    src = _save_program(tmp_path / "clean.pt2")
    with zipfile.ZipFile(src) as z:
        root = z.namelist()[0].split("/", 1)[0]
        config = z.read(f"{root}/data/weights/model_weights_config.json")
    dup = _rewrite(src, tmp_path / "dup.pt2", lambda rel, data: data,  # miniz looks names up case-insensitively
                   {"DATA/weights/model_weights_config.json": config})
    outside = _rewrite(src, tmp_path / "outside.pt2", lambda rel, data: data, {"../evil": b"x"})
    for bad, why in ((dup, "appears twice"), (outside, "'..'")):
        with pytest.raises(UntrustedModelError, match=why):
            check_pt2_archive(bad)


def test_load_torch_reference_refuses_a_registry_pt2_that_holds_code_unless_the_spec_trusts_it(tmp_path):
    from tailguard.core.reference import ResolvedModel, load_torch_reference
    from tailguard.core.spec import parse_spec
    from tailguard.monitoring import testing as T

    marker = tmp_path / "ran"
    folder = tmp_path / "download"
    program = plant("pickled_weight", folder, marker)
    resolved = ResolvedModel(registered_name="tiny-clf", version="1", run_id=None, format="torch_export",
                             local_dir=str(folder), source_uri="models:/tiny-clf/1", model_file=program.name)

    def model_spec(**source):
        d = T.spec_dict()
        d["model"]["source"] = {"format": "torch_export", **source}
        return parse_spec(d).model

    with pytest.raises(UntrustedModelError) as info:  # the fetch-reference / export / build tasks' load
        load_torch_reference(resolved, model_spec())
    _assert_refused(info.value, program, "model.source.trusted: true")
    assert not marker.exists()
    load_torch_reference(resolved, model_spec(trusted=True))
    assert marker.exists()


def test_register_exits_2_naming_the_file_and_never_runs_the_payload_when_the_pt2_holds_code(tmp_path, monkeypatch):
    from tailguard.cli import app

    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))
    marker = tmp_path / "ran"
    program = plant("pickled_constant", tmp_path / "m", marker)
    r = CliRunner().invoke(app, ["register", "tiny", str(program), "--tracking-uri",
                                 f"sqlite:///{tmp_path / 'mlflow.db'}"])
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert "program.pt2" in text and "--trusted" in text and "Traceback" not in text
    assert not marker.exists() and not (tmp_path / "mlflow.db").exists()  # nothing written


def test_monitor_refuses_a_pt2_candidate_that_holds_code_and_never_runs_it_unless_trusted(tmp_path, monkeypatch):
    import uvicorn

    from tailguard.core.spec import parse_spec
    from tailguard.monitoring import testing as T
    from tailguard.monitoring.config import resolve_config
    from tailguard.monitoring.serve import serve
    from tailguard.monitoring.service import MonitorService

    marker = tmp_path / "ran"
    program = _with_manifest(plant("pickled_weight", tmp_path / "m", marker))
    ref = T.linear_classifier(tmp_path / "ref.onnx")
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(json.dumps(T.spec_dict({"sample_rate": 1.0})))
    # `monitor serve` refuses before serving (exit 2); uvicorn.run is the one seam replaced, so that a serve that
    # does not refuse (the old code) returns instead of serving forever
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    with pytest.raises(UntrustedModelError) as info:
        serve(spec_file, ref, program, port=0)
    _assert_refused(info.value, program, "--trusted")
    # the service itself (what a library caller builds) leaves the candidate unloaded, naming why
    svc = MonitorService(resolve_config(parse_spec(T.spec_dict({"sample_rate": 1.0}))), ref, program, start=False)
    svc._load_models()
    assert "trusted" in svc.load_errors.get("candidate", "") and svc.runners["candidate"] is None
    assert not marker.exists()
    svc.stop()


def test_validate_torch_runner_fails_the_variant_naming_trusted_when_its_program_holds_code(tmp_path):
    from tailguard.components.validate.runners import VariantUnusable, torch_runner

    marker = tmp_path / "ran"
    program = _with_manifest(plant("pickled_weight", tmp_path / "m", marker))
    variant = NS(precision="fp32", torch_compile="eager", torch_device="cpu", cuda_graphs=False)
    spec = NS(model=NS(inputs=SPECS, pad_values={}, source=NS(trusted=False)), benchmark=NS(intra_op_num_threads=0))
    with pytest.raises(VariantUnusable, match="trusted"):  # the variant fails with the reason, the run goes on
        torch_runner(spec, variant, program, {"details": {"source_sha256": "f" * 64}}, None)
    assert not marker.exists()
