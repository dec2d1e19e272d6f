"""token_classification parity (tailguard.core.tokens via parity.per_sample_metrics): masked per-position top-1
agreement, sequence exact match, greedy-CTC decoding and cer (rapidfuzz), worst-case non-finite rows, and the
catalogue/spec entries. Real numpy arrays; values checked against hand-worked sequences."""

import numpy as np
import pytest

from tailguard.core import metrics as M
from tailguard.core import tokens
from tailguard.core.errors import InputError
from tailguard.core.parity import aggregate, per_sample_metrics
from tailguard.core.spec.gates import MODEL_TASK_METRICS


def _onehot(ids, classes=5):
    ids = np.asarray(ids)
    out = np.full((*ids.shape, classes), -5.0, dtype=np.float32)
    np.put_along_axis(out, ids[..., None], 5.0, axis=-1)
    return out


def test_sequences_collapses_repeats_and_drops_blank_when_ctc_greedy():
    ids = np.array([[0, 1, 1, 0, 1, 2, 2, -1], [0, 0, 0, 0, 0, 0, 0, 0]], dtype=np.int32)

    assert tokens.sequences(ids, decode="ctc_greedy", blank=0) == [[1, 1, 2], []]
    assert tokens.sequences(ids) == [[0, 1, 1, 0, 1, 2, 2], [0] * 8]


def test_per_sample_metrics_scores_token_agreement_exact_match_and_cer_when_one_position_differs():
    ref = _onehot([[0, 1, 1, 0, 2, 0, 3, 3], [1, 0, 2, 0, 3, 0, 4, 0]])
    cand = ref.copy()
    cand[0, 4] = _onehot([3])[0]   # 2 -> 3: decoded [1, 2, 3] -> [1, 3, 3]: one substitution of 3 labels

    ps = per_sample_metrics("token_classification", ref, cand, decode="ctc_greedy", blank=0)

    assert ps["token_top1_agree"].tolist() == [7 / 8, 1.0]
    assert ps["sequence_exact"].tolist() == [False, True]
    assert ps["char_error"].tolist() == pytest.approx([1 / 3, 0.0])
    agg = aggregate("token_classification", ps)
    assert agg == pytest.approx({"token_top1_agreement": 15 / 16, "sequence_exact_match": 0.5, "cer": 1 / 6})


def test_per_sample_metrics_ignores_masked_positions_when_a_mask_is_given():
    ref = _onehot([[1, 2, 3, 4]])
    cand = _onehot([[1, 2, 4, 4]])   # differs at position 2 only
    mask = np.array([[1, 1, 0, 0]])

    masked = per_sample_metrics("token_classification", ref, cand, mask=mask)
    unmasked = per_sample_metrics("token_classification", ref, cand)

    assert masked["token_top1_agree"].tolist() == [1.0] and masked["sequence_exact"].tolist() == [True]
    assert unmasked["token_top1_agree"].tolist() == [0.75] and unmasked["char_error"].tolist() == [0.25]


def test_per_sample_metrics_truncates_cer_at_one_when_the_candidate_inserts_more_than_the_reference_holds():
    ref = _onehot([[0, 1, 0, 0, 0, 0, 0, 0], [0] * 8])
    cand = _onehot([[2, 1, 3, 4, 2, 3, 4, 2], [0, 0, 1, 0, 0, 0, 0, 0]])

    ps = per_sample_metrics("token_classification", ref, cand, decode="ctc_greedy")

    # [1] vs 8 labels: 7 edits / 1 -> truncated to 1; an empty reference against [1] -> 1
    assert ps["char_error"].tolist() == [1.0, 1.0]


def test_per_sample_metrics_scores_a_non_finite_row_worst_case_when_the_candidate_holds_nan():
    ref = _onehot([[1, 2], [1, 2]])
    cand = ref.copy()
    cand[1, 0, 0] = np.nan

    ps = per_sample_metrics("token_classification", ref, cand, decode="ctc_greedy")

    assert ps["non_finite"].tolist() == [False, True]
    assert ps["token_top1_agree"].tolist() == [1.0, 0.0] and ps["char_error"].tolist() == [0.0, 1.0]
    assert ps["sequence_exact"].tolist() == [True, False]


def test_per_sample_metrics_gives_the_same_values_when_given_ids_of_different_padded_widths():
    ref = _onehot([[1, 2, 3, 0], [4, 0, 0, 0]])
    cand = _onehot([[1, 2, 2, 0], [4, 0, 0, 0]])
    mask = np.array([[1, 1, 1, 1], [1, 0, 0, 0]])
    ids_ref = tokens.token_ids(ref, mask)
    ids_cand = tokens.token_ids(cand, mask)[:, :4]
    narrow = np.full((2, 6), tokens.IGNORE, dtype=np.int32)
    narrow[:, :4] = ids_cand  # a run padded wider than the reference's

    a = per_sample_metrics("token_classification", ref, cand, mask=mask, decode="ctc_greedy")
    b = per_sample_metrics("token_classification", ids_ref, narrow, decode="ctc_greedy")

    for k in ("token_top1_agree", "sequence_exact", "char_error"):
        assert a[k].tolist() == b[k].tolist()


def test_token_ids_raises_naming_mask_input_when_the_mask_time_axis_differs_from_the_output():
    with pytest.raises(InputError) as info:
        tokens.token_ids(_onehot([[1, 2, 3]]), np.ones((1, 5)))
    assert "mask_input" in info.value.hint


def test_catalogue_registers_token_metrics_with_directions_and_bounded_ranges_when_task_is_token_classification():
    assert MODEL_TASK_METRICS["token_classification"] == ("token_top1_agreement", "sequence_exact_match", "cer")
    assert M.direction("cer") == "lower" and M.direction("token_top1_agreement") == "higher"
    assert M.is_proportion("sequence_exact_match") and not M.is_proportion("cer")
    assert M.metric("slice.font.DejaVuSans.cer").name == "cer"
    assert M.row_metric("char_error").value_range == (0.0, 1.0)
    assert M.monitor_metrics("token_classification") == ("token_top1_agree", "sequence_exact", "char_error",
                                                         "candidate_error_rate")
    assert "abs_error.p99" not in MODEL_TASK_METRICS["token_classification"]
    from tailguard.monitoring.config import METRIC_RANGE

    assert METRIC_RANGE["char_error"] == (0.0, 1.0) and METRIC_RANGE["token_top1_agree"] == (0.0, 1.0)


def test_classification_parity_hints_token_classification_when_given_three_axis_outputs():
    ref = _onehot([[1, 2, 3]])
    with pytest.raises(InputError) as info:
        per_sample_metrics("classification", ref, ref)
    assert "token_classification" in info.value.hint
