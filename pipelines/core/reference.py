"""Resolve the FP32 reference: an MLflow registry version -> local files, a storage format, a torch module.

Storage conventions (what `tailguard.registration.register_reference` writes and `resolve_reference` reads;
components/resolve/README.md):

| format         | registry version holds                                                  | loaded with |
| -------------- | ----------------------------------------------------------------------- | ----------- |
| `onnx`         | an MLflow `onnx` flavor model (`model.onnx`)                            | ONNX Runtime (later steps) |
| `torch_export` | `model.pt2` (`torch.export.save`) + `tailguard-model.json`, or an MLflow `pytorch` flavor saved with `serialization_format="pt2"` (`data/model.pt2`) | `torch.export.load(...).module()` |
| `state_dict`   | `model.safetensors` + `tailguard-model.json` (class_path, init_kwargs)  | `cls(**init_kwargs).load_state_dict(strict)` |
| `pickle`       | an MLflow `pytorch` flavor saved with pickle (`data/model.pth`)         | `mlflow.pytorch.load_model`, only with `model.source.trusted: true` |

Every version registered here carries the tags `tailguard.format` and `tailguard.sha256` (SHA-256 of the model
file as stored); `resolve_reference` recomputes the digest after download and refuses a mismatch. A version
registered by another tool (no `tailguard.sha256` tag) gets the digest computed at its first resolve and recorded
as that tag, with a `RegistryDigestWarning` (once: later resolves compare against it). Users register
files with `tailguard register` / `tailguard.register_model` (pipelines/registration.py), which checks them and
calls `register_reference` (same module: registering is the application's job; this kernel module only reads).

A state dict's `class_path` module is imported from `sys.path`, then from the folders of $TAILGUARD_MODEL_PATH
(tailguard.core.torch_load, which loads a torch module from its files for this module and for registration).

Trust (docs/deploy.md, Trust model): the registry's content is data, not instructions. A class path from a
version's `tailguard-model.json` is imported only when the spec names the same class (`model.source.class_path`)
or says `model.source.trusted: true`; a pickle loads only with `trusted: true`; a torch.export `.pt2` loads only
after its archive was read and holds no code (tailguard.core.pt2_archive: no pickled weight or constant, no custom
or opaque object, no expression or guard torch evaluates), or with `trusted: true`; the model file must be a
regular file inside the downloaded artifact folder (no absolute path, no `..`, no symlink leading out, no device /
FIFO).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import stat
import warnings
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import TYPE_CHECKING, Any, Mapping

from tailguard.core.contract import FORMAT_TAG, SHA256_TAG
from tailguard.core.digests import file_sha256
from tailguard.core.errors import InputError, UntrustedModelError
from tailguard.core.home import quiet_environment
from tailguard.core.pt2_archive import check_pt2_archive
from tailguard.core.torch_load import (
    add_model_path,
    build_state_dict_module,
    read_state_dict,
)

if TYPE_CHECKING:  # heavy imports stay inside the functions (KFP components import this module)
    import torch
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

    from tailguard.core.spec.model import ModelSpec
    from tailguard.core.spec.root import Spec

FORMATS = ("onnx", "torch_export", "state_dict", "pickle")
DESCRIPTOR_FILE = "tailguard-model.json"
DESCRIPTOR_SCHEMA = "tailguard/model-descriptor/v1"
REFERENCE_ARTIFACT = "reference"  # artifact folder (inside the registering run) that holds the reference
STATE_DICT_FILE = "model.safetensors"
EXPORTED_PROGRAM_FILE = "model.pt2"
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")
_MAX_LISTED = 20


class RegistryDigestWarning(UserWarning):
    """A registry version had no `tailguard.sha256` tag (registered by another tool): its digest was computed at
    resolve and recorded as the tag, so later resolves compare against it."""


# ------------------------------------------------------------------------------------------ the record
@dataclass
class ResolvedModel:
    """The FP32 reference, downloaded: what later steps need to load it. JSON-serializable (crosses KFP tasks).

    Attributes:
        registered_name: MLflow registered model name.
        version: the resolved version number, as a string (e.g. "3").
        run_id: MLflow run that produced the version, or None.
        format: one of "onnx", "torch_export", "state_dict", "pickle".
        local_dir: absolute folder holding the downloaded artifacts of the version.
        source_uri: the version's `source` in the registry (where its artifacts live).
        model_file: the model file, relative to `local_dir` (model.onnx, model.pt2, model.safetensors, ...).
        onnx_path: absolute path of the ONNX file (format "onnx" only, else None).
        class_path: "module:Class" of the torch module (format "state_dict"), else None.
        init_kwargs: keyword arguments for `class_path`.
        sha256: hex SHA-256 of the model file (64 chars).
    """

    registered_name: str
    version: str
    run_id: str | None
    format: str
    local_dir: str
    source_uri: str
    model_file: str
    onnx_path: str | None = None
    class_path: str | None = None
    init_kwargs: dict[str, Any] = field(default_factory=dict)
    sha256: str = ""

    @property
    def model_path(self) -> Path:
        """Absolute path of the model file."""
        return Path(self.local_dir) / self.model_file

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form (see `from_dict`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ResolvedModel":
        """Inverse of `to_dict`; unknown keys are ignored.

        Raises:
            InputError: a required key is missing or the format is unknown.
        """
        names = {f.name for f in fields(cls)}
        required = [f.name for f in fields(cls) if f.name not in ("onnx_path", "class_path", "init_kwargs", "sha256")]
        missing = [k for k in required if k not in d]
        if missing:
            raise InputError(f"resolved model record is missing {missing}",
                             hint="pass the `resolved` output of the resolve step unchanged")
        if d["format"] not in FORMATS:
            raise InputError(f"resolved model record: unknown format {d['format']!r}; known: {list(FORMATS)}")
        kw = {k: v for k, v in d.items() if k in names}
        _check_relative(str(kw["model_file"]), field="resolved model record: model_file", where="the record")
        kw["version"] = str(kw["version"])
        kw["init_kwargs"] = dict(kw.get("init_kwargs") or {})
        return cls(**kw)

    def with_local_dir(self, local_dir: str | Path) -> "ResolvedModel":
        """The same record for a copy of `local_dir` elsewhere (e.g. a KFP artifact mounted at another path)."""
        local_dir = str(Path(local_dir).resolve())
        onnx_path = str(Path(local_dir) / self.model_file) if self.format == "onnx" else None
        return replace(self, local_dir=local_dir, onnx_path=onnx_path)


# ------------------------------------------------------------------------------------------- versions
def resolve_version(client: "MlflowClient", name: str, version: str) -> "ModelVersion":
    """Find a registry version: "latest" (highest version number), a version number, or "@alias".

    Registry aliases are used, not the deprecated stages. "latest" ignores aliases and stages: it is the
    highest version number of the registered model.

    Args:
        client: an MlflowClient pointing at the registry.
        name: registered model name (spec `model.registered_name`).
        version: "latest", "7", or "@production" (spec `model.version`, or the CLI / trigger override).

    Returns:
        The MLflow ModelVersion.

    Raises:
        InputError: no such registered model (hint: close names), no versions, no such version (hint: the
            existing versions), no such alias (hint: the existing aliases), or a malformed `version`.
    """
    from mlflow.exceptions import MlflowException

    version = str(version).strip()
    if not (version == "latest" or re.fullmatch(r"[1-9]\d*", version) or re.fullmatch(r"@[A-Za-z0-9_\-]+", version)):
        raise InputError(f"model.version: {version!r} is not 'latest', a positive version number, or '@alias'",
                         hint="e.g. version: latest, version: 3, or version: '@production'")
    try:
        registered = client.get_registered_model(name)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        known = [m.name for m in client.search_registered_models(max_results=1000)]
        close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
        listed = close or known[:_MAX_LISTED]
        raise InputError(f"model.registered_name: no registered model {name!r} in the registry",
                         hint=(f"did you mean one of {close}?" if close else
                               f"registered models: {listed}" if listed else "the registry has no models yet; "
                               "register the FP32 reference first (see components/resolve/README.md)")) from None
    versions = sorted(client.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version))
    numbers = [str(v.version) for v in versions]
    listed = numbers[-_MAX_LISTED:]
    if version == "latest":
        if not versions:
            raise InputError(f"model.version: registered model {name!r} has no versions",
                             hint="register a version of the FP32 reference first")
        mv = versions[-1]
    elif version.startswith("@"):
        alias = version[1:]
        aliases = dict(registered.aliases or {})
        if alias not in aliases:
            raise InputError(f"model.version: registered model {name!r} has no alias {alias!r}",
                             hint=(f"existing aliases: {sorted(aliases)} (versions: {listed})" if aliases else
                                   f"the model has no aliases; existing versions: {listed}"))
        mv = client.get_model_version(name, str(aliases[alias]))
    else:
        if version not in numbers:
            raise InputError(f"model.version: registered model {name!r} has no version {version}",
                             hint=f"existing versions: {listed}" if listed else "the model has no versions yet")
        mv = versions[numbers.index(version)]
    status = str(getattr(mv, "status", "READY") or "READY")
    if status != "READY":
        raise InputError(f"model.version: version {mv.version} of {name!r} is {status}, not READY",
                         hint="wait for the registration to finish, or pick another version")
    return mv


# ------------------------------------------------------------------------------------------- resolving
def resolve_reference(spec: "Spec", *, tracking_uri: str, out_dir: Path, version: str | None = None) -> ResolvedModel:
    """Resolve the spec's registry version, download its artifacts and detect (and vet) its format.

    Args:
        spec: the spec (`model.registered_name`, `model.version`, `model.source`, `mlflow.registry_uri`).
        tracking_uri: MLflow tracking URI (also the registry URI unless `mlflow.registry_uri` is set).
        out_dir: folder the artifacts are downloaded into (created).
        version: overrides `model.version` ("latest", a number, "@alias"), e.g. from the trigger or the CLI.

    Returns:
        The ResolvedModel (paths under `out_dir`).

    Warns:
        RegistryDigestWarning: the version had no `tailguard.sha256` tag (registered by another tool); the digest
            computed here was recorded as that tag (or, where the registry refused the write, only pinned for
            this pipeline run: fetch-reference compares against it).

    Raises:
        InputError: unknown model / version / alias (see `resolve_version`), no model file of the format, a
            format that contradicts `model.source.format`, a state dict without a class path, a model file
            outside the downloaded folder (absolute path, `..`, a symlink leading out) or not a regular file, or
            a model file whose SHA-256 differs from the one recorded at registration.
        UntrustedModelError: the version holds a pickled PyTorch model, or names in its tailguard-model.json a
            class the spec does not name, and `model.source.trusted` is false.
    """
    quiet_environment()
    import mlflow
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=spec.mlflow.registry_uri or tracking_uri)
    name = spec.model.registered_name
    mv = resolve_version(client, name, version or spec.model.version)
    download_uri = client.get_model_version_download_uri(name, mv.version)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=download_uri, dst_path=str(out_dir),
                                                     tracking_uri=tracking_uri)).resolve()
    if local.is_file():
        local = local.parent
    src = spec.model.source
    descriptor = _read_descriptor(local)
    fmt, model_file = _detect_format(local, descriptor, src.format, src.weights_file, name, str(mv.version))
    where = f"{name!r} version {mv.version}"
    if fmt == "pickle" and not src.trusted:
        raise UntrustedModelError(
            f"model.source.trusted: {where} holds a pickled PyTorch model (mlflow.pytorch pickle flavor, "
            f"{model_file}); unpickling runs arbitrary code stored in the artifact, so tailguard refuses it "
            "unless model.source.trusted is true",
            hint="re-register the reference as a state dict, a torch.export program or ONNX (`tailguard "
                 "register NAME FILE`, components/resolve/README.md), or set model.source.trusted: true for a "
                 "source you control")
    class_path, init_kwargs = None, {}
    if fmt == "state_dict":
        class_path, init_kwargs = _class_and_kwargs(spec.model, descriptor)
        if not class_path:
            raise InputError(f"model.source.class_path: {where} holds a state dict ({model_file}) but no class "
                             "path is known (none in the spec and no tailguard-model.json descriptor)",
                             hint="set model.source.class_path: 'package.module:Class' (and init_kwargs)")
        _check_class_trusted(class_path, spec.model, where)
    model_path = confined_file(local, model_file, where=where,
                               field="model.source.weights_file" if src.weights_file else "model.version")
    digest = sha256_file(model_path)
    tag = (mv.tags or {}).get(SHA256_TAG)
    expected = {"registry tag tailguard.sha256": tag,
                f"{DESCRIPTOR_FILE}": (descriptor or {}).get("sha256") if descriptor else None}
    for what, want in expected.items():
        if want and want != digest:
            raise InputError(f"model.version: {where}: {model_file} has SHA-256 {digest}, but the {what} says "
                             f"{want}; the artifact changed after registration",
                             hint="re-register the reference, or check who rewrote the artifact store")
    if not tag:
        _record_digest(client, name, str(mv.version), digest, fmt, where, model_file)
    return ResolvedModel(registered_name=name, version=str(mv.version), run_id=mv.run_id or None, format=fmt,
                         local_dir=str(local), source_uri=str(mv.source), model_file=model_file,
                         onnx_path=str(local / model_file) if fmt == "onnx" else None, class_path=class_path,
                         init_kwargs=init_kwargs, sha256=digest)


def _record_digest(client: "MlflowClient", name: str, version: str, digest: str, fmt: str, where: str,
                   model_file: str) -> None:
    """Record the digest computed at resolve as the version's `tailguard.sha256` tag (and `tailguard.format` when
    missing), with one RegistryDigestWarning: the next resolve finds the tag and compares against it."""
    from mlflow.exceptions import MlflowException

    try:
        client.set_model_version_tag(name, version, SHA256_TAG, digest)
        client.set_model_version_tag(name, version, FORMAT_TAG, fmt)
        recorded = f"recorded it as the version's {SHA256_TAG} tag; later resolves compare against it"
    except MlflowException as exc:  # e.g. read-only registry credentials
        recorded = (f"could not record it as the {SHA256_TAG} tag ({exc.error_code}); this pipeline run is pinned "
                    "to it (fetch-reference compares), later runs compute it afresh")
    warnings.warn(f"{where} has no {SHA256_TAG} tag (registered by another tool than tailguard): computed the "
                  f"SHA-256 of {model_file} at resolve ({digest}) and {recorded}", RegistryDigestWarning,
                  stacklevel=3)


def _check_relative(rel: str, *, field: str, where: str) -> PurePosixPath:
    """`rel` as a relative POSIX path without `..` parts (artifact paths are POSIX), else InputError naming
    `field`."""
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or PureWindowsPath(rel).is_absolute() or ".." in p.parts or "\\" in rel:
        raise InputError(f"{field}: {where}: model file {rel!r} is not a relative path inside the version's "
                         "artifacts (absolute paths and '..' are refused)",
                         hint="re-register the reference with `tailguard register` (its descriptor names a file "
                              "beside it), or set model.source.weights_file to a file of the version")
    return p


def confined_file(local: Path, rel: str, *, field: str = "model.version", where: str = "the reference") -> Path:
    """The model file `rel` inside the downloaded artifact folder `local`, checked before anything reads it.

    Args:
        local: the folder the version's artifacts were downloaded into.
        rel: the model file, relative to `local` (from the descriptor, the MLmodel flavor, the file names, or
            `model.source.weights_file`).
        field: the spec field named in errors.
        where: "'name' version N", for messages.

    Returns:
        `local / rel`.

    Raises:
        InputError: `rel` is absolute or has `..` parts, resolves (through symlinks) outside `local`, does not
            exist, or is not a regular file (a device such as /dev/zero, a FIFO, a folder: never hashed or read).
    """
    _check_relative(rel, field=field, where=where)
    path = Path(local) / rel
    root = Path(local).resolve()
    real = path.resolve()  # follows symlinks without opening anything
    if not real.is_relative_to(root):
        raise InputError(f"{field}: {where}: model file {rel!r} leads outside the downloaded artifacts (to {real}, "
                         "through a symlink); only files inside the version's folder are read",
                         hint="re-register the reference with the model file itself, not a link to it")
    try:
        mode = os.stat(real).st_mode
    except OSError:
        raise InputError(f"{field}: {where}: model file {rel!r} is not in the version's artifacts",
                         hint=f"files: {_files(Path(local), ('.onnx', '.pt2') + WEIGHT_SUFFIXES)[:_MAX_LISTED]}"
                         ) from None
    if not stat.S_ISREG(mode):
        raise InputError(f"{field}: {where}: model file {rel!r} is not a regular file (a device, FIFO or folder); "
                         "only regular files are hashed and loaded",
                         hint="re-register the reference with the model file itself")
    return path


def _check_class_trusted(class_path: str, model: "ModelSpec", where: str) -> None:
    """Refuse a class path that only the registry names (tailguard-model.json) unless the spec trusts the source.

    Raises:
        UntrustedModelError: `model.source.class_path` is unset and `model.source.trusted` is false.
    """
    if model.source.class_path or model.source.trusted:
        return
    raise UntrustedModelError(
        f"model.source.class_path: {where} asks to import and build the class {class_path!r} (named by its "
        f"{DESCRIPTOR_FILE} in the registry, not by the spec); importing a module runs its code in every step "
        "that loads the reference, so tailguard imports only a class the spec names",
        hint=f"add `class_path: {class_path}` under model.source if that is the class you expect, or set "
             "model.source.trusted: true for a registry only trusted people can write to (docs/deploy.md, "
             "Trust model)")


def _read_descriptor(local: Path) -> dict[str, Any] | None:
    path = local / DESCRIPTOR_FILE
    if not path.is_file():
        return None
    try:
        desc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"model.version: {path} is not valid JSON: {exc}") from None
    if not isinstance(desc, dict) or desc.get("format") not in FORMATS or not desc.get("file"):
        raise InputError(f"model.version: {path} needs 'format' (one of {list(FORMATS)}) and 'file'")
    return desc


def _read_mlmodel_flavors(local: Path) -> dict[str, Any]:
    import yaml

    path = local / "MLmodel"
    if not path.is_file():
        return {}
    return dict((yaml.safe_load(path.read_text()) or {}).get("flavors") or {})


def _files(local: Path, suffixes: tuple[str, ...]) -> list[str]:
    return sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file() and p.suffix in suffixes)


def _detect_format(local: Path, descriptor: dict[str, Any] | None, declared: str, weights_file: str | None,
                   name: str, version: str) -> tuple[str, str]:
    """(format, model file relative to `local`) from the descriptor, the MLmodel flavors, or the file names."""
    where = f"{name!r} version {version}"
    flavors = _read_mlmodel_flavors(local)
    found: list[tuple[str, str]] = []  # (format, file) found, best first
    if descriptor:
        found.append((descriptor["format"], descriptor["file"]))
    if "onnx" in flavors:
        found.append(("onnx", str(flavors["onnx"].get("data") or "model.onnx")))
    if "pytorch" in flavors:
        data = str(flavors["pytorch"].get("model_data") or "data")
        if (local / data / EXPORTED_PROGRAM_FILE).is_file():
            found.append(("torch_export", f"{data}/{EXPORTED_PROGRAM_FILE}"))
        elif (local / data / "model.pth").is_file():
            found.append(("pickle", f"{data}/model.pth"))
    if not flavors:
        for fmt, suffixes in (("onnx", (".onnx",)), ("torch_export", (".pt2",)), ("state_dict", WEIGHT_SUFFIXES)):
            files = _files(local, suffixes)
            if len(files) == 1:
                found.append((fmt, files[0]))

    if weights_file:
        if not (local / weights_file).is_file():
            raise InputError(f"model.source.weights_file: {weights_file!r} is not in the artifacts of {where}",
                             hint=f"files: {_files(local, ('.onnx', '.pt2') + WEIGHT_SUFFIXES)[:_MAX_LISTED]}")
        if declared == "auto":
            by_suffix = {".onnx": "onnx", ".pt2": "torch_export"}
            fmt = by_suffix.get(Path(weights_file).suffix, "state_dict")
        else:
            fmt = declared
        return fmt, weights_file
    if declared == "auto":
        if found:
            return found[0]
        raise InputError(f"model.source.format: cannot tell the storage format of {where}: no "
                         f"{DESCRIPTOR_FILE}, no onnx/pytorch MLmodel flavor, and not exactly one model file",
                         hint=f"set model.source.format (and weights_file); files: "
                              f"{_files(local, ('.onnx', '.pt2') + WEIGHT_SUFFIXES)[:_MAX_LISTED]}")
    for fmt, file in found:
        if fmt == declared:
            return fmt, file
    if declared == "state_dict":
        files = _files(local, WEIGHT_SUFFIXES)
        if len(files) == 1:
            return "state_dict", files[0]
        raise InputError(f"model.source.weights_file: {where} has {len(files)} weight files {files[:_MAX_LISTED]}; "
                         "cannot pick the state dict", hint="set model.source.weights_file to one of them")
    detected = found[0][0] if found else "unknown"
    raise InputError(f"model.source.format: the spec says {declared!r} but {where} holds {detected!r}",
                     hint=f"set model.source.format: {detected if found else 'auto'} or pick another version")


def _class_and_kwargs(model: "ModelSpec", descriptor: dict[str, Any] | None) -> tuple[str | None, dict[str, Any]]:
    """class path and init kwargs: a spec class_path other than the descriptor's overrides it (with the spec's
    kwargs only); otherwise (the same class, or none in the spec) the descriptor's kwargs updated by the spec's."""
    src = model.source
    desc = descriptor or {}
    if src.class_path and src.class_path != desc.get("class_path"):
        return src.class_path, dict(src.init_kwargs)
    return desc.get("class_path"), {**dict(desc.get("init_kwargs") or {}), **dict(src.init_kwargs)}


# --------------------------------------------------------------------------------------------- loading
def load_torch_reference(resolved: ResolvedModel, spec: "ModelSpec") -> "torch.nn.Module":
    """Load the resolved reference as a torch module (CPU, eval mode where the module supports it).

    - torch_export: `torch.export.load(file).module()` (a GraphModule; it has no train/eval switch: the program
      was captured in the mode it was exported in), after `check_pt2_archive` unless `spec.source.trusted`: an
      archive whose loading would run code (a pickled weight, a custom object, an expression torch evaluates) is
      refused.
    - state_dict: import `class_path` ("module:Class"; `spec.source.class_path` overrides the record), build it
      with `init_kwargs`, read the weights (safetensors, or `torch.load(weights_only=True)`), load them strictly.
      Strictness is checked as `load_state_dict(strict=True)` does (any missing or unexpected key fails), but all
      such keys are listed in the error.
    - pickle: `mlflow.pytorch.load_model` of the downloaded folder, only when `spec.source.trusted` is true.

    Args:
        resolved: output of `resolve_reference`.
        spec: the spec's `model` section.

    Returns:
        The torch.nn.Module; forward takes the model inputs in `spec.inputs` order.

    Raises:
        InputError: ONNX reference (no torch module), unknown class path (names model.source.class_path), bad
            init kwargs, unreadable weights, or a state dict that does not fit the class (missing / unexpected
            keys or shape mismatches listed).
        UntrustedModelError: a pickle reference without `model.source.trusted: true`, a state dict whose
            class the spec does not name (`model.source.class_path`) without `trusted: true`, or a torch.export
            archive that holds code without `trusted: true`.
    """
    import torch

    path = resolved.model_path
    if resolved.format == "onnx":
        raise InputError(f"model.source.format: {resolved.registered_name!r} version {resolved.version} is an ONNX "
                         "model; there is no torch module to load", hint="use onnx_path with ONNX Runtime")
    if not path.is_file():
        raise InputError(f"reference model file not found: {path}",
                         hint="pass the folder the resolve step downloaded into (ResolvedModel.with_local_dir)")
    if resolved.format == "torch_export":
        check_pt2_archive(path, trusted=spec.source.trusted)
        try:
            return torch.export.load(str(path)).module()
        except Exception as exc:  # torch raises several types for a bad archive
            raise InputError(f"model.version: {path} is not a loadable torch.export program: {exc}") from None
    if resolved.format == "pickle":
        if not spec.source.trusted:
            raise UntrustedModelError(
                f"model.source.trusted: {resolved.registered_name!r} version {resolved.version} is a pickled "
                "PyTorch model; unpickling runs arbitrary code, so it loads only with model.source.trusted: true",
                hint="re-register it as a state dict / torch.export / ONNX, or trust a source you control")
        import mlflow.pytorch
        from mlflow.exceptions import MlflowException

        add_model_path()  # unpickling imports the module's classes
        try:
            module = mlflow.pytorch.load_model(resolved.local_dir)
        except MlflowException as exc:
            raise InputError(f"model.version: cannot load the pickled model in {resolved.local_dir}: "
                             f"{exc.message}") from None
        return module.eval()
    class_path = spec.source.class_path or resolved.class_path
    if not class_path:
        raise InputError("model.source.class_path: a state-dict reference needs a class path",
                         hint="set model.source.class_path: 'package.module:Class'")
    _check_class_trusted(class_path, spec, f"{resolved.registered_name!r} version {resolved.version}")
    same = spec.source.class_path in (None, resolved.class_path)
    init_kwargs = dict(resolved.init_kwargs) if same else dict(spec.source.init_kwargs)
    weights = read_state_dict(path, "model.source.weights_file")
    return build_state_dict_module(class_path, init_kwargs, weights, weights_name=path.name)


sha256_file = file_sha256  # one sha256 helper: tailguard.core.digests.file_sha256


# ---------------------------------------------------------------------------------------------- in later tasks
def alias_version(client: Any, model_name: str, alias: str) -> str | None:
    """The version `alias` of `model_name` points to, or None (no such model or alias)."""
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_model_version_by_alias(model_name, alias).version)
    except MlflowException:
        return None


def load_resolved(resolved_json: str, reference_dir: str) -> ResolvedModel:
    """The ResolvedModel of `main`'s JSON with its paths rebased onto this task's view of the artifact folder."""
    d = json.loads(resolved_json)
    sub = d.pop("artifact_subdir", ".")
    return ResolvedModel.from_dict(d).with_local_dir(str(Path(reference_dir) / sub))
