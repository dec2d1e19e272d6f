"""Accuracy-driven search (components/search/logic.py) on a tiny MLP with one planted sensitive MatMul
(tests/helpers/search_models.py).

Real throughout: ONNX Runtime quantization (build_variant), sessions, and the evaluation -- each trial is
validated by `validate_variant` against FP32 reference outputs on validation rows, with a real parity gate
(cosine_similarity.min >= 0.99) and a real (3-iteration) latency measurement. No latency gate, so pass/fail
never depends on timing. Hand-made Trial lists test the Pareto front and the choice rule.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tailguard.components.search.logic import (
    SearchResult,
    Trial,
    _families,
    _trial_name,
    choose_trial,
    run_search,
    write_search_artifacts,
)
from tailguard.components.validate.logic import validate_variant
from tailguard.core.errors import InputError
from tailguard.core.runtime import OrtRunner, run_dataset
from tailguard.core.spec.base import NAME_RE
from tailguard.core.spec.variants import SearchSpec
from tests.helpers.search_models import PLANTED, mlp_dataset, mlp_spec, mlp_variant, planted_mlp

# A small space: 2 families (per-tensor, per-channel), k in {0, 1, 2, 4} -> {0, 1, 2, 3} (3 probed nodes).
SPACE = {"exclude_most_sensitive": [0, 1, 2, 4], "per_channel": [False, True], "float_op_types": [[]]}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """(fp32 path, sensitivity rows, validation rows, FP32 reference outputs on the validation rows)."""
    fp32 = planted_mlp(tmp_path_factory.mktemp("mlp") / "mlp.onnx")
    validation = mlp_dataset(64, seed=7)
    reference = run_dataset(OrtRunner(fp32), validation, mlp_spec(mlp_variant()).model.inputs, batch_size=16)
    return fp32, mlp_dataset(32, seed=1), validation, reference


def _search(env, tmp_path, *, search=None, min_cosine=0.99, clock=None, on_trial=None, evaluate=None, **q):
    fp32, sens_rows, validation, reference = env
    # 7-bit weights (reduce_range): with 8-bit per-channel weights, ORT's u8s8 kernels on x86 without VNNI
    # saturate int16 pair sums and the per-channel configuration keeping only mm2 float fails the gate there
    # (cosine_similarity.min 0.885; 0.998 with exact int32). 7-bit weights cannot overflow (2 * 255 * 64 <= 32767),
    # so every CPU computes the same trials: cosine_similarity.min >= 0.998 once mm2 is float, < 0 while it is not.
    variant = mlp_variant(search={"space": SPACE, **(search or {})}, **{"reduce_range": True, **q})
    spec = mlp_spec(variant, min_cosine=min_cosine)

    def real_evaluate(trial_variant, model_path):
        return validate_variant(spec, variant.name, OrtRunner(model_path), reference, validation,
                                tmp_path / "eval" / trial_variant.name, model_path=model_path)

    kw = {"clock": clock} if clock is not None else {}
    return run_search(spec, variant, fp32, tmp_path / "search", calibration=None, sensitivity_data=sens_rows,
                      evaluate=evaluate or real_evaluate, on_trial=on_trial, **kw)


def _summary(result: SearchResult) -> list[tuple]:
    return [(t.name, json.dumps(t.config, sort_keys=True), t.status, t.passed) for t in result.trials]


# ---------------------------------------------------------------------------------------------- the search
def test_run_search_chooses_a_config_excluding_the_planted_node_when_the_unexcluded_config_fails(env, tmp_path):
    seen = []
    res = _search(env, tmp_path, search={"when": "always"}, on_trial=seen.append)
    assert res.stopped_by == "space_exhausted" and res.sensitivity["node"].iloc[0] == PLANTED
    assert [t.index for t in seen] == list(range(len(res.trials)))  # on_trial after every trial, in order
    unexcluded = [t for t in res.trials if t.config["excluded_nodes"] == []]
    assert unexcluded and all(t.status == "ok" and not t.passed for t in unexcluded)
    assert all(PLANTED in t.config["excluded_nodes"] for t in res.trials if t.passed)
    chosen = res.trials[res.chosen]
    assert chosen.passed and PLANTED in chosen.config["excluded_nodes"]
    assert PLANTED in chosen.variant.quantization.exclude_nodes and chosen.variant.name == chosen.name
    assert Path(chosen.model_path).is_file() and chosen.model_path.startswith(str(tmp_path / "search" / "trials"))
    assert chosen.p50_ms is not None and chosen.p50_ms > 0 and chosen.result is not None
    assert chosen.metric == chosen.result.worst_slice["metric"]
    assert chosen.worst_slice_value == chosen.result.worst_slice["observed"]
    # own family (per-tensor), when: always: the variant as specified (k=0) first; it fails, so binary search
    # over k = [1, 2, 3]: 2 passes, then 1 passes. Next family: middle of [0, 1, 2, 3] (2) passes, 1 passes, 0 fails
    assert [(t.config["per_channel"], t.config["exclude_most_sensitive"]) for t in res.trials] == [
        (False, 0), (False, 2), (False, 1), (True, 2), (True, 1), (True, 0)]
    assert [t.passed for t in res.trials] == [False, True, True, True, True, False]
    assert res.to_dict()["trials"][res.chosen]["excluded_nodes"] == chosen.config["excluded_nodes"]


def test_run_search_does_not_rebuild_the_variant_as_specified_when_search_runs_on_failure(env, tmp_path):
    res = _search(env, tmp_path)  # when: on_failure (default): the own family's k=0 is the failed variant itself
    own = [t.config["exclude_most_sensitive"] for t in res.trials if t.config["per_channel"] is False]
    assert own == [2, 1] and res.stopped_by == "space_exhausted"
    assert [t.config["exclude_most_sensitive"] for t in res.trials if t.config["per_channel"]] == [2, 1, 0]


def test_run_search_tries_the_variant_as_specified_once_when_it_passes_and_search_runs_always(env, tmp_path):
    res = _search(env, tmp_path, search={"when": "always"}, min_cosine=-1.0)  # every configuration passes
    assert [(t.config["per_channel"], t.config["exclude_most_sensitive"]) for t in res.trials] == [
        (False, 0), (True, 2), (True, 1), (True, 0)]
    assert all(t.passed for t in res.trials) and res.chosen is not None and res.stopped_by == "space_exhausted"


def test_run_search_gives_the_same_trials_when_run_twice_with_the_same_seed(env, tmp_path):
    search = {"seed": 3, "space": {**SPACE, "float_op_types": [[], ["Relu"]]}, "max_trials": 5}
    a = _search(env, tmp_path / "a", search=search)
    b = _search(env, tmp_path / "b", search=search)
    assert _summary(a) == _summary(b) and len(a.trials) == 5
    pd.testing.assert_frame_equal(a.sensitivity.drop(columns="seconds"), b.sensitivity.drop(columns="seconds"))


def test_run_search_runs_exactly_one_trial_when_max_trials_is_1(env, tmp_path):
    res = _search(env, tmp_path, search={"max_trials": 1})
    assert len(res.trials) == 1 and res.stopped_by == "max_trials"
    assert res.trials[0].name == "mlp-int8-t00"


def test_run_search_stops_before_the_next_trial_when_the_clock_passes_max_minutes(env, tmp_path):
    ticks = iter([0.0, 0.0, 61.0, 61.0, 61.0])  # start, before trial 0, before trial 1, ...

    res = _search(env, tmp_path, search={"max_minutes": 1.0}, clock=lambda: next(ticks))
    assert len(res.trials) == 1 and res.stopped_by == "max_minutes"


def test_run_search_chooses_nothing_when_no_configuration_passes(env, tmp_path):
    res = _search(env, tmp_path, search={"when": "always", "space": {**SPACE, "exclude_most_sensitive": [0]}})
    assert len(res.trials) == 2 and not any(t.passed for t in res.trials)
    assert res.chosen is None and res.stopped_by == "space_exhausted"
    assert res.to_dict()["chosen_name"] is None


def test_run_search_records_a_failed_trial_and_goes_on_when_evaluate_raises(env, tmp_path):
    calls = []

    def evaluate(trial_variant, model_path):
        calls.append(trial_variant.name)
        if len(calls) == 1:
            raise RuntimeError("validation node lost")
        fp32, _, validation, reference = env
        return validate_variant(mlp_spec(mlp_variant()), "mlp-int8", OrtRunner(model_path), reference, validation,
                                tmp_path / "eval" / trial_variant.name, model_path=model_path)

    res = _search(env, tmp_path, evaluate=evaluate, search={"max_trials": 3})
    first = res.trials[0]
    assert first.status == "failed" and not first.passed and first.result is None
    assert "RuntimeError: validation node lost" in first.reason and first.model_path
    assert len(res.trials) == 3 and res.trials[1].status == "ok"


def test_run_search_records_failed_builds_when_the_variant_excludes_an_unknown_node(env, tmp_path):
    res = _search(env, tmp_path, search={"max_trials": 2}, exclude_nodes=["mm9"])
    assert [t.status for t in res.trials] == ["failed", "failed"] and res.chosen is None
    assert "mm9" in res.trials[0].reason and res.trials[0].result is None


def test_run_search_builds_static_trials_with_each_calibration_method_when_the_variant_is_static(env, tmp_path):
    fp32, sens_rows, validation, reference = env
    space = {"exclude_most_sensitive": [0, 1], "per_channel": [False], "calibration_methods": ["minmax", "percentile"],
             "float_op_types": [[]]}
    variant = mlp_variant(mode="static", op_types=["MatMul"], search={"space": space, "when": "always"})
    spec = mlp_spec(variant, min_cosine=0.95)  # static INT8 activations cost ~1% on their own (cos.min 0.988)

    def evaluate(trial_variant, model_path):
        return validate_variant(spec, variant.name, OrtRunner(model_path), reference, validation,
                                tmp_path / "eval" / trial_variant.name, model_path=model_path)

    res = run_search(spec, variant, fp32, tmp_path / "search", calibration=sens_rows, sensitivity_data=sens_rows,
                     evaluate=evaluate)
    assert res.sensitivity["node"].iloc[0] == PLANTED and res.stopped_by == "space_exhausted"
    # own family (minmax) first, from the variant as specified (k=0, fails), then k=1 (passes); percentile:
    # binary search over k = [0, 1] from the middle: 1 passes, then 0 fails
    assert [(t.config["calibration_method"], t.config["exclude_most_sensitive"], t.passed) for t in res.trials] == [
        ("minmax", 0, False), ("minmax", 1, True), ("percentile", 1, True), ("percentile", 0, False)]
    assert [t.variant.quantization.calibration_method for t in res.trials] == ["minmax", "minmax", "percentile",
                                                                               "percentile"]
    assert all(t.status == "ok" for t in res.trials)
    assert (Path(res.trials[0].model_path).parent / "calibration.parquet").is_file()


def test_run_search_raises_input_error_when_a_static_variant_gets_no_calibration(env, tmp_path):
    with pytest.raises(InputError, match="calibration"):
        _search(env, tmp_path, mode="static")


# ------------------------------------------------------------------------------------------------ ordering
def test_families_put_the_variant_own_settings_first_and_shuffle_the_rest_by_seed():
    # op types dynamic quantization quantizes (Relu / Softmax sets would be skipped: they cannot differ)
    space = {"per_channel": [True, False], "float_op_types": [[], ["MatMul"], ["Attention"]]}
    orders = {seed: _families(mlp_variant(), SearchSpec(seed=seed, space=space)) for seed in range(6)}
    assert all(f[0].per_channel is False and f[0].float_op_types == () for f in orders.values())
    assert all(len(f) == 6 and len(set(f)) == 6 for f in orders.values())
    assert _families(mlp_variant(), SearchSpec(seed=2, space=space)) == orders[2]
    assert len({tuple(f) for f in orders.values()}) > 1  # the seed changes the order


def test_families_merge_op_type_sets_when_the_variant_already_keeps_them_float():
    space = {"per_channel": [False], "float_op_types": [[], ["Relu"]]}
    fams = _families(mlp_variant(exclude_op_types=["Relu"]), SearchSpec(space=space))
    assert len(fams) == 1 and fams[0].float_op_types == ()


def test_trial_name_stays_dns_1123_when_the_variant_name_is_63_characters():
    name = _trial_name("a" * 62 + "b", 7)
    assert len(name) <= 63 and name.endswith("-t07") and re.fullmatch(NAME_RE, name)
    assert _trial_name("v", 12) == "v-t12"


# ------------------------------------------------------------------------------------------- front, choice
def _t(index, p50, value, *, passed=True, status="ok", metric="nn_top1_agreement"):
    return Trial(index=index, name=f"v-t{index:02d}", config={"exclude_most_sensitive": index,
                                                                "excluded_nodes": ["n"] * index,
                                                                "per_channel": True, "calibration_method": None,
                                                                "float_op_types": ["Softmax"]},
                 variant=mlp_variant(), status=status, passed=passed, p50_ms=p50, worst_slice_value=value,
                 overall_value=value, seconds=0.1, metric=metric)


def _result(trials):
    return SearchResult(variant="v", trials=trials, chosen=choose_trial(trials), stopped_by="max_trials",
                        sensitivity=pd.DataFrame({"rank": [1], "node": ["n"], "op_type": ["MatMul"],
                                                  "output_rel_l2": [0.5], "output_cosine_drop": [0.1]}), seed=0)


def test_pareto_marks_non_dominated_ok_trials_when_given_a_hand_made_list():
    trials = [_t(0, 1.0, 0.90, passed=False), _t(1, 2.0, 0.95), _t(2, 3.0, 0.93),  # 2 is dominated by 1
              _t(3, 0.5, None, status="failed", passed=False), _t(4, 2.0, 0.95),  # 4 ties 1: both stay
              _t(5, 4.0, 0.99)]
    front = _result(trials).pareto()
    assert list(front["on_front"]) == [True, True, False, False, True, True]
    assert list(front["chosen"]) == [False, True, False, False, False, False]  # fastest passing, lower index
    assert list(front["excluded_count"]) == [0, 1, 2, 3, 4, 5] and front["float_op_types"].iloc[0] == "Softmax"


def test_pareto_prefers_lower_values_when_the_key_metric_is_an_error():
    trials = [_t(0, 1.0, 0.5, metric="abs_error.mean"), _t(1, 2.0, 0.1, metric="abs_error.mean"),
              _t(2, 3.0, 0.3, metric="abs_error.mean")]
    assert list(_result(trials).pareto()["on_front"]) == [True, True, False]


def test_choose_trial_picks_the_lowest_p50_passing_trial_when_some_fail_or_lack_latency():
    assert choose_trial([_t(0, 0.5, 0.9, passed=False), _t(1, None, 0.99), _t(2, 3.0, 0.97),
                         _t(3, 3.0, 0.98)]) == 2
    assert choose_trial([_t(0, None, 0.99)]) == 0
    assert choose_trial([_t(0, 1.0, 0.9, passed=False)]) is None


def test_write_search_artifacts_writes_every_file_when_given_a_result(tmp_path):
    res = _result([_t(0, 1.0, 0.90, passed=False), _t(1, 2.0, 0.95), _t(2, 3.0, 0.93)])
    paths = write_search_artifacts(res, tmp_path / "art")
    assert set(paths) == {"sensitivity.csv", "sensitivity.png", "trials.csv", "pareto.csv", "pareto.png",
                          "search.json"}
    for name in ("sensitivity.png", "pareto.png"):
        assert Path(paths[name]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(Path(paths["search.json"]).read_text())
    assert doc["chosen"] == 1 and doc["chosen_name"] == "v-t01" and doc["stopped_by"] == "max_trials"
    assert [t["on_front"] for t in doc["trials"]] == [True, True, False]
    assert doc["trials"][1]["config"]["excluded_nodes"] == ["n"] and doc["sensitivity"][0]["node"] == "n"
    trials = pd.read_csv(paths["trials.csv"])
    assert len(trials) == 3 and json.loads(trials["excluded_nodes"].iloc[2]) == ["n", "n"]
    assert list(pd.read_csv(paths["pareto.csv"])["chosen"]) == [False, True, False]


def test_search_result_to_dict_is_json_when_the_search_ran_for_real(env, tmp_path):
    res = _search(env, tmp_path, search={"max_trials": 2})
    doc = json.loads(json.dumps(res.to_dict()))
    assert doc["n_trials"] == 2 and doc["variant"] == "mlp-int8" and doc["seed"] == 0
    assert {"rank", "node", "op_type", "output_rel_l2", "output_cosine_drop"} <= set(doc["sensitivity"][0])
    paths = write_search_artifacts(res, tmp_path / "art")
    assert np.isfinite(pd.read_csv(paths["pareto.csv"])["p50_ms"]).all()


# ------------------------------------------------------------------ trials that cannot differ (issue 26, item 4)
def test_quantized_op_types_reads_ort_registries_when_asked_for_dynamic_static_qdq_and_qoperator():
    from onnxruntime.quantization.registry import IntegerOpsRegistry, QDQRegistry, QLinearOpsRegistry

    from tailguard.components.search.logic import quantized_op_types

    dynamic = quantized_op_types(mlp_variant().quantization)
    assert dynamic == set(IntegerOpsRegistry) | {"Gemm"}  # Gemm: quantize_dynamic rewrites it as MatMul + Add
    assert not dynamic & {"LayerNormalization", "SkipLayerNormalization", "Softmax", "Gelu", "BiasGelu"}
    qdq = quantized_op_types(mlp_variant(mode="static").quantization)
    assert qdq == set(QLinearOpsRegistry) | set(QDQRegistry) and {"LayerNormalization", "Softmax"} <= qdq
    qop = quantized_op_types(mlp_variant(mode="static", format="qoperator").quantization)
    assert qop == set(QLinearOpsRegistry) and "LayerNormalization" not in qop
    assert quantized_op_types(mlp_variant(mode="static", op_types=["MatMul"]).quantization) == {"MatMul"}
    assert quantized_op_types(mlp_variant(op_types=["MatMul", "Softmax"]).quantization) == {"MatMul", "Gemm"}


def test_plan_families_skips_the_default_layer_norm_gelu_families_when_the_variant_is_dynamic():
    from tailguard.components.search.logic import SKIPPED_STATUS, plan_families

    families, skipped, dropped = plan_families(mlp_variant(), SearchSpec(), {"MatMul", "Relu"})
    assert [(f.per_channel, f.float_op_types) for f in families] == [(False, ()), (True, ())]
    assert [(s["per_channel"], s["status"], s["same_as"]) for s in skipped] == [
        (True, SKIPPED_STATUS, []), (False, SKIPPED_STATUS, [])]
    assert skipped[0]["float_op_types"] == SearchSpec().space.float_op_types[1]
    assert "LayerNormalization" in skipped[0]["reason"] and "IntegerOpsRegistry" in skipped[0]["reason"]
    assert set(dropped) == set(SearchSpec().space.float_op_types[1])


def test_plan_families_drops_an_op_type_absent_from_the_graph_and_keeps_one_present_when_static(env, tmp_path):
    from tailguard.components.search.logic import plan_families, prepared_op_types

    fp32 = env[0]
    variant = mlp_variant(mode="static")  # static QDQ quantizes Softmax and Relu; the MLP has Relu, no Softmax
    space = {"per_channel": [False], "calibration_methods": ["minmax"],
             "float_op_types": [[], ["Softmax"], ["Relu", "Softmax"]]}
    graph = prepared_op_types(tmp_path / "no-sensitivity-here", variant.quantization, fp32)  # the FP32 file's
    assert graph == {"MatMul", "Relu"}
    families, skipped, dropped = plan_families(variant, SearchSpec(space=space), graph)
    assert [f.float_op_types for f in families] == [(), ("Relu",)]  # ["Relu", "Softmax"] keeps Relu: planned
    assert [(s["float_op_types"], s["same_as"]) for s in skipped] == [(["Softmax"], [])]
    assert dropped == {"Softmax": "the prepared graph has no node of this op type"}


def test_run_search_skips_and_counts_families_that_cannot_differ_when_a_float_op_type_is_never_quantized(env,
                                                                                                       tmp_path):
    """Dynamic INT8 never quantizes Relu: the two Relu families (per-channel and not) would rebuild the same
    models as the two empty ones (what issue 26 saw: t02/t03 repeating t00/t01 with identical results)."""
    res = _search(env, tmp_path, search={"space": {**SPACE, "float_op_types": [[], ["Relu"]]}})
    assert all(t.config["float_op_types"] == [] for t in res.trials)
    configs = [json.dumps(t.config, sort_keys=True) for t in res.trials]
    assert len(configs) == len(set(configs))  # no configuration built twice
    assert res.stopped_by == "space_exhausted" and len(res.skipped) == 2
    doc = json.loads(json.dumps(res.to_dict()))
    assert doc["n_skipped"] == 2 and {s["status"] for s in doc["skipped"]} == {"skipped: cannot differ"}
    assert "Relu" in doc["dropped_op_types"] and "IntegerOpsRegistry" in doc["skipped"][0]["reason"]


def _search_doc(trials, **extra):
    return {"variant": "v", "stopped_by": "space_exhausted", "chosen_name": "v-t01", "trials": trials, **extra}


def _trial_rec(i, *, float_op_types, per_channel=True, nodes=(), chosen=False):
    return {"index": i, "name": f"v-t{i:02d}", "status": "ok", "passed": True, "p50_ms": 1.0 + i,
            "worst_slice_value": 0.97433, "on_front": True, "chosen": chosen, "per_channel": per_channel,
            "calibration_method": None, "excluded_nodes": list(nodes), "float_op_types": ",".join(float_op_types),
            "config": {"float_op_types": list(float_op_types)}}


def test_search_table_shows_the_column_that_differs_and_notes_constant_ones_when_trials_differ_in_one_setting():
    from tailguard.components.register.report import search_table

    doc = _search_doc([_trial_rec(0, float_op_types=[]), _trial_rec(1, float_op_types=["Softmax"], chosen=True)])
    columns, rows, notes = search_table(doc)
    assert columns == ["trial", "float op types", "p50 ms", "worst slice", "passed", "front", "chosen"]
    assert [r["float op types"] for r in rows] == ["-", "Softmax"] and rows[1]["chosen"] == "<-"
    assert notes == ["same in every trial: excluded nodes -; per_channel True; calibration -"]
    varied = _search_doc([_trial_rec(0, float_op_types=[], per_channel=False, nodes=["mm2"]),
                          _trial_rec(1, float_op_types=[], per_channel=True)])
    columns, rows, _ = search_table(varied)
    assert columns[:3] == ["trial", "excluded nodes", "per_channel"] and "float op types" not in columns
    assert [(r["excluded nodes"], r["per_channel"]) for r in rows] == [("mm2", "False"), ("-", "True")]


def test_print_search_and_the_report_show_differing_columns_and_skipped_families_when_a_search_skipped_some():
    from tailguard.components.register.report import run_report_html
    from tailguard.terminal import console, print_search

    doc = _search_doc([_trial_rec(0, float_op_types=[]), _trial_rec(1, float_op_types=["Softmax"], chosen=True)],
                      skipped=[{"per_channel": True, "calibration_method": None, "float_op_types": ["Gelu"],
                                "same_as": [], "status": "skipped: cannot differ", "reason": "..."}],
                      n_skipped=1, dropped_op_types={"Gelu": "dynamic quantization never quantizes it"})
    with console.capture() as cap:
        print_search(doc)
    text = cap.get()
    assert "float op types" in text and "Softmax" in text and "per_channel True" in text
    assert "1 family of the search space skipped: cannot differ" in text and "Gelu" in text
    html = run_report_html({"parent_run_id": "p", "experiment_id": "1", "variants": [], "searches": [doc]},
                           run={"run_id": "p", "status": "FINISHED"})
    assert "<th>float op types</th>" in html and "<th>per_channel</th>" not in html
    assert "1 family of the search space skipped" in html


def test_pareto_uses_the_overall_value_when_the_worst_slice_value_is_nan():
    # the search reads trial values through core.results.number_or_none (as the gates do): a NaN worst slice is
    # "not measured", so the overall value stands in and the trial can be on the front
    from tailguard.core.results import number_or_none

    nan_worst = _t(1, 1.0, number_or_none(float("nan")))
    nan_worst.overall_value = 0.97
    front = _result([_t(0, 2.0, 0.95), nan_worst]).pareto()
    assert list(front["on_front"]) == [False, True]
    assert front["worst_slice_value"].isna().iloc[1]
