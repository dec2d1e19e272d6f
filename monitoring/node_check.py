"""The monitor checks its own node (issue 23, item 4): is this node of a kind the promoted variant was validated on?

An INT8 graph is computed differently on CPUs with and without VNNI, on ARM and on GPUs (tailguard.core.hardware),
so the candidate outputs the monitor recomputes on the mirror path (`/infer`, gRPC ModelInfer) are the serving
node's only when the monitor's node picks the same kernels. At start the monitor reads the registry version of its
candidate (`monitor serve --candidate-version NAME@ALIAS`), whose `tailguard.validated_on` tag lists the nodes the
register step recorded for each serving target (or the build node): target, status, passed, placement, cpu, isa,
gpu. The monitor recomputes the candidate with ONNX Runtime's CPU execution provider (`OrtRunner`'s default), so:
for a version whose `tailguard.execution_provider` is the CPU's, this node matches when its ISA flags (the ones
that choose ONNX Runtime's CPU kernels, `tailguard.core.hardware.KERNEL_ISA_FLAGS`; not the CPU model name, not a
GPU, which a CPU kernel does not use) equal those of a node the variant passed on; a version validated on another
execution provider (CUDA, TensorRT) is never recomputed the way it serves: a mismatch in `execution_provider`.

On a mismatch the monitor stays ready, and says so: /readyz `node_mismatch`, the gauge
`tailguard_monitor_node_mismatch`, `candidate_source="recomputed_other_node"` on the compared-request counter and on
sampled-pair records, and the differing facts on every alert record. The live responses of the payload-logger and
pairs paths are the serving node's own and are never marked.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from tailguard.core.contract import EXECUTION_PROVIDER_TAG, SHA256_TAG, VALIDATED_ON_TAG
from tailguard.core.errors import InputError
from tailguard.core.hardware import fact_differences, kernel_facts, node_facts


class NodeCheckStatus(str, Enum):
    """Outcome of the monitor's node check (`NodeCheck.status`)."""

    MATCHED = "matched"              # this node computes the candidate as a node the variant passed on
    MISMATCH = "mismatch"            # it matches none of them: recomputed candidate outputs are another node's
    UNKNOWN = "unknown"              # the registry could not be read, or holds no usable record (the reason says)
    NOT_CONFIGURED = "not_configured"  # no --candidate-version: nothing to compare with
    PENDING = "pending"              # the check has not finished (it reads the registry in the background)


@dataclass(frozen=True)
class NodeCheck:
    """The monitor's node against the promoted variant's validated nodes.

    Attributes:
        status: a NodeCheckStatus value.
        node: this node's kernel facts ({"cpu", "isa", "gpu"}, `tailguard.core.hardware.kernel_facts`).
        matched: the target the node matched ("<target>", or "build node" for a variant validated without serving
            targets); None unless matched.
        closest: on a mismatch, the validated node with the fewest differing facts (its target or "build node").
        differences: on a mismatch, {fact: {"node": value, "validated": value}} against `closest` ({} otherwise):
            /readyz's `node_mismatch`.
        validated: the nodes the variant passed on ([{target, isa, gpu, cpu, placement}]).
        version: the registry version read ("name/3"), None when none was.
        reason: one line on how the status was reached.
    """

    status: str
    node: dict[str, str]
    matched: str | None = None
    closest: str | None = None
    differences: dict[str, dict[str, str]] = field(default_factory=dict)
    validated: list[dict[str, Any]] = field(default_factory=list)
    version: str | None = None
    reason: str = ""

    @property
    def mismatch(self) -> bool:
        """True when the node matches none of the nodes the variant passed on."""
        return self.status == NodeCheckStatus.MISMATCH.value

    def to_dict(self) -> dict[str, Any]:
        """JSON form (/readyz `node_check`)."""
        return asdict(self)


def _name(entry: dict[str, Any]) -> str:
    return str(entry["target"]) if entry.get("target") else "build node"


