"""Label- and retrieval-aware embedding metrics (pipelines/core/parity.py): kNN label accuracy vs the
reference's, recall@k of the FP32 top-k, margin-aware top-1 agreement; overall, per slice, with bounds and
gates. Synthetic embeddings with known answers."""

import numpy as np
import pandas as pd
import pytest

from tailguard.components.validate.gates import evaluate_gates
from tailguard.components.validate.intervals import metric_bound
from tailguard.components.validate.logic import validate_variant
from tailguard.core.data import Dataset
from tailguard.core.errors import InputError
from tailguard.core.parity import aggregate, per_sample_metrics
from tailguard.core.slices import per_slice_table, slice_groups
from tailguard.core.spec import parse_spec
from tailguard.core.spec.data import SliceSpec
from tailguard.core.spec.gates import MODEL_TASK_METRICS, PROPORTION_METRICS
from tailguard.core.stats import wilson_bound

DIM_PER_GROUP = 3


def _unit(v):
    v = np.asarray(v, dtype=np.float64)
    return v / np.linalg.norm(v)


def _near_tie_groups(n_tie: int, n_decisive: int, *, tie_gap=0.002, flip_tie=True, flip_decisive=0):
    """Groups of three rows (query q, neighbours a, b) in orthogonal 3-d subspaces of one embedding space.

    Tie groups: cos(q, a) exceeds cos(q, b) by about `tie_gap` (a near-tie). Decisive groups: by about 0.5.
    The candidate equals the reference except for query rows: in a tie group (if `flip_tie`) q is nudged so
    that b becomes its nearest neighbour (a flip of a near-tie); in the first `flip_decisive` decisive groups q
    is moved onto b (a decisive flip).

    Returns:
        (reference (rows, dim) float32, candidate (rows, dim) float32, query rows of tie groups, query rows of
        decisively flipped groups, group kind per row ("tie"/"decisive")).
    """
    groups = n_tie + n_decisive
    dim = DIM_PER_GROUP * groups
    ref, cand, kinds = [], [], []
    tie_q, flipped_q = [], []
    for g in range(groups):
        tie = g < n_tie
        t1 = 0.5
        t2 = np.arccos(np.cos(t1) - (tie_gap if tie else 0.5))
        q = np.array([1.0, 0.0, 0.0])
        a = np.array([np.cos(t1), np.sin(t1), 0.0])
        b = np.array([np.cos(t2), 0.0, np.sin(t2)])
        qc = q.copy()
        if tie and flip_tie:
            qc = _unit(q + np.array([0.0, -0.01, 0.01]))  # towards b, away from a: b now wins by ~0.008
        if not tie and (g - n_tie) < flip_decisive:
            qc = b.copy()
        for vec, cvec in ((q, qc), (a, a), (b, b)):
            r, c = np.zeros(dim), np.zeros(dim)
            r[DIM_PER_GROUP * g:DIM_PER_GROUP * (g + 1)] = vec
            c[DIM_PER_GROUP * g:DIM_PER_GROUP * (g + 1)] = cvec
            ref.append(r)
            cand.append(c)
            kinds.append("tie" if tie else "decisive")
        (tie_q if tie else flipped_q if (g - n_tie) < flip_decisive else []).append(3 * g)
    return (np.asarray(ref, dtype=np.float32), np.asarray(cand, dtype=np.float32), tie_q, flipped_q,
            np.asarray(kinds))


# -------------------------------------------------------------------------------- margin-aware agreement
def test_margin_agreement_passes_where_nn_top1_fails_when_only_near_ties_flip():
    ref, cand, tie_q, _, _ = _near_tie_groups(n_tie=20, n_decisive=40)
    per = per_sample_metrics("embedding", ref, cand, margin_tolerance=0.01)
    agg = aggregate("embedding", per)
    n = ref.shape[0]
    assert np.flatnonzero(~per["nn_top1_agree"]).tolist() == tie_q  # every near-tie flipped, nothing else
    assert agg["nn_top1_agreement"] == pytest.approx(1 - 20 / n)
    assert agg["nn_top1_margin_agreement"] == 1.0
    assert np.all(per["nn_margin"][tie_q] < 0.01)


def test_margin_agreement_counts_a_flip_when_the_fp32_margin_is_decisive():
    ref, cand, tie_q, flipped, _ = _near_tie_groups(n_tie=10, n_decisive=30, flip_decisive=3)
    per = per_sample_metrics("embedding", ref, cand, margin_tolerance=0.01)
    n = ref.shape[0]
    assert np.flatnonzero(~per["nn_top1_margin_agree"]).tolist() == flipped
    assert aggregate("embedding", per)["nn_top1_margin_agreement"] == pytest.approx(1 - 3 / n)
    strict = per_sample_metrics("embedding", ref, cand, margin_tolerance=0.0)  # tolerance 0: plain agreement
    assert np.array_equal(strict["nn_top1_margin_agree"], strict["nn_top1_agree"])


