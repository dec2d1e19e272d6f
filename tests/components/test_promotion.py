"""Promotion decided with confidence (issue 25 item 5, components/register/promotion.py `decide_promotion`,
`compare_passing`): the fastest passing variant takes the alias only when its advantage over every other passing
variant is confident by `promotion.margin`; otherwise the alias holder among the tied keeps it, else the most
exact of them.

The rule is tested with comparisons written out (`compare=`, the seam that times); `compare_passing` is tested for
real: two ONNX models of very different cost (a 24-layer 512-wide MatMul chain and a single small MatMul) and two
identical ones, timed interleaved with ONNX Runtime on Parquet rows. Nothing asserts a duration; the slow model is
~100x the work of the fast one, so the decision holds at any load.
"""

import numpy as np
import pytest

from tailguard.components.register.promotion import PromotionRule, compare_passing, decide_promotion
from tailguard.components.register.summary import VariantSummary
from tailguard.core.results import VariantResult


def _row(name, precision, p50, passed=True):
    return VariantSummary(variant=name, backend="onnxruntime", precision=precision, status="ok", passed=passed,
                          p50_ms=p50)


ROWS = [_row("ort-fp32", "fp32", 10.0), _row("ort-fp16", "fp16", 9.8), _row("ort-int8", "int8", 9.5),
        _row("ort-int8-bad", "int8", 2.0, passed=False)]


def _comparison(leader, ratios):
    """A comparison as compare_passing returns it: {name: (ratio, lower, upper)} against the leader."""
    return {"leader": leader, "rounds": 80,
            "ratios": {n: {"name": n, "ratio": r, "lower": lo, "upper": hi} for n, (r, lo, hi) in ratios.items()}}


def test_decide_promotion_takes_the_fastest_when_its_advantage_over_every_other_is_confident():
    comp = _comparison("ort-int8", {"ort-fp32": (1.4, 1.3, 1.5), "ort-fp16": (1.2, 1.1, 1.3)})
    d = decide_promotion(ROWS, margin=0.03, compare=lambda rows: comp)
    assert d.chosen.variant == "ort-int8" and d.rule == PromotionRule.CONFIDENT.value and d.tied == []
    assert "ort-fp16" in d.reason and "1 + margin 0.03" in d.reason
    assert d.comparison is comp


def test_decide_promotion_prefers_the_most_exact_when_the_fastest_is_within_noise_of_the_next():
    # int8 is fastest by its median but only 1% ahead of fp16 (bounds straddle 1.03): fp16 and int8 are tied;
    # fp32 is confidently 30% slower, so it is out; the most exact of the tied, fp16, is promoted
    comp = _comparison("ort-int8", {"ort-fp32": (1.4, 1.3, 1.5), "ort-fp16": (1.01, 0.98, 1.04)})
    d = decide_promotion(ROWS, margin=0.03, compare=lambda rows: comp)
    assert d.chosen.variant == "ort-fp16" and d.rule == PromotionRule.MOST_EXACT.value
    assert d.tied == ["ort-fp16", "ort-int8"]


def test_decide_promotion_keeps_the_alias_holder_when_it_is_among_the_tied():
    comp = _comparison("ort-fp16", {"ort-fp32": (1.01, 0.97, 1.05), "ort-int8": (1.02, 0.99, 1.06)})
    d = decide_promotion(ROWS, margin=0.03, holder="ort-int8", compare=lambda rows: comp)
    assert d.chosen.variant == "ort-int8" and d.rule == PromotionRule.HOLDER.value
    # a holder confidently slower than the fastest by the margin does not keep it
    comp = _comparison("ort-fp16", {"ort-fp32": (1.01, 0.97, 1.05), "ort-int8": (1.3, 1.2, 1.4)})
    d = decide_promotion(ROWS, margin=0.03, holder="ort-int8", compare=lambda rows: comp)
    assert d.chosen.variant == "ort-fp32" and d.rule == PromotionRule.MOST_EXACT.value


