"""`tailguard register` / `tailguard.register_model`: a user's model file -> a registry version that resolve reads.

Real parts: a SQLite MLflow store in tmp_path, ONNX / torch.export / state-dict files of a small digits-shaped MLP
(64 -> 16 -> 10) whose class lives in a module written into tmp_path (never the cwd), the resolve step's
`resolve_reference` / `load_torch_reference`, ONNX Runtime, and (slow) a whole `tailguard run` from another cwd.
No mocks.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from tailguard.cli import app
from tailguard.core.contract import FORMAT_TAG, SHA256_TAG
from tailguard.core.errors import InputError, UntrustedModelError
from tailguard.core.reference import load_torch_reference, resolve_reference
from tailguard.core.spec import parse_spec
from tailguard.core.torch_load import MODEL_PATH_ENV, add_model_path, import_module_class

runner = CliRunner()
N_IN, HIDDEN, N_OUT = 64, 16, 10
MODULE_SOURCE = textwrap.dedent('''
    import torch


    class DigitsMLP(torch.nn.Module):
        """x: (batch, 64) float32 -> logits: (batch, n_classes) float32."""

        def __init__(self, hidden: int = 32, n_classes: int = 10) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(64, hidden)
            self.fc2 = torch.nn.Linear(hidden, n_classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.relu(self.fc1(x)))
''')
X = torch.linspace(-1.0, 1.0, 4 * N_IN).reshape(4, N_IN)  # (batch=4, features=64) float32


def write_module(folder: Path) -> str:
    """Write a uniquely named module defining DigitsMLP into `folder`; returns its 'module:Class' path."""
    name = f"user_digits_{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(MODULE_SOURCE)
    return f"{name}:DigitsMLP"


def build_model() -> torch.nn.Module:
    """The seeded module, from the module's source run in a private namespace: the module file itself is not
    imported (nor put on sys.path) until `tailguard register` looks for it."""
    namespace: dict = {}
    exec(compile(MODULE_SOURCE, "<user module>", "exec"), namespace)
    torch.manual_seed(0)
    return namespace["DigitsMLP"](hidden=HIDDEN).eval()


def make_spec(name: str, **source):
    return parse_spec({
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "register-test"},
        "model": {"registered_name": name, "task": "classification",
                  "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", N_IN]}],
                  "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", N_OUT]}], "source": source},
        "data": {"calibration": {"uri": "unused.parquet"}, "validation": {"uri": "unused.parquet"}},
        "variants": [{"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"}],
        "gates": [{"metric": "top1_agreement", "min": 0.9}],
    })


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One SQLite store and $TAILGUARD_HOME for the module (creating a store costs seconds); tests use their own
    registered model names."""
    root = tmp_path_factory.mktemp("store")
    return {"uri": f"sqlite:///{root / 'mlflow.db'}", "home": root / "home", "db": root / "mlflow.db"}


@pytest.fixture
def env(tmp_path, monkeypatch, store):
    """The module's store; the cwd is an empty folder; the user's module in tmp_path/models; sys.path restored."""
    monkeypatch.setenv("TAILGUARD_HOME", str(store["home"]))
    monkeypatch.delenv(MODEL_PATH_ENV, raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))  # add_model_path appends to it
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    models = tmp_path / "models"
    class_path = write_module(models)
    return {"root": tmp_path, "uri": store["uri"], "db": store["db"], "models": models,
            "class_path": class_path, "model": build_model()}


def register(env, *args) -> object:
    return runner.invoke(app, ["register", *map(str, args), "--tracking-uri", env["uri"]])


def resolve(env, name: str, out: str = "resolved", **source):
    return resolve_reference(make_spec(name, **source), tracking_uri=env["uri"], out_dir=env["root"] / out)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------------------------- formats
def test_register_prints_version_and_models_uri_when_onnx_file(env):
    onnx_file = env["root"] / "digits.onnx"
    torch.onnx.export(env["model"], (X,), str(onnx_file), input_names=["x"], output_names=["logits"],
                      dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}}, dynamo=False)

    first = register(env, "digits", onnx_file, "--tag", "team=vision", "--tag", "note=a=b")
    second = register(env, "digits", onnx_file)

    assert first.exit_code == 0, first.output
    assert "registered digits version 1 (onnx" in first.output and "models:/digits/1" in first.output
    assert second.exit_code == 0 and "version 2" in second.output
    resolved = resolve(env, "digits")
    assert resolved.format == "onnx" and resolved.version == "2" and resolved.onnx_path
    import mlflow
    import onnxruntime as ort

    mv = mlflow.MlflowClient(env["uri"]).get_model_version("digits", "1")
    assert mv.tags["team"] == "vision" and mv.tags["note"] == "a=b" and mv.tags[FORMAT_TAG] == "onnx"
    logits = ort.InferenceSession(resolved.onnx_path).run(None, {"x": X.numpy()})[0]
    np.testing.assert_allclose(logits, env["model"](X).detach().numpy(), atol=1e-5)