def test_gates_nn_top1_fails_and_margin_agreement_passes_per_slice_when_near_ties_are_planted():
    ref, cand, _, _, kinds = _near_tie_groups(n_tie=30, n_decisive=30)
    per = per_sample_metrics("embedding", ref, cand)
    frame = pd.DataFrame({"kind": kinds})
    groups = slice_groups(frame, [SliceSpec(name="kind", column="kind")])
    table = per_slice_table("embedding", per, groups)
    spec = _spec([{"metric": "nn_top1_agreement", "min": 0.8, "confidence": 0.95, "scope": "per_slice"},
                  {"metric": "nn_top1_margin_agreement", "min": 0.95, "confidence": 0.95, "scope": "per_slice"}])
    top1, margin = evaluate_gates(spec, "int8", aggregate("embedding", per), table, {}, per_sample=per,
                                  groups=groups)
    assert top1.status == "failed" and [f["value"] for f in top1.detail["failing"]] == ["tie"]
    assert margin.status == "passed" and margin.decided_on == "bound"
    # the bound is Wilson's (a 0/1 metric): 90 of 90 rows agree in the "tie" group
    assert "nn_top1_margin_agreement" in PROPORTION_METRICS
    assert margin.observed == pytest.approx(wilson_bound(90, 90, 0.95, "lower"))


# ------------------------------------------------------------------------------------------- recall@k
def _brute_recall(ref, cand, k):
    """Independent oracle: full sort of cosine scores, self excluded."""
    rn = ref / np.linalg.norm(ref, axis=1, keepdims=True)
    cn = cand / np.linalg.norm(cand, axis=1, keepdims=True)
    out = []
    for i in range(len(ref)):
        def top(q, i=i):
            s = rn @ q
            s[i] = -np.inf
            return set(np.argsort(-s, kind="stable")[:k].tolist())
        out.append(len(top(rn[i]) & top(cn[i])) / k)
    return np.asarray(out)


@pytest.mark.parametrize("k", [1, 3, 10])
def test_recall_at_k_matches_a_brute_force_search_when_candidate_is_noisy(k):
    rng = np.random.default_rng(k)
    ref = rng.normal(size=(60, 16))
    cand = ref + 0.3 * rng.normal(size=ref.shape)
    per = per_sample_metrics("embedding", ref, cand, recall_k=k)
    np.testing.assert_allclose(per["nn_recall"], _brute_recall(ref, cand, k))
    assert aggregate("embedding", per)["nn_recall_at_k"] == pytest.approx(_brute_recall(ref, cand, k).mean())
    assert 0.0 < per["nn_recall"].mean() < 1.0  # the noise does reorder neighbourhoods


def test_recall_at_k_is_one_when_candidate_equals_reference_and_k_is_capped_by_the_index():
    ref = np.random.default_rng(0).normal(size=(6, 8))
    per = per_sample_metrics("embedding", ref, ref.copy(), recall_k=50)  # only 5 other rows to rank
    assert np.all(per["nn_recall"] == 1.0)


# ---------------------------------------------------------------------------------- kNN label accuracy
def _clusters(n_per=20, n_clusters=4, dim=12, seed=0):
    rng = np.random.default_rng(seed)
    centres = 5 * rng.normal(size=(n_clusters, dim))
    labels = np.repeat([f"c{j}" for j in range(n_clusters)], n_per)
    ref = np.repeat(centres, n_per, axis=0) + 0.1 * rng.normal(size=(n_clusters * n_per, dim))
    return ref, labels, centres


def test_knn_accuracy_drops_by_moved_rows_while_reference_accuracy_stays_when_rows_move_cluster():
    ref, labels, centres = _clusters()
    cand = ref.copy()
    moved = [0, 1, 2, 25, 47]
    for i in moved:  # these candidate rows now sit in the next cluster
        j = (int(labels[i][1:]) + 1) % len(centres)
        cand[i] = centres[j]
    per = per_sample_metrics("embedding", ref, cand, labels=labels)
    agg = aggregate("embedding", per)
    assert agg["reference_accuracy"] == 1.0
    assert agg["accuracy"] == pytest.approx(1 - len(moved) / len(ref))
    assert np.flatnonzero(~per["correct"]).tolist() == moved