def test_decide_promotion_chooses_the_same_variant_when_noise_reorders_variants_within_the_margin():
    # three runs of one demo: the medians of three equally fast variants come out in three different orders
    runs = [_comparison("ort-int8", {"ort-fp32": (1.01, 0.97, 1.05), "ort-fp16": (1.005, 0.98, 1.03)}),
            _comparison("ort-fp16", {"ort-fp32": (1.02, 0.99, 1.06), "ort-int8": (1.01, 0.97, 1.04)}),
            _comparison("ort-fp32", {"ort-fp16": (1.01, 0.98, 1.04), "ort-int8": (1.02, 0.99, 1.05)})]
    chosen = {decide_promotion(ROWS, margin=0.03, compare=lambda rows, c=c: c).chosen.variant for c in runs}
    assert chosen == {"ort-fp32"}
    # the old rule, the lowest validation p50, follows the noise
    assert decide_promotion(ROWS, margin=None).chosen.variant == "ort-int8"


def test_decide_promotion_without_a_comparison_treats_every_passing_variant_as_tied():
    d = decide_promotion(ROWS, margin=0.03, compare=lambda rows: None)
    assert d.chosen.variant == "ort-fp32" and "no paired comparison" in d.reason
    only = decide_promotion([ROWS[2], ROWS[3]], margin=0.03, compare=lambda rows: pytest.fail("not needed"))
    assert only.chosen.variant == "ort-int8" and only.rule == PromotionRule.ONLY_PASSING.value
    none = decide_promotion([ROWS[3]], margin=0.03)
    assert none.chosen is None and none.rule == PromotionRule.NONE_PASSED.value


def test_decide_promotion_ranks_nothing_when_the_node_was_short_of_cpu_during_the_comparison():
    # the fifth demo of issue 25's repeats: timed at load 1.6-4 on 2 cores, int8 looked 1.29x faster with a lower
    # bound above 1.03; with the node short of CPU for 40% of the comparison the timings rank nothing
    comp = {**_comparison("ort-int8", {"ort-fp32": (1.4, 1.3, 1.5), "ort-fp16": (1.294, 1.032, 1.5)}),
            "cpu_pressure": {"some_share": 0.40, "source": "/proc/pressure/cpu"}}
    d = decide_promotion(ROWS, margin=0.03, compare=lambda rows: comp, max_cpu_pressure=0.1)
    assert d.chosen.variant == "ort-fp32" and d.rule == PromotionRule.MOST_EXACT.value
    assert d.tied == ["ort-fp32", "ort-fp16", "ort-int8"] and "short of CPU for 40%" in d.reason
    held = decide_promotion(ROWS, margin=0.03, holder="ort-fp16", compare=lambda rows: comp, max_cpu_pressure=0.1)
    assert held.chosen.variant == "ort-fp16" and held.rule == PromotionRule.HOLDER.value
    # the same comparison on a quiet node (or with the check off, or where PSI cannot be read) is trusted
    quiet = {**comp, "cpu_pressure": {"some_share": 0.02, "source": "/proc/pressure/cpu"}}
    unread = {**comp, "cpu_pressure": {"some_share": None, "source": None}}
    for c, limit in ((quiet, 0.1), (comp, None), (unread, 0.1)):
        d = decide_promotion(ROWS, margin=0.03, compare=lambda rows, c=c: c, max_cpu_pressure=limit)
        assert d.chosen.variant == "ort-int8" and d.rule == PromotionRule.CONFIDENT.value


# ------------------------------------------------------------------------------------ compare_passing, real
def _chain(path, layers, width=512):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(layers)
    inits, nodes, x = [], [], "x"
    dims = [64] + [width] * layers + [8]
    for i in range(len(dims) - 1):
        w = numpy_helper.from_array((rng.normal(size=(dims[i], dims[i + 1])) / np.sqrt(dims[i])).astype(np.float32),
                                    f"w{i}")
        inits.append(w)
        y = "y" if i == len(dims) - 2 else f"h{i}"
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [y]))
        x = y
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])], inits)
    path.mkdir(parents=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path / "model.onnx"))
    return path


