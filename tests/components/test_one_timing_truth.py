"""One timing truth (issue 37): the promotion's paired rounds include the FP32 references (torch eager, the ONNX
export) and are what the summary table, report and metrics show; every step builds its timed ONNX Runtime sessions
the same way, so the validate step's "x onnx fp32" and the promotion's direct comparison agree.

Real ONNX Runtime and torch on tiny models whose costs differ by a large factor (a 24-layer 512-wide MatMul chain
against a single 64x8 MatMul, ~100x the work), single-threaded sessions so a loaded node slows each run in
proportion to its length. Nothing asserts a duration: ratios are compared through their intervals.
"""

import pytest

from tailguard.components.register.promotion import (
    PromotionDecision,
    apply_paired,
    compare_passing,
    decide_promotion,
    latency_gate_contradictions,
    paired_metrics,
)
from tailguard.components.register.summary import VariantSummary
from tests.components.test_promotion import _chain, _row, _setup

ALLOW_SPINNING = "session.intra_op.allow_spinning"


def _one_thread(spec):
    return spec.model_copy(update={"benchmark": spec.benchmark.model_copy(update={"intra_op_num_threads": 1})})


class _TorchChain:
    """torch eager baseline: `layers` Linear(512, 512) layers after a 64->512 one (forward(x))."""

    def __new__(cls, layers):
        import torch

        torch.manual_seed(0)
        mods = [torch.nn.Linear(64, 512)] + [torch.nn.Linear(512, 512) for _ in range(layers)] + [
            torch.nn.Linear(512, 8)]
        return torch.nn.Sequential(*mods)


def _baselines(tmp_path, *, torch_layers, onnx_layers):
    from tailguard.core.runtime import TorchRunner, timed_ort_runner

    onnx_dir = _chain(tmp_path / "export", onnx_layers)

    class Wrap:  # forward(x=...) as the reference's inputs are named
        def __init__(self, m):
            self.m = m

        def eval(self):
            self.m.eval()

        def __call__(self, x):
            return self.m(x)

    def make():
        return {"torch": TorchRunner(Wrap(_TorchChain(torch_layers)), ["x"], intra_op_num_threads=1),
                "onnx_fp32": timed_ort_runner(onnx_dir / "model.onnx", intra_op_num_threads=1)}

    return make


# ------------------------------------------------------------------------------- item 2: one session configuration
def test_timed_sessions_never_spin_when_built_by_validate_reference_pass_promotion_and_search(tmp_path):
    # the validate step built its variant and ONNX FP32 sessions with ORT's default (spinning) while the promotion
    # set force_spinning_stop: the same two models came out 1.7x apart between the two (issue 37)
    from tailguard.components.reference.logic import onnx_baseline_runner
    from tailguard.components.validate.runners import reference_runners, variant_runner

    spec, _, _, variants = _setup(tmp_path, [("ort-fp32", "fp32", 1)])
    model_dir = tmp_path / "ort-fp32"
    sessions = {
        "validate variant": variant_runner(spec, variants["ort-fp32"], {"artifact": "model.onnx"}, model_dir, None),
        "validate onnx_fp32": reference_runners(spec, model_dir)["onnx_fp32"],
        "reference pass": onnx_baseline_runner(model_dir / "model.onnx", 1),
    }
    for where, runner in sessions.items():
        opts = runner.session.get_session_options()
        assert opts.get_session_config_entry(ALLOW_SPINNING) == "0", where
        with pytest.raises(RuntimeError):  # no force_spinning_stop anywhere: one configuration
            opts.get_session_config_entry("session.force_spinning_stop")


def test_validate_and_promotion_speed_ratio_agree_within_intervals_when_one_model_does_far_less_work(tmp_path):
    from tailguard.components.validate.runners import reference_runners, variant_runner
    from tailguard.components.validate.timing import _timed
    from tailguard.core.data import load_validation
    from tailguard.core.latency import add_speed_ratios

    spec, rows, results, variants = _setup(tmp_path, [("ort-fast", "fp32", 0)])
    spec = _one_thread(spec)
    export = _chain(tmp_path / "export", 24)  # the ONNX FP32 export: ~100x the fast variant's work
    # the validate step's way: the variant beside the ONNX FP32 export in its own task
    runner = variant_runner(spec, variants["ort-fast"], {"artifact": "model.onnx"}, tmp_path / "ort-fast", export)
    timed = _timed(spec, {"variant": runner, **reference_runners(spec, export)}, load_validation(spec), None, None)
    perf = timed.pop("variant")
    add_speed_ratios(perf, timed)
    v = perf[1]
    task = (v["speedup_vs_onnx_fp32"], v["speedup_vs_onnx_fp32.lb95"], v["speedup_vs_onnx_fp32.ub95"])
    # the promotion's way: its paired rounds with the export as a baseline
    from tailguard.core.runtime import timed_ort_runner

    comp = compare_passing(spec, rows, results, variants, margin=0.03, batch_size=1,
                           baselines=lambda: {"onnx_fp32": timed_ort_runner(export / "model.onnx",
                                                                              intra_op_num_threads=1)})
    s = comp["speedups"]["ort-fast"]["onnx_fp32"]
    paired = (s["ratio"], s["lower"], s["upper"])
    assert task[0] > 5 and paired[0] > 5, (task, paired)  # the fast model is far faster both ways
    assert task[1] <= paired[2] and paired[1] <= task[2], f"validate {task} vs promotion {paired}: intervals apart"


