"""The metric catalogue: one frozen table of every metric tailguard computes, logs, gates on or monitors.

Every property of a metric lives here once: its direction, how it is aggregated from per-row values, which
confidence bound applies, which model tasks (model.task) produce it, its units and its meaning. The spec
(`tailguard.core.spec`: MODEL_TASK_METRICS, PERF_METRICS, PROPORTION_METRICS, ... are computed from this table), the
gates, the report and the shadow monitor read it; none of them decides a direction on its own.

Two tables:

- `METRICS`: the aggregate metrics, one value per variant (overall) or per slice group, named as in MLflow and in
  `gates[].metric`: parity metrics (aggregated from per-row values, formulas in `tailguard.core.parity`),
  performance metrics (timed or measured by the validate step), the build metric (counted on the graph) and
  two records of the run (`non_finite_rows`, `gates_passed`).
- `ROW_METRICS`: the per-row values `tailguard.core.parity.per_sample_metrics` returns (`top1_agree`,
  `cosine_similarity`, ...): what parity metrics aggregate and what the shadow monitor tracks.

Metric keys as logged (components/validate/result.py, components/export/task.py) wrap a catalogue name; `parse_key`
and every helper below accept them:

    <metric>                          e.g. top1_agreement, cosine_similarity.p01, latency_ms.p99
    bs<N>.<metric>                    a batched performance metric at batch size N, e.g. bs32.latency_ms.p50
    slice.<slice>.<value>.<metric>    a parity metric of one slice group (the value may contain dots)
    <metric>.lb<C> / <metric>.ub<C>   its one-sided lower / upper C% confidence bound, e.g.
                                      speedup_vs_onnx_fp32.lb95
    baseline.<name>.bs<N>.<metric>    a baseline's latency on the parent run, e.g.
                                      baseline.onnx_fp32.bs1.latency_ms.p50

Keys that count things rather than measure a variant (`slice.<s>.<v>.support`, `bs<N>.n_iterations`,
`<ratio>.rounds`, `discovered.*`, `search.*`, `trial.seconds`, `calibration.*`) have no direction and are not in
the catalogue: `metric()` raises for them.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal, Mapping

from tailguard.core.errors import InputError

if TYPE_CHECKING:  # pragma: no cover - stats imports numpy, which the catalogue does not need
    from tailguard.core.stats import Side

Direction = Literal["higher", "lower"]
Kind = Literal["proportion", "continuous", "performance", "build", "record"]
Aggregate = Literal["mean", "quantile", "max", "min", "ratio", "fact", "count"]
Bound = Literal["wilson", "bootstrap", "paired_bootstrap"]

MODEL_TASKS: tuple[str, ...] = ("classification", "embedding", "regression", "generic", "token_classification")
# model tasks whose outputs are compared element by element (abs_error): a token_classification output is reduced to its
# per-position top-1 class ids while it is run (tailguard.core.tokens), so its logits are never held whole
ALL_MODEL_TASKS = MODEL_TASKS
LABELLED_MODEL_TASKS = ("classification", "embedding")  # model tasks whose parity uses data.validation.label_column
INF = math.inf


@dataclass(frozen=True)
class RowMetric:
    """One per-row parity value (`tailguard.core.parity.per_sample_metrics`), one number per validation row.

    Attributes:
        key: the per-row key, e.g. "top1_agree", "cosine_similarity".
        direction: "higher" / "lower" is better; None for a value that is context, not quality (nn_margin).
        binary: the value is 0/1 (a bool array): its mean is a proportion (Wilson bound, Fisher's exact test).
        value_range: (lo, hi) every finite row lies in; +-inf for an unbounded side. The monitor's detector bets
            against the bound on the good side (monitoring/detector.py), so that one must be finite for monitored keys.
        units: of one row's value.
        model_tasks: the model tasks (spec model.task) whose per_sample_metrics return it.
        monitored: the shadow monitor can track it (monitoring.metrics): computed from one (reference,
            candidate) pair alone, needing neither labels nor a neighbour index.
        needs_labels: only computed with data.validation.label_column.
        meaning: one line.
        from_parity: `tailguard.core.parity.per_sample_metrics` computes it (False: the shadow monitor's own
            value, candidate_error_rate).
    """

    key: str
    direction: Direction | None
    binary: bool
    value_range: tuple[float, float]
    units: str
    model_tasks: tuple[str, ...]
    monitored: bool
    needs_labels: bool
    meaning: str
    from_parity: bool = True

    @property
    def higher_is_better(self) -> bool:
        """True when a higher value is better. Raises InputError for a key without a direction."""
        if self.direction is None:
            raise InputError(f"per-row value {self.key!r} has no direction (it is context, not a quality)",
                             hint="compare a parity metric instead")
        return self.direction == "higher"


@dataclass(frozen=True)
class Metric:
    """One aggregate metric: a value per variant (overall) or per slice group, as logged to MLflow and gated on.

    Attributes:
        name: the metric name in gates[].metric and MLflow, e.g. "abs_error.p99".
        kind: "proportion" (mean of a 0/1 row value: Wilson score bound), "continuous" (any other parity
            aggregate: seeded percentile bootstrap), "performance" (timed or measured on the node), "build"
            (counted on the built graph, no sampling noise), "record" (a fact of the run, not gated).
        direction: "higher" or "lower" is better.
        aggregate: how the value is formed: "mean" / "quantile" / "max" / "min" over rows (parity) or timed
            iterations (latency), "ratio" of two measurements (throughput, cost, speedups), "fact" (one
            measurement or count of the artifact), "count" (rows).
        units: e.g. "fraction", "nats", "ms".
        model_tasks: the model tasks (spec model.task) that produce it (every one for performance/build/record
            metrics).
        meaning: one line.
        row_key: the per-row key a parity metric aggregates (ROW_METRICS), else None.
        statistic: the reduction of `row_key` as `tailguard.core.parity` spells it ("mean", "max", "min",
            "p99", "p01"), or of the timed iterations for latency ("p50", "p95", "p99", "mean"); None otherwise.
        value_range: (lo, hi) of the value; +-inf for an unbounded side.
        batched: measured per benchmark batch size (logged as bs<N>.<name>; a gate may set batch_size).
        gateable: a gate may name it (gates[].metric).
        per_slice: computed per slice group (slice.<s>.<v>.<name>); only parity metrics are.
        bound: the confidence bound a `confidence` gate uses: "wilson", "bootstrap" (parity) or
            "paired_bootstrap" (a speed ratio timed interleaved with its baseline); None: no bound (such a gate
            with `confidence` is a spec error).
        needs_labels: only computed with data.validation.label_column.
        self_score: the FP32 reference's score against itself, what `max_drop` is measured from (1 for
            agreements and cosine, 0 for errors and KL); None when there is none (accuracy is compared with
            reference_accuracy of the same rows; performance metrics have no relative gate).
    """

    name: str
    kind: Kind
    direction: Direction
    aggregate: Aggregate
    units: str
    model_tasks: tuple[str, ...]
    meaning: str
    row_key: str | None = None
    statistic: str | None = None
    value_range: tuple[float, float] = (-INF, INF)
    batched: bool = False
    gateable: bool = True
    per_slice: bool = False
    bound: Bound | None = None
    needs_labels: bool = False
    self_score: float | None = None

    @property
    def higher_is_better(self) -> bool:
        """True when a higher value is better."""
        return self.direction == "higher"

    @property
    def is_parity(self) -> bool:
        """A parity metric: compares the variant's outputs with the FP32 reference's (proportion or continuous)."""
        return self.kind in ("proportion", "continuous")


# -------------------------------------------------------------------------------------------- per-row values
_F01 = (0.0, 1.0)
_NONNEG = (0.0, INF)
_TOK = ("token_classification",)
_DENSE = tuple(t for t in MODEL_TASKS if t not in _TOK)

ROW_METRICS: tuple[RowMetric, ...] = (
    # order: the monitor's default metrics per model task are the monitored keys of the task in this order
    RowMetric("top1_agree", "higher", True, _F01, "0/1", ("classification",), True, False,
              "argmax of the variant's logits equals argmax of the FP32 reference's"),
    RowMetric("kl_divergence", "lower", False, _NONNEG, "nats", ("classification",), True, False,
              "KL(softmax(reference) || softmax(variant)), float64 log-softmax, clipped at 0"),
    RowMetric("cosine_similarity", "higher", False, (-1.0, 1.0), "cosine", ("embedding",), True, False,
              "cosine of the variant's and the reference's vectors (norms floored at 1e-12)"),
    RowMetric("abs_error", "lower", False, _NONNEG, "output units", _DENSE, True, False,
              "largest |variant - reference| over the row's output elements"),
    RowMetric("rel_error", "lower", False, _NONNEG, "relative (dimensionless)", ("regression", "generic"), True,
              False, "largest |variant - reference| / max(|reference|, 1e-6) over the row's output elements"),
    # token_classification (formulas: tailguard.core.tokens); cer is truncated at 1 so every value lies in [0, 1]
    RowMetric("token_top1_agree", "higher", False, _F01, "fraction", _TOK, True, False,
              "share of the row's unmasked positions whose top-1 class equals the FP32 reference's"),
    RowMetric("sequence_exact", "higher", True, _F01, "0/1", _TOK, True, False,
              "the row's sequence equals the reference's: every unmasked position's top-1 class, or with "
              "model.decode kind ctc_greedy the decoded label sequence"),
    RowMetric("char_error", "lower", False, _F01, "edits per reference label", _TOK, True, False,
              "min(1, Levenshtein distance of the variant's sequence to the reference's / reference length); "
              "an empty reference scores 0 against an empty sequence, else 1"),
    RowMetric("correct", "higher", True, _F01, "0/1", LABELLED_MODEL_TASKS, False, True,
              "the variant's prediction equals the label (classification: argmax; embedding: kNN label)"),
    RowMetric("reference_correct", "higher", True, _F01, "0/1", LABELLED_MODEL_TASKS, False, True,
              "the FP32 reference's prediction equals the label"),
    RowMetric("nn_top1_agree", "higher", True, _F01, "0/1", ("embedding",), False, False,
              "the nearest FP32-index neighbour of the variant's vector equals the reference's"),
    RowMetric("nn_top5_overlap", "higher", False, _F01, "fraction", ("embedding",), False, False,
              "share of the reference's 5 nearest neighbours among the variant's 5 nearest"),
    RowMetric("nn_recall", "higher", False, _F01, "fraction", ("embedding",), False, False,
              "share of the reference's K nearest neighbours (analysis.embedding.recall_k) among the variant's K"),
    RowMetric("nn_margin", None, False, _NONNEG, "cosine", ("embedding",), False, False,
              "the FP32 query's top-1 minus top-2 neighbour cosine (+inf with a one-entry index): context of a flip"),
    RowMetric("nn_top1_margin_agree", "higher", True, _F01, "0/1", ("embedding",), False, False,
              "nn_top1_agree, or the FP32 top-1/top-2 gap is within analysis.embedding.margin_tolerance"),
    RowMetric("non_finite", "lower", True, _F01, "0/1", MODEL_TASKS, False, False,
              "the variant's (or the reference's) output row holds NaN or +-inf (scored worst case)"),
    # monitor only (parity never computes it): 1 for a sampled row the candidate failed on (it raised, timed out
    # or answered a wrong shape), else 0; a slice's mean is the candidate's error rate there (docs/monitor.md)
    RowMetric("candidate_error_rate", "lower", True, _F01, "0/1", MODEL_TASKS, True, False,
              "the candidate failed on the row (error, timeout, wrong output shape); shadow monitor only",
              from_parity=False),
)


# ------------------------------------------------------------------------------------------ aggregate metrics
def _parity(name: str, kind: Kind, model_tasks: tuple[str, ...], units: str, meaning: str, *,
            needs_labels: bool = False, self_score: float | None = None) -> Metric:
    """A parity metric: row key and statistic from its name (`x.p99` -> x, p99) unless it is a named mean."""
    row_key, statistic = _NAMED_MEANS.get(name) or tuple(name.rsplit(".", 1))  # type: ignore[assignment]
    row = _ROWS[row_key]
    aggregate: Aggregate = ("quantile" if statistic.startswith("p") else statistic)  # type: ignore[assignment]
    lo, hi = row.value_range
    assert row.direction is not None  # a parity metric aggregates a row value with a direction
    return Metric(name=name, kind=kind, direction=row.direction, aggregate=aggregate, units=units,
                  model_tasks=model_tasks, meaning=meaning, row_key=row_key, statistic=statistic, value_range=(lo, hi),
                  per_slice=True, bound="wilson" if kind == "proportion" else "bootstrap", needs_labels=needs_labels,
                  self_score=self_score)


def _perf(name: str, direction: Direction, aggregate: Aggregate, units: str, meaning: str, *,
          statistic: str | None = None, batched: bool = True, gateable: bool = True, bound: Bound | None = None,
          value_range: tuple[float, float] = _NONNEG) -> Metric:
    return Metric(name=name, kind="performance", direction=direction, aggregate=aggregate, units=units,
                  model_tasks=MODEL_TASKS, meaning=meaning, statistic=statistic, value_range=value_range,
                  batched=batched, gateable=gateable, bound=bound)


_ROWS = {r.key: r for r in ROW_METRICS}
# parity metrics that are means under another name than <row key>.mean
_NAMED_MEANS: dict[str, tuple[str, str]] = {
    "accuracy": ("correct", "mean"), "reference_accuracy": ("reference_correct", "mean"),
    "top1_agreement": ("top1_agree", "mean"), "nn_top1_agreement": ("nn_top1_agree", "mean"),
    "nn_top5_agreement": ("nn_top5_overlap", "mean"), "nn_recall_at_k": ("nn_recall", "mean"),
    "nn_top1_margin_agreement": ("nn_top1_margin_agree", "mean"),
    "token_top1_agreement": ("token_top1_agree", "mean"), "sequence_exact_match": ("sequence_exact", "mean"),
    "cer": ("char_error", "mean"),
}
_CLS, _EMB, _REG = ("classification",), ("embedding",), ("regression", "generic")

# The order within a model task is the order `tailguard.core.parity.aggregate` returns (MODEL_TASK_METRICS[model_task]).
METRICS: tuple[Metric, ...] = (
    # ---- parity: 0/1 means (Wilson) and continuous aggregates (bootstrap), per row -> overall and per slice
    _parity("accuracy", "proportion", LABELLED_MODEL_TASKS, "fraction",
            "share of rows the variant predicts correctly (classification: argmax; embedding: kNN label accuracy "
            "in the FP32 index, analysis.embedding.knn_k)", needs_labels=True),
    _parity("reference_accuracy", "proportion", LABELLED_MODEL_TASKS, "fraction",
            "the FP32 reference's own accuracy on the same rows (what `accuracy` with max_drop is compared with)",
            needs_labels=True),
    _parity("top1_agreement", "proportion", _CLS, "fraction",
            "share of rows whose top-1 class equals the FP32 reference's", self_score=1.0),
    _parity("kl_divergence.mean", "continuous", _CLS, "nats",
            "mean KL divergence of the variant's softmax from the reference's", self_score=0.0),
    _parity("kl_divergence.p99", "continuous", _CLS, "nats",
            "99th percentile of the per-row KL divergence (the tail)", self_score=0.0),
    _parity("cosine_similarity.mean", "continuous", _EMB, "cosine",
            "mean cosine similarity of the variant's and the reference's vectors", self_score=1.0),
    _parity("cosine_similarity.p01", "continuous", _EMB, "cosine",
            "1st percentile of the per-row cosine similarity (the worst 1% of rows)", self_score=1.0),
    _parity("cosine_similarity.min", "continuous", _EMB, "cosine",
            "lowest per-row cosine similarity", self_score=1.0),
    _parity("nn_top1_agreement", "proportion", _EMB, "fraction",
            "share of rows whose nearest FP32-index neighbour is the reference's", self_score=1.0),
    _parity("nn_top5_agreement", "continuous", _EMB, "fraction",
            "mean overlap of the variant's and the reference's 5 nearest neighbours", self_score=1.0),
    _parity("abs_error.max", "continuous", _DENSE, "output units",
            "largest absolute output difference over all rows", self_score=0.0),
    _parity("abs_error.mean", "continuous", _DENSE, "output units",
            "mean of the per-row largest absolute output difference", self_score=0.0),
    _parity("abs_error.p99", "continuous", _DENSE, "output units",
            "99th percentile of the per-row largest absolute output difference", self_score=0.0),
    _parity("nn_recall_at_k", "continuous", _EMB, "fraction",
            "mean recall@K of the reference's K nearest neighbours (analysis.embedding.recall_k)", self_score=1.0),
    _parity("nn_top1_margin_agreement", "proportion", _EMB, "fraction",
            "nn_top1_agreement where the FP32 top-1/top-2 gap exceeds analysis.embedding.margin_tolerance "
            "(near-ties count as agreeing)", self_score=1.0),
    _parity("rel_error.max", "continuous", _REG, "relative (dimensionless)",
            "largest relative output difference over all rows", self_score=0.0),
    _parity("rel_error.mean", "continuous", _REG, "relative (dimensionless)",
            "mean of the per-row largest relative output difference", self_score=0.0),
    _parity("token_top1_agreement", "continuous", _TOK, "fraction",
            "mean over rows of the share of unmasked positions whose top-1 class is the reference's", self_score=1.0),
    _parity("sequence_exact_match", "proportion", _TOK, "fraction",
            "share of rows whose sequence (positions' top-1 classes, or the CTC-decoded labels) is the reference's",
            self_score=1.0),
    _parity("cer", "continuous", _TOK, "edits per reference label",
            "mean per-row character error rate of the variant's sequence against the reference's (Levenshtein "
            "distance / reference length, truncated at 1)", self_score=0.0),
    # ---- performance: overall only; latency/throughput/cost/speedups per benchmark batch size (bs<N>.)
    _perf("latency_ms.p50", "lower", "quantile", "ms", "median latency of one batch over the timed iterations",
          statistic="p50"),
    _perf("latency_ms.p95", "lower", "quantile", "ms", "95th percentile latency of one batch", statistic="p95"),
    _perf("latency_ms.p99", "lower", "quantile", "ms", "99th percentile latency of one batch", statistic="p99"),
    _perf("latency_ms.mean", "lower", "mean", "ms", "mean latency of one batch",
          statistic="mean", gateable=False),
    _perf("throughput_per_s", "higher", "ratio", "inferences/s",
          "rows per second of one sequential stream: batch size x 1000 / mean latency (ms)"),
    _perf("usd_per_1m_inferences", "lower", "ratio", "USD per 1M inferences",
          "cost.usd_per_hour / 3600 / throughput_per_s x 1e6 (needs a cost section)"),
    _perf("speedup_vs_torch", "higher", "ratio", "x (ratio)",
          "median torch eager latency / median variant latency (torch timed in the reference pass; no bound)"),
    _perf("speedup_vs_onnx_fp32", "higher", "ratio", "x (ratio)",
          "median FP32 ONNX latency / median variant latency, timed interleaved in the same process "
          "(bounds .lb95/.ub95: paired bootstrap over rounds)", bound="paired_bootstrap"),
    _perf("peak_rss_mb", "lower", "max", "MiB",
          "peak resident set size of the validate process (ru_maxrss; in a local run an upper bound)", batched=False),
    _perf("model_size_mb", "lower", "fact", "MiB", "size of the variant's model file(s)", batched=False),
    # ---- build: counted once on the graph of INT8 onnxruntime variants (components/build/macs.py)
    Metric("quantized_mac_fraction", "build", "higher", "fact", "fraction", MODEL_TASKS,
           "MACs computed in INT8 / all MACs of the graph, per sample (INT8 onnxruntime variants only)",
           value_range=_F01),
    # ---- records of the run: logged on the variant's run, not gated
    Metric("non_finite_rows", "record", "lower", "count", "rows", MODEL_TASKS,
           "validation rows whose variant output held NaN or +-inf", row_key="non_finite", value_range=_NONNEG,
           gateable=False),
    Metric("gates_passed", "record", "higher", "fact", "0/1", MODEL_TASKS,
           "1 when the variant passed every gate that applies to it, else 0", value_range=_F01, gateable=False),
)

CATALOGUE: Mapping[str, Metric] = MappingProxyType({m.name: m for m in METRICS})
ROW_CATALOGUE: Mapping[str, RowMetric] = MappingProxyType(_ROWS)
if len(CATALOGUE) != len(METRICS) or len(_ROWS) != len(ROW_METRICS):  # pragma: no cover - a typo in the tables
    raise RuntimeError("metric catalogue: duplicate names")


# ------------------------------------------------------------------------------------------------ name keys
@dataclass(frozen=True)
class MetricKey:
    """A metric key as logged, taken apart (patterns: module docstring).

    Attributes:
        key: the key as given.
        metric: the catalogue entry it names.
        batch_size: N of a bs<N>. prefix, else None.
        slice: (slice name, sanitised value) of a slice.<s>.<v>. prefix, else None.
        bound: "lower" / "upper" for a .lb<C> / .ub<C> suffix, else None.
        confidence: C / 100 of that suffix (e.g. 0.95), else None.
        baseline: <name> of a baseline.<name>. prefix (torch, onnx_fp32), else None.
    """

    key: str
    metric: Metric
    batch_size: int | None = None
    slice: tuple[str, str] | None = None
    bound: Side | None = None
    confidence: float | None = None
    baseline: str | None = None


_BS = re.compile(r"^bs([1-9]\d*)\.(.+)$")
_BASELINE = re.compile(r"^baseline\.([A-Za-z0-9_]+)\.(bs[1-9]\d*\..+)$")
_BOUND = re.compile(r"^(.+)\.(lb|ub)(\d+(?:\.\d+)?)$")
_SLICE = re.compile(r"^slice\.([A-Za-z0-9_\-]+)\.(.+)$")  # slice names: SliceSpec.name's pattern


def _unknown(name: str, what: str = "metric") -> InputError:
    names = sorted([*CATALOGUE, *_ROWS])
    close = difflib.get_close_matches(name, names, n=1)
    return InputError(f"unknown {what} {name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""),
                      hint=f"known metrics: {', '.join(sorted(CATALOGUE))}; per-row values: "
                           f"{', '.join(sorted(_ROWS))} (docs/spec.md, Metrics)")


def _catalogue_entry(name: str) -> tuple[Metric, dict] | None:
    """A catalogue name, optionally with a .lb<C>/.ub<C> bound suffix."""
    if name in CATALOGUE:
        return CATALOGUE[name], {}
    m = _BOUND.match(name)
    if m and m.group(1) in CATALOGUE:
        return CATALOGUE[m.group(1)], {"bound": "lower" if m.group(2) == "lb" else "upper",
                                       "confidence": float(m.group(3)) / 100.0}
    return None


def parse_key(key: str) -> MetricKey:
    """Take a logged metric key apart into its catalogue metric and its prefix/suffix parts.

    Args:
        key: e.g. "top1_agreement", "bs32.latency_ms.p99", "slice.length.[16,32).abs_error.p99",
            "speedup_vs_onnx_fp32.lb95", "baseline.torch.bs1.latency_ms.p50".

    Returns:
        The MetricKey. A slice value holding dots is resolved by the longest trailing catalogue name.

    Raises:
        InputError: the key names no catalogue metric (a count such as slice.<s>.<v>.support, a typo), or a
            prefix does not suit the metric (bs<N>. on an unbatched metric, slice. on one not computed per slice).
    """
    if not isinstance(key, str) or not key:
        raise InputError(f"metric key must be a non-empty string, got {key!r}")
    found = _catalogue_entry(key)
    if found is not None:
        return MetricKey(key, found[0], **found[1])
    m = _BASELINE.match(key)
    if m:
        inner = parse_key(m.group(2))
        return MetricKey(key, inner.metric, batch_size=inner.batch_size, bound=inner.bound,
                         confidence=inner.confidence, baseline=m.group(1))
    m = _BS.match(key)
    if m:
        found = _catalogue_entry(m.group(2))
        if found is None:
            raise _unknown(m.group(2))
        if not found[0].batched:
            raise InputError(f"metric key {key!r}: {found[0].name} is not measured per batch size",
                             hint="drop the bs<N>. prefix")
        return MetricKey(key, found[0], batch_size=int(m.group(1)), **found[1])
    m = _SLICE.match(key)
    if m:
        parts = m.group(2).split(".")
        for i in range(1, len(parts)):  # longest trailing name first; the value keeps at least one part
            found = _catalogue_entry(".".join(parts[i:]))
            if found is not None:
                if not found[0].per_slice:
                    raise InputError(f"metric key {key!r}: {found[0].name} is not computed per slice",
                                     hint="only parity metrics have slice.<slice>.<value>. keys")
                return MetricKey(key, found[0], slice=(m.group(1), ".".join(parts[:i])), **found[1])
    raise _unknown(key)


def metric(name: str) -> Metric:
    """The catalogue entry of a metric name or logged key (`parse_key` patterns).

    Raises:
        InputError: unknown name (with the closest known one).
    """
    if name in CATALOGUE:
        return CATALOGUE[name]
    return parse_key(name).metric


def row_metric(key: str) -> RowMetric:
    """The entry of a per-row key (`ROW_METRICS`), e.g. "top1_agree".

    Raises:
        InputError: unknown key.
    """
    try:
        return _ROWS[key]
    except (KeyError, TypeError):
        raise _unknown(key, "per-row value") from None


def is_known(name: str) -> bool:
    """Whether `name` is a catalogue metric, a logged key of one, or a per-row key."""
    if name in _ROWS:
        return True
    try:
        parse_key(name)
    except InputError:
        return False
    return True


def direction(name: str) -> Direction:
    """"higher" or "lower" is better, for a metric name, a logged key (bs<N>., slice., .lb95, ...) or a per-row key.

    Raises:
        InputError: unknown name, or a per-row key without a direction (nn_margin).
    """
    if name in _ROWS:
        return "higher" if _ROWS[name].higher_is_better else "lower"
    return metric(name).direction


def higher_is_better(name: str, *, default: bool | None = None) -> bool:
    """Whether a higher value of a metric is better (`direction`).

    Args:
        name: metric name, logged key or per-row key.
        default: returned instead of raising for an unknown name or a per-row key without a direction
            (display code that must not fail on a column it does not know); None: raise.

    Raises:
        InputError: unknown name or a per-row key without a direction, and no default.
    """
    if default is None:
        return direction(name) == "higher"
    try:
        return direction(name) == "higher"
    except InputError:
        return default


def is_proportion(name: str) -> bool:
    """Whether a metric (or logged key) is the mean of a 0/1 per-row value (Wilson bound, Fisher's exact test);
    for a per-row key, whether it is 0/1. Raises InputError for an unknown name."""
    if name in _ROWS:
        return _ROWS[name].binary
    return metric(name).kind == "proportion"


def model_task_metrics(model_task: str, *, with_labels: bool = True) -> tuple[str, ...]:
    """The parity metrics a model task produces, in the order `tailguard.core.parity.aggregate` returns them.

    Args:
        model_task: the spec's model.task.
        with_labels: False leaves out those that need data.validation.label_column (accuracy,
            reference_accuracy).

    Raises:
        InputError: unknown model.task.
    """
    _check_model_task(model_task)
    return tuple(m.name for m in METRICS
                 if m.is_parity and model_task in m.model_tasks and (with_labels or not m.needs_labels))


def monitor_metrics(model_task: str) -> tuple[str, ...]:
    """The per-row keys the shadow monitor can track for a model task (and tracks by default), in ROW_METRICS order:
    classification top1_agree, kl_divergence, abs_error; embedding cosine_similarity, abs_error;
    regression/generic abs_error, rel_error; token_classification token_top1_agree, sequence_exact, char_error;
    every model task candidate_error_rate. Raises InputError for an unknown model.task."""
    _check_model_task(model_task)
    return tuple(r.key for r in ROW_METRICS if r.monitored and model_task in r.model_tasks)


def metrics_of(kind: Kind, *, gateable: bool | None = None) -> tuple[str, ...]:
    """The names of one kind, in catalogue order (gateable: True/False filters on `Metric.gateable`)."""
    return tuple(m.name for m in METRICS if m.kind == kind and (gateable is None or m.gateable == gateable))


def _check_model_task(model_task: str) -> None:
    if model_task not in MODEL_TASKS:
        raise InputError(f"unknown model.task {model_task!r}", hint=f"use one of {list(MODEL_TASKS)} (model.task)")


def catalogue_markdown() -> str:
    """The catalogue as two Markdown tables (aggregate metrics, then per-row values), as docs/spec.md holds them
    between its `metric-catalogue` markers (tests/core/test_metric_catalogue.py keeps the copy in step)."""

    def rng(r: tuple[float, float]) -> str:
        return f"[{r[0]:g}, {r[1]:g}]".replace("inf]", "inf)").replace("[-inf", "(-inf")

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    def model_tasks(t: tuple[str, ...]) -> str:
        return "all" if t == MODEL_TASKS else ", ".join(t)

    lines = ["| metric | kind | better | aggregate | units | range | tasks | meaning |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m in METRICS:
        how = m.aggregate + (f" of `{m.row_key}`" if m.row_key else "") + (
            f" ({m.statistic})" if m.statistic and m.aggregate == "quantile" else "")
        notes = [n for n, on in (("per batch size", m.batched), ("not gateable", not m.gateable),
                                 ("needs labels", m.needs_labels)) if on]
        kind = m.kind + (f", {m.bound} bound" if m.bound else "")
        lines.append(f"| `{m.name}` | {kind} | {m.direction} | {how} | {m.units} | {rng(m.value_range)} | "
                     f"{model_tasks(m.model_tasks)} | {cell(m.meaning)}"
                     f"{' (' + '; '.join(notes) + ')' if notes else ''} |")
    lines += ["", "| per-row value | better | 0/1 | units | range | tasks | monitor | meaning |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in ROW_METRICS:
        lines.append(f"| `{r.key}` | {r.direction or '-'} | {'yes' if r.binary else 'no'} | {r.units} | "
                     f"{rng(r.value_range)} | {model_tasks(r.model_tasks)} | {'yes' if r.monitored else 'no'} | "
                     f"{cell(r.meaning)}"
                     f"{' (needs labels)' if r.needs_labels else ''} |")
    return "\n".join(lines) + "\n"
