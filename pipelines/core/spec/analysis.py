"""The spec's `analysis` section: what validation computes beyond the gates (worst samples, worst-slice discovery,
bootstrap and sequential-decision settings, per-node sensitivity, the embedding metrics' k and tolerance).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tailguard.core.spec.base import SpecModel


class DiscoverySpec(SpecModel):
    """Automatic worst-slice discovery over metadata columns (components/validate/discovery.py)."""

    enabled: bool = Field(True, description="Search metadata columns for the worst slices.")
    columns: list[str] | None = Field(None, description=(
        "Metadata columns searched (default: every validation column that is not a model input or the label)."))
    pairs: bool = Field(True, description="Also search pairs of columns (conjunctions of two values).")
    metric: str | None = Field(None, description=(
        "Parity metric compared (default: classification top1_agreement, embedding nn_top1_agreement, "
        "regression/generic abs_error.mean)."))
    min_support: int = Field(30, ge=5, description=(
        "A tested slice needs at least this many validation rows (and so does the rest)."))
    max_bins: int = Field(4, ge=2, le=20, description="Numeric columns are cut into this many quantile bins.")
    max_values: int = Field(100, ge=2, description="Categorical columns with more distinct values are skipped.")
    alpha: float = Field(0.05, gt=0, lt=0.5, description=(
        "False discovery rate (Benjamini-Hochberg) across every slice tested."))
    max_results: int = Field(20, ge=1, description="Report at most this many discovered slices (worst first).")


class BootstrapSpec(SpecModel):
    """Percentile bootstrap for confidence bounds of metrics that are not proportions."""

    samples: int = Field(1000, ge=100, description="Bootstrap resamples.")
    seed: int = Field(0, description="Seed: the same data give the same bounds.")


class SensitivitySpec(SpecModel):
    """Per-node quantization sensitivity of INT8 variants, also when no search runs (components/search/README.md)."""

    enabled: bool = Field(False, description=(
        "Rank the quantizable nodes of every INT8 onnxruntime variant by the output error of quantizing each one "
        "alone (calibration rows); sensitivity.csv and sensitivity.png go to the variant's run. A search always "
        "does this for the variant it searches."))
    samples: int = Field(64, ge=1, description="Calibration rows used.")


class EmbeddingAnalysisSpec(SpecModel):
    """Settings of the label- and retrieval-aware embedding metrics (pipelines/core/parity.py)."""

    knn_k: int = Field(1, ge=1, le=100, description=(
        "accuracy / reference_accuracy (task embedding, with data.validation.label_column): the label predicted "
        "for a row is the majority label of its knn_k nearest FP32 neighbours (ties: the nearer neighbour's)."))
    recall_k: int = Field(10, ge=1, le=1000, description=(
        "nn_recall_at_k: share of the FP32 query's k nearest neighbours that the variant's query also ranks in "
        "its k nearest."))
    margin_tolerance: float = Field(0.01, ge=0, le=2, description=(
        "nn_top1_margin_agreement: a top-1 disagreement counts only where the FP32 query's top-1 and top-2 "
        "cosine similarities differ by more than this (a near-tie may flip under any rounding)."))


class SequentialSpec(SpecModel):
    """Parity decided sequentially (issue 25): validation rows are scored in a seeded shuffled order, block by block,
    and each parity gate is decided as soon as a confidence sequence for its all-rows value says which side of its
    threshold that value falls (docs/spec.md, Sequential validation)."""

    enabled: bool = Field(True, description=(
        "Score the validation rows in shuffled blocks and stop when the gates are decided; false scores every row "
        "(the decisions on all rows are the same either way)."))
    alpha: float = Field(0.01, gt=0, lt=0.5, description=(
        "Per gate: the chance that a gate decided before the last row differs from its decision on every row "
        "(the prior-posterior-ratio confidence sequence of Waudby-Smith & Ramdas 2020, split evenly over the "
        "gate's slice groups)."))
    block_rows: int = Field(100, ge=1, description="Rows scored between two looks at the gates.")
    min_rows: int = Field(200, ge=1, description=(
        "No gate is decided on fewer rows than this (all rows when the validation set is smaller)."))
    seed: int = Field(0, description="Seed of the row order: the same data and seed score the same rows.")
    stop: Literal["verdict", "all_gates"] = Field("verdict", description=(
        "verdict: stop as soon as the variant's verdict is known (every gate decided passed, or one decided "
        "failed: the others are then reported undecided; a variant a parity gate failed is not timed, its "
        "latency gates undecided); all_gates: stop only when every gate is decided, every variant timed."))


class AnalysisSpec(SpecModel):
    """What validation computes beyond the gates: tail samples, worst-slice discovery, bootstrap settings."""

    worst_k: int = Field(50, ge=0, description=(
        "Keep the k validation rows with the worst per-row parity (worst_samples.csv, with their metadata)."))
    discovery: DiscoverySpec = Field(default_factory=DiscoverySpec, description="Worst-slice discovery.")
    bootstrap: BootstrapSpec = Field(default_factory=BootstrapSpec, description="Bootstrap for bounds.")
    sensitivity: SensitivitySpec = Field(default_factory=SensitivitySpec, description=(
        "Per-node sensitivity of INT8 variants without a search."))
    embedding: EmbeddingAnalysisSpec = Field(default_factory=EmbeddingAnalysisSpec, description=(
        "k and tolerance of the embedding metrics accuracy (kNN), nn_recall_at_k and nn_top1_margin_agreement."))
    sequential: SequentialSpec = Field(default_factory=SequentialSpec, description=(
        "Score validation rows in shuffled blocks until every gate is decided (anytime-valid decisions)."))
