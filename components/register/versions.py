"""The registry calls of register-and-promote: which variants get a model version (`registration_policy`), the tags of a
version (`backend_tags`, `validated_on_text`), reusing a version with the same sha256 (`versions_by_sha256`) and
registering a logged artifact folder (`register_artifact_folder`).
"""

from __future__ import annotations

import json
from enum import Enum
from typing import TYPE_CHECKING, Any

from tailguard.components.register.summary import VariantSummary, node_of
from tailguard.core.contract import (
    ARTIFACT_FINGERPRINT_TAG,
    COMPILE_TAG,
    CUDA_GRAPHS_TAG,
    DEVICE_TAG,
    EXECUTION_PROVIDER_TAG,
    FILES_SHA256_TAG,
    SHA256_TAG,
    VALIDATED_ON_TAG,
)

if TYPE_CHECKING:
    from tailguard.core.spec.variants import VariantSpec


class Registration(str, Enum):
    """What the register step did with a built variant's model (VariantSummary.registration)."""

    REGISTERED = "registered"          # a new version of the optimized model
    REUSED = "reused"                  # an existing version holds the same artefact (sha256): that version is used
    NOT_REGISTERED = "not_registered"  # the policy leaves it out; its MLflow run holds the model


def registration_policy(policy: str, row: VariantSummary, selected: bool) -> tuple[bool, str]:
    """Whether `row` gets a registry version under `promotion.register_variants`, and why not.

    Args:
        policy: promoted | passing | all (spec `promotion.register_variants`).
        row: a built variant's summary row (status ok, a logged model).
        selected: `row` is the variant `decide_promotion` chose (it gets the alias when promotion is on).

    Returns:
        (register, reason): reason is "" when it is registered, else the words for the summary row.
    """
    if policy == "all" or selected or (policy == "passing" and row.passed):
        return True, ""
    if row.passed:
        return False, f"not registered: passed, not selected (promotion.register_variants: {policy})"
    return False, f"not registered: failed its gates (promotion.register_variants: {policy})"


def versions_by_sha256(client: Any, model_name: str) -> dict[str, str]:
    """Which artefacts the registry already holds for `model_name`.

    Args:
        client: an `mlflow.MlflowClient` on the registry.
        model_name: the registered model (the spec's optimized model name).

    Returns:
        {hex sha256 (tag SHA256_TAG): the lowest version number holding it, as str}; versions without the tag
        (registered by hand) are left out.
    """
    out: dict[str, str] = {}
    token = None
    while True:
        page = client.search_model_versions(f"name = '{model_name}'", page_token=token)
        for mv in page:
            sha = (mv.tags or {}).get(SHA256_TAG)
            if sha and (sha not in out or int(mv.version) < int(out[sha])):
                out[sha] = str(mv.version)
        token = page.token
        if not token:
            return out


def backend_tags(variant: VariantSpec, run_tags: dict[str, str]) -> dict[str, str]:
    """The registered version's backend-specific tags: the ONNX Runtime execution provider (onnxruntime), the
    TensorRT plan's fingerprint (tensorrt: TensorRT version, GPU, compute capability, CUDA; from the validated run's
    ARTIFACT_FINGERPRINT_TAG), or the torch variant's compile mode, device, CUDA graphs and the artefact's
    fingerprint (torch version, device name, compute capability or CPU ISA flags); for both node-bound kinds also
    the digest of the artefact folder's files (FILES_SHA256_TAG, checked by `tailguard fetch`)."""
    files = {FILES_SHA256_TAG: run_tags[FILES_SHA256_TAG]} if run_tags.get(FILES_SHA256_TAG) else {}
    if variant.backend == "tensorrt":
        return {ARTIFACT_FINGERPRINT_TAG: run_tags.get(ARTIFACT_FINGERPRINT_TAG, ""), **files}
    if variant.backend != "torch":
        return {EXECUTION_PROVIDER_TAG: variant.execution_provider}
    return {COMPILE_TAG: variant.torch_compile, DEVICE_TAG: variant.torch_device,
            CUDA_GRAPHS_TAG: str(variant.cuda_graphs).lower(),
            ARTIFACT_FINGERPRINT_TAG: run_tags.get(ARTIFACT_FINGERPRINT_TAG, ""), **files}


def register_artifact_folder(client: Any, name: str, model_uri: str, run_id: str, tags: dict[str, str]) -> Any:
    """Register a run's artefact folder (`runs:/<run>/<path>`, not an MLflow model: no MLmodel file) as a new
    version of `name`, with `MlflowClient.create_model_version(source=<the run's artifact URI>/<path>)`;
    `mlflow.register_model` only takes logged MLflow models. `models:/name/N` downloads the folder.

    Returns:
        The ModelVersion.
    """
    from mlflow.exceptions import MlflowException

    path = model_uri.removeprefix(f"runs:/{run_id}/").strip("/")
    source = client.get_run(run_id).info.artifact_uri.rstrip("/") + "/" + path
    try:
        client.create_registered_model(name)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    return client.create_model_version(name, source=source, run_id=run_id, tags=tags)


def validated_on(row: VariantSummary, tags: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The `tailguard.validated_on` tag of a registered variant (JSON list; the monitor compares its own node with
    the nodes a variant passed on, monitoring/node_check.py): with serving targets one entry per target,
    {target, status, passed, placement, cpu, isa, gpu}; without, one entry {target: null, ..., placement:
    "build_node"} from the validation run's `tags`."""
    if row.targets:
        return [{"target": t, "status": e["status"], "passed": bool(e["passed"]), "placement": e.get("placement"),
                 **(e.get("hardware") or {"cpu": "unknown", "isa": "unknown", "gpu": "none"})}
                for t, e in row.targets.items()]
    return [{"target": None, "status": row.status, "passed": row.passed, "placement": "build_node",
             **node_of(tags or {})}]


VALIDATED_ON_MAX_CHARS = 5000  # MLflow's limit on a model version tag value


def validated_on_text(entries: list[dict[str, Any]]) -> str:
    """`validated_on` entries as the tag's JSON text; past VALIDATED_ON_MAX_CHARS the CPU model names are dropped
    (the monitor compares the ISA flags and GPUs only), then the entries that did not pass."""
    text = json.dumps(entries, separators=(",", ":"))
    if len(text) > VALIDATED_ON_MAX_CHARS:
        text = json.dumps([{k: v for k, v in e.items() if k != "cpu"} for e in entries], separators=(",", ":"))
    if len(text) > VALIDATED_ON_MAX_CHARS:
        text = json.dumps([{k: v for k, v in e.items() if k != "cpu"} for e in entries if e.get("passed")],
                          separators=(",", ":"))[:VALIDATED_ON_MAX_CHARS]
    return text


def _record_nodes(client: Any, model_name: str, row: VariantSummary, nodes: dict[str, list[dict[str, Any]]]) -> None:
    """Set `tailguard.validated_on` on the version an alias just moved to (a reused version holds the tag of the
    run that registered it: this run's validation is the one the alias now stands on)."""
    if row.registration == Registration.REUSED.value and row.version is not None:
        client.set_model_version_tag(model_name, str(row.version), VALIDATED_ON_TAG,
                                     validated_on_text(nodes.get(row.variant, [])))
