"""Parity metrics (pipelines/core/parity.py) on synthetic outputs with known answers."""

import math
from types import SimpleNamespace

import numpy as np
import pytest

from tailguard.core import parity
from tailguard.core.errors import InputError
from tailguard.core.parity import aggregate, non_finite_rows, per_sample_metrics
from tailguard.core.spec.gates import MODEL_TASK_METRICS


def _paired_embeddings(n_pairs: int = 20, dim: int = 32, seed: int = 0) -> np.ndarray:
    """Rows 2k and 2k+1 are near-duplicates; pairs point in random directions, so NN(row 2k) = row 2k+1."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(n_pairs, dim))
    rows = np.repeat(centres, 2, axis=0) + 0.01 * rng.normal(size=(2 * n_pairs, dim))
    return rows.astype(np.float32)


def test_per_sample_metrics_identical_when_candidate_equals_reference_classification():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(50, 6)).astype(np.float32)
    labels = rng.integers(0, 6, size=50)
    agg = aggregate("classification", per_sample_metrics("classification", logits, logits.copy(), labels=labels))
    assert agg["top1_agreement"] == 1.0
    assert agg["kl_divergence.mean"] == 0.0 and agg["kl_divergence.p99"] == 0.0
    assert agg["abs_error.max"] == 0.0
    assert agg["accuracy"] == agg["reference_accuracy"] == np.mean(logits.argmax(1) == labels)


def test_aggregate_keys_are_task_metrics_when_labels_given_or_not():
    logits = np.eye(4, dtype=np.float32)
    with_labels = aggregate("classification", per_sample_metrics("classification", logits, logits,
                                                                 labels=np.arange(4)))
    without = aggregate("classification", per_sample_metrics("classification", logits, logits))
    assert tuple(with_labels) == MODEL_TASK_METRICS["classification"]
    assert tuple(without) == tuple(m for m in MODEL_TASK_METRICS["classification"]
                                   if m not in ("accuracy", "reference_accuracy"))
    emb = _paired_embeddings(4)
    assert tuple(aggregate("embedding", per_sample_metrics("embedding", emb, emb))) == tuple(
        m for m in MODEL_TASK_METRICS["embedding"] if m not in ("accuracy", "reference_accuracy"))
    assert tuple(aggregate("embedding", per_sample_metrics("embedding", emb, emb, labels=np.arange(8) // 2))) == \
        MODEL_TASK_METRICS["embedding"]
    reg = np.ones((3, 2))
    regression = aggregate("regression", per_sample_metrics("regression", reg, reg))
    assert tuple(regression) == MODEL_TASK_METRICS["regression"]


def test_top1_agreement_counts_flips_when_three_of_twenty_rows_flip():
    ref = np.zeros((20, 3), dtype=np.float32)
    ref[:, 0] = 5.0  # every reference row predicts class 0
    cand = ref.copy()
    cand[[2, 9, 17], 1] = 10.0  # three rows flip to class 1
    ps = per_sample_metrics("classification", ref, cand, labels=np.zeros(20, dtype=np.int64))
    agg = aggregate("classification", ps)
    assert agg["top1_agreement"] == pytest.approx(17 / 20)
    assert agg["accuracy"] == pytest.approx(17 / 20)
    assert agg["reference_accuracy"] == 1.0
    assert np.flatnonzero(~ps["top1_agree"]).tolist() == [2, 9, 17]
    assert agg["abs_error.max"] == pytest.approx(10.0)


def test_kl_divergence_matches_closed_form_when_uniform_vs_three_to_one():
    ref = np.zeros((1, 2), dtype=np.float32)  # p = (0.5, 0.5)
    cand = np.array([[math.log(3.0), 0.0]], dtype=np.float32)  # q = (0.75, 0.25)
    kl = per_sample_metrics("classification", ref, cand)["kl_divergence"][0]
    assert kl == pytest.approx(0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25), rel=1e-5)


def test_embedding_metrics_perfect_when_candidate_equals_reference():
    emb = _paired_embeddings()
    agg = aggregate("embedding", per_sample_metrics("embedding", emb, emb.copy()))
    assert agg["cosine_similarity.min"] == pytest.approx(1.0, abs=1e-12)
    assert agg["nn_top1_agreement"] == 1.0 and agg["nn_top5_agreement"] == 1.0
    assert agg["abs_error.max"] == 0.0


def test_nn_top1_agreement_drops_by_two_rows_when_two_candidate_rows_are_swapped():
    emb = _paired_embeddings(n_pairs=20)  # 40 rows
    cand = emb.copy()
    cand[[0, 10]] = emb[[10, 0]]  # rows 0 and 10 (in different pairs) swap embeddings
    ps = per_sample_metrics("embedding", emb, cand)
    # cand_0 == ref_10, whose nearest neighbour (row 0 excluded) is row 10 itself; NN(ref_0) is row 1.
    assert np.flatnonzero(~ps["nn_top1_agree"]).tolist() == [0, 10]
    assert aggregate("embedding", ps)["nn_top1_agreement"] == pytest.approx(38 / 40)
    assert ps["nn_top5_overlap"][[0, 10]].max() < 1.0
    assert np.all(np.delete(ps["nn_top5_overlap"], [0, 10]) == 1.0)
    assert ps["cosine_similarity"][[0, 10]].max() < 0.9


def test_nn_search_includes_self_when_an_explicit_index_is_given():
    emb = _paired_embeddings(n_pairs=5)
    cand = emb.copy()
    cand[0] = emb[2]
    ps = per_sample_metrics("embedding", emb, cand, reference_index=emb.copy(), exclude_self=False)
    # with itself in the index, NN(ref_i) = i; NN(cand_0) = 2
    assert ps["nn_top1_agree"].tolist() == [False] + [True] * 9


def test_nn_search_gives_same_answer_when_split_in_small_blocks(monkeypatch):
    rng = np.random.default_rng(3)
    ref = rng.normal(size=(60, 8)).astype(np.float32)
    cand = ref + 0.3 * rng.normal(size=ref.shape).astype(np.float32)
    whole = per_sample_metrics("embedding", ref, cand)
    monkeypatch.setattr(parity, "SEARCH_BLOCK_BYTES", 4 * 60 * 7)  # 7 query rows per block
    blocked = per_sample_metrics("embedding", ref, cand)
    assert np.array_equal(whole["nn_top1_agree"], blocked["nn_top1_agree"])
    assert np.array_equal(whole["nn_top5_overlap"], blocked["nn_top5_overlap"])
    assert 0 < whole["nn_top1_agree"].mean() < 1  # the noise really reorders some neighbours


def test_non_finite_rows_scored_worst_case_when_candidate_has_nan_and_inf():
    emb = _paired_embeddings(n_pairs=10)
    cand = emb.copy()
    cand[3, 0] = np.nan
    cand[7, 5] = np.inf
    ps = per_sample_metrics("embedding", emb, cand)
    assert non_finite_rows(cand).tolist() == [i in (3, 7) for i in range(20)]
    assert ps["non_finite"].sum() == 2
    agg = aggregate("embedding", ps)
    assert agg["cosine_similarity.min"] == -1.0
    assert agg["nn_top1_agreement"] == pytest.approx(18 / 20)
    assert agg["abs_error.max"] == math.inf
    assert not any(math.isnan(v) for v in agg.values())

    logits = np.zeros((4, 3), dtype=np.float32)
    bad = logits.copy()
    bad[1] = np.nan
    cagg = aggregate("classification", per_sample_metrics("classification", logits, bad, labels=np.zeros(4)))
    assert cagg["top1_agreement"] == 0.75 and cagg["accuracy"] == 0.75
    assert cagg["kl_divergence.p99"] == math.inf and cagg["kl_divergence.mean"] == math.inf


def test_regression_errors_match_hand_computation_when_values_known():
    ref = np.array([[2.0, 4.0], [0.0, 1.0]])
    cand = np.array([[2.5, 4.0], [1e-7, 1.0]])
    ps = per_sample_metrics("regression", ref, cand)
    assert ps["abs_error"].tolist() == pytest.approx([0.5, 1e-7])
    assert ps["rel_error"].tolist() == pytest.approx([0.25, 1e-7 / parity.REL_EPS])
    agg = aggregate("regression", ps)
    assert agg["abs_error.max"] == pytest.approx(0.5) and agg["rel_error.mean"] == pytest.approx((0.25 + 0.1) / 2)


def test_aggregate_uses_only_masked_rows_when_mask_given():
    ref = np.zeros((6, 2), dtype=np.float32)
    ref[:, 0] = 1
    cand = ref.copy()
    cand[:3, 1] = 5  # first three rows disagree
    ps = per_sample_metrics("classification", ref, cand)
    mask = np.array([True, False, False, True, True, True])
    assert aggregate("classification", ps, mask)["top1_agreement"] == pytest.approx(0.75)
    empty = aggregate("classification", ps, np.zeros(6, dtype=bool))
    assert all(math.isnan(v) for v in empty.values())
    with pytest.raises(InputError, match="mask has 2 rows"):
        aggregate("classification", ps, np.ones(2, dtype=bool))


def test_percentile_is_inf_not_nan_when_tail_is_infinite():
    ps = {"abs_error": np.array([1.0, 2.0, 3.0, np.inf]), "rel_error": np.zeros(4)}
    agg = aggregate("generic", ps)
    assert agg["abs_error.p99"] == math.inf
    ps = {"abs_error": np.arange(101, dtype=float), "rel_error": np.zeros(101)}
    assert aggregate("generic", ps)["abs_error.p99"] == pytest.approx(np.percentile(np.arange(101), 99))


def test_per_sample_metrics_raises_input_error_when_shapes_or_task_are_wrong():
    with pytest.raises(InputError, match="differs from the reference"):
        per_sample_metrics("embedding", np.zeros((3, 4)), np.zeros((3, 5)))
    with pytest.raises(InputError, match="needs 2-D outputs"):
        per_sample_metrics("classification", np.zeros((3, 4, 2)), np.zeros((3, 4, 2)))
    with pytest.raises(InputError, match="unknown model.task"):
        per_sample_metrics("ranking", np.zeros((3, 4)), np.zeros((3, 4)))
    with pytest.raises(InputError, match="labels for 3 rows"):
        per_sample_metrics("classification", np.zeros((3, 4)), np.zeros((3, 4)), labels=np.zeros(2))
    with pytest.raises(InputError, match="at least 2 rows"):
        per_sample_metrics("embedding", np.ones((1, 4)), np.ones((1, 4)))


# ------------------------------------------------------------------------------ probability outputs (issue 38)
def _probability_rows(seed: int = 0, rows: int = 200, classes: int = 6) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(classes, 0.3), size=rows)
    q = np.abs(p + rng.normal(0, 0.02, p.shape))
    return p, q / q.sum(axis=1, keepdims=True)


def test_per_sample_metrics_computes_kl_on_the_values_when_outputs_are_probabilities():
    from tailguard.core.parity import PROBABILITY_FLOOR, per_sample_metrics

    p, q = _probability_rows()
    pc, qc = np.clip(p, PROBABILITY_FLOOR, None), np.clip(q, PROBABILITY_FLOOR, None)
    pc, qc = pc / pc.sum(axis=1, keepdims=True), qc / qc.sum(axis=1, keepdims=True)
    exact = (pc * (np.log(pc) - np.log(qc))).sum(axis=1)

    as_probs = per_sample_metrics("classification", p, q, probabilities=True)["kl_divergence"]
    as_logits = per_sample_metrics("classification", p, q)["kl_divergence"]

    np.testing.assert_allclose(as_probs, exact, rtol=1e-9, atol=1e-12)
    assert as_logits.mean() < 0.5 * as_probs.mean()  # a softmax of probabilities flattens them: KL understated
    assert (per_sample_metrics("classification", p, q, probabilities=True)["top1_agree"]
            == per_sample_metrics("classification", p, q)["top1_agree"]).all()


def test_output_kind_warning_names_the_fix_when_logits_rows_already_sum_to_one():
    from tailguard.components.reference.logic import output_kind_warnings
    from tailguard.core.parity import looks_like_probabilities
    from tailguard.core.spec.model import TensorSpec

    p, _ = _probability_rows()
    logits = np.log(p) + 3.0
    assert looks_like_probabilities(p) and not looks_like_probabilities(logits)

    def spec(kind):  # what output_kind_warnings reads of a Spec: model.task, model.outputs
        out = TensorSpec(name="prob", dtype="float32", shape=["batch", 6], kind=kind)
        return SimpleNamespace(model=SimpleNamespace(task="classification", outputs=[out]))

    [warning] = output_kind_warnings(spec(None), p)
    assert "model.outputs[0] (prob)" in warning and "declare `kind: probabilities`" in warning
    assert output_kind_warnings(spec("probabilities"), p) == []
    assert output_kind_warnings(spec(None), logits) == []


def test_spec_refuses_kind_on_an_input_and_probabilities_on_an_embedding_output():
    from pydantic import ValidationError

    from tailguard.core.spec.model import ModelSpec

    base = {"registered_name": "m", "task": "classification",
            "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
            "outputs": [{"name": "p", "dtype": "float32", "shape": ["batch", 3], "kind": "probabilities"}]}
    assert ModelSpec.model_validate(base).outputs[0].kind == "probabilities"
    with pytest.raises(ValidationError, match="inputs.0.kind: kind applies to outputs only"):
        ModelSpec.model_validate({**base, "inputs": [{**base["inputs"][0], "kind": "logits"}]})
    with pytest.raises(ValidationError, match="outputs.0.kind: 'probabilities' applies to model.task classification"):
        ModelSpec.model_validate({**base, "task": "embedding"})


def test_monitor_compare_rows_scores_kl_like_validation_when_outputs_are_probabilities():
    from tailguard.monitoring.compare import compare_rows

    p, q = _probability_rows(1, rows=20)
    got = compare_rows("classification", p, q, ["top1_agree", "kl_divergence"], probabilities=True)
    np.testing.assert_array_equal(got["kl_divergence"],
                                  per_sample_metrics("classification", p, q, probabilities=True)["kl_divergence"])
