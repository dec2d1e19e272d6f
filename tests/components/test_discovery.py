"""Worst-slice discovery (components/validate/discovery.py): planted slices, error rates, candidate rules."""


import numpy as np
import pandas as pd
import pytest
from scipy import stats

from tailguard.components.validate.discovery import MAX_PAIRS_TESTED, TABLE_COLUMNS, DiscoveryResult, discover_slices
from tailguard.core.errors import InputError
from tailguard.core.slices import slice_groups
from tailguard.core.spec.analysis import DiscoverySpec
from tailguard.core.spec.data import SliceSpec

ALPHA = 0.05
# Tolerance of simulated error rates over 200 seeded replications: two binomial standard errors at alpha
# (2 * sqrt(0.05 * 0.95 / 200) = 0.031). The procedure's realised rates are ~0.03 (discrete Fisher tests and
# BH are conservative here); without a multiple-comparison correction they would be near 1 (checked below).
REPS = 200
TOL = 2 * np.sqrt(ALPHA * (1 - ALPHA) / REPS)


def _frame(rng: np.random.Generator, rows: int) -> pd.DataFrame:
    """3 categorical columns (5, 4, 3 values) and one numeric column (binned into 4 quantile bins)."""
    return pd.DataFrame({"lang": rng.choice(["de", "en", "fr", "ja", "zh"], rows),
                         "source": rng.choice(["web", "news", "chat", "code"], rows),
                         "device": rng.choice(["ios", "android", "web"], rows),
                         "length": rng.gamma(2.0, 30.0, rows)})


def _run(frame, per_sample, model_task="classification", **spec) -> DiscoveryResult:
    return discover_slices(frame, per_sample, model_task=model_task, spec=DiscoverySpec(**spec))


# ------------------------------------------------------------------------------------------- planted answers
def test_discover_slices_ranks_planted_value_first_when_one_group_is_worse():
    rng = np.random.default_rng(1)
    f = _frame(rng, 5000)
    bad = (f["lang"] == "ja").to_numpy()
    agree = rng.random(5000) < np.where(bad, 0.80, 0.98)
    r = _run(f, {"top1_agree": agree})
    top = r.table.iloc[0]
    assert (top.slice, top.value, bool(top.significant)) == ("lang", "ja", True)
    assert top.support == bad.sum()
    assert top.metric == "top1_agreement"
    assert top.value_in_slice == pytest.approx(agree[bad].mean())
    assert top.value_rest == pytest.approx(agree[~bad].mean())
    assert top["drop"] == pytest.approx(agree[~bad].mean() - agree[bad].mean())
    assert top["drop"] == pytest.approx(0.18, abs=0.04)
    assert np.array_equal(r.masks[("lang", "ja")], bad)
    assert list(r.table.columns) == list(TABLE_COLUMNS)
    assert "Fisher" in r.method and "Benjamini-Hochberg" in r.method


def test_discover_slices_ranks_planted_pair_first_when_a_conjunction_is_worse():
    rng = np.random.default_rng(2)
    f = _frame(rng, 5000)
    bad = ((f["lang"] == "fr") & (f["source"] == "code")).to_numpy()
    agree = rng.random(5000) < np.where(bad, 0.80, 0.98)
    r = _run(f, {"top1_agree": agree})
    top = r.table.iloc[0]
    assert (top.slice, top.value, bool(top.significant)) == ("lang&source", "fr&code", True)
    assert np.array_equal(r.masks[("lang&source", "fr&code")], bad)
    assert top.support == bad.sum()


def test_discover_slices_lists_no_pairs_when_pairs_disabled():
    rng = np.random.default_rng(2)
    f = _frame(rng, 2000)
    r = _run(f, {"top1_agree": rng.random(2000) < 0.95}, pairs=False, max_results=1000)
    assert not r.table["slice"].str.contains("&").any()
    assert r.tested == 5 + 4 + 3 + 4


