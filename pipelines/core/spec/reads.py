"""What each pipeline step reads of the spec, declared in one place (issue 40 item 2).

Every KFP task receives a `spec_yaml`, but no step reads all of it. What a step reads decides three things that
used to be spelled out separately: the spec a pure task is given (`tailguard.pipeline.step_spec_yaml`: what it does
not read gets its default, so a change there leaves KFP's and the local cache's keys alone), what reference-pass's
cache key takes of `gates` (`components/reference/logic.py` `timing_gates_key`), and what a gate-only re-run may
change and when it may not run at all (`tailguard.rerun.REDECIDED_SECTIONS`, `components/redecide/logic.py`
`spec_reasons`). They all read the declarations below (the idea of Olive's pass that declares its own config beside
its code, `olive/passes/olive_pass.py`): a new spec section is read by a step only once it is listed here.

Paths are dotted spec field names (`model`, `analysis.sensitivity`); a path names the field and everything under
it. Plain data: nothing of tailguard is imported, so the kernel, the components and the application can all read it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class SpecReads:
    """The spec fields one step reads.

    Attributes:
        step: the step's task name (`build-<variant>` for the builds).
        paths: dotted paths of the fields it reads (each with everything under it).
        ignores: paths under `paths` that it does not read (`model.version`: the concrete version reaches the
            step as fetch-reference's artifact).
        variants: which `variants` entries it reads: "none" (given one canonical FP32 variant, a spec needs
            one), "own" (its own, its `search` only by its presence) or "all".
        gates: what it reads of `gates`: "none", "baseline_batch_sizes" (only the batch sizes at which a speed gate
            reads reference-pass's baselines, `timing_gates_key`) or "all".
    """

    step: str
    paths: tuple[str, ...]
    ignores: tuple[str, ...] = ()
    variants: Literal["none", "own", "all"] = "none"
    gates: Literal["none", "baseline_batch_sizes", "all"] = "none"


# What the measuring steps read: the model and its data, the slices, how to time, whether to rank nodes.
_MEASURED = ("apiVersion", "kind", "metadata.name", "model", "data", "slices", "benchmark", "analysis.sensitivity")
_NOT_MEASURED = ("model.version", "data.expectations")

EXPORT = SpecReads("export", _MEASURED, _NOT_MEASURED)
REFERENCE_PASS = SpecReads("reference-pass", _MEASURED, _NOT_MEASURED, gates="baseline_batch_sizes")
BUILD = SpecReads("build-<variant>", _MEASURED, _NOT_MEASURED, variants="own")
# The decision: the validate step's gate verdicts (replayed on stored measurements by a re-decide) and
# register-and-promote. These are the sections a gate-only re-run may change.
DECIDE = SpecReads("decide", ("gates", "promotion"), variants="all", gates="all")

# Spec fields under which a measuring step's own work depends on the decided sections, so that a gate-only re-run
# cannot replay it on stored measurements: {path: why}. `spec_reasons` refuses a spec where one is set.
NOT_REPLAYABLE: dict[str, str] = {
    "serving_targets": "the spec has serving_targets (one validation per target)",
    "variants.search": ("variant {name!r} has a search: which trials run and which is chosen depend on the gates, "
                        "so the search runs again"),
}

# The canonical FP32 variant a step that reads no variant is given (a spec needs one).
CANONICAL_VARIANT: dict[str, str] = {"name": "fp32", "backend": "onnxruntime", "precision": "fp32"}


def _get(doc: Any, path: list[str]) -> tuple[bool, Any]:
    for key in path:
        if not isinstance(doc, dict) or key not in doc:
            return False, None
        doc = doc[key]
    return True, doc


def _put(doc: dict[str, Any], path: list[str], value: Any) -> None:
    for key in path[:-1]:
        doc = doc.setdefault(key, {})
    doc[path[-1]] = value


def step_view(doc: dict[str, Any], reads: SpecReads, variant: str | None = None) -> dict[str, Any]:
    """The part of a spec document (`Spec.model_dump(mode="json")`) that a step reads; every other field is left
    out, so that parsing the result gives it its default.

    `gates` are kept only when the step reads them ("all"); otherwise `gates` is [] and `promotion` is
    {enabled: false} (a spec without a parity gate is valid only so), unless the step reads `promotion`.

    Args:
        doc: the spec as a JSON-able dict.
        reads: the step's declaration.
        variant: the step's own variant (with `reads.variants == "own"`).

    Returns:
        A new dict (the input is not changed).

    Raises:
        KeyError: `reads.variants` is "own" and `variant` is not a variant of the spec.
    """
    out: dict[str, Any] = {}
    for path in reads.paths:
        found, value = _get(doc, path.split("."))
        if found:
            _put(out, path.split("."), copy.deepcopy(value))
    for path in reads.ignores:
        *parent, last = path.split(".")
        found, where = _get(out, parent)
        if found and isinstance(where, dict):
            where.pop(last, None)
    if reads.variants == "all":
        out["variants"] = copy.deepcopy(doc["variants"])
    elif reads.variants == "own":
        mine = [copy.deepcopy(v) for v in doc["variants"] if v["name"] == variant]
        if not mine:
            raise KeyError(f"variant {variant!r} is not in the spec; variants: {[v['name'] for v in doc['variants']]}")
        if mine[0].get("search") is not None:
            mine[0]["search"] = {}  # read only by its presence
        out["variants"] = mine
    else:
        out["variants"] = [dict(CANONICAL_VARIANT)]
    out["gates"] = copy.deepcopy(doc.get("gates", [])) if reads.gates == "all" else []
    if reads.gates != "all" and "promotion" not in reads.paths:
        out["promotion"] = {"enabled": False}
    return out


def not_replayable(doc: dict[str, Any]) -> str | None:
    """Why a gate-only re-run cannot replay a spec document (`NOT_REPLAYABLE`, first match), or None.

    Args:
        doc: the spec as a JSON-able dict (`Spec.model_dump(mode="json")`).
    """
    for path, why in NOT_REPLAYABLE.items():
        head, _, field = path.partition(".")
        value = doc.get(head)
        if not field:
            if value:
                return why
            continue
        for item in value or []:
            if isinstance(item, dict) and item.get(field) is not None:
                return why.format(name=item.get("name"))
    return None