# ------------------------------------------------------------------------- item 1: the baselines in the rounds
def test_compare_passing_times_torch_and_onnx_fp32_in_the_rounds_but_never_lets_a_baseline_lead(tmp_path):
    # the ONNX FP32 export is the fastest runner in the rounds; the leader is still a passing variant
    spec, rows, results, variants = _setup(tmp_path, [("ort-a", "fp32", 24), ("ort-b", "fp16", 0)])
    spec = _one_thread(spec)
    comp = compare_passing(spec, rows, results, variants, margin=0.03, batch_size=1,
                           baselines=_baselines(tmp_path, torch_layers=24, onnx_layers=0))
    assert comp["leader"] == "ort-b" and set(comp["ratios"]) == {"ort-a"}
    assert comp["baselines"] == ["torch", "onnx_fp32"]
    assert set(comp["latency"]) == {"ort-a", "ort-b", "torch", "onnx_fp32"}
    assert set(comp["p50_ms"]) == {"ort-a", "ort-b"}  # only variants rank
    fast_vs_torch = comp["speedups"]["ort-b"]["torch"]
    assert fast_vs_torch["lower"] > 1.0 and fast_vs_torch["lower"] <= fast_vs_torch["ratio"] <= fast_vs_torch["upper"]
    assert comp["speedups"]["ort-a"]["onnx_fp32"]["upper"] < 1.0  # the 24-layer chain is slower than the export
    assert "torch" in comp["method"] and "allow_spinning=0" in comp["method"]
    metrics = paired_metrics(comp)
    assert metrics["paired.torch.latency_ms.p50"] == comp["latency"]["torch"]["p50_ms"]
    assert metrics["paired.ort-b.speedup_vs_torch.lb95"] == fast_vs_torch["lower"]


def test_compare_passing_times_a_single_passing_variant_against_the_baselines(tmp_path):
    # one passing variant: nothing to rank, but the table's speed-ups still come from paired rounds
    spec, rows, results, variants = _setup(tmp_path, [("ort-b", "fp16", 0)])
    spec = _one_thread(spec)
    comp = compare_passing(spec, rows, results, variants, margin=0.03, batch_size=1,
                           baselines=_baselines(tmp_path, torch_layers=24, onnx_layers=24))
    assert comp["leader"] == "ort-b" and comp["ratios"] == {}
    assert comp["speedups"]["ort-b"]["onnx_fp32"]["lower"] > 1.0
    d = decide_promotion(rows, margin=0.03, compare=lambda r: comp)
    apply_paired(rows, comp, d)
    assert rows[0].paired["speedup_vs_torch"] == comp["speedups"]["ort-b"]["torch"]
    assert rows[0].paired["tied"] is False


def test_compare_passing_goes_on_without_baselines_when_they_do_not_load(tmp_path, capsys):
    from tailguard.core.errors import InputError

    spec, rows, results, variants = _setup(tmp_path, [("ort-a", "fp32", 2), ("ort-b", "fp32", 0)])

    def broken():
        raise InputError("ONNX file not found: export/model.onnx")

    comp = compare_passing(spec, rows, results, variants, margin=0.03, batch_size=1, baselines=broken)
    assert comp is not None and comp["baselines"] == [] and comp["speedups"] == {"ort-a": {}, "ort-b": {}}
    assert "without the FP32 baselines" in capsys.readouterr().err


# ----------------------------------------------------------------- what the table, report and gates show
def _comp(tied_ratio):
    lat = lambda p50: {"p50_ms": p50, "p99_ms": p50 * 2, "p50_ms.lb95": p50 * 0.9, "p50_ms.ub95": p50 * 1.1}  # noqa
    return {"leader": "ort-int8", "rounds": 80, "batch_size": 1, "stopped_by": "decided",
            "ratios": {"ort-fp32": {"name": "ort-fp32", "ratio": tied_ratio, "lower": tied_ratio - 0.05,
                                    "upper": tied_ratio + 0.05}},
            "p50_ms": {"ort-fp32": 3.7, "ort-int8": 3.5},
            "latency": {"ort-fp32": lat(3.7), "ort-int8": lat(3.5), "torch": lat(6.0), "onnx_fp32": lat(3.8)},
            "baselines": ["torch", "onnx_fp32"], "cpu_pressure": {"some_share": 0.02},
            "speedups": {n: {"torch": {"ratio": 6.0 / p, "lower": 6.0 / p - 0.1, "upper": 6.0 / p + 0.1},
                             "onnx_fp32": {"ratio": 3.8 / p, "lower": 3.8 / p - 0.05, "upper": 3.8 / p + 0.05}}
                         for n, p in (("ort-fp32", 3.7), ("ort-int8", 3.5))}}