# ------------------------------------------------------------------------------------------- error rates
def test_discover_slices_any_discovery_rate_within_alpha_when_no_slice_is_worse():
    # complete null: every row Bernoulli(0.95), so FDR = P(any discovery) (the family-wise error rate)
    any_sig = nominal = 0
    for seed in range(REPS):
        rng = np.random.default_rng(seed)
        f = _frame(rng, 2000)
        r = _run(f, {"top1_agree": rng.random(2000) < 0.95}, alpha=ALPHA)
        any_sig += bool(r.table["significant"].any())
        nominal += bool((r.table["p_value"] <= ALPHA).any())
    assert r.tested > 100  # ~16 single groups and ~95 pairs per replication
    assert any_sig / REPS <= ALPHA + TOL
    assert nominal / REPS > 0.5  # uncorrected, most replications would "discover" a slice


def test_discover_slices_any_discovery_rate_within_alpha_when_continuous_null():
    any_sig = 0
    for seed in range(REPS):
        rng = np.random.default_rng(10_000 + seed)
        f = _frame(rng, 2000)
        cos = 1.0 - rng.exponential(0.01, 2000)
        r = _run(f, {"cosine_similarity": cos, "nn_top1_agree": np.ones(2000, bool)}, model_task="embedding",
                 metric="cosine_similarity.mean", alpha=ALPHA)
        any_sig += bool(r.table["significant"].any())
    assert any_sig / REPS <= ALPHA + TOL


def test_discover_slices_false_discovery_proportion_within_alpha_when_one_slice_is_planted():
    fdp, found = [], 0
    for seed in range(REPS):
        rng = np.random.default_rng(20_000 + seed)
        f = _frame(rng, 2000)
        planted = (f["lang"] == "en").to_numpy()
        agree = rng.random(2000) < np.where(planted, 0.85, 0.95)
        r = _run(f, {"top1_agree": agree}, alpha=ALPHA, max_results=10_000)
        sig = r.table[r.table["significant"]]
        # a discovery is true when most of its rows are planted rows ("lang=en" and its pairs)
        false = sum(planted[r.masks[(s, v)]].mean() < 0.5 for s, v in zip(sig["slice"], sig["value"]))
        fdp.append(false / max(len(sig), 1))
        found += bool(((sig["slice"] == "lang") & (sig["value"] == "en")).any())
    assert np.mean(fdp) <= ALPHA + TOL
    assert found / REPS >= 0.9  # the procedure has power: not passing by never discovering


# ------------------------------------------------------------------------------------------- the tests themselves
def test_discover_slices_p_values_match_scipy_when_compared_per_candidate():
    rng = np.random.default_rng(3)
    f = _frame(rng, 600)
    agree = rng.random(600) < np.where(f["device"] == "ios", 0.85, 0.95)
    cos = 1.0 - rng.exponential(np.where(f["device"] == "ios", 0.02, 0.01))
    cos[:4] = -1.0
    r_bin = _run(f, {"top1_agree": agree}, max_results=1000)
    r_cont = _run(f, {"cosine_similarity": cos, "nn_top1_agree": agree}, model_task="embedding",
                  metric="cosine_similarity.mean", max_results=1000)
    assert len(r_bin.table) >= 5 and len(r_cont.table) >= 5
    for _, row in r_bin.table.head(5).iterrows():
        m = r_bin.masks[(row.slice, row.value)]
        k, n = int((~agree[m]).sum()), int(m.sum())
        kr, nr = int((~agree[~m]).sum()), int((~m).sum())
        expected = stats.fisher_exact([[k, n - k], [kr, nr - kr]], alternative="greater").pvalue
        assert row.p_value == pytest.approx(expected, rel=1e-9)
    for _, row in r_cont.table.head(5).iterrows():
        m = r_cont.masks[(row.slice, row.value)]
        expected = stats.mannwhitneyu(-cos[m], -cos[~m], alternative="greater", method="asymptotic").pvalue
        assert row.p_value == pytest.approx(expected, rel=1e-9)
        assert row.value_in_slice == pytest.approx(cos[m].mean())


