"""`tailguard bench MODEL`: an independent check of a registered variant's speed (issue 37, item 4).

Times any registered version of `<model>-optimized` against the FP32 references it was built from, torch eager
and the unoptimized ONNX FP32 export, in one interleaved run: the promotion's paired rounds
(components/register/promotion.py `compare_passing`, same batches, order alternating, every ONNX Runtime session built
by `tailguard.core.runtime.timed_ort_runner`), at the spec's promotion batch size, on the spec's validation rows.
It prints the table a run prints (`tailguard.terminal.print_summary`): p50 / p99 and the speed-ups with their
one-sided 95% bounds, from those rounds only.

Where the pieces come from: the version's files (`tailguard.fetch.fetch_model`, sha256 checked); the reference
version it was built from (its `tailguard.source_version` / `tailguard.source_sha256` tags) downloaded and exported
to ONNX as a run does (the fetch-reference and export steps, served by the local cache under $TAILGUARD_HOME when a
run made them already); the variant's backend from its `tailguard.backend` / `tailguard.precision` tags and the
spec's variant of the same name (`tailguard.variant`, a '-searched' row's base variant).
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path
from typing import Any

from tailguard.core.contract import BACKEND_TAG, PRECISION_TAG, SOURCE_SHA256_TAG, SOURCE_VERSION_TAG, VARIANT_TAG
from tailguard.core.errors import InputError, StepError
from tailguard.core.spec.root import Spec

SEARCHED_SUFFIX = "-searched"


def variant_spec_of(spec: Spec, tags: dict[str, str]) -> Any:
    """The spec's VariantSpec of a registered version (by its `tailguard.variant` tag; a '<V>-searched' version
    runs as V), else one made from its backend and precision tags (CPU).

    Raises:
        InputError: the version has no `tailguard.backend` tag (not registered by tailguard).
    """
    from tailguard.core.spec.variants import VariantSpec

    name = tags.get(VARIANT_TAG) or ""
    base = name[: -len(SEARCHED_SUFFIX)] if name.endswith(SEARCHED_SUFFIX) else name
    for v in spec.variants:
        if v.name == base:
            return v.model_copy(update={"name": name})
    backend, precision = tags.get(BACKEND_TAG), tags.get(PRECISION_TAG)
    if not backend or not precision:
        raise InputError(f"MODEL: the version has no {BACKEND_TAG} / {PRECISION_TAG} tags",
                         hint="bench times versions that tailguard registered (`tailguard run`)")
    extra = {"device": "cpu"} if backend == "torch" else {}
    return VariantSpec(name=name or f"{backend}-{precision}", backend=backend, precision=precision, **extra)


def bench_model(ref: str, spec: Spec, *, tracking_uri: str | None = None, batch_size: int | None = None) -> Any:
    """Time the registered version `ref` against torch eager and the ONNX FP32 export in one interleaved run.

    Args:
        ref: "NAME@ALIAS" or "NAME/VERSION" (a `models:/` prefix is accepted) of a version tailguard registered.
        spec: the spec it was built with (model inputs, data.validation, benchmark, analysis.bootstrap).
        tracking_uri: the MLflow store (default: $MLFLOW_TRACKING_URI, else the local store under $TAILGUARD_HOME).
        batch_size: rows per batch (default: the spec's promotion batch size, else its first benchmark one).

    Returns:
        A RunSummary with one row (its `paired` figures) and `promotion_comparison` (the rounds), for
        `print_summary`.

    Raises:
        InputError: `ref` unknown or malformed, a version without its source tags, or a model that cannot be
            timed on this node's CPU (exit 2).
        StepError: the download or the timing failed (exit 1).
    """
    from tailguard.components.export.task import main as export_main
    from tailguard.components.register.promotion import PromotionDecision, apply_paired, compare_passing
    from tailguard.components.register.summary import RunSummary, VariantSummary
    from tailguard.components.register.task import baseline_runners
    from tailguard.components.resolve.task import fetch_main
    from tailguard.core.results import VariantResult
    from tailguard.core.spec import dump_spec
    from tailguard.fetch import fetch_model

    bs = batch_size or spec.promotion.batch_size or spec.benchmark.batch_sizes[0]
    with tempfile.TemporaryDirectory(prefix="tailguard-bench-") as tmp:
        work = Path(tmp)
        got = fetch_model(ref, work / "variant", tracking_uri=tracking_uri)
        tags = got.tags
        source, sha = tags.get(SOURCE_VERSION_TAG), tags.get(SOURCE_SHA256_TAG)
        if not source or not sha:
            raise InputError(f"MODEL: {got.name} v{got.version} has no {SOURCE_VERSION_TAG} / {SOURCE_SHA256_TAG} "
                             "tags: its FP32 reference is unknown",
                             hint="bench times versions that tailguard registered (`tailguard run`)")
        variant = variant_spec_of(spec, tags)
        name = variant.name
        model = spec.model.model_copy(update={"version": source})
        with contextlib.redirect_stdout(io.StringIO()):  # the steps' TAILGUARD_TASK_TIMING lines
            fetched = fetch_main(tracking_uri=got.tracking_uri, model_json=model.model_dump_json(), version=source,
                                 sha256=sha, out_dir=str(work / "reference"),
                                 registry_uri=spec.mlflow.registry_uri or "")
            export_main(spec_yaml=dump_spec(spec), resolved_json=fetched, reference_dir=str(work / "reference"),
                        out_dir=str(work / "onnx"))
        row = VariantSummary(variant=name, backend=variant.backend, precision=variant.precision, status="ok",
                             passed=True, version=got.version, p50_ms=0.0)
        result = VariantResult(name, variant.backend, variant.precision, "ok", passed=True,
                               model_uri=str(work / "variant"))
        comparison = compare_passing(
            spec, [row], {name: result}, {name: variant}, margin=float(spec.promotion.margin or 0.0), batch_size=bs,
            baselines=lambda: baseline_runners(spec, fetched, str(work / "reference"), str(work / "onnx")))
        if comparison is None:
            raise StepError(f"{got.name} v{got.version} ({variant.backend}, {variant.precision}) could not be timed "
                            "here: a CPU variant of onnxruntime or torch is needed, and the benchmark budget must "
                            "allow 30 rounds (the error above, if any)", step="bench",
                            hint="raise benchmark.max_seconds in the spec, or bench a CPU variant")
        row.p50_ms = comparison["p50_ms"][name]
        apply_paired([row], comparison, PromotionDecision(row, "bench", ""))
    summary = RunSummary(parent_run_id="", experiment_id="", source_model=spec.model.registered_name,
                         source_version=str(source), optimized_model=got.name, alias="", promotion_enabled=False,
                         batch_size=bs, variants=[row], promotion_comparison=comparison)
    summary.promotion_reason = (f"bench of {got.name} v{got.version} ({name}) against torch eager and the ONNX FP32 "
                                f"export of v{source}, {comparison['rounds']} interleaved rounds at batch {bs}")
    return summary
