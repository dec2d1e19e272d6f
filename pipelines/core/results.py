"""Typed step results: what one step hands the next as a JSON file, instead of tags and metric names.

Two results cross a unit boundary:

    BuildResult      a build (quantize/compile): status ok | failed | skipped, reason, artifact, details. The build
                    task returns it as JSON; the validate task reads it and logs it as build.json.
    VariantResult   one candidate's validation: the validate task writes it for every outcome (ok, failed build,
                    skipped build) as the artifact variant_result.json of the variant's MLflow run, the search
                    task writes it for the chosen trial's '<V>-searched' run; the register step reads it (and
                    only it) to build each summary row and to decide promotion. `passed` is decided once, by the
                    validate step's `gates.verdict`, and stored here; readers never recompute it.

MLflow tags and metrics stay as they are (the MLflow UI, the docs and dashboards read them); the files are the
channel between steps. Each file carries `schema_version`; a reader refuses a version it does not know
(`ResultFormatError`) instead of guessing at renamed fields.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

from tailguard.core.errors import InputError


# The status vocabularies that cross units. Str-valued (StrEnum): a member is the string it names, so JSON files,
# MLflow tags and comparisons with text read from them are the same as with the plain words.
class BuildStatus(StrEnum):
    """A build's and a candidate's status (BuildResult.status, VariantResult.status, the tag tailguard.status, the
    summary's build_status)."""

    OK = "ok"            # built (and, for a candidate, validated)
    FAILED = "failed"    # the step or the validation broke: the reason says where
    SKIPPED = "skipped"  # cannot be built on this node (e.g. TensorRT without a GPU): the reason says why


class GateStatus(StrEnum):
    """One gate's status for one variant (GateResult.status, the tag gate.<key>, VariantResult.gates)."""

    PASSED = "passed"
    FAILED = "failed"
    INSUFFICIENT_DATA = "insufficient_data"  # no group reached min_support: not judged, never counted as passed
    NOT_APPLICABLE = "not_applicable"        # the gate's `variants` list does not name this variant
    UNDECIDED = "undecided"                  # sequential validation stopped on another gate's failure first


class GatesVerdict(StrEnum):
    """A candidate run's tag tailguard.gates: its gates' verdict, or that none was judged."""

    PASSED = "passed"
    FAILED = "failed"
    NOT_EVALUATED = "not_evaluated"  # the build failed or was skipped, or a search trial not validated


class PromotionStatus(StrEnum):
    """What a run's promotion did (tag tailguard.promotion, RunSummary.promotion, `promote`'s outcome)."""

    PROMOTED = "promoted"          # the alias moved to this run's version
    SUPERSEDED = "superseded"      # a concurrent run's promotion replaced this one's
    NOT_PROMOTED = "not_promoted"  # no alias moved


class RunOutcome(StrEnum):
    """A parent run's tag tailguard.outcome."""

    PROMOTED = "promoted"
    SUPERSEDED = "superseded"
    NO_PASSING_VARIANT = "no_passing_variant"
    PROMOTION_DISABLED = "promotion_disabled"  # variants passed, but the promotion moved no alias
    FAILED = "failed"                          # a task failed or the run was interrupted (tracking.mark_failed)

# Bump when a field is renamed, removed or changes meaning (adding an optional field is not a bump).
BUILD_RESULT_SCHEMA = 1
VARIANT_RESULT_SCHEMA = 1


class ResultFormatError(InputError):
    """A result file that cannot be read: not JSON, a missing field, or a schema version this tailguard does not
    know (written by another tailguard version). Exit code 2: re-run the step with this version."""


def number_or_none(value: Any) -> float | None:
    """A metric value as a float, or None where there is no number: None, a value float() refuses, or NaN.

    NaN is "not measured" here (a gate's estimate or bound over no rows, a metric missing from a result): it must
    not order or compare as a value (it would drop a search trial off the Pareto front instead of letting its
    overall value stand in, and is not valid JSON). +-inf are kept: they are measured worst cases (non-finite rows
    score +inf for errors, tailguard.core.parity).

    Args:
        value: a Python or numpy number, or anything else.

    Returns:
        float (inf kept) or None.
    """
    if value is None:
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def json_ready(obj: Any, *, nan_as_none: bool = False) -> Any:
    """`obj` with numpy scalars turned into Python numbers and tuples into lists, for json.dumps.

    Args:
        obj: a number, numpy scalar, str, dict, list or tuple (nested).
        nan_as_none: False keeps inf/NaN (results files); True writes NaN as None (JSON null: tables a reader
            loads with pandas, e.g. the search's trials).
    """
    if isinstance(obj, dict):
        return {str(k): json_ready(v, nan_as_none=nan_as_none) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v, nan_as_none=nan_as_none) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):  # numpy scalar
        obj = obj.item()
    if nan_as_none and isinstance(obj, float) and math.isnan(obj):
        return None
    return obj


