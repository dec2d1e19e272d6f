"""Register a user's FP32 reference model from a file: the `tailguard register` command and `tailguard.register_model`.

A file goes into the MLflow registry the way the resolve step reads it back (components/resolve/README.md):

| file                      | format (`--format`) | stored as |
| ------------------------- | ------------------- | --------- |
| `*.onnx`                  | `onnx`              | an MLflow `onnx` flavor model |
| `*.pt2` (torch.export.save) | `torch-export`    | `model.pt2` + `tailguard-model.json` |
| `*.pt` / `*.pth` / `*.safetensors` / `*.bin` (a state dict) | `state-dict` | `model.safetensors` + `tailguard-model.json` (class_path, init_kwargs) |

Everything is checked before anything is written: the file is read, a state dict is loaded into its class
(`class_path` built with `init_kwargs`, strictly), tags and kwargs are validated. A pickled whole module
(`torch.save(model)`) is refused: save `model.state_dict()` or a torch.export program instead.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from tailguard.core.contract import FILES_SHA256_TAG, FORMAT_TAG, OUTPUTS_TAG, ROLE_TAG, SHA256_TAG
from tailguard.core.contract import ONNX_INLINE_LIMIT_BYTES as _ONNX_INLINE_LIMIT_BYTES
from tailguard.core.digests import artifact_files_sha256
from tailguard.core.errors import InputError
from tailguard.core.home import quiet_environment
from tailguard.core.pt2_archive import REGISTER_FIX
from tailguard.core.reference import (
    DESCRIPTOR_FILE,
    DESCRIPTOR_SCHEMA,
    EXPORTED_PROGRAM_FILE,
    REFERENCE_ARTIFACT,
    STATE_DICT_FILE,
    sha256_file,
)
from tailguard.core.torch_load import (
    build_state_dict_module,
    import_module_class,
    load_exported_program,
    read_state_dict,
)

if TYPE_CHECKING:  # heavy imports stay inside the functions
    import onnx
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

# User-facing format names (the CLI's), and the resolve step's names for them.
FORMAT_NAMES = {"onnx": "onnx", "torch-export": "torch_export", "state-dict": "state_dict"}
# File suffix -> format when `format` is not given.
SUFFIX_FORMATS = {".onnx": "onnx", ".pt2": "torch-export", ".pt": "state-dict", ".pth": "state-dict",
                  ".safetensors": "state-dict", ".bin": "state-dict"}
DEFAULT_EXPERIMENT = "tailguard/model-registration"  # the experiment `tailguard demo` registers its model in
RESERVED_TAG_PREFIX = "tailguard."  # format / digest tags written by tailguard; a user tag must not overwrite them
# The model's output signature, recorded at registration where the format has one (ONNX graph outputs, a
# torch.export program's outputs): JSON {"positional": bool, "outputs": [{name, dtype, shape}]}; `tailguard spec
# check` compares a spec's model.outputs with it (pipelines/preflight.py).
_TAG_VALUE_LIMIT = 5000  # MLflow's longest model version tag value: a longer signature is not recorded
_TAG_KEY = re.compile(r"^[\w.\-/ ]{1,250}$")


@dataclass(frozen=True)
class RegisteredModel:
    """A version registered by `register_model`.

    Attributes:
        name: registered model name.
        version: the new version number, as a string ("3").
        format: the resolve step's format name: "onnx", "torch_export" or "state_dict".
        model_uri: "models:/<name>/<version>".
        sha256: hex SHA-256 of the model file as stored (the `tailguard.sha256` version tag).
        tracking_uri: the MLflow tracking (and registry) URI it was registered in.
        run_id: the MLflow run that logged the files.
        class_path: "module:Class" (state_dict), else None.
        class_file: the file that defines the class (state_dict), else None: a run must import it from there
            (the spec's folder, `tailguard run --model-path`, or an installed package).
    """

    name: str
    version: str
    format: str
    model_uri: str
    sha256: str
    tracking_uri: str
    run_id: str | None
    class_path: str | None = None
    class_file: str | None = None


def infer_format(path: Path) -> str:
    """The format name ("onnx", "torch-export", "state-dict") of a model file from its suffix.

    Raises:
        InputError: an unknown suffix (names `format`).
    """
    fmt = SUFFIX_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise InputError(f"format: cannot tell the format of {path.name} from its suffix {path.suffix or '(none)'!r}",
                         hint="give the format: onnx, torch-export or state-dict (suffixes: "
                              + ", ".join(f"{s} -> {f}" for s, f in SUFFIX_FORMATS.items()) + ")")
    return fmt


def parse_tags(pairs: Iterable[str]) -> dict[str, str]:
    """`KEY=VALUE` strings (the CLI's `--tag`) -> {key: value}.

    Raises:
        InputError: a pair without "=" or with an empty or malformed key (names `tags`).
    """
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = str(pair).partition("=")
        if not sep or not key.strip():
            raise InputError(f"tags: {pair!r} is not KEY=VALUE", hint="e.g. --tag team=vision --tag dataset=digits")
        out[key.strip()] = value
    return out


def parse_init_kwargs(text: str) -> dict[str, Any]:
    """The CLI's `--init-kwargs` JSON text -> a dict.

    Raises:
        InputError: not JSON, or JSON that is not an object (names `init_kwargs`).
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"init_kwargs: not valid JSON ({exc.msg} at character {exc.pos}): {text!r}",
                         hint="a JSON object, e.g. '{\"hidden\": 64, \"n_classes\": 10}' (quote it for the shell)"
                         ) from None
    if not isinstance(value, dict):
        raise InputError(f"init_kwargs: must be a JSON object of keyword arguments, got {type(value).__name__}",
                         hint="e.g. '{\"hidden\": 64}'")
    return value


def register_model(name: str, path: str | Path, *, format: str | None = None, class_path: str | None = None,
                   init_kwargs: Mapping[str, Any] | None = None, tags: Mapping[str, str] | None = None,
                   description: str | None = None, tracking_uri: str | None = None,
                   experiment: str = DEFAULT_EXPERIMENT, model_path: Iterable[str | Path] = (),
                   spec: str | Path | None = None, trusted: bool = False) -> RegisteredModel:
    """Register an FP32 reference model file as a new version of `name`, the way `tailguard run` resolves it.

    Everything is checked before anything is written to the store. The model is then logged in a new MLflow run of
    `experiment` and registered (pipelines/core/reference.py `register_reference`); the version carries the tags
    `tailguard.format` and `tailguard.sha256` (SHA-256 of the stored model file) plus `tags`.

    MLflow is pointed at `tracking_uri` (tracking and registry, `tailguard.core.tracking.configure`) and stays pointed
    there after the call, as `tailguard run` does.

    Args:
        name: registered model name (the spec's `model.registered_name`); created if needed.
        path: the model file: `.onnx`; `.pt2` (torch.export.save); or a state dict `.pt` / `.pth` (torch.save of
            {name: tensor}, read with weights_only=True) / `.safetensors` / `.bin`.
        format: "onnx", "torch-export" or "state-dict" ("torch_export" / "state_dict" are accepted too); None:
            from the file suffix (`SUFFIX_FORMATS`).
        class_path: "module:Class" of the torch.nn.Module a state dict loads into (state-dict only, required).
            Looked up in the installed packages, then in `model_path`, then $TAILGUARD_MODEL_PATH.
        init_kwargs: JSON-serializable keyword arguments of the class (state-dict only).
        tags: extra version tags (keys must not start with "tailguard.").
        description: the version's description.
        tracking_uri: MLflow tracking URI; None: $MLFLOW_TRACKING_URI, else the embedded store under
            $TAILGUARD_HOME (the same as `tailguard run` for a spec without `mlflow.tracking_uri`).
        experiment: MLflow experiment of the registering run.
        model_path: folders to import the class's module from (appended to sys.path; see
            pipelines/core/torch_load.py `add_model_path`).
        spec: a spec YAML whose `model.outputs` (dtype, rank, fixed sizes) are checked against the model before
            anything is written: the ONNX graph's outputs (by name), a torch.export program's outputs (by
            position), or a state dict's module run on a batch shaped like `model.inputs` (by position).
            Without it, ONNX and torch.export signatures are still recorded (tag `tailguard.outputs`) for
            `tailguard spec check` to compare.
        trusted: a `.pt2` from a source the caller trusts (`--trusted`): its archive is not read for code first.
            Without it, a `.pt2` whose loading would run code (a pickled weight or constant, a custom or opaque
            object, an expression or guard torch evaluates, an AOTInductor package) is refused
            (tailguard.core.pt2_archive).

    Returns:
        The RegisteredModel (version, models:/ URI, format, sha256).

    Raises:
        InputError: naming the argument: `name` empty; `path` missing or not a model of its format (a pickled
            module, a corrupt file); `format` unknown or not inferable; `class_path` missing for a state dict,
            given for another format, not importable, or not fitting the weights (keys listed); `init_kwargs` not
            a JSON-serializable dict or not accepted by the class; `tags` reserved or malformed; `model_path` not
            a folder; the module fails on a batch shaped like the spec's inputs.
        SpecError: `spec` is invalid, or its model.outputs do not fit the model (each output named, declared vs
            found, and the declaration that fits).
        UntrustedModelError: (exit 2) a `.pt2` that holds code, without `trusted`.
    """

    if not str(name or "").strip():
        raise InputError("name: the registered model name is empty", hint="e.g. digits-mlp")
    name = str(name).strip()
    path = Path(path).expanduser()
    if not path.is_file():
        raise InputError(f"path: model file not found: {path}" + (" (a folder)" if path.is_dir() else ""),
                         hint="pass an .onnx, .pt2, or state-dict (.pt / .pth / .safetensors) file")
    fmt_name = _format_name(format, path)
    fmt = FORMAT_NAMES[fmt_name]
    folders = [Path(p).expanduser() for p in model_path]
    for folder in folders:
        if not folder.is_dir():
            raise InputError(f"model_path: not a folder: {folder}",
                             hint="the folder that holds the module of --class-path")
    init_kwargs = dict(init_kwargs or {})
    if fmt != "state_dict" and (class_path or init_kwargs):
        raise InputError(f"class_path: a class path and init_kwargs go with a state dict only; {path.name} is "
                         f"{fmt_name}", hint="drop --class-path / --init-kwargs, or pass a state dict")
    try:
        json.dumps(init_kwargs)
    except (TypeError, ValueError) as exc:
        raise InputError(f"init_kwargs: must be JSON-serializable: {exc}") from None
    user_tags = {str(k): str(v) for k, v in (tags or {}).items()}
    for key in user_tags:
        if not _TAG_KEY.match(key):
            raise InputError(f"tags: {key!r} is not a valid tag key (letters, digits, _ - . / and spaces, up to "
                             "250 characters)")
        if key.startswith(RESERVED_TAG_PREFIX):
            raise InputError(f"tags: {key!r} starts with {RESERVED_TAG_PREFIX!r}, which tailguard reserves for "
                             "the tags it writes (format, SHA-256)", hint="pick another key")

    from tailguard.components.export import signature as sig

    model_spec = _spec_model(spec)
    model_arg: dict[str, Any]
    class_file = None
    found: list[Any] | None = None  # the recorded signature
    if fmt == "onnx":
        model_arg = {"onnx_path": _load_onnx(path)}
        found = sig.onnx_output_signature(model_arg["onnx_path"])
        if model_spec is not None:
            sig.check_output_signature(model_spec.outputs, found, what=f"the ONNX graph of {path.name}",
                                       source=str(spec), model_task=model_spec.task)
    elif fmt == "torch_export":
        ep = load_exported_program(path, field="path", trusted=trusted, fix=REGISTER_FIX)
        model_arg = {"exported_program": path}
        found = sig.exported_program_output_signature(ep)
        if model_spec is not None:
            sig.check_output_signature(model_spec.outputs, found, what=f"the program in {path.name}",
                                       source=str(spec), positional=True)
    else:
        if not class_path:
            raise InputError(f"class_path: {path.name} is a state dict; it needs the class it loads into",
                             hint="--class-path 'module:Class' (the module beside the spec, in --model-path, or "
                                  "installed), with --init-kwargs JSON for its __init__")
        weights = read_state_dict(path, "path")  # (weights_only / safetensors: no code runs)
        module = build_state_dict_module(class_path, init_kwargs, weights, weights_name=path.name,
                                               class_field="class_path", kwargs_field="init_kwargs",
                                               search_path=folders)
        class_file = _module_file(type(module))
        model_arg = {"state_dict": weights, "class_path": class_path, "init_kwargs": init_kwargs}
        if model_spec is not None:
            sig.check_output_signature(model_spec.outputs, _module_outputs(module, model_spec, class_path),
                                       what=f"{class_path} with these weights on a batch of 2 rows",
                                       source=str(spec), positional=True, concrete=True)
    if found is not None:
        recorded = json.dumps({"positional": fmt == "torch_export", "outputs": [o.to_dict() for o in found]},
                              separators=(",", ":"))
        if len(recorded) <= _TAG_VALUE_LIMIT:
            user_tags[OUTPUTS_TAG] = recorded

    from tailguard.core.tracking import configure, tracking_uri_for

    uri = tracking_uri or tracking_uri_for(None)
    configure(uri, experiment)
    mv = register_reference(name, **model_arg, tags=user_tags, description=description, trusted=trusted)
    return RegisteredModel(name=name, version=str(mv.version), format=fmt, model_uri=f"models:/{name}/{mv.version}",
                           sha256=(mv.tags or {}).get(SHA256_TAG, ""), tracking_uri=uri,
                           run_id=mv.run_id or None, class_path=class_path if fmt == "state_dict" else None,
                           class_file=class_file)


def _spec_model(spec: str | Path | None) -> Any:
    """The `model` section of the spec file `spec` (None without one).

    Raises:
        SpecError: the spec is invalid (every error with its field path).
        InputError: the file is missing (names `spec`).
    """
    if spec is None:
        return None
    from tailguard.core.spec import load_spec

    if not Path(spec).is_file():
        raise InputError(f"spec: spec file not found: {spec}", hint="the spec YAML whose model.outputs to check")
    return load_spec(spec).model


def _module_outputs(module: Any, model_spec: Any, class_path: str) -> list[Any]:
    """The outputs (positional OutputSigs) of a torch module run on a batch of 2 rows made from `model.inputs`
    (`components.export.logic.dummy_feeds`: every named axis 4 long, filled with value_range's lower bound or 0).

    Raises:
        InputError: the module raises on that batch (names `class_path`).
    """
    import torch

    from tailguard.components.export.logic import dummy_feeds
    from tailguard.components.export.signature import array_output_signature

    feeds = dummy_feeds(model_spec)
    try:
        with torch.inference_mode():
            out = module(*[torch.from_numpy(feeds[t.name]) for t in model_spec.inputs])
    except Exception as exc:  # a model raises anything on inputs it does not expect
        raise InputError(f"class_path: {class_path} failed on a batch shaped like model.inputs "
                         f"({', '.join(f'{k} {list(v.shape)} {v.dtype}' for k, v in feeds.items())}): "
                         f"{type(exc).__name__}: {str(exc)[:300]}",
                         hint="make model.inputs (order, dtypes, shapes) match forward()'s arguments") from None
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    return array_output_signature([f"#{i}" for i in range(len(outs))], outs)


def _format_name(format: str | None, path: Path) -> str:
    if format is None or not str(format).strip():
        return infer_format(path)
    key = str(format).strip().lower().replace("_", "-")
    if key not in FORMAT_NAMES:
        raise InputError(f"format: unknown format {format!r}; known: {list(FORMAT_NAMES)}",
                         hint="pickled whole modules are not registered: save model.state_dict() (state-dict) or "
                              "torch.export.save a program (torch-export)" if key == "pickle" else
                         "or leave it out to infer it from the file suffix")
    return key


def _load_onnx(path: Path) -> Any:
    import onnx

    try:
        return onnx.load(str(path))  # external data files beside it are read in
    except Exception as exc:  # onnx raises DecodeError / OSError / ValueError for a bad file
        raise InputError(f"path: {path} is not a loadable ONNX model: {type(exc).__name__}: {exc}",
                         hint="export it with torch.onnx.export, or give --format if the suffix misleads") from None


def _module_file(cls: type) -> str | None:
    import sys

    mod = sys.modules.get(cls.__module__)
    return getattr(mod, "__file__", None)


# ----------------------------------------------------------------- registering (moved from core/reference.py)
def register_reference(registered_name: str, *, onnx_path: "str | Path | onnx.ModelProto | None" = None,
                       state_dict: Mapping[str, Any] | str | Path | None = None, class_path: str | None = None,
                       init_kwargs: dict[str, Any] | None = None, exported_program: Any = None,
                       pickled_module: Any = None, tags: dict[str, str] | None = None,
                       description: str | None = None, trusted: bool = False) -> "ModelVersion":
    """Log an FP32 reference in the current MLflow tracking store and register it as a new version.

    The caller has pointed MLflow at the store (`mlflow.set_tracking_uri`, e.g. `tailguard.core.tracking.configure`)
    and chosen the experiment. The files are logged in a new run (nested if a run is active) and registered as a
    new version of `registered_name` (created if needed). Exactly one model argument is given:

    - `onnx_path` (an .onnx file, or an `onnx.ModelProto`): `mlflow.onnx.log_model` (flavor onnx); the weights
      stay inline up to ~1.8 GB.
    - `exported_program` (a `torch.export.ExportedProgram`, or a .pt2 file of one, copied unchanged after
      `torch.export.load` has read it): `torch.export.save` -> `model.pt2` plus the
      descriptor `tailguard-model.json`, logged as run artifacts. (`mlflow.pytorch.log_model(serialization_format=
      "pt2")` exports an nn.Module itself and cannot take an already exported program; versions it produced are
      still resolved as torch_export.)
    - `state_dict` ({parameter name: tensor}, or a .safetensors / .pt / .pth file of one) with `class_path` and
      `init_kwargs`: `model.safetensors` plus the descriptor (format, class_path, init_kwargs, file, sha256),
      registered with `client.create_model_version(source=<artifact uri>, run_id=...)`.
    - `pickled_module` (a torch.nn.Module): `mlflow.pytorch.log_model(serialization_format="pickle")`. Resolving
      it needs `model.source.trusted: true`; it exists to exercise that refusal.

    Pip requirements are pinned from the installed versions (no slow requirement inference).

    Args:
        registered_name: registered model to add a version to.
        onnx_path: an .onnx file (external data files beside it are read in), or an onnx.ModelProto.
        state_dict: tensors by parameter name, or a .safetensors / .pt / .pth file holding them.
        class_path: "module:Class" of the torch.nn.Module the state dict loads into (state_dict only).
        init_kwargs: JSON-serializable keyword arguments for `class_path` (state_dict only).
        exported_program: a torch.export.ExportedProgram, or the path of a .pt2 file saved by torch.export.save.
        pickled_module: a torch.nn.Module to pickle.
        tags: extra version tags.
        description: version description.
        trusted: an `exported_program` .pt2 file from a trusted source is not read for code first.

    Returns:
        The new ModelVersion, tagged `tailguard.format` and `tailguard.sha256` (SHA-256 of the stored model file).

    Raises:
        InputError: not exactly one model argument, a missing file, a state dict without an importable
            class_path, or init_kwargs that are not JSON-serializable.
    """
    quiet_environment()
    import mlflow

    given = {k: v for k, v in (("onnx_path", onnx_path), ("state_dict", state_dict),
                               ("exported_program", exported_program), ("pickled_module", pickled_module))
             if v is not None}
    if len(given) != 1:
        raise InputError(f"register_reference: give exactly one of onnx_path, state_dict, exported_program, "
                         f"pickled_module (got {sorted(given) or 'none'})")
    if (class_path is not None or init_kwargs) and state_dict is None:
        raise InputError("register_reference: class_path and init_kwargs go with state_dict only")
    client = mlflow.MlflowClient()
    user_tags = {str(k): str(v) for k, v in (tags or {}).items()}
    nested = mlflow.active_run() is not None
    with tempfile.TemporaryDirectory(prefix="tailguard-register-") as tmp, \
            mlflow.start_run(run_name=f"register-{registered_name}", nested=nested) as run:
        run_id = run.info.run_id
        mlflow.set_tag(ROLE_TAG, "reference")
        if onnx_path is not None:
            fmt, mv = "onnx", _register_onnx(client, registered_name, onnx_path, Path(tmp))
        elif pickled_module is not None:
            fmt, mv = "pickle", _register_pickle(client, registered_name, pickled_module, Path(tmp))
        else:
            folder = Path(tmp) / REFERENCE_ARTIFACT
            folder.mkdir()
            if state_dict is not None:
                fmt = "state_dict"
                _write_state_dict(state_dict, class_path, init_kwargs, folder)
            else:
                fmt = "torch_export"
                _write_exported_program(exported_program, folder, trusted=trusted)
            mlflow.log_artifacts(str(folder), artifact_path=REFERENCE_ARTIFACT)
            _ensure_registered_model(client, registered_name)
            digest = json.loads((folder / DESCRIPTOR_FILE).read_text())["sha256"]
            mv = client.create_model_version(registered_name, source=mlflow.get_artifact_uri(REFERENCE_ARTIFACT),
                                             run_id=run_id, tags={FORMAT_TAG: fmt, SHA256_TAG: digest,
                                                                  FILES_SHA256_TAG: artifact_files_sha256(folder)})
        for k, v in user_tags.items():
            client.set_model_version_tag(registered_name, mv.version, k, v)
        if description:
            client.update_model_version(registered_name, mv.version, description=description)
    return client.get_model_version(registered_name, mv.version)


def _ensure_registered_model(client: "MlflowClient", name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        client.create_registered_model(name)


def _register_logged(client: "MlflowClient", name: str, info: Any, fmt: str, model_file: str,
                     tmp: Path) -> "ModelVersion":
    """Register a LoggedModel and tag it with the digest of the model file as stored, and of all its files
    (external data too) as stored (FILES_SHA256_TAG)."""
    import mlflow

    location = client.get_logged_model(info.model_id).artifact_location.rstrip("/")
    stored = Path(mlflow.artifacts.download_artifacts(artifact_uri=location, dst_path=str(tmp / "stored")))
    digest = sha256_file(stored / model_file)
    _ensure_registered_model(client, name)
    return client.create_model_version(name, source=info.model_uri, run_id=info.run_id, model_id=info.model_id,
                                       tags={FORMAT_TAG: fmt, SHA256_TAG: digest,
                                             FILES_SHA256_TAG: artifact_files_sha256(stored)})


def _register_onnx(client: "MlflowClient", name: str, source: "str | Path | onnx.ModelProto",
                   tmp: Path) -> "ModelVersion":
    import mlflow
    import onnx
    import onnxruntime

    if isinstance(source, onnx.ModelProto):
        model = source
    else:
        path = Path(source)
        if not path.is_file():
            raise InputError(f"onnx_path: ONNX file not found: {path}")
        try:
            model = onnx.load(str(path))  # external data files beside it are read in
        except Exception as exc:  # onnx raises DecodeError / OSError / ValueError for a bad file
            raise InputError(f"onnx_path: {path} is not a loadable ONNX model: {exc}") from None
    external = model.ByteSize() > _ONNX_INLINE_LIMIT_BYTES
    info = mlflow.onnx.log_model(model, name=REFERENCE_ARTIFACT, save_as_external_data=external,
                                 pip_requirements=[f"onnx=={onnx.__version__}",
                                                   f"onnxruntime=={onnxruntime.__version__}"])
    return _register_logged(client, name, info, "onnx", "model.onnx", tmp)


def _register_pickle(client: "MlflowClient", name: str, module: Any, tmp: Path) -> "ModelVersion":
    import mlflow
    import torch

    if not isinstance(module, torch.nn.Module):
        raise InputError(f"register_reference: pickled_module must be a torch.nn.Module, got {type(module).__name__}")
    info = mlflow.pytorch.log_model(module, name=REFERENCE_ARTIFACT, serialization_format="pickle",
                                    pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"])
    return _register_logged(client, name, info, "pickle", "data/model.pth", tmp)


def _write_descriptor(folder: Path, **entries: Any) -> None:
    desc = {"schema": DESCRIPTOR_SCHEMA, **entries}
    (folder / DESCRIPTOR_FILE).write_text(json.dumps(desc, indent=2, sort_keys=True))


def _write_state_dict(state_dict: Mapping[str, Any] | str | Path, class_path: str | None,
                      init_kwargs: dict[str, Any] | None, folder: Path) -> None:
    import torch
    from safetensors.torch import save_file

    if not class_path:
        raise InputError("register_reference: a state_dict needs class_path ('module:Class')",
                         hint="the class the weights load into, e.g. tailguard.models:MeanPooledEncoder")
    import_module_class(class_path, field="class_path")
    init_kwargs = dict(init_kwargs or {})
    try:
        json.dumps(init_kwargs)
    except TypeError as exc:
        raise InputError(f"register_reference: init_kwargs must be JSON-serializable: {exc}") from None
    tensors = read_state_dict(Path(state_dict), "state_dict") if isinstance(state_dict, (str, Path)) \
        else dict(state_dict)
    bad = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise InputError(f"register_reference: state_dict values must be tensors; not tensors: {bad[:10]}")
    # safetensors refuses shared storage (tied weights) and non-contiguous views: store independent copies.
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, str(folder / STATE_DICT_FILE))
    _write_descriptor(folder, format="state_dict", file=STATE_DICT_FILE, class_path=class_path,
                      init_kwargs=init_kwargs, sha256=sha256_file(folder / STATE_DICT_FILE),
                      torch_version=torch.__version__)


def _write_exported_program(ep: Any, folder: Path, *, trusted: bool = False) -> None:
    """Store an ExportedProgram (saved with torch.export.save), or copy a .pt2 file of one unchanged after checking
    that it holds no code (unless `trusted`) and that torch.export.load reads it."""
    import torch

    target = folder / EXPORTED_PROGRAM_FILE
    if isinstance(ep, (str, Path)):
        load_exported_program(Path(ep), field="exported_program", trusted=trusted, fix=REGISTER_FIX)
        shutil.copyfile(ep, target)
    elif isinstance(ep, torch.export.ExportedProgram):
        torch.export.save(ep, str(target))
    else:
        raise InputError("exported_program: must be a torch.export.ExportedProgram or a .pt2 file of one, got "
                         f"{type(ep).__name__}", hint="pass torch.export.export(model.eval(), example_args)")
    _write_descriptor(folder, format="torch_export", file=EXPORTED_PROGRAM_FILE,
                      sha256=sha256_file(target), torch_version=torch.__version__)