def _setup(tmp_path, layers):
    """A spec over 64 Parquet rows and one passing row per (name, layers) with its model in a folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tailguard.core.spec import parse_spec
    from tailguard.core.spec.variants import VariantSpec

    rng = np.random.default_rng(0)
    pq.write_table(pa.table({"x": pa.array([r.tolist() for r in rng.normal(size=(64, 64)).astype(np.float32)],
                                           type=pa.list_(pa.float32()))}), tmp_path / "v.parquet")
    spec = parse_spec({
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "p"},
        "model": {"registered_name": "m", "task": "generic",
                  "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 64]}],
                  "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", 8]}]},
        "data": {"calibration": {"uri": str(tmp_path / "v.parquet")},
                 "validation": {"uri": str(tmp_path / "v.parquet")}},
        "variants": [{"name": n, "backend": "onnxruntime", "precision": p} for n, p, _ in layers],
        "gates": [{"metric": "abs_error.max", "max": 1.0}],
        "benchmark": {"batch_sizes": [1], "warmup": 100, "iterations": 200, "max_seconds": 20}})
    rows = [_row(n, p, 1.0) for n, p, _ in layers]
    results = {n: VariantResult(n, "onnxruntime", p, "ok", passed=True,
                                model_uri=str(_chain(tmp_path / n, k))) for n, p, k in layers}
    variants = {n: VariantSpec(name=n, backend="onnxruntime", precision=p) for n, p, _ in layers}
    return spec, rows, results, variants


def test_compare_passing_finds_the_confidently_faster_model_when_one_does_far_less_work(tmp_path):
    spec, rows, results, variants = _setup(tmp_path, [("ort-fp32", "fp32", 24), ("ort-fp16", "fp16", 0)])
    comp = compare_passing(spec, rows, results, variants, margin=0.03, batch_size=1)
    assert comp["leader"] == "ort-fp16" and comp["ratios"]["ort-fp32"]["lower"] > 1.03
    assert comp["stopped_by"] == "decided" and comp["rounds"] < 200  # decided at an early look
    share = comp["cpu_pressure"]["some_share"]  # the node's CPU pressure over the rounds (None without PSI)
    assert share is None or 0.0 <= share <= 1.0
    d = decide_promotion(rows, margin=0.03, compare=lambda r: comp)
    assert d.chosen.variant == "ort-fp16" and d.rule == PromotionRule.CONFIDENT.value


class _SeededClock:
    """The one seam of the test below: a clock (ns) whose timed runs last a seeded draw of one distribution,
    whichever model runs. Two identical models on a real clock can differ by more than the 3% margin on a loaded
    machine (two sessions, two thread pools: 1.034x at load ~6 here), so the claim "the rounds' statistics leave
    equal models tied" is checked on equal timings; the models still run, for real, between the two reads."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.now = 0
        self.reads = 0

    def __call__(self) -> int:
        self.reads += 1
        if self.reads % 2 == 0:  # the read after a run: the run took ~100 us with 20% jitter and rare stalls
            self.now += int(self.rng.lognormal(np.log(100_000), 0.2) * (5 if self.rng.random() < 0.02 else 1))
        return self.now


def test_compare_passing_leaves_identical_models_tied_so_the_most_exact_is_promoted(tmp_path):
    spec, rows, results, variants = _setup(tmp_path, [("ort-fp32", "fp32", 2), ("ort-fp16", "fp16", 2)])
    comp = compare_passing(spec, rows, results, variants, margin=0.03, batch_size=1, clock=_SeededClock())
    other = next(iter(comp["ratios"].values()))
    assert other["lower"] <= 1.03  # never confidently 3% apart: the same model
    d = decide_promotion(rows, margin=0.03, compare=lambda r: comp)
    assert d.chosen.variant == "ort-fp32" and d.rule == PromotionRule.MOST_EXACT.value


def test_compare_passing_declines_when_a_variant_cannot_be_timed_here(tmp_path):
    spec, rows, results, variants = _setup(tmp_path, [("ort-fp32", "fp32", 1), ("ort-fp16", "fp16", 0)])
    variants["ort-fp16"] = variants["ort-fp16"].model_copy(update={"backend": "tensorrt"})
    assert compare_passing(spec, rows, results, variants, margin=0.03, batch_size=1) is None
