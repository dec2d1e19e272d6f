"""The tailguard spec: one YAML file -> one tree of pydantic v2 models (extra="forbid").

This package's entry (`tailguard.core.spec`) reads, validates, dumps and describes a spec: `load_spec` /
`parse_spec` / `validate_spec` report every problem with its field path in one pass (`SpecError`, the text
`tailguard spec check` prints), `dump_spec` / `spec_from_yaml` carry a spec to the pipeline's tasks, and
`json_schema` is what `tailguard spec schema` prints (docs/spec.schema.json holds a copy; a test keeps it in step),
and `quantization_preset` builds a validated `QuantizationSpec` from a named preset (`tailguard.core.presets`).
The models are the truth: `root.py` (the root `Spec` and its cross-section checks), one module per section
(`model.py`, `data.py` with the slices, `variants.py`, `gates.py` with promotion, `analysis.py`, `benchmark.py` with
cost, `targets.py` with kubeflow, `monitor.py`), `base.py` (their common base, names and limits), `reads.py` (what
each pipeline step reads of a spec).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tailguard.core.errors import FieldError, SpecError
from tailguard.core.presets import QUANTIZATION_PRESETS
from tailguard.core.spec.gates import NO_PARITY_GATE, PARITY_GATE_EXAMPLE
from tailguard.core.spec.root import CROSS_FIELD_SEP, SKIP_CROSS_FIELD, Spec
from tailguard.core.spec.variants import QuantizationSpec


# --------------------------------------------------------------------------------------------- loading
def _loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and p.startswith("function-after")))


# Spec keys removed on purpose: `spec check` names them with what replaced them instead of "unknown field".
REMOVED_FIELDS: dict[str, str] = {
    "monitoring.correction": (
        "removed: the monitor's sequential detector controls false alarms over the stream and across slices by "
        "construction (monitoring.alpha over monitoring.horizon sampled requests, docs/monitor.md); delete this "
        "key"),
    "monitoring.clear_factor": (
        "removed: an alert clears when the recovery detector finds the slice back on the good side of its "
        "threshold (docs/monitor.md, Statistics and alerts); delete this key"),
    "promotion.select": (
        "removed: it had one value and nothing read it; the variant to promote is the fastest passing one decided "
        "with confidence by promotion.margin (docs/spec.md, Gates and promotion); delete this key"),
}


def field_errors(exc: ValidationError, *,
                 unknown: str = "unknown field (check the spelling; see `tailguard spec schema`)") -> list[FieldError]:
    """One FieldError per pydantic error of `exc` (dotted field path, message, offending input); cross-field
    problems ("<path>: <problem>" lines) become one FieldError each. `unknown` is the message for an unknown
    field, REMOVED_FIELDS' for a removed one. Used by the spec and by the trigger's config."""
    out: list[FieldError] = []
    for e in exc.errors(include_url=False):
        msg = e["msg"].removeprefix("Value error, ")
        loc = _loc(e["loc"])
        if e["type"] == "extra_forbidden":
            msg = REMOVED_FIELDS.get(loc, unknown)
        if e["type"] == "value_error" and not loc and re.match(r"^[A-Za-z_][\w.]*: ", msg):
            # cross-field (Spec._cross_field): "<field path>: <problem>" lines, one FieldError each
            for part in msg.split(CROSS_FIELD_SEP):
                field_path, _, text = part.partition(": ")
                out.append(FieldError(field_path, text or part))
            continue
        out.append(FieldError(loc, msg, e.get("input")))
    return out


_MAX_PRUNE_ROUNDS = 4


def _drop(doc: Any, loc: tuple[Any, ...]) -> bool:
    """Delete the mapping key at pydantic error location `loc` from `doc` (in place); parts that are not keys or
    indexes of the document (union tags, validator names) are skipped. False when the location ends at a list item
    or the root (deleting it would renumber the field paths of later errors) or is not found."""
    parts = [p for p in loc if not (isinstance(p, str) and ("[" in p or p.startswith("function-")))]
    if not parts:
        return False
    node = doc
    for part in parts[:-1]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            return False
    if isinstance(node, dict) and parts[-1] in node:
        del node[parts[-1]]
        return True
    return False


def _hidden_errors(data: dict[str, Any], exc: ValidationError) -> tuple[dict[str, Any], list[FieldError]]:
    """The cross-field errors (unknown gate metric, unknown slice, ...) that field errors kept from running.

    Pydantic runs Spec's model validators only when every field is valid, so a type error elsewhere would hide
    them until the user fixed it and tried again. This drops every invalid field from a copy of the document
    (optional fields then take their defaults) and validates again, a few rounds, collecting what the model
    validators find. Errors at the dropped fields themselves are not repeated.

    Returns:
        (the pruned document, the extra FieldErrors).
    """
    doc = copy.deepcopy(data)
    dropped: set[str] = set()
    extra: list[FieldError] = []
    for _ in range(_MAX_PRUNE_ROUNDS):
        progress = False
        for e in exc.errors(include_url=False):
            if _drop(doc, tuple(e["loc"])):
                dropped.add(_loc(tuple(e["loc"])))
                progress = True
        if not progress:
            return doc, extra
        try:
            Spec.model_validate(doc)
            return doc, extra
        except ValidationError as again:
            exc = again
            for fe in field_errors(again):
                if not any(fe.loc == d or fe.loc.startswith(d + ".") for d in dropped):
                    if not any(fe.loc == x.loc and fe.message == x.message for x in extra):
                        extra.append(fe)
    return doc, extra


def validate_spec(data: Any) -> tuple[Spec | None, list[FieldError]]:
    """Validate a parsed YAML/JSON document as a Spec and collect every problem at once.

    Field errors (types, unknown fields) and the cross-field errors they would otherwise hide (`_hidden_errors`)
    are returned together.

    Returns:
        (spec, errors): errors empty -> the Spec. Errors non-empty -> a partial Spec for further checks (e.g. of
        the data files): the document without its invalid optional fields, validated without the cross-field
        rules (whose errors are in `errors`); None when even that does not validate (a required field is wrong).
    """
    if not isinstance(data, dict):
        return None, [FieldError("", f"expected a mapping at the top level, got {type(data).__name__}")]
    try:
        return Spec.model_validate(data), []
    except ValidationError as exc:
        errors = field_errors(exc)
        doc = data
        if all(e["loc"] for e in exc.errors(include_url=False)):  # field errors: Spec's validators did not run
            doc, extra = _hidden_errors(data, exc)
            known = {(e.loc, e.message) for e in errors}
            errors += [e for e in extra if (e.loc, e.message) not in known]
        try:  # the rest of the spec, for checks beyond the spec itself (data files)
            partial: Spec | None = Spec.model_validate(doc, context={SKIP_CROSS_FIELD: True})
        except ValidationError:
            partial = None
        return partial, errors


def spec_error(errors: list[FieldError], data: Any, *, source: str = "spec") -> SpecError:
    """The SpecError for `errors` (from `validate_spec`), with a fix hint (the parity-gate example when the spec
    has no parity gate)."""
    hint = "fix the fields above; `tailguard spec schema` prints every field"
    if any(e.loc == "gates" and e.message.startswith(NO_PARITY_GATE) for e in errors):
        model_task = (data.get("model") or {}).get("task") if isinstance(data, dict) and isinstance(data.get("model"),
                                                                                               dict) else None
        example = PARITY_GATE_EXAMPLE.get(str(model_task), PARITY_GATE_EXAMPLE["embedding"])
        hint = (f"add a gate on a parity metric (overall or per_slice) for every variant, e.g. "
                f"`- {example}` under gates, or set `promotion: {{enabled: false}}` to register and report "
                "without moving the alias; " + hint)
    return SpecError(errors, source=source, hint=hint)


def parse_spec(data: Any, *, source: str = "spec") -> Spec:
    """Validate a parsed YAML/JSON document as a Spec.

    Raises:
        SpecError: with every problem and its field path.
    """
    spec, errors = validate_spec(data)
    if errors or spec is None:
        raise spec_error(errors or [FieldError("", "not a valid spec")], data, source=source)
    return spec


def load_spec(path: str | Path, *, resolve_paths: bool = True) -> Spec:
    """Load and validate a spec file.

    Args:
        path: YAML file.
        resolve_paths: make relative data URIs absolute, relative to the spec file's folder.

    Raises:
        SpecError: the file is missing, is not YAML, or is not a valid spec (every error with its field path).
    """
    p = Path(path)
    spec = parse_spec(read_spec_document(p), source=str(p))
    if resolve_paths:
        resolve_data_uris(spec, p)
    return spec


def read_spec_document(path: str | Path) -> Any:
    """The parsed YAML of a spec file (not validated).

    Raises:
        SpecError: the file is missing or is not YAML (with the line and column).
    """
    p = Path(path)
    if not p.is_file():
        raise SpecError([FieldError("", f"file not found: {p}")], source=str(p),
                        hint="pass the path of a spec YAML file")
    try:
        return yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError([FieldError("", f"not valid YAML{where}: {getattr(exc, 'problem', exc)}")],
                        source=str(p)) from None


def resolve_data_uris(spec: Spec, spec_path: str | Path) -> None:
    """Make relative data URIs absolute, relative to the spec file's folder (in place)."""
    base = Path(spec_path).resolve().parent
    for ds in (spec.data.calibration, spec.data.validation):
        if "://" not in ds.uri and not Path(ds.uri).is_absolute():
            ds.uri = str((base / ds.uri).resolve())