def _summary(rows, comp):
    from tailguard.components.register.summary import RunSummary

    return RunSummary(parent_run_id="p", experiment_id="e", source_model="m", source_version="1",
                      optimized_model="m-optimized", alias="production", promotion_enabled=True, batch_size=1,
                      variants=rows, promotion_comparison=comp)


def test_summary_rows_show_the_paired_rounds_with_bounds_and_mark_task_figures_when_a_variant_was_not_in_them():
    from tailguard.runner import summary_rows

    rows = [_row("ort-fp32", "fp32", 6.72), _row("ort-int8", "int8", 3.50), _row("ort-bad", "int8", 2.0, passed=False)]
    rows[0].speedup_vs_torch, rows[2].speedup_vs_torch = 0.83, 3.1
    comp = _comp(1.057)
    d = decide_promotion(rows, margin=0.03, compare=lambda r: comp)
    apply_paired(rows, comp, d)
    cells = {r["variant"]: r for r in summary_rows(_summary(rows, comp))}
    # the validate task's 6.72 ms / 0.83x are gone: the paired rounds' figures, with their bounds
    assert cells["ort-fp32"]["p50 ms"] == "3.70" and cells["ort-fp32"]["x torch"] == "1.62 [1.52,1.72]"
    assert cells["ort-int8"]["x onnx fp32"] == "1.09 [1.04,1.14]"
    # a failed variant was not in the rounds: its task figures, marked
    assert cells["ort-bad"]["p50 ms"] == "2.00*" and cells["ort-bad"]["x torch"] == "3.10*"


def test_summary_rows_say_tied_when_the_rounds_could_not_rank_the_fastest(tmp_path):
    from tailguard.runner import summary_rows

    rows = [_row("ort-fp32", "fp32", 6.72), _row("ort-int8", "int8", 3.50)]
    comp = _comp(1.02)  # within the 3% margin: tied, the most exact (fp32) is promoted
    d = decide_promotion(rows, margin=0.03, compare=lambda r: comp)
    apply_paired(rows, comp, d)
    assert d.chosen.variant == "ort-fp32"
    rows[0].promoted, rows[0].version = True, "3"
    cells = {r["variant"]: r for r in summary_rows(_summary(rows, comp))}
    assert cells["ort-fp32"]["promoted"] == "@production -> v3 tied" and cells["ort-int8"]["promoted"] == "tied"
    assert paired_metrics(comp, d)["paired.ort-int8.tied"] == 1.0


def test_print_summary_names_the_rounds_and_explains_the_task_mark(capsys):
    from tailguard.terminal import print_summary

    rows = [_row("ort-fp32", "fp32", 6.72), _row("ort-bad", "int8", 2.0, passed=False)]
    comp = _comp(1.5)
    comp["ratios"], comp["leader"] = {}, "ort-fp32"
    apply_paired(rows, comp, PromotionDecision(rows[0], "only_passing", "only"))
    print_summary(_summary(rows, comp))
    out = capsys.readouterr().out
    assert "timing: 80 paired rounds at batch 1" in out and "torch eager 6.00 ms" in out
    assert "validate-task timing (a gate input" in out and "[1.52,1.72]" in out  # may wrap before the bounds


def test_report_variants_table_shows_the_paired_figures_and_the_rounds_line():
    from tailguard.components.register.report import run_report_html

    rows = [_row("ort-fp32", "fp32", 6.72), _row("ort-bad", "int8", 2.0, passed=False)]
    comp = _comp(1.5)
    apply_paired(rows, comp, PromotionDecision(rows[0], "only_passing", "only"))
    html = run_report_html(_summary(rows, comp).to_dict(), run={"run_id": "p", "status": "FINISHED"})
    assert "1.62 [1.52,1.72]" in html and "timing: 80 paired rounds" in html and "2.00*" in html


def test_latency_gate_contradiction_warns_when_the_task_passed_but_the_paired_rounds_exceed_the_threshold(tmp_path):
    spec, _, _, _ = _setup(tmp_path, [("ort-fp32", "fp32", 0)])
    spec = spec.model_copy(update={"gates": [*spec.gates, type(spec.gates[0])(metric="latency_ms.p99", max=5.0,
                                                                              batch_size=1)]})
    gate = spec.gates[-1]
    row = VariantSummary(variant="ort-fp32", backend="onnxruntime", precision="fp32", status="ok", passed=True,
                         p50_ms=2.0, p99_ms=4.0, gates={gate.key: "passed"})
    row.paired = {"p50_ms": 3.0, "p99_ms": 7.5, "rounds": 80}
    [warning] = latency_gate_contradictions(spec, row, 1)
    assert "4 ms" in warning and "7.5 ms" in warning and "80 paired rounds" in warning
    row.paired["p99_ms"] = 4.5  # within the threshold both ways: nothing to say
    assert latency_gate_contradictions(spec, row, 1) == []
    assert latency_gate_contradictions(spec, row, 32) == []  # another batch size: not the rounds' figure