def test_knn_accuracy_uses_the_majority_of_k_neighbours_when_knn_k_is_three():
    # query 0 at the origin side; its 3 nearest: one "x" (nearest) then two "y"
    ref = np.array([[1.0, 0.0, 0.0], [0.99, 0.1, 0.0], [0.97, 0.0, 0.2], [0.97, 0.0, -0.2],
                    [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    labels = np.array(["y", "x", "y", "y", "x", "x"])
    one = per_sample_metrics("embedding", ref, ref.copy(), labels=labels, knn_k=1)
    three = per_sample_metrics("embedding", ref, ref.copy(), labels=labels, knn_k=3)
    assert not one["reference_correct"][0] and three["reference_correct"][0]
    # tie (one vote each, k=2): the nearer neighbour's label wins
    two = per_sample_metrics("embedding", ref, ref.copy(), labels=labels, knn_k=2)
    assert not two["reference_correct"][0]


def test_knn_accuracy_gate_with_max_drop_uses_the_paired_bound_when_labels_given():
    ref, labels, centres = _clusters(n_per=50)
    cand = ref.copy()
    cand[:4] = centres[1]  # 4 of 200 rows leave their cluster
    per = per_sample_metrics("embedding", ref, cand, labels=labels)
    spec = _spec([{"metric": "accuracy", "max_drop": 0.05, "confidence": 0.95},
                  {"metric": "accuracy", "max_drop": 0.001, "confidence": 0.95}])
    loose, tight = evaluate_gates(spec, "int8", aggregate("embedding", per), pd.DataFrame(), {}, per_sample=per)
    assert loose.status == "passed" and "Newcombe" in loose.method
    assert tight.status == "failed" and loose.detail["reference_score"] == 1.0


def test_embedding_metrics_raise_when_labels_or_settings_are_unusable():
    ref = np.random.default_rng(0).normal(size=(5, 4))
    with pytest.raises(InputError):
        per_sample_metrics("embedding", ref, ref, labels=np.arange(4))
    with pytest.raises(InputError):
        per_sample_metrics("embedding", ref, ref, recall_k=0)
    with pytest.raises(InputError):
        per_sample_metrics("embedding", ref, ref, margin_tolerance=-0.1)
    with pytest.raises(InputError):
        per_sample_metrics("embedding", ref, ref, labels=np.arange(5), reference_index=ref.copy())


# ------------------------------------------------------------------------------ bounds, spec, end to end
def test_recall_at_k_bound_is_a_bootstrap_and_margin_bound_is_wilson_when_per_slice():
    ref, cand, _, _, kinds = _near_tie_groups(n_tie=10, n_decisive=10, flip_decisive=2)
    per = per_sample_metrics("embedding", ref, cand)
    mask = kinds == "decisive"
    margin_lb = metric_bound("embedding", "nn_top1_margin_agreement", per, mask, 0.95, "lower")
    agree = int(per["nn_top1_margin_agree"][mask].sum())
    assert margin_lb == pytest.approx(wilson_bound(agree, int(mask.sum()), 0.95, "lower"))
    recall_lb = metric_bound("embedding", "nn_recall_at_k", per, mask, 0.95, "lower")
    assert recall_lb <= per["nn_recall"][mask].mean()


def _spec(gates, **analysis):
    return parse_spec({
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "emb"},
        "model": {"registered_name": "enc", "task": "embedding",
                  "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
                  "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", 4]}]},
        "data": {"calibration": {"uri": "c.parquet"},
                 "validation": {"uri": "v.parquet", "label_column": "label", "batch_size": 16}},
        "slices": [{"name": "kind", "column": "kind"}],
        "variants": [{"name": "int8", "backend": "onnxruntime", "precision": "fp32"}],
        "gates": gates, "benchmark": {"batch_sizes": [1], "warmup": 0, "iterations": 2},
        "analysis": {"discovery": {"enabled": False}, **analysis},
        "promotion": {"enabled": False}})


def test_spec_accepts_the_new_embedding_metrics_and_rejects_a_bad_margin_tolerance():
    for m in ("nn_recall_at_k", "nn_top1_margin_agreement", "accuracy"):
        assert m in MODEL_TASK_METRICS["embedding"]
        _spec([{"metric": m, "min": 0.9, "confidence": 0.95, "scope": "per_slice"}])
    spec = _spec([], embedding={"recall_k": 5, "margin_tolerance": 0.02, "knn_k": 3})
    assert spec.analysis.embedding.recall_k == 5
    with pytest.raises(Exception) as exc:
        _spec([], embedding={"margin_tolerance": -1})
    assert "analysis.embedding.margin_tolerance" in str(exc.value)


class _IdentityRunner:
    def run(self, feeds):
        return [np.asarray(feeds["x"], dtype=np.float32)]


def test_validate_variant_reports_knn_accuracy_when_embedding_labels_are_strings(tmp_path):
    ref, labels, _ = _clusters(n_per=10, n_clusters=3, dim=4)
    ref = ref.astype(np.float32)
    frame = pd.DataFrame({"label": labels, "kind": np.where(np.arange(len(ref)) % 2 == 0, "even", "odd")})
    ds = Dataset({"x": list(ref)}, frame, np.full(len(ref), 4, dtype=np.int64), str(tmp_path / "v.parquet"))
    spec = _spec([{"metric": "nn_recall_at_k", "min": 0.99}], embedding={"recall_k": 3})
    res = validate_variant(spec, "int8", _IdentityRunner(), [ref], ds, tmp_path / "out")
    assert res.overall["accuracy"] == res.overall["reference_accuracy"] == 1.0
    assert res.overall["nn_recall_at_k"] == 1.0 and res.passed
    assert {"slice.kind.even.nn_top1_margin_agreement", "slice.kind.odd.accuracy"} <= set(res.mlflow_metrics())