def test_discover_slices_q_values_are_benjamini_hochberg_when_all_rows_listed():
    rng = np.random.default_rng(4)
    f = _frame(rng, 1000)
    agree = rng.random(1000) < np.where(f["source"] == "chat", 0.85, 0.95)
    r = _run(f, {"top1_agree": agree}, pairs=False, max_results=1000)
    # with pairs off every candidate is a single group; list every one with drop > 0 and check BH on the
    # full family by recomputing p-values of all groups (drop <= 0 groups included)
    all_p = []
    for col in ("lang", "source", "device"):
        for v in f[col].unique():
            m = (f[col] == v).to_numpy()
            k, n = int((~agree[m]).sum()), int(m.sum())
            kr, nr = int((~agree[~m]).sum()), int((~m).sum())
            all_p.append(((col, v), stats.fisher_exact([[k, n - k], [kr, nr - kr]], alternative="greater").pvalue))
    for g in slice_groups(f, [SliceSpec(name="length", column="length", quantiles=4)]):
        k, n = int((~agree[g.mask]).sum()), g.support
        kr, nr = int((~agree[~g.mask]).sum()), 1000 - n
        all_p.append((("length", g.value),
                      stats.fisher_exact([[k, n - k], [kr, nr - kr]], alternative="greater").pvalue))
    q = dict(zip([k for k, _ in all_p], stats.false_discovery_control([p for _, p in all_p], method="bh")))
    assert r.tested == len(all_p)
    for _, row in r.table.iterrows():
        assert row.q_value == pytest.approx(q[(row.slice, row.value)], rel=1e-9)


# ------------------------------------------------------------------------------------ slices tested
def test_discover_slices_respects_min_support_when_bad_group_is_small():
    rng = np.random.default_rng(5)
    rows = 1000
    tiny = np.zeros(rows, dtype=bool)
    tiny[:20] = True  # 20 rows, all disagreeing
    f = pd.DataFrame({"g": np.where(tiny, "tiny", rng.choice(["a", "b"], rows)),
                      "big": np.where(np.arange(rows) < rows - 10, "most", "few")})
    agree = rng.random(rows) < 0.97
    agree[tiny] = False
    r = _run(f, {"top1_agree": agree}, min_support=30, max_results=1000)
    assert "tiny" not in set(r.table["value"].str.split("&").explode())
    assert (r.table["support"] >= 30).all() and (rows - r.table["support"] >= 30).all()
    assert "most" not in set(r.table["value"])  # its rest (10 rows) is under min_support
    r_small = _run(f, {"top1_agree": agree}, min_support=10, pairs=False)
    assert (r_small.table.iloc[0].slice, r_small.table.iloc[0].value) == ("g", "tiny")
    assert bool(r_small.table.iloc[0].significant)


def test_discover_slices_finds_worse_cosine_when_metric_is_a_quantile():
    rng = np.random.default_rng(6)
    f = _frame(rng, 3000)
    bad = (f["source"] == "news").to_numpy()
    cos = 1.0 - rng.exponential(np.where(bad, 0.03, 0.01))
    per_sample = {"cosine_similarity": cos, "nn_top1_agree": np.ones(3000, bool)}
    r = _run(f, per_sample, model_task="embedding", metric="cosine_similarity.p01")
    top = r.table.iloc[0]
    assert (top.slice, top.value, bool(top.significant)) == ("source", "news", True)
    assert top.metric == "cosine_similarity.mean" and r.tested_metric == "cosine_similarity.mean"
    assert r.metric == "cosine_similarity.p01"
    assert "quantile" in r.method and "Mann-Whitney" in r.method
    assert top.value_in_slice == pytest.approx(cos[bad].mean())
    assert top["drop"] == pytest.approx(cos[~bad].mean() - cos[bad].mean())
    assert top["drop"] > 0.015