def parse_validated_on(text: str, *, source: str = VALIDATED_ON_TAG) -> list[dict[str, Any]]:
    """The entries of a `tailguard.validated_on` tag value (JSON list of objects with isa/gpu).

    Raises:
        InputError: not a JSON list of objects.
    """
    try:
        entries = json.loads(text)
    except ValueError as exc:
        raise InputError(f"{source}: not JSON ({exc})",
                         hint="re-run the pipeline that registered the version") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise InputError(f"{source}: expected a JSON list of objects, got {type(entries).__name__}",
                         hint="re-run the pipeline that registered the version")
    return entries


CPU_PROVIDER = "CPUExecutionProvider"  # what the monitor recomputes the candidate with (OrtRunner's default)


def check_node(node: dict[str, str], entries: list[dict[str, Any]], *, version: str | None = None,
               execution_provider: str | None = None) -> NodeCheck:
    """Compare this node's kernel facts with the nodes a variant was validated on.

    Args:
        node: this node's `kernel_facts` ({"cpu", "isa", "gpu"}).
        entries: `parse_validated_on` entries; only those that passed count (a node where the variant failed or
            was skipped validates nothing).
        version: the registry version they came from, for the record.
        execution_provider: the version's `tailguard.execution_provider` (None: the CPU's). The monitor recomputes
            on the CPU, so for the CPU's the ISA flags are compared (`fact_differences(..., compare=("isa",))`);
            for another one the recomputation never matches the serving one.

    Returns:
        MATCHED when a passing entry has no differences with `node`; MISMATCH (with the differences against the
        closest passing entry) when every one differs; UNKNOWN when none passed or there are no entries.
    """
    passing = [e for e in entries if e.get("passed")]
    validated = [{k: e.get(k) for k in ("target", "isa", "gpu", "cpu", "placement")} for e in passing]
    if not entries:
        return NodeCheck(NodeCheckStatus.UNKNOWN.value, node, version=version, reason=(
            f"the version has no {VALIDATED_ON_TAG} record (registered before tailguard recorded it)"))
    if not passing:
        return NodeCheck(NodeCheckStatus.UNKNOWN.value, node, version=version, reason=(
            f"the version passed its gates on none of its {len(entries)} recorded node(s)"))
    provider = execution_provider or CPU_PROVIDER
    if provider != CPU_PROVIDER:
        closest = passing[0]
        return NodeCheck(NodeCheckStatus.MISMATCH.value, node, closest=_name(closest), validated=validated,
                         version=version, differences={"execution_provider": {
                             "node": f"{CPU_PROVIDER} (the monitor recomputes on the CPU)", "validated": provider}},
                         reason=(f"the version was validated on {provider}; the monitor recomputes the candidate on "
                                 "the CPU, so its recomputed outputs are never the serving node's"))
    diffs = [(e, fact_differences(node, {"isa": str(e.get("isa", "unknown")), "gpu": str(e.get("gpu", "none"))},
                                  compare=("isa",)))
             for e in passing]
    for e, d in diffs:
        if not d:
            return NodeCheck(NodeCheckStatus.MATCHED.value, node, matched=_name(e), validated=validated,
                             version=version, reason=f"this node has the ISA flags of {_name(e)}")
    closest, d = min(diffs, key=lambda x: len(x[1]))
    return NodeCheck(NodeCheckStatus.MISMATCH.value, node, closest=_name(closest), differences=d,
                     validated=validated, version=version, reason=(
                         f"this node matches none of the {len(passing)} node(s) the variant passed on; closest: "
                         f"{_name(closest)} (differs in {', '.join(d)})"))


_VERSION = re.compile(r"^(?P<name>.+)/(?P<version>\d+)$")
_ALIAS = re.compile(r"^(?P<name>.+)@(?P<alias>[\w\-]+)$")