def test_register_loads_state_dict_into_class_from_model_path_when_module_is_not_in_cwd(env):
    weights = env["root"] / "digits.pt"
    torch.save(env["model"].state_dict(), weights)
    kwargs = json.dumps({"hidden": HIDDEN})

    r = register(env, "digits-sd", weights, "--class-path", env["class_path"], "--init-kwargs", kwargs,
                 "--model-path", env["models"])

    assert r.exit_code == 0, r.output
    assert "(state_dict" in r.output and str(env["models"]) in r.output  # where the run must find the class
    resolved = resolve(env, "digits-sd", class_path=env["class_path"])  # a run imports only a class the spec names
    assert resolved.format == "state_dict" and resolved.class_path == env["class_path"]
    assert resolved.init_kwargs == {"hidden": HIDDEN}
    module = load_torch_reference(resolved, make_spec("digits-sd", class_path=env["class_path"]).model)
    torch.testing.assert_close(module(X), env["model"](X))


def test_register_stores_the_pt2_file_unchanged_when_torch_export(env):
    pt2 = env["root"] / "digits.pt2"
    torch.export.save(torch.export.export(env["model"], (X,)), str(pt2))

    r = register(env, "digits-ep", pt2, "--description", "exported")

    assert r.exit_code == 0, r.output
    resolved = resolve(env, "digits-ep")
    assert resolved.format == "torch_export" and resolved.sha256 == sha256(pt2)
    torch.testing.assert_close(load_torch_reference(resolved, make_spec("digits-ep").model)(X), env["model"](X))


def test_register_model_is_exported_and_returns_the_version_when_called_from_python(env):
    import tailguard

    weights = env["root"] / "digits.safetensors"
    from safetensors.torch import save_file

    save_file(env["model"].state_dict(), str(weights))
    reg = tailguard.register_model("digits-api", weights, class_path=env["class_path"],
                                   init_kwargs={"hidden": HIDDEN}, tracking_uri=env["uri"],
                                   model_path=[env["models"]], tags={"source": "api"})

    assert (reg.version, reg.format, reg.model_uri) == ("1", "state_dict", "models:/digits-api/1")
    assert len(reg.sha256) == 64 and reg.tracking_uri == env["uri"]
    assert callable(tailguard.register_reference)


# ------------------------------------------------------------------------- plain MLflow registrations
def test_resolve_reads_a_plain_mlflow_onnx_log_when_registered_without_tailguard_tags(env):
    import mlflow
    import onnx

    from tailguard.core.tracking import configure

    onnx_file = env["root"] / "plain.onnx"
    torch.onnx.export(env["model"], (X,), str(onnx_file), input_names=["x"], output_names=["logits"],
                      dynamic_axes={"x": {0: "batch"}}, dynamo=False)
    configure(env["uri"], "plain")
    with mlflow.start_run():
        # mlflow's default save_as_external_data=True: weights in a separate file beside model.onnx
        info = mlflow.onnx.log_model(onnx.load(str(onnx_file)), name="model", pip_requirements=["onnx"])
    mv = mlflow.register_model(info.model_uri, "plain-onnx")
    assert SHA256_TAG not in (mv.tags or {})

    resolved = resolve(env, "plain-onnx")

    import onnxruntime as ort

    assert resolved.format == "onnx" and resolved.model_file == "model.onnx"
    logits = ort.InferenceSession(resolved.onnx_path).run(None, {"x": X.numpy()})[0]
    np.testing.assert_allclose(logits, env["model"](X).detach().numpy(), atol=1e-5)


def test_resolve_reads_a_plain_mlflow_pytorch_pt2_log_when_registered_without_tailguard_tags(env):
    import mlflow

    from tailguard.core.tracking import configure

    configure(env["uri"], "plain")
    with mlflow.start_run():
        info = mlflow.pytorch.log_model(env["model"], name="model", input_example=X.numpy(),
                                        serialization_format="pt2", pip_requirements=["torch"])
    mlflow.register_model(info.model_uri, "plain-pt2")

    resolved = resolve(env, "plain-pt2")

    assert resolved.format == "torch_export" and resolved.model_file == "data/model.pt2"
    torch.testing.assert_close(load_torch_reference(resolved, make_spec("plain-pt2").model)(X), env["model"](X))