def test_discover_slices_lists_only_worse_slices_when_metric_is_an_error():
    rng = np.random.default_rng(7)
    f = _frame(rng, 3000)
    big = (f["device"] == "android").to_numpy()
    small = (f["device"] == "ios").to_numpy()
    err = rng.exponential(np.where(big, 0.05, np.where(small, 0.001, 0.01)))
    r = _run(f, {"abs_error": err, "rel_error": err}, model_task="regression", max_results=1000)
    top = r.table.iloc[0]
    assert (top.slice, top.value, bool(top.significant)) == ("device", "android", True)
    assert top.metric == "abs_error.mean" and top["drop"] == pytest.approx(err[big].mean() - err[~big].mean())
    assert (r.table["drop"] > 0).all()
    assert ("device", "ios") not in set(zip(r.table["slice"], r.table["value"]))


def test_discover_slices_ranks_non_finite_rows_worst_when_they_cluster_in_a_slice():
    rng = np.random.default_rng(8)
    f = _frame(rng, 2000)
    err = rng.exponential(0.01, 2000)
    zh = np.nonzero((f["lang"] == "zh").to_numpy())[0]
    err[zh[:60]] = np.inf  # per_sample_metrics scores non-finite outputs +inf
    err[np.nonzero((f["lang"] == "de").to_numpy())[0][:1]] = np.inf  # one elsewhere
    r = _run(f, {"abs_error": err, "rel_error": err}, model_task="regression")
    top = r.table.iloc[0]
    assert (top.slice, top.value, bool(top.significant)) == ("lang", "zh", True)
    assert top.value_in_slice == np.inf and top["drop"] == np.inf
    assert np.isfinite(r.table["p_value"]).all()


def test_discover_slices_skips_array_and_id_columns_when_columns_default():
    rng = np.random.default_rng(9)
    rows = 500
    f = pd.DataFrame({"id": [f"row-{i}" for i in range(rows)],
                      "tokens": [list(range(i % 5)) for i in range(rows)],
                      "vec": [np.zeros(3)] * rows,
                      "const": ["same"] * rows,
                      "input_ids": rng.choice(["x", "y"], rows),
                      "label": rng.choice(["pos", "neg"], rows),
                      "topic": rng.choice(["a", "b", "c"], rows)})
    r = discover_slices(f, {"top1_agree": rng.random(rows) < 0.95}, model_task="classification",
                        spec=DiscoverySpec(max_results=1000), exclude_columns=["input_ids", "label"])
    assert r.columns == ["topic"]
    assert set(r.skipped) == {"id", "tokens", "vec", "const"}
    assert "max_values" in r.skipped["id"] and r.skipped["const"] == "constant"
    assert "arrays" in r.skipped["tokens"] and "arrays" in r.skipped["vec"]
    assert set(r.table["slice"]) <= {"topic"}


def test_discover_slices_raises_input_error_when_explicit_column_holds_lists():
    f = pd.DataFrame({"tokens": [[1, 2]] * 100, "topic": ["a", "b"] * 50})
    with pytest.raises(InputError, match="analysis.discovery.columns.*tokens.*arrays"):
        _run(f, {"top1_agree": np.ones(100, bool)}, columns=["tokens", "topic"])


def test_discover_slices_raises_input_error_naming_field_and_columns_when_column_unknown():
    f = pd.DataFrame({"lang": ["en", "de"] * 50, "source": ["web"] * 100})
    with pytest.raises(InputError) as e:
        _run(f, {"top1_agree": np.ones(100, bool)}, columns=["lang", "langauge"])
    msg = str(e.value)
    assert "analysis.discovery.columns" in msg and "'langauge'" in msg
    assert "'lang'" in msg and "'source'" in msg


