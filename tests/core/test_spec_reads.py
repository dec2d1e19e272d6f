"""What each step reads of the spec, declared once (tailguard.core.spec.reads, issue 40 item 2): the pure tasks'
spec, reference-pass's cache key, the gate-only re-run's sections and its refusals all come from it."""

from __future__ import annotations

import pytest

from tailguard.core.spec.reads import BUILD, DECIDE, EXPORT, REFERENCE_PASS, SpecReads, not_replayable, step_view


def _doc() -> dict:
    return {"apiVersion": "tailguard/v1", "kind": "OptimizationSpec",
            "metadata": {"name": "m", "labels": {"team": "a"}},
            "model": {"registered_name": "m", "version": "7", "task": "classification"},
            "data": {"validation": {"uri": "v.parquet"}, "expectations": [{"type": "x"}]},
            "slices": [{"name": "label", "column": "label"}],
            "variants": [{"name": "a", "backend": "onnxruntime", "precision": "fp32"},
                         {"name": "b", "backend": "onnxruntime", "precision": "int8", "search": {"max_trials": 3}}],
            "gates": [{"metric": "top1_agreement", "min": 0.99}], "promotion": {"alias": "prod"},
            "analysis": {"sensitivity": True, "sequential": False}, "benchmark": {"warmup": 5},
            "cost": {"usd_per_hour": 2.5}, "mlflow": {"tracking_uri": "x"}, "serving_targets": []}


def test_step_view_keeps_only_the_declared_paths_when_given_a_build_step():
    view = step_view(_doc(), BUILD, "b")
    assert view["metadata"] == {"name": "m"} and "version" not in view["model"]
    assert "expectations" not in view["data"] and view["analysis"] == {"sensitivity": True}
    assert view["variants"] == [{"name": "b", "backend": "onnxruntime", "precision": "int8", "search": {}}]
    assert view["gates"] == [] and view["promotion"] == {"enabled": False}
    assert not {"cost", "mlflow", "serving_targets", "monitoring", "kubeflow"} & set(view)


def test_step_view_gives_the_canonical_variant_when_the_step_reads_no_variant():
    assert step_view(_doc(), EXPORT)["variants"] == [{"name": "fp32", "backend": "onnxruntime", "precision": "fp32"}]
    assert step_view(_doc(), EXPORT) == step_view(_doc(), REFERENCE_PASS)  # one spec for both, gates in the key


def test_step_view_raises_keyerror_when_the_build_variant_is_unknown():
    with pytest.raises(KeyError, match="'zz' is not in the spec"):
        step_view(_doc(), BUILD, "zz")


def test_step_view_keeps_gates_and_promotion_when_the_step_reads_them():
    view = step_view(_doc(), DECIDE)
    assert view["gates"] == _doc()["gates"] and view["promotion"] == {"alias": "prod"}
    assert [v["name"] for v in view["variants"]] == ["a", "b"]
    assert step_view(_doc(), SpecReads("x", ("model",), gates="none"))["promotion"] == {"enabled": False}


def test_not_replayable_names_the_searched_variant_or_the_targets_when_the_spec_has_them():
    assert not_replayable(_doc()) == ("variant 'b' has a search: which trials run and which is chosen depend on "
                                      "the gates, so the search runs again")
    doc = _doc()
    doc["variants"][1]["search"] = None
    assert not_replayable(doc) is None
    doc["serving_targets"] = [{"name": "t"}]
    assert not_replayable(doc) == "the spec has serving_targets (one validation per target)"


def test_rerun_redecided_sections_are_what_the_decision_reads_when_imported():
    from tailguard.rerun import REDECIDED_SECTIONS

    assert REDECIDED_SECTIONS == DECIDE.paths == ("gates", "promotion")


def test_spec_reads_declares_every_top_level_spec_field_when_compared_with_the_model():
    """A new top-level spec section must be declared: read by a measuring step, by the decision, or listed here
    as read by neither (then changing it re-runs nothing that caches)."""
    from tailguard.core.spec.root import Spec

    read = {p.split(".")[0] for r in (EXPORT, REFERENCE_PASS, BUILD, DECIDE) for p in r.paths} | {"variants"}
    neither = {"analysis", "cost", "mlflow", "kubeflow", "monitoring", "serving_targets"}  # analysis: but sensitivity
    assert set(Spec.model_fields) == read | neither