def test_resolve_refuses_a_plain_mlflow_pytorch_pickle_log_naming_trusted_when_not_trusted(env):
    import mlflow

    from tailguard.core.tracking import configure

    configure(env["uri"], "plain")
    with mlflow.start_run():
        info = mlflow.pytorch.log_model(env["model"], name="model", serialization_format="pickle",
                                        pip_requirements=["torch"])
    mlflow.register_model(info.model_uri, "plain-pickle")

    with pytest.raises(UntrustedModelError) as exc:
        resolve(env, "plain-pickle")
    assert "model.source.trusted" in exc.value.message and "tailguard register" in exc.value.hint


# ---------------------------------------------------------------------------------------- bad input
def _bad_cases(env) -> dict[str, tuple[list, str]]:
    """case -> (CLI arguments after NAME, text the error must contain)."""
    root, cp = env["root"], env["class_path"]
    torch.save(env["model"].state_dict(), root / "w.pt")
    torch.save(torch.nn.Sequential(torch.nn.Linear(2, 2)), root / "whole.pt")  # a pickled module, not a state dict
    (root / "junk.onnx").write_text("not a model")
    (root / "notes.txt").write_text("hello")
    broken = f"broken_{uuid.uuid4().hex[:8]}"
    (env["models"] / f"{broken}.py").write_text("import torch\nclass Net(torch.nn.Module)\n")  # SyntaxError
    mp = ["--model-path", env["models"]]
    return {  # first: the module is not imported yet (later cases import it through --model-path)
        "class only in another folder": ([root / "w.pt", "--class-path", cp], "--class-path: cannot import module"),
        "missing file": ([root / "none.onnx"], "PATH: model file not found"),
        "unknown format": ([root / "w.pt", "--format", "tflite"], "--format: unknown format 'tflite'"),
        "suffix not known": ([root / "notes.txt"], "--format: cannot tell the format"),
        "class not importable": ([root / "w.pt", "--class-path", "no_such_module_x:Net"],
                                 "--class-path: cannot import module 'no_such_module_x'"),
        "no such class": ([root / "w.pt", "--class-path", cp.replace("DigitsMLP", "DigitMLP"), *mp],
                          "--class-path: module"),
        "no class path": ([root / "w.pt"], "--class-path: w.pt is a state dict"),
        "class path for onnx": ([root / "junk.onnx", "--class-path", cp], "--class-path: a class path"),
        "bad json": ([root / "w.pt", "--class-path", cp, *mp, "--init-kwargs", "{hidden: 16}"],
                     "--init-kwargs: not valid JSON"),
        "json not an object": ([root / "w.pt", "--class-path", cp, *mp, "--init-kwargs", "[16]"],
                               "--init-kwargs: must be a JSON object"),
        "module fails on import": ([root / "w.pt", "--class-path", f"{broken}:Net", *mp],
                                   f"--class-path: importing module '{broken}'"),
        "kwargs rejected": ([root / "w.pt", "--class-path", cp, *mp, "--init-kwargs", '{"width": 16}'],
                            "--init-kwargs: "),
        "weights do not fit": ([root / "w.pt", "--class-path", cp, *mp, "--init-kwargs", '{"hidden": 8}'],
                               "--class-path: the state dict w.pt does not fit"),
        "pickled module": ([root / "whole.pt", "--class-path", cp, *mp], "PATH: "),
        "corrupt onnx": ([root / "junk.onnx"], "PATH: "),
        "tag without =": ([root / "w.pt", "--class-path", cp, *mp, "--tag", "team"], "--tag: 'team' is not KEY=VALUE"),
        "reserved tag": ([root / "w.pt", "--class-path", cp, *mp, "--tag", "tailguard.sha256=0"], "--tag: "),
        "model path missing": ([root / "w.pt", "--class-path", cp, "--model-path", root / "nowhere"],
                               "--model-path: not a folder"),
    }


def test_register_exits_2_naming_the_field_and_writes_nothing_when_input_is_bad(env):
    import mlflow

    failures = []
    for case, (args, expected) in _bad_cases(env).items():
        r = register(env, "bad-model", *args)
        if r.exit_code != 2 or expected not in r.output or "Traceback" in r.output:
            failures.append(f"{case}: exit {r.exit_code}, output {r.output!r}")
    assert not failures, "\n".join(failures)
    client = mlflow.MlflowClient(env["uri"], registry_uri=env["uri"]) if env["db"].exists() else None
    assert client is None or not client.search_registered_models(filter_string="name = 'bad-model'")