def test_discover_slices_raises_input_error_when_metric_has_no_per_row_values():
    f = pd.DataFrame({"lang": ["en", "de"] * 50})
    with pytest.raises(InputError, match="analysis.discovery.metric"):
        _run(f, {"top1_agree": np.ones(100, bool)}, metric="accuracy")  # no labels -> no "correct"
    with pytest.raises(InputError, match="analysis.discovery.metric"):
        _run(f, {"top1_agree": np.ones(100, bool)}, metric="cosine_similarity.mean")  # not a classification metric


def test_discover_slices_raises_input_error_when_lengths_differ():
    f = pd.DataFrame({"lang": ["en", "de"] * 50})
    with pytest.raises(InputError, match="100 rows"):
        _run(f, {"top1_agree": np.ones(99, bool)})


def test_discover_slices_bins_numeric_column_like_declared_quantile_slices_when_many_values():
    rng = np.random.default_rng(10)
    f = pd.DataFrame({"length": rng.gamma(2.0, 30.0, 1000), "few": rng.choice([1.0, 2.0, 3.0], 1000)})
    agree = rng.random(1000) < 0.9
    r = _run(f, {"top1_agree": agree}, pairs=False, max_bins=4, max_results=1000, min_support=5)
    declared = {g.value: g.mask for g in slice_groups(f, [SliceSpec(name="l", column="length", quantiles=4)])}
    listed = r.table[r.table["slice"] == "length"]
    for v in listed["value"]:
        assert np.array_equal(r.masks[("length", v)], declared[v])
    assert set(r.table.loc[r.table["slice"] == "few", "value"]) <= {"1", "2", "3"}  # by value, without ".0"
    assert r.tested == 4 + 3


def test_discover_slices_skips_pair_identical_to_a_single_when_columns_are_nested():
    rng = np.random.default_rng(11)
    lex = rng.choice(["noun.body", "noun.food", "verb.motion", "verb.social"], 2000)
    f = pd.DataFrame({"lexname": lex, "pos": [v.split(".")[0] for v in lex]})
    r = _run(f, {"top1_agree": rng.random(2000) < 0.95}, max_results=1000)
    assert r.tested == 4 + 2  # every lexname&pos cell equals a lexname group


def test_discover_slices_caps_pair_candidates_when_columns_have_many_values():
    rng = np.random.default_rng(12)
    rows = 10_000
    f = pd.DataFrame({f"c{i}": rng.integers(0, 50, rows).astype(str) for i in range(10)})
    agree = rng.random(rows) < 0.97
    r = _run(f, {"top1_agree": agree}, min_support=5)
    assert r.tested == 500 + MAX_PAIRS_TESTED
    assert f"capped at the {MAX_PAIRS_TESTED} largest" in r.method


def test_discover_slices_returns_empty_table_when_disabled_or_no_candidate():
    f = pd.DataFrame({"lang": ["en", "de"] * 10})
    off = _run(f, {"top1_agree": np.ones(20, bool)}, enabled=False)
    assert off.tested == 0 and off.table.empty and "disabled" in off.method
    few = _run(f, {"top1_agree": np.zeros(20, bool)})  # 10 rows per group < min_support 30
    assert few.tested == 0 and few.table.empty and few.masks == {}
    assert list(few.table.columns) == list(TABLE_COLUMNS)


def test_discover_slices_masks_are_positional_when_frame_index_is_not_a_range():
    rng = np.random.default_rng(13)
    f = _frame(rng, 1000)
    bad = (f["lang"] == "de").to_numpy()
    agree = rng.random(1000) < np.where(bad, 0.7, 0.97)
    shuffled = f.set_axis(rng.permutation(1000) + 5000)  # an index left over from filtering
    r = _run(shuffled, {"top1_agree": agree})
    assert (r.table.iloc[0].slice, r.table.iloc[0].value) == ("lang", "de")
    assert np.array_equal(r.masks[("lang", "de")], bad)
