"""`tailguard fetch MODEL@ALIAS|MODEL/VERSION -o DIR`: get a registered model's files out of the MLflow registry.

The reference is resolved through the registry (an alias such as the spec's promotion alias, or a version number),
the version's MLflow model is downloaded, and its artefact files -- the ONNX file and any sidecars beside it
(external-data files, an engine manifest; for a reference registered by `tailguard register`, the state dict and
its tailguard-model.json) -- are written into DIR. MLflow's packaging files (MLmodel, conda.yaml,
python_env.yaml, requirements.txt, ...) are left out: DIR is what a serving runtime loads (KServe's onnx
runtime, a Triton model repository's `<model>/<version>/`, docs/deploy.md). The store is found the way
`tailguard register` and `tailguard report` find it: --tracking-uri, else $MLFLOW_TRACKING_URI, else the local
store under $TAILGUARD_HOME.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tailguard.core.contract import FILES_SHA256_TAG, SHA256_TAG
from tailguard.core.digests import artifact_files, file_sha256, files_sha256
from tailguard.core.errors import InputError, StepError

# MODEL@ALIAS or MODEL/VERSION, optionally as a models:/ URI. Registered model names may contain "/" and "@" is
# not allowed in them by MLflow, so the alias form splits at the last "@" and the version form at the last "/".
_VERSION = re.compile(r"^(?P<name>.+)/(?P<version>\d+)$")
_ALIAS = re.compile(r"^(?P<name>.+)@(?P<alias>[\w\-]+)$")


@dataclass(frozen=True)
class FetchedFile:
    """One file `fetch_model` wrote: its path, size in bytes and hex sha256."""

    path: Path
    bytes: int
    sha256: str


@dataclass
class FetchResult:
    """What `fetch_model` did.

    Attributes:
        name: registered model name.
        version: the version the reference resolved to ("3").
        alias: the alias asked for, or None (a version was asked for).
        tracking_uri: the store it came from.
        out_dir: the folder the files were written into.
        files: the files written, sorted by path.
        registry_sha256: the version's `tailguard.sha256` tag (the digest of its model file as stored), or None
            for a version registered without tailguard.
        tags: the version's tags (tailguard.variant, tailguard.gates, ...).
    """

    name: str
    version: str
    alias: str | None
    tracking_uri: str
    out_dir: Path
    files: list[FetchedFile] = field(default_factory=list)
    registry_sha256: str | None = None
    tags: dict[str, str] = field(default_factory=dict)


def parse_model_ref(ref: str) -> tuple[str, str | None, str | None]:
    """Split MODEL@ALIAS / MODEL/VERSION (optionally prefixed with `models:/`) into (name, alias, version).

    Raises:
        InputError: neither form (names the MODEL argument and both forms).
    """
    text = ref.strip()
    if text.startswith("models:/"):
        text = text[len("models:/"):]
    if m := _ALIAS.match(text):
        return m.group("name"), m.group("alias"), None
    if m := _VERSION.match(text):
        return m.group("name"), None, m.group("version")
    raise InputError(f"MODEL: {ref!r} names neither an alias nor a version",
                     hint="write NAME@ALIAS (e.g. digits-cnn-optimized@production) or NAME/VERSION (e.g. "
                          "digits-cnn-optimized/3)")


def _client(tracking_uri: str | None) -> tuple[Any, str]:
    from tailguard.core.home import quiet_environment

    quiet_environment()  # before mlflow reads it: no artifact progress bars on the terminal
    import mlflow

    from tailguard.core.tracking import init_store, tracking_uri_for

    uri = tracking_uri or tracking_uri_for(None)
    init_store(uri)
    return mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri), uri


def _resolve(client: Any, name: str, alias: str | None, version: str | None, uri: str) -> Any:
    """The ModelVersion named; InputError naming what exists when it does not."""
    from mlflow.exceptions import MlflowException

    try:
        model = client.get_registered_model(name)
    except MlflowException:
        known = sorted(m.name for m in client.search_registered_models(max_results=50))
        raise InputError(f"MODEL: no registered model {name!r} in {uri}",
                         hint=(f"registered models there: {', '.join(known)}" if known else
                               "the store has no registered model")
                              + "; --tracking-uri selects another store") from None
    if alias is not None:
        aliases = dict(getattr(model, "aliases", None) or {})
        if alias not in aliases:
            have = ", ".join(f"@{a} -> v{v}" for a, v in sorted(aliases.items())) or "none"
            raise InputError(f"MODEL: {name!r} has no alias @{alias} (aliases: {have})",
                             hint=f"use one of its aliases or a version, e.g. {name}/1; a run moves the spec's "
                                  "promotion.alias only when a variant passed every gate")
        version = str(aliases[alias])
    try:
        return client.get_model_version(name, str(version))
    except MlflowException:
        versions = sorted((int(v.version) for v in client.search_model_versions(f"name = '{name}'",
                                                                                max_results=1000)))
        have = (f"v{versions[0]}..v{versions[-1]}" if len(versions) > 3 else
                ", ".join(f"v{v}" for v in versions)) or "none"
        raise InputError(f"MODEL: {name!r} has no version {version} (versions: {have})",
                         hint=f"pass an existing version or an alias, e.g. {name}@production") from None


def fetch_model(ref: str, out_dir: str | Path, *, tracking_uri: str | None = None) -> FetchResult:
    """Download the artefact files of the registered model version `ref` into `out_dir`.

    Args:
        ref: "NAME@ALIAS" or "NAME/VERSION" (a `models:/` prefix is accepted).
        out_dir: folder to write into (created; files of the same names are replaced, others are left alone).
        tracking_uri: MLflow tracking and registry URI; None: $MLFLOW_TRACKING_URI, else the local store under
            $TAILGUARD_HOME (as `tailguard register` / `report` / `run` without mlflow.tracking_uri).

    Returns:
        The FetchResult: the version resolved and each file written with its size (bytes) and sha256.

    Raises:
        InputError: `ref` malformed, or no such registered model / alias / version (exit 2; the message lists
            what the store holds); `out_dir` is an existing file.
        StepError: the download failed, held no artefact file, or a file is not the one registered: the files do
            not match the version's `tailguard.files_sha256` tag (every file: external data, manifest,
            descriptor), no file has its `tailguard.sha256` tag, or (a version without the first tag) a file other
            than the model file is not covered by any recorded digest -- nothing is written to `out_dir` then
            (exit 1). A version with neither tag (registered by another tool) is written unchecked, as its
            FetchResult.registry_sha256 None says.
    """
    name, alias, version = parse_model_ref(ref)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"--output: {out} is a file, not a folder", hint="pass a folder to write the model into")
    client, uri = _client(tracking_uri)
    mv = _resolve(client, name, alias, version, uri)
    tags = dict(mv.tags or {})
    out.mkdir(parents=True, exist_ok=True)
    # Download next to the destination (same file system: the files are moved in by rename), then remove it.
    with tempfile.TemporaryDirectory(prefix=".tailguard-fetch-", dir=out) as tmp:
        import mlflow
        from mlflow.exceptions import MlflowException

        try:
            # the version's own artifact location: a models:/ URI would be resolved against MLflow's global
            # registry URI, not this store's (the store named by --tracking-uri would not be the one read)
            source = client.get_model_version_download_uri(name, str(mv.version))
            local = Path(mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=tmp, tracking_uri=uri))
        except (MlflowException, OSError) as exc:
            raise StepError(f"downloading {name} v{mv.version} from {uri} failed: {str(exc).splitlines()[0]}",
                            step="fetch") from None
        found = artifact_files(local)
        if not found:
            raise StepError(f"{name} v{mv.version} holds no model file (only MLflow's packaging files)",
                            step="fetch")
        digests = {p: file_sha256(p) for p in found}
        expected = tags.get(SHA256_TAG) or None
        rel = [str(p.relative_to(local)) for p in found]
        if expected and expected not in digests.values():
            raise StepError(f"no downloaded file of {name} v{mv.version} has the sha256 the registry recorded "
                            f"({SHA256_TAG} {expected[:12]}...): the stored files changed after registration",
                            step="fetch", hint="re-register the model, or fetch another version")
        all_files = tags.get(FILES_SHA256_TAG) or None
        if all_files and files_sha256(found, local) != all_files:
            raise StepError(f"the files of {name} v{mv.version} ({rel}) do not match the digest recorded at "
                            f"registration ({FILES_SHA256_TAG} {all_files[:12]}...): a file was added, removed or "
                            "changed after registration", step="fetch",
                            hint="re-register the model, or fetch another version")
        if expected and not all_files:
            unchecked = [r for r, p in zip(rel, found) if digests[p] != expected]
            if unchecked:
                raise StepError(f"{name} v{mv.version} holds files no recorded digest covers: {unchecked} (only "
                                f"the model file's {SHA256_TAG} was recorded)", step="fetch",
                                hint=f"re-register the version with this tailguard, which records {FILES_SHA256_TAG} "
                                     "over every file")
        written = []
        for p in found:
            dest = out / p.relative_to(local)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(p), str(dest))
            written.append(FetchedFile(dest, dest.stat().st_size, digests[p]))
    return FetchResult(name=name, version=str(mv.version), alias=alias, tracking_uri=uri, out_dir=out,
                       files=written, registry_sha256=expected, tags=tags)
