"""The spec's `data` section (calibration and validation Parquet sets, extra expectations) and its `slices`
(declared groups of validation rows: by a metadata column, a request header or a value derived from the model's
tensors, `DeriveSpec`), with `derive_errors`, the derived slices' checks against the `model` section.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from tailguard.core.spec.base import MAX_SLICE_GROUPS, MAX_SLICE_NAME, SpecModel
from tailguard.core.spec.model import ModelSpec


# ---------------------------------------------------------------------------------------------- data
class Expectation(SpecModel):
    """A Great Expectations expectation, by its snake_case type and keyword arguments."""

    type: str = Field(description="e.g. expect_column_values_to_be_between", pattern=r"^expect_[a-z0-9_]+$")
    kwargs: dict[str, Any] = Field(default_factory=dict,
                                   description="Arguments, e.g. {column: n_tokens, min_value: 1}.")
    datasets: list[Literal["calibration", "validation"]] = Field(
        default_factory=lambda: ["calibration", "validation"], description="Datasets the expectation applies to.")


class DatasetSpec(SpecModel):
    """One Parquet dataset: a column per model input (array-valued), plus label and metadata columns."""

    uri: str = Field(description="Parquet file path (relative to the spec file) or s3:// URI.")
    max_samples: int | None = Field(None, ge=1, description="Use at most this many rows (seeded sample).")
    min_rows: int = Field(1, ge=1, description="Fewer rows fails the data check.")
    batch_size: int = Field(32, ge=1, description="Rows per inference batch (padded per batch).")
    label_column: str | None = Field(None, description=(
        "Ground-truth label column: classification accuracy (integer class ids), or embedding kNN label "
        "accuracy (any hashable labels)."))
    seed: int = Field(0, description="Seed for the max_samples subsample.")


class CalibrationSpec(DatasetSpec):
    """The calibration set for static quantization."""

    max_samples: int | None = Field(256, ge=1, description="Calibration rows (seeded sample).")
    batch_size: int = Field(8, ge=1, description="Rows per calibration batch.")
    stratify_by: str | None = Field(None, description=(
        "Metadata column to stratify the calibration sample over, so rare slices are represented."))


class DataSpec(SpecModel):
    """Calibration and validation data, and the expectations the data check enforces."""

    calibration: CalibrationSpec = Field(description="Calibration set (static INT8).")
    validation: DatasetSpec = Field(description="Validation set: parity, slices and latency inputs.")
    expectations: list[Expectation] = Field(default_factory=list, description=(
        "Extra Great Expectations run on top of the built-in ones (input columns present, non-null, finite)."))


# -------------------------------------------------------------------------------------------- slices
# Reductions a derived slice may apply per row over the non-batch axes (tailguard.core.derive.REDUCERS has the
# formulas). A declared vocabulary: no eval, no user code.
DeriveReduce = Literal["sum", "mean", "max", "min", "count_nonzero", "argmax", "norm", "length", "nearest_centroid"]
# Reductions unchanged by zero padding at the end of a variable-length axis (the rows of a batched request are
# padded by its sender; validation rows are not): the only ones allowed on an input with a variable axis.
PAD_INVARIANT_REDUCES = frozenset({"sum", "count_nonzero", "length", "norm"})
MAX_CENTROIDS = 256


class DeriveSpec(SpecModel):
    """How a derived slice's per-row value is computed from a model input or the reference's first output
    (tailguard.core.derive.derive_values; docs/spec.md, Derived slices)."""

    input: str | None = Field(None, description="A model input by name (model.inputs[].name).")
    output: Literal["reference"] | None = Field(None, description=(
        "'reference': the FP32 reference model's first output (never the candidate's: slicing on the candidate "
        "would bias the comparison)."))
    select: tuple[int, int] | None = Field(None, description=(
        "[start, stop): a range of the row's flattened (row-major) non-batch elements, before reducing."))
    reduce: DeriveReduce = Field(description=(
        "Per row over the non-batch axes: sum, mean, max, min, count_nonzero, argmax (index of the largest "
        "element: the reference's top-1 class), norm (L2), length (positions of the last axis up to the last "
        "non-zero element: the tokens of an attention mask), nearest_centroid (index of the nearest of `centroids` "
        "k-means centroids "
        "fitted on the validation set's reference outputs)."))
    centroids: int | None = Field(None, ge=2, le=MAX_CENTROIDS, description=(
        "nearest_centroid only: number of k-means centroids (seeded; fitted by the pipeline)."))

    @model_validator(mode="after")
    def _one_source(self) -> "DeriveSpec":
        if (self.input is None) == (self.output is None):
            raise ValueError("give exactly one of input (a model input name) or output: reference")
        if self.select is not None and not 0 <= self.select[0] < self.select[1]:
            raise ValueError("select must be [start, stop) with 0 <= start < stop")
        if (self.reduce == "nearest_centroid") != (self.centroids is not None):
            raise ValueError("centroids (the number of k-means centroids) goes with reduce: nearest_centroid, "
                             "and only with it")
        if self.reduce == "nearest_centroid" and self.output is None:
            raise ValueError("nearest_centroid applies to output: reference (centroids of the reference outputs)")
        return self


class SliceSpec(SpecModel):
    """A declared slice: rows grouped by the value of a metadata column, of a value derived from the request's
    tensors or the reference's output (`derive`), or of a request header (`header`); by value, bins or quantiles.
    Exactly one of column, derive, header."""

    name: str = Field(description="Slice name used in metric keys: slice.<name>.<value>.<metric>.",
                      pattern=r"^[A-Za-z0-9_\-]+$", max_length=MAX_SLICE_NAME)
    column: str | None = Field(None, description="Metadata column in the validation data.")
    derive: DeriveSpec | None = Field(None, description=(
        "Compute the per-row value from a model input or the reference's output: needs nothing from the client "
        "and no column in the validation data."))
    header: str | None = Field(None, pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~\-]+$", description=(
        "HTTP header / gRPC metadata key / logger-forwarded header whose value is the slice value in the monitor "
        "(case-insensitive); in the validation data, the column of that name."))
    values: list[str | int] | None = Field(None, description="Only these values (default: every value seen).")
    bins: list[float] | None = Field(None, min_length=2, description="Bin edges, left-closed [a, b).")
    quantiles: int | None = Field(None, ge=2, le=100, description="Number of equal-frequency bins.")
    max_groups: int = Field(100, ge=1, le=MAX_SLICE_GROUPS, description=(
        "At most this many groups; the rest go to 'other'."))

    @model_validator(mode="after")
    def _one_kind(self) -> "SliceSpec":
        sources = [k for k in ("column", "derive", "header") if getattr(self, k) is not None]
        if len(sources) != 1:
            raise ValueError("give exactly one of column, derive, header"
                             + (f" (got {', '.join(sources)})" if sources else ""))
        kinds = [k for k in ("values", "bins", "quantiles") if getattr(self, k) is not None]
        if len(kinds) > 1:
            raise ValueError(f"give at most one of values, bins, quantiles (got {', '.join(kinds)})")
        if self.bins is not None and sorted(self.bins) != self.bins:
            raise ValueError("bins must be increasing")
        return self

    @property
    def data_column(self) -> str | None:
        """The validation data column this slice reads (column, or the header's name); None when derived."""
        return self.column if self.column is not None else self.header


def derive_errors(i: int, s: SliceSpec, model: ModelSpec) -> list[str]:
    """Problems of a derived slice against the model's declared tensors ("<field path>: <problem>" lines).

    Rules: the input exists; `select` lies within the row's element count when every non-batch axis is fixed,
    and needs the variable axis first otherwise (positions of a padded row stay put); on an input with a
    variable-length axis only the reductions unchanged by zero padding (PAD_INVARIANT_REDUCES) with pad value 0;
    argmax on the reference output of a classification model; nearest_centroid on an embedding model; length
    needs at least one non-batch axis.
    """
    d = s.derive
    if d is None:
        return []
    at = f"slices.{i}.derive"
    errors: list[str] = []
    if d.input is not None:
        by_name = {t.name: t for t in model.inputs}
        t = by_name.get(d.input)
        if t is None:
            return [f"{at}.input: unknown input {d.input!r}; model.inputs: {list(by_name)}"]
        dims = t.shape[1:]
        variable = [a for a in dims if isinstance(a, str)]
        if d.reduce in ("argmax", "nearest_centroid"):
            errors.append(f"{at}.reduce: {d.reduce} applies to output: reference, not to an input")
        if variable and d.reduce not in PAD_INVARIANT_REDUCES:
            errors.append(f"{at}.reduce: input {d.input!r} has the variable-length axis {variable[0]!r}, which a "
                          f"batched request pads: {d.reduce} would depend on the padding; use one of "
                          f"{sorted(PAD_INVARIANT_REDUCES)}")
        if variable and float(model.pad_values.get(d.input, 0)) != 0.0:
            errors.append(f"{at}.input: input {d.input!r} is padded with {model.pad_values[d.input]:g} "
                          "(model.pad_values), which a derived value would count; derive from an input padded with 0")
        if d.select is not None:
            if not variable:
                n = 1
                for a in dims:
                    n *= int(a)
                if d.select[1] > n:
                    errors.append(f"{at}.select: [{d.select[0]}, {d.select[1]}) is past the {n} elements of a row "
                                  f"of {d.input!r} (shape {t.shape})")
            elif not isinstance(dims[0], str) or len(variable) > 1:
                errors.append(f"{at}.select: input {d.input!r} (shape {t.shape}) has a variable axis after a "
                              "fixed one, so padding moves the flattened positions; select needs the variable "
                              "axis first")
        if d.reduce == "length" and not dims:
            errors.append(f"{at}.reduce: length needs an axis after batch; input {d.input!r} has shape {t.shape}")
    else:
        if d.reduce == "argmax" and model.task != "classification":
            errors.append(f"{at}.reduce: argmax of the reference output is the predicted class of a "
                          f"classification model; model.task is {model.task!r}")
        if d.reduce == "nearest_centroid" and model.task != "embedding":
            errors.append(f"{at}.reduce: nearest_centroid clusters the reference embeddings of an embedding "
                          f"model; model.task is {model.task!r}")
        out = model.outputs[0]
        if d.select is not None and all(isinstance(a, int) for a in out.shape[1:]):
            n = 1
            for a in out.shape[1:]:
                n *= int(a)
            if d.select[1] > n:
                errors.append(f"{at}.select: [{d.select[0]}, {d.select[1]}) is past the {n} elements of a row of "
                              f"the reference output {out.name!r} (shape {out.shape})")
    if d.reduce in ("argmax", "nearest_centroid") and (s.bins is not None or s.quantiles is not None):
        errors.append(f"slices.{i}.{'bins' if s.bins is not None else 'quantiles'}: {d.reduce} gives a class "
                      "index: group it by value (drop bins/quantiles)")
    return errors