# Top-level keys added after the first release that `dump_spec` leaves out while they hold their default: the text
# tasks receive, and so the compiled IR and KFP's cache keys, stay the same for specs that do not use them.
OMITTED_WHEN_DEFAULT: dict[str, Any] = {"serving_targets": []}


def dump_spec(spec: Spec) -> str:
    """YAML text of a spec (what KFP tasks receive as the `spec_yaml` parameter); the OMITTED_WHEN_DEFAULT keys
    only when they differ from their default."""
    doc = spec.model_dump(mode="json", exclude_none=False)
    for key, default in OMITTED_WHEN_DEFAULT.items():
        if doc.get(key) == default:
            doc.pop(key, None)
    return yaml.safe_dump(doc, sort_keys=False)


def spec_from_yaml(text: str) -> Spec:
    """Inverse of `dump_spec`. Raises SpecError."""
    return parse_spec(yaml.safe_load(text))


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a spec (draft 2020-12, as pydantic generates it)."""
    schema = Spec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "https://tailguard.dev/schemas/tailguard-v1.json"
    return schema


# --------------------------------------------------------------------------------------------- presets
def quantization_preset(name: str, **overrides: Any):
    """A validated `QuantizationSpec` from a named preset, with field overrides.

    Args:
        name: a key of QUANTIZATION_PRESETS.
        **overrides: QuantizationSpec fields that replace the preset's.

    Returns:
        tailguard.core.spec.variants.QuantizationSpec.

    Raises:
        SpecError: unknown preset name (listing the known ones) or an invalid override.
    """
    if name not in QUANTIZATION_PRESETS:
        raise SpecError([FieldError("quantization.preset", f"unknown preset {name!r}; known: "
                                                          f"{sorted(QUANTIZATION_PRESETS)}")])
    try:
        return QuantizationSpec.model_validate({"preset": name, **overrides})
    except ValidationError as exc:
        raise SpecError([FieldError(".".join(map(str, e["loc"])) or "quantization", e["msg"])
                         for e in exc.errors(include_url=False)], source=f"preset {name}") from None