def read_model_version(ref: str, tracking_uri: str | None = None, *, hint: str = "name a registered version of "
                       "the candidate (the alias it was fetched by)") -> Any:
    """The registry version `--candidate-version` names (the one reader of that option: the node check, the
    centroids of nearest_centroid slices).

    Args:
        ref: NAME@ALIAS or NAME/VERSION, optionally as a models:/ URI (the init container's CANDIDATE_MODEL_URI).
        tracking_uri: the MLflow registry (None: $MLFLOW_TRACKING_URI, MLflow's default).
        hint: the fix printed when the registry has no such model, alias or version.

    Returns:
        The mlflow.entities.model_registry.ModelVersion.

    Raises:
        InputError: `ref` is neither form; no such model, alias or version.
    """
    import mlflow
    from mlflow.exceptions import MlflowException

    text = ref.strip().removeprefix("models:/")
    m = _ALIAS.match(text) or _VERSION.match(text)
    if m is None:
        raise InputError(f"--candidate-version: {ref!r} names neither an alias nor a version",
                         hint="write NAME@ALIAS (e.g. minilm-embedder-optimized@production) or NAME/VERSION")
    g = m.groupdict()
    client = mlflow.MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    try:
        return (client.get_model_version_by_alias(g["name"], g["alias"]) if "alias" in g
                else client.get_model_version(g["name"], g["version"]))
    except MlflowException as exc:
        raise InputError(f"--candidate-version: {ref!r}: {str(exc).splitlines()[0]}", hint=hint) from None


def read_validated_on(ref: str, tracking_uri: str | None = None
                      ) -> tuple[str, list[dict[str, Any]], str | None, str | None]:
    """The `tailguard.validated_on` entries of the registry version `ref`, and its execution provider.

    Args:
        ref: NAME@ALIAS or NAME/VERSION, optionally as a models:/ URI (the init container's CANDIDATE_MODEL_URI).
        tracking_uri: the MLflow registry (None: $MLFLOW_TRACKING_URI, MLflow's default).

    Returns:
        ("name/version", entries, the version's `tailguard.execution_provider` or None, its `tailguard.sha256`
        (the model file's digest) or None); entries [] when the version has no tag.

    Raises:
        InputError: `ref` is neither form; no such model, alias or version; an unreadable tag.
    """
    mv = read_model_version(ref, tracking_uri)
    where = f"{mv.name}/{mv.version}"
    tags = mv.tags or {}
    tag = tags.get(VALIDATED_ON_TAG)
    entries = parse_validated_on(tag, source=f"{where} tag {VALIDATED_ON_TAG}") if tag else []
    return where, entries, tags.get(EXECUTION_PROVIDER_TAG) or None, tags.get(SHA256_TAG) or None


def run_node_check(ref: str | None, tracking_uri: str | None = None, *,
                   node: dict[str, str] | None = None, candidate_file: str | Path | None = None) -> NodeCheck:
    """The monitor's check at start: this node (`node`, default `kernel_facts(node_facts())`) against the version
    `ref` (`read_validated_on`); NOT_CONFIGURED without `ref`, UNKNOWN (with the error) when the registry cannot be
    read. With `candidate_file` (the `--candidate` file), its sha256 is compared with the version's
    `tailguard.sha256` first: a file that is not that version's model is a MISMATCH (`differences["sha256"]`),
    whatever the node, since the version's validated nodes say nothing about another file. Never raises: the
    monitor serves whatever the outcome."""
    here = node if node is not None else kernel_facts(node_facts())
    if not ref:
        return NodeCheck(NodeCheckStatus.NOT_CONFIGURED.value, here, reason=(
            "no --candidate-version: the nodes the candidate was validated on are unknown to this monitor"))
    try:
        version, entries, provider, digest = read_validated_on(ref, tracking_uri)
        if candidate_file is not None and digest and Path(candidate_file).is_file():
            from tailguard.core.digests import file_sha256

            got = file_sha256(Path(candidate_file))
            if got != digest:
                return NodeCheck(NodeCheckStatus.MISMATCH.value, here, version=version,
                                 differences={"sha256": {"node": got, "validated": digest}},
                                 reason=(f"the candidate file {Path(candidate_file).name} (sha256 {got[:12]}...) "
                                         f"is not the model of {version} (sha256 {digest[:12]}...): fetch that "
                                         "version, or name the version the file came from"))
    except InputError as exc:
        return NodeCheck(NodeCheckStatus.UNKNOWN.value, here, reason=exc.message)
    except Exception as exc:  # noqa: BLE001 - an unreachable registry must not stop the monitor
        return NodeCheck(NodeCheckStatus.UNKNOWN.value, here,
                         reason=f"the registry could not be read: {type(exc).__name__}: {str(exc)[:300]}")
    return check_node(here, entries, version=version, execution_provider=provider)