# ------------------------------------------------------------------------------------------ model path
def test_import_module_class_finds_the_module_through_the_env_path_when_not_on_sys_path(env, monkeypatch):
    folder = env["root"] / "elsewhere"
    class_path = write_module(folder)
    with pytest.raises(InputError) as exc:
        import_module_class(class_path)
    assert "model.source.class_path" in exc.value.message and "--model-path" in exc.value.hint

    monkeypatch.setenv(MODEL_PATH_ENV, os.pathsep.join([str(env["root"] / "missing"), str(folder)]))
    assert import_module_class(class_path).__name__ == "DigitsMLP"


def test_add_model_path_appends_after_installed_packages_when_folder_given(env):
    site = next(i for i, p in enumerate(sys.path) if p.endswith("site-packages"))
    folders = add_model_path([env["models"]])
    assert folders[0] == env["models"].resolve()
    assert sys.path.index(str(env["models"].resolve())) > site


# ------------------------------------------------------------------------------------- end to end (slow)
def make_rows(n: int, seed: int):
    import pandas as pd

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, N_IN)).astype(np.float32)
    return pd.DataFrame({"x": list(x), "group": ["a" if i % 2 else "b" for i in range(n)]})


@pytest.mark.integration
@pytest.mark.slow
def test_run_imports_the_class_from_the_specs_folder_when_started_from_another_cwd(tmp_path):
    """register from one folder (--model-path), run from another: the class resolves from the spec's folder."""
    project, cwd = tmp_path / "project", tmp_path / "cwd"
    cwd.mkdir()
    class_path = write_module(project)
    environ = {**os.environ, "TAILGUARD_HOME": str(tmp_path / "home"), "PYTHONPATH": ""}
    for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", MODEL_PATH_ENV):
        environ.pop(k, None)
    model = subprocess.run(  # train-and-save as the user's script would, in its own process
        [sys.executable, "-c", f"import torch, {class_path.split(':')[0]} as m; torch.manual_seed(0); "
                               f"torch.save(m.DigitsMLP(hidden={HIDDEN}).state_dict(), 'digits.pt')"],
        cwd=project, env=environ, capture_output=True, text=True)
    assert model.returncode == 0, model.stderr
    make_rows(96, 0).to_parquet(project / "validation.parquet")
    make_rows(32, 1).to_parquet(project / "calibration.parquet")
    spec = project / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "digits-cwd"},
        "model": {"registered_name": "digits-user", "task": "classification",
                  "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", N_IN]}],
                  "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", N_OUT]}],
                  "source": {"class_path": class_path}},
        "data": {"calibration": {"uri": "calibration.parquet", "max_samples": 32},
                 "validation": {"uri": "validation.parquet", "batch_size": 32}},
        "slices": [{"name": "group", "column": "group"}],
        "variants": [{"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"}],
        "gates": [{"metric": "top1_agreement", "min": 0.9}],
        "benchmark": {"batch_sizes": [1], "warmup": 1, "iterations": 5, "max_seconds": 1},
        "promotion": {"alias": "production"},
    }, sort_keys=False))

    def tailguard(*args):
        return subprocess.run([sys.executable, "-m", "tailguard.cli", *map(str, args)], cwd=cwd, env=environ,
                              capture_output=True, text=True, timeout=600)

    reg = tailguard("register", "digits-user", project / "digits.pt", "--class-path", class_path,
                    "--init-kwargs", json.dumps({"hidden": HIDDEN}), "--model-path", project)
    assert reg.returncode == 0, reg.stdout + reg.stderr
    assert "models:/digits-user/1" in reg.stdout

    run = tailguard("run", spec)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "promoted" in run.stdout
    assert not list(cwd.iterdir())  # nothing left in the current directory


def test_run_exits_2_naming_model_path_when_the_folder_is_missing_or_the_runner_is_kfp(tmp_path):
    from tests.core.test_spec import TINY

    missing = runner.invoke(app, ["run", str(TINY), "--model-path", str(tmp_path / "nowhere")])
    kfp = runner.invoke(app, ["run", str(TINY), "--runner", "kfp", "--host", "http://127.0.0.1:9",
                              "--model-path", str(tmp_path)])

    assert missing.exit_code == 2 and "--model-path: not a folder" in missing.output
    assert kfp.exit_code == 2 and "--model-path: applies to local runs only" in kfp.output