def _check_version(d: Any, expected: int, what: str, source: str, *, missing_ok: bool = False) -> None:
    if not isinstance(d, dict):
        raise ResultFormatError(f"{source}: a {what} must be a JSON object, got {type(d).__name__}",
                                hint=f"re-run the step that writes the {what}")
    version = d.get("schema_version")
    if version is None and missing_ok:
        return
    if version != expected:
        raise ResultFormatError(
            f"{source}: {what} schema_version {version!r} is not the {expected} this tailguard reads",
            hint="re-run the pipeline with this tailguard version (the file was written by another one)")


def _build(cls: type, d: dict[str, Any], what: str, source: str) -> Any:
    known = {f.name for f in fields(cls)}
    try:
        return cls(**{k: v for k, v in d.items() if k in known})
    except (TypeError, ValueError) as exc:
        raise ResultFormatError(f"{source}: not a valid {what}: {exc}",
                                hint=f"re-run the step that writes the {what}") from None


def _check_status(status: Any, what: str) -> None:
    if status not in tuple(BuildStatus):
        raise ValueError(f"{what}.status must be one of {[s.value for s in BuildStatus]}, got {status!r}")


# ------------------------------------------------------------------------------------------------ BuildResult
@dataclass
class BuildResult:
    """Outcome of one build step for one variant.

    Attributes:
        status: ok | failed | skipped.
        reason: why it failed or was skipped ("" when ok).
        artifact: path of the produced model file, if any.
        details: JSON-serializable facts about the build (node counts, timings in s, sizes in bytes).

    Raises:
        ValueError: status is not ok | failed | skipped.
    """

    status: BuildStatus
    reason: str = ""
    artifact: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_status(self.status, "BuildResult")

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form, with `schema_version`."""
        return {**json_ready(asdict(self)), "schema_version": BUILD_RESULT_SCHEMA}

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "build result") -> "BuildResult":
        """Inverse of `to_dict`. Keys it does not know (the build task's "variant", "cached") are ignored; a dict
        without `schema_version` (written before it existed, e.g. a local cache entry) reads as version 1.

        Args:
            d: the parsed JSON.
            source: the file or output it came from, for error messages.

        Raises:
            ResultFormatError: another schema version, a missing status, or an unknown status.
        """
        _check_version(d, BUILD_RESULT_SCHEMA, "build result", source, missing_ok=True)
        return _build(cls, d, "build result", source)


# ------------------------------------------------------------------------------------------------ VariantResult
@dataclass(frozen=True)
class VariantResult:
    """What the validate step decided for one candidate (a spec variant or a search's '<V>-searched').

    Attributes:
        variant: the candidate's name (the run's tailguard.variant).
        backend, precision: the spec variant's (for '<V>-searched': V's).
        status: ok (built and validated) | failed | skipped (the build's status when it was not ok).
        passed: the candidate passed every gate, as the validate step's `gates.verdict` decided it (False for every
            status other than ok; an insufficient-data gate is not passed). Readers never recompute it.
        reason: why not passed ("failed gates: ...", "not promoted: gate X had insufficient data", the build's
            reason), "" when passed.
        run_id: the MLflow run this file is an artifact of.
        model_uri: the logged MLflow model ("runs:/<id>/model" or "models:/m-..."), None when none was logged.
        sha256: hex sha256 of the validated .onnx file, None when none.
        perf: {batch size: {perf metric: value}} at every benchmark batch size: latency_ms.p50/.p95/.p99/.mean
            (ms), throughput_per_s (rows/s), usd_per_1m_inferences (USD), speedup_vs_torch,
            speedup_vs_onnx_fp32 (+ .lb95/.ub95 when timed interleaved), n_iterations; scalars only (the raw
            timings stay in result.json).
        overall: overall-scope metrics ({name: value}: parity metrics, peak_rss_mb, model_size_mb (MiB),
            quantized_mac_fraction).
        gates: one {gate, status, metric, observed, threshold} per spec gate (status passed | failed |
            insufficient_data | not_applicable; gate = the key as the spec and docs spell it).
        worst_slice: {slice, value, support, metric, observed} of the worst slice group, or None.
        discovered: up to 3 worst significant discovered slices ({slice, value, support, metric, value_in_slice,
            value_rest, q_value}); [] when none or discovery was off.
        quantized_mac_fraction: INT8 builds: MACs computed in INT8 / all MACs, in [0, 1]; else None.
        search_of: for '<V>-searched': the searched spec variant V; else None.
        trial_run_id: for '<V>-searched': the run of the chosen trial; else None.
        warnings: what the build flagged although no gate asked (its BuildResult details["warnings"]: fusion that
            did not happen, INT8 attention MatMuls without fused attention, the torch exporter's warnings);
            [] when none. Optional field: results written before it existed read with [].
        hardware_dependent: the validate step's numerics check (components/validate/numerics.py
            `compare_numerics`): True when a gate outcome or the worst slice's value differs beyond its
            tolerance between the node's INT8 kernels and exact integer accumulation, so the verdict may not hold
            on a CPU with another INT8 kernel; False when they agree; None when the check did not run (an FP32/
            FP16 graph cannot differ, a failed build). Optional field: older results read with None.
        numerics: the check's summary: {"status": consistent | hardware_dependent | not_checked, "reason",
            "tolerance", "metric", "native_worst" / "exact_worst" ({slice, value, support, metric, observed} or
            None), "worst_slice_delta", "max_slice_delta", "gate_differences" ([{gate, native, exact}]),
            "native_seconds" / "exact_seconds" (s)}; None when not recorded. Optional field.
        rows: rows of the validation set; rows_used: the rows scored (fewer when sequential validation decided
            every gate first, components/validate/sequential.py); None when not recorded. Optional fields.

    Raises:
        ValueError: status is unknown, or passed is True with status other than ok.
    """

    variant: str
    backend: str
    precision: str
    status: BuildStatus
    passed: bool = False
    reason: str = ""
    run_id: str | None = None
    model_uri: str | None = None
    sha256: str | None = None
    perf: dict[int, dict[str, float]] = field(default_factory=dict)
    overall: dict[str, float] = field(default_factory=dict)
    gates: list[dict[str, Any]] = field(default_factory=list)
    worst_slice: dict[str, Any] | None = None
    discovered: list[dict[str, Any]] = field(default_factory=list)
    quantized_mac_fraction: float | None = None
    search_of: str | None = None
    trial_run_id: str | None = None
    warnings: list[str] = field(default_factory=list)
    hardware_dependent: bool | None = None
    numerics: dict[str, Any] | None = None
    rows: int | None = None
    rows_used: int | None = None

    def __post_init__(self) -> None:
        _check_status(self.status, "VariantResult")
        if not isinstance(self.passed, bool):
            raise ValueError(f"VariantResult.passed must be true or false, got {self.passed!r}")
        if self.passed and self.status != BuildStatus.OK:
            raise ValueError(f"VariantResult.passed is true but status is {self.status!r} (only ok can pass)")
        if self.hardware_dependent is not None and not isinstance(self.hardware_dependent, bool):
            raise ValueError(f"VariantResult.hardware_dependent must be true, false or null, got "
                             f"{self.hardware_dependent!r}")

    def perf_value(self, batch_size: int, key: str) -> float | None:
        """perf[batch_size][key] as a float (e.g. perf_value(1, "latency_ms.p50") in ms); None when not measured
        or NaN."""
        v = (self.perf.get(batch_size) or {}).get(key)
        if v is None or isinstance(v, bool):
            return None
        f = float(v)
        return None if math.isnan(f) else f

    def gate_statuses(self) -> dict[str, str]:
        """{gate key: status} in spec order."""
        return {g["gate"]: g["status"] for g in self.gates}

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form, with `schema_version` (perf batch sizes become strings; `from_dict` turns them
        back; inf/NaN stay floats, so write with Python's json)."""
        d = json_ready(asdict(self))
        return {"schema_version": VARIANT_RESULT_SCHEMA, **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "variant result") -> "VariantResult":
        """Inverse of `to_dict`; keys it does not know are ignored.

        Args:
            d: the parsed JSON.
            source: the file or run it came from, for error messages.

        Raises:
            ResultFormatError: no or another `schema_version`, a missing or invalid field.
        """
        _check_version(d, VARIANT_RESULT_SCHEMA, "variant result", source)
        d = dict(d)
        try:
            d["perf"] = {int(k): dict(v) for k, v in (d.get("perf") or {}).items()}
        except (TypeError, ValueError, AttributeError):
            raise ResultFormatError(f"{source}: perf must map batch sizes to metric objects, got {d.get('perf')!r}",
                                    hint="re-run the validate step") from None
        d["gates"] = list(d.get("gates") or [])
        if any(not isinstance(g, dict) or "gate" not in g or "status" not in g for g in d["gates"]):
            raise ResultFormatError(f"{source}: every gates entry needs 'gate' and 'status'",
                                    hint="re-run the validate step")
        return _build(cls, d, "variant result", source)

    @classmethod
    def read(cls, path: str | Path) -> "VariantResult":
        """Read a variant_result.json.

        Raises:
            ResultFormatError: missing or unreadable file, or an invalid result (see `from_dict`).
        """
        p = Path(path)
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError) as exc:
            raise ResultFormatError(f"cannot read {p}: {exc}", hint="re-run the validate step") from None
        return cls.from_dict(d, source=str(p))
