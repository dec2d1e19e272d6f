"""The per-row slice path (issue 35): `SliceStatistics.update_groups` computes every slice group of a request at
once (one segmented sum, monitoring/units.py) and must leave the statistics exactly where one `update` per group leaves
them: counts, display sums, every CUSUM and its change point, alerts. Seeded simulations and hypothesis-drawn
requests drive two real SliceStatistics side by side; no wall clock."""

import functools
import math

import numpy as np
import pytest

from tailguard.monitoring.config import Bound
from tailguard.monitoring.detector import SliceStatistics

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

BOUNDS = {"top1_agree": Bound("top1_agree", 0.97, True, "min"),
          "candidate_error_rate": Bound("candidate_error_rate", 0.0, False, "max"),
          "kl_divergence": Bound("kl_divergence", 0.05, False, "max", truncate_at=1.0)}
METRICS = ("top1_agree", "kl_divergence", "abs_error", "candidate_error_rate")


def _pair(max_request_rows=16, **kw):
    args = dict(streams_per_request=3, alpha=0.05, horizon=2000, min_support=5, max_request_rows=max_request_rows)
    args.update(kw)
    return (SliceStatistics("m", METRICS, BOUNDS, **args), SliceStatistics("m", METRICS, BOUNDS, **args))


def _request(rng, rows, classes, agree=0.95, nan_rate=0.0, error_rate=0.01, kl_scale=0.1):
    labels = rng.integers(0, classes, rows)
    groups = [(["all", "domain=a"], None)] + [([f"predicted={c}"], np.flatnonzero(labels == c))
                                              for c in np.unique(labels)]
    values = {"top1_agree": (rng.random(rows) < agree).astype(float), "kl_divergence": rng.random(rows) * kl_scale,
              "abs_error": rng.random(rows), "candidate_error_rate": (rng.random(rows) < error_rate).astype(float)}
    if nan_rate:
        values["kl_divergence"][rng.random(rows) < nan_rate] = np.nan
    return groups, values


def _count_apply(stats):
    """A spy at one seam: {"apply": the (group, key) units `stats` applied one by one (`_apply`) so far}."""
    calls = {"apply": 0}
    real_apply = stats._apply

    def counting_apply(keys, *args, **kw):
        calls["apply"] += len(keys)
        return real_apply(keys, *args, **kw)

    stats._apply = counting_apply
    return calls


def _per_group(st_, groups, values, **kw):
    fired = []
    for keys, idx in groups:
        part = values if idx is None else {m: v[idx] for m, v in values.items()}
        fired += st_.update(keys, part, 1.0, **kw).fired
    return fired


def _assert_same(a, b):
    assert list(a.slices) == list(b.slices)
    for key, x in a.slices.items():
        y = b.slices[key]
        assert (x.rows, x.requests, x.oversize, x.last_request) == (y.rows, y.requests, y.oversize, y.last_request), key
        assert math.isclose(x.sw, y.sw, rel_tol=1e-9) and math.isclose(x.sww, y.sww, rel_tol=1e-9), key
        for m in METRICS:
            assert math.isclose(x.swm[m], y.swm[m], rel_tol=1e-9, abs_tol=1e-12), (key, m)
            assert math.isclose(x.swx[m], y.swx[m], rel_tol=1e-9, abs_tol=1e-12), (key, m)
        for m, sx in x.streams.items():
            sy = y.streams[m]
            assert np.allclose(sx.alarm.s, sy.alarm.s, rtol=1e-9, atol=1e-12), (key, m)
            assert sx.alarm.start == sy.alarm.start and sx.active == sy.active, (key, m)
            assert np.allclose(sx.acc, sy.acc, rtol=1e-9, atol=1e-12), (key, m)
            for j, level in enumerate(sx.alarm.s):
                if level > 0:  # a running CUSUM's change point and window mark (the alert's value reads them)
                    assert sx.alarm.start_request[j] == sy.alarm.start_request[j], (key, m, j)
                    mx, my = sx.alarm.mark[j], sy.alarm.mark[j]
                    assert (mx is None) == (my is None) and (mx is None or np.allclose(mx, my, rtol=1e-9)), (key, m, j)


def test_update_groups_matches_one_update_per_group_when_a_drifted_class_alarms():
    grouped, looped = _pair()
    rng = np.random.default_rng(3)
    fired_g, fired_l = [], []
    for i in range(600):
        groups, values = _request(rng, 16, 6, agree=0.99)
        drifted = [idx for keys, idx in groups if keys == ["predicted=2"]]
        if i >= 200 and drifted:  # class 2's rows drift to 0.6 agreement
            values["top1_agree"][drifted[0]] = (rng.random(len(drifted[0])) < 0.6).astype(float)
        fired_g += grouped.update_groups(groups, values, 1.0, request_index=i).fired
        fired_l += _per_group(looped, groups, values, request_index=i)
    _assert_same(grouped, looped)
    assert [(a.slice, a.metric) for a in fired_g] == [(a.slice, a.metric) for a in fired_l]
    assert ("predicted=2", "top1_agree") in [(a.slice, a.metric) for a in fired_g]


@pytest.mark.parametrize("batch", [4, 16])
def test_update_batch_matches_one_update_per_group_when_cusums_rise_and_clip_within_a_batch(batch):
    """Micro-batches of `batch` requests whose agreement hovers around the threshold, so each key's CUSUMs leave
    zero, climb and clip back several times inside one batch, and class 2 drifts until it alarms: the state,
    change points, window marks and alerts (values included) equal one `update` per group in order."""
    from tailguard.monitoring.units import GroupedRequest

    grouped, looped = _pair()
    rng = np.random.default_rng(17)
    fired_g, fired_l = [], []
    for b in range(900 // batch):
        reqs = []
        for k in range(batch):
            i = b * batch + k
            groups, values = _request(rng, 16, 4, agree=0.985, error_rate=0.0, kl_scale=0.09)
            drifted = [idx for keys, idx in groups if keys == ["predicted=2"]]
            if i >= 450 and drifted:
                values["top1_agree"][drifted[0]] = (rng.random(len(drifted[0])) < 0.7).astype(float)
            ratios = [[0.5] * len(keys) for keys, _ in groups] if k % 3 == 0 else None
            reqs.append(GroupedRequest(groups, values, 1.5, ratios, i))
            fired_l += _per_group_ratios(looped, groups, values, ratios, request_index=i)
        fired_g += [a for ev in grouped.update_batch(reqs) for a in ev.fired]
    _assert_same(grouped, looped)
    key = [(a.slice, a.metric, a.request_index, round(a.value, 9), a.window_requests) for a in fired_g]
    assert key == [(a.slice, a.metric, a.request_index, round(a.value, 9), a.window_requests) for a in fired_l]
    assert ("predicted=2", "top1_agree") in [(a.slice, a.metric) for a in fired_g]


@pytest.mark.parametrize("seed", [3, 8])
def test_update_batch_composes_most_units_and_matches_one_update_per_group_when_traffic_is_mostly_good(seed):
    """The common case of production traffic: most (request, slice group) units sit on the good side of idle
    detectors (`SliceStatistics.apply_batch` composes them per key), while one class drifts from request 400 on,
    some requests carry NaN values or more than M rows, some keys are new in a batch and the ratios vary: the state,
    the slice order, change points, window marks and alerts equal one `update` per group in order, and most units
    took the composed path (not `_apply`)."""
    from tailguard.monitoring.units import GroupedRequest

    grouped, looped = _pair(max_request_rows=12)
    calls = _count_apply(grouped)
    rng = np.random.default_rng(seed)
    fired_g, fired_l, units = [], [], 0
    for b in range(100):
        reqs = []
        for k in range(8):
            i = b * 8 + k
            rows = 14 if rng.random() < 0.02 else int(rng.integers(1, 13))  # 2% of requests over M = 12 rows
            groups, values = _request(rng, rows, 3 + b // 40, agree=1.0, error_rate=0.0, kl_scale=0.01,
                                      nan_rate=0.3 if rng.random() < 0.02 else 0.0)
            drifted = [idx for keys, idx in groups if keys == ["predicted=2"]]
            if i >= 400 and drifted:
                values["top1_agree"][drifted[0]] = (rng.random(len(drifted[0])) < 0.6).astype(float)
            ratios = [[float(rng.choice([0.25, 1.0]))] * len(keys) for keys, _ in groups] if k % 2 else None
            reqs.append(GroupedRequest(groups, values, 1.5, ratios, i))  # the weight _per_group_ratios uses
            units += sum(len(keys) for keys, idx in groups if idx is None or len(idx))
            fired_l += _per_group_ratios(looped, groups, values, ratios, request_index=i)
        fired_g += [a for ev in grouped.update_batch(reqs) for a in ev.fired]
        if b == 49:  # before the drift: only units with NaN or over M rows, new keys and what follows them in
            # their key's batch go one by one
            assert calls["apply"] < units / 2, (calls, units)
    _assert_same(grouped, looped)
    assert [(s.version, s.incarnation) for s in grouped.slices.values()] == \
        [(s.version, s.incarnation) for s in looped.slices.values()] and grouped.version == looped.version
    key = [(a.slice, a.metric, a.request_index, round(a.value, 9), a.window_requests) for a in fired_g]
    assert key == [(a.slice, a.metric, a.request_index, round(a.value, 9), a.window_requests) for a in fired_l]
    assert ("predicted=2", "top1_agree") in [(a.slice, a.metric) for a in fired_g]
    assert any(s.oversize for s in grouped.slices.values())


def test_update_batch_matches_one_update_per_sorted_group_when_indices_descend_or_a_group_is_empty():
    """A caller's group given with its row indices descending is reduced as the same rows ascending (a row's decay
    weight is its place in the group), and a group of no rows adds nothing, first, inside or last in a batch."""
    from tailguard.monitoring.units import GroupedRequest

    grouped, looped = _pair()
    rng = np.random.default_rng(23)
    for b in range(40):
        reqs = []
        for k in range(4):
            i = b * 4 + k
            groups, values = _request(rng, 16, 4, agree=0.9)
            looped_groups = list(groups)
            shuffled = [(keys, idx[::-1].tolist()) if idx is not None else (keys, idx) for keys, idx in groups]
            empty = (["predicted=9"], [])
            shuffled = [empty, *shuffled] if k == 0 else [*shuffled, empty] if k == 3 else \
                [shuffled[0], empty, *shuffled[1:]]
            reqs.append(GroupedRequest(shuffled, values, 1.0, None, i))
            _per_group(looped, looped_groups, values, request_index=i)
        grouped.update_batch(reqs)
    _assert_same(grouped, looped)
    assert "predicted=9" not in grouped.slices or grouped.slices["predicted=9"].rows == 0


def _per_group_ratios(st_, groups, values, ratios, **kw):
    fired = []
    for (keys, idx), r in zip(groups, ratios or [None] * len(groups)):
        part = values if idx is None else {m: v[idx] for m, v in values.items()}
        fired += st_.update(keys, part, 1.5, r, **kw).fired
    return fired


def test_update_groups_matches_one_update_per_group_when_values_hold_nan_or_a_group_exceeds_m():
    grouped, looped = _pair(max_request_rows=4)  # groups of more than 4 rows: split into chunks (per-group path)
    rng = np.random.default_rng(5)
    for i in range(200):
        groups, values = _request(rng, 12, 3, nan_rate=0.2 if i % 2 else 0.0)
        grouped.update_groups(groups, values, 1.0, request_index=i)
        _per_group(looped, groups, values, request_index=i)
    _assert_same(grouped, looped)
    assert any(s.oversize for s in grouped.slices.values())


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), classes=st.integers(1, 8), seed=st.integers(0, 10_000),
       ratio=st.sampled_from([None, 0.25, 1.0]))
def test_update_groups_matches_one_update_per_group_when_requests_are_drawn(rows, classes, seed, ratio):
    grouped, looped = _pair(max_request_rows=32)
    rng = np.random.default_rng(seed)
    for i in range(20):
        groups, values = _request(rng, rows, classes, agree=0.9)
        ratios = None if ratio is None else [[ratio] * len(keys) for keys, _ in groups]
        grouped.update_groups(groups, values, 2.0, ratios, request_index=i)
        for (keys, idx), r in zip(groups, ratios or [None] * len(groups)):
            part = values if idx is None else {m: v[idx] for m, v in values.items()}
            looped.update(keys, part, 2.0, r, request_index=i)
    _assert_same(grouped, looped)


def test_engine_replica_takes_checkpoints_when_its_slices_are_per_row():
    """A replica (`--evidence-only`) whose slices are per row (the default `predicted`) checkpoints its walks every
    CHECKPOINT_EVERY sampled requests, as one with request-level slices does (the combiner merges in order)."""
    from tailguard.core.spec import parse_spec
    from tailguard.monitoring import testing as T
    from tailguard.monitoring.combine import CHECKPOINT_EVERY
    from tailguard.monitoring.config import resolve_config
    from tailguard.monitoring.slice_monitor import SliceMonitor

    cfg = resolve_config(parse_spec(T.spec_dict({"sample_rate": 1.0, "seed": 0, "max_request_rows": 8})))
    monitor = SliceMonitor(cfg, role="replica", clock=lambda: 0.0)
    rng = np.random.default_rng(0)
    for i in range(CHECKPOINT_EVERY + 1):
        x = {"x": rng.normal(size=(8, T.N_FEATURES)).astype(np.float32)}
        keys, decision = monitor.admit({"domain": "news"}, x)
        assert keys.per_row
        ref = rng.normal(size=(8, T.N_CLASSES)).astype(np.float32)
        monitor.observe(keys, decision, ref, ref.copy(), request_index=i)
    assert monitor.checkpoints.after(0)


def _engine_pair(**mon):
    from tailguard.core.spec import parse_spec
    from tailguard.monitoring import testing as T
    from tailguard.monitoring.config import resolve_config
    from tailguard.monitoring.slice_monitor import SliceMonitor

    cfg = resolve_config(parse_spec(T.spec_dict({"sample_rate": 1.0, "seed": 0, "max_request_rows": 8, **mon})))
    return SliceMonitor(cfg, clock=lambda: 0.0), SliceMonitor(cfg, clock=lambda: 0.0), T


@pytest.mark.parametrize("slice_columns", [None, ["domain"]])
def test_engine_observe_batch_matches_one_observe_per_request_when_requests_are_mixed(slice_columns):
    """A micro-batch through `observe_batch` leaves the statistics, alerts and counters one `observe` per request
    leaves, with per-row (default `predicted`) or request-level slices, requests of 1 to 12 rows (over M = 8: the
    per-group path), NaN reference rows, candidate failures and a drifted class."""
    from tailguard.monitoring.slice_monitor import Observation

    batched, single, T = _engine_pair(**({"slice_columns": slice_columns} if slice_columns else {}))
    rng = np.random.default_rng(11)
    fired_b, fired_s = [], []
    for b in range(60):
        items = []
        for k in range(int(rng.integers(1, 9))):
            rows = int(rng.integers(1, 13))
            x = {"x": rng.normal(size=(rows, T.N_FEATURES)).astype(np.float32)}
            meta = {"domain": str(rng.choice(["news", "web", "legal"]))}
            keys_b, dec_b = batched.admit(meta, x)
            keys_s, dec_s = single.admit(meta, x)
            assert list(keys_b) == list(keys_s) and dec_b == dec_s
            ref = rng.normal(size=(rows, T.N_CLASSES)).astype(np.float32)
            if rng.random() < 0.1:
                ref[0] = np.nan
            cand = ref + rng.normal(scale=0.05, size=ref.shape).astype(np.float32)
            if b > 20:  # class 1's rows drift
                drift = np.argmax(np.nan_to_num(ref), axis=1) == 1
                cand[drift] = -ref[drift]
            failure = "candidate_timeout" if rng.random() < 0.05 else None
            items.append((keys_b, dec_b, keys_s, dec_s, ref, None if failure else cand, failure, b * 100 + k))
        evs = batched.observe_batch([Observation(kb, db, ref, cand, idx, failure=f)
                                     for kb, db, _, _, ref, cand, f, idx in items])
        fired_b += [(a.slice, a.metric, a.request_index, round(a.value, 9), a.rows_seen, a.window_requests,
                     a.change_point_request_index) for ev in evs for a in ev.fired]
        for _, _, ks, ds, ref, cand, f, idx in items:
            fired_s += [(a.slice, a.metric, a.request_index, round(a.value, 9), a.rows_seen, a.window_requests,
                         a.change_point_request_index)
                        for a in single.observe(ks, ds, ref, cand, request_index=idx, failure=f).fired]
    _assert_same(batched.stats, single.stats)
    assert fired_b == fired_s
    assert (batched.compared_rows, batched.compared_requests) == (single.compared_rows, single.compared_requests)
    assert any(s.reference_failures for s in batched.stats.slices.values())
    assert fired_b, "the drifted class must alert"


@pytest.mark.parametrize("seed", range(6))
def test_row_groups_gives_the_general_paths_keys_when_a_request_has_one_row(seed):
    """A one-row request's one group holds the same keys, in the same order, as the same row sent twice (column,
    header, input- and output-derived rules, per-row metadata and every pair)."""
    from tailguard.monitoring import testing as T

    cfg = _four_rule_config(per_row_metadata=True)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(1, T.N_FEATURES)).astype(np.float32)
    ref = rng.normal(size=(1, T.N_CLASSES)).astype(np.float32)
    domain = str(rng.choice(["news", "web"]))
    meta_one, meta_two = ({"domain": [domain]}, {"domain": [domain, domain]}) if seed % 2 else \
        ({"domain": domain}, {"domain": domain})
    headers = {"x-tenant": "acme"}
    keys_one, _ = cfg.row_keys(meta_one, {"x": x}, headers)
    keys_two, _ = cfg.row_keys(meta_two, {"x": np.concatenate([x, x])}, headers)
    one = cfg.row_groups(keys_one, ref, np.ones(1, dtype=bool))
    two = cfg.row_groups(keys_two, np.concatenate([ref, ref]), np.ones(2, dtype=bool))
    assert len(one) == 1 and one[0][1] is None
    assert one == two
    assert sum("&" in k for k in one[0][0]) == 6  # every pair of the 4 rules


@pytest.mark.parametrize("per_row_metadata", [False, True])
def test_one_row_group_gives_rule_labels_and_groups_of_when_a_request_has_one_row(per_row_metadata, monkeypatch):
    """The one-row path (`MonitorConfig.one_row_group`, memoized by the row's labels) gives the labels and the
    keys, in order, that `rule_labels` and `groups_of` give, for rows seen before or not; each config (a
    `dataclasses.replace` too) keeps its own memo, bounded by ONE_ROW_MEMO; without the output rule's label it
    leaves the request to the general path."""
    import dataclasses

    from tailguard.monitoring import config as C
    from tailguard.monitoring import testing as T

    cfg = dataclasses.replace(_four_rule_config(per_row_metadata))
    assert cfg.one_row_keys == {} and cfg.one_row_keys is not _four_rule_config(per_row_metadata).one_row_keys
    monkeypatch.setattr(C, "ONE_ROW_MEMO", 3)
    rng = np.random.default_rng(5)
    predicted = cfg.rules[3]
    for _ in range(40):
        x = rng.normal(size=(1, T.N_FEATURES)).astype(np.float32) * 60
        ref = rng.normal(size=(1, T.N_CLASSES)).astype(np.float32)
        domain = str(rng.choice(["news", "web"]))
        meta = {"domain": [domain] if per_row_metadata else domain}
        keys, _ = cfg.row_keys(meta, {"x": x}, {"x-tenant": str(rng.choice(["acme", "init"]))})
        outputs = [None, None, None, cfg.output_labels(predicted, ref)]
        per_rule = cfg.rule_labels(keys, ref, np.ones(1, dtype=bool), outputs)
        groups = cfg.groups_of(per_rule, 1)
        assert cfg.one_row_group(keys, outputs) == (per_rule, tuple(groups[0][0]))
        assert len(cfg.one_row_keys) <= 3
        assert cfg.one_row_group(keys, None) is None


@functools.lru_cache(maxsize=None)
def _four_rule_config(per_row_metadata=False):
    """A column, a header, an input- and an output-derived rule, every pair of them on."""
    from tailguard.core.spec import parse_spec
    from tailguard.monitoring import testing as T
    from tailguard.monitoring.config import resolve_config

    slices = [{"name": "domain", "column": "domain"}, {"name": "tenant", "header": "x-tenant"},
              {"name": "ink", "derive": {"input": "x", "select": [0, 2], "reduce": "sum"}, "bins": [-100, 0, 100]},
              {"name": "predicted", "derive": {"output": "reference", "reduce": "argmax"}}]
    return resolve_config(parse_spec(T.spec_dict({"sample_rate": 1.0, "seed": 0, "slice_pairs": True,
                                                 "per_row_metadata": per_row_metadata}, slices=slices)))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 3), st.integers(1, 20), st.data())
def test_groups_of_matches_the_general_grouping_when_one_rule_varies_by_row(varying, rows, data):
    """`MonitorConfig.groups_of`'s path for one rule whose labels differ by row (`predicted` beside request-level
    rules) gives the groups, their order and their keys' order that the general grouping gives (every pair of 4
    rules on; one label or several; labels that look like another rule's)."""
    cfg = _four_rule_config()
    labels = st.sampled_from(["0", "1", "7", "news", "[0,100)", "missing"])
    per_rule = [data.draw(st.lists(labels, min_size=rows, max_size=rows)) if r == varying else data.draw(labels)
                for r in range(4)]
    got = cfg.groups_of(per_rule, rows)
    assert got == cfg._groups_of_any(per_rule, rows)
    assert got[0][1] is None and got[0][0][0] == "all"
    assert sorted(i for _, idx in got[1:] for i in idx) == (list(range(rows)) if len(got) > 1 else [])


@pytest.mark.parametrize("good_requests", [3, 40])
def test_update_batch_composes_good_units_when_a_slices_cusums_are_above_zero_but_below_the_alarm(good_requests):
    """After a request that disagrees on every row, the slice's CUSUMs sit above 0 but below the alarm level; a batch
    of agreeing requests is composed (no `_apply`) and leaves the CUSUMs, their change points and window marks, the
    walks and the counts where one `update` per request leaves them: still above 0 after 3 requests, back at 0 (with
    the start one past the request that brought them there) after 40."""
    from tailguard.monitoring.units import GroupedRequest

    grouped, looped = _pair(max_request_rows=16)
    calls = _count_apply(grouped)

    def request(i, agree):
        rows = 8
        values = {"top1_agree": np.full(rows, 1.0 if agree else 0.0), "kl_divergence": np.full(rows, 0.01),
                  "abs_error": np.full(rows, 0.1), "candidate_error_rate": np.zeros(rows)}
        return GroupedRequest([(["all", "predicted=1"], None)], values, 1.0, None, i), values

    batches = [[request(0, True), request(1, True)], [request(2, False), request(3, True)],
               [request(4 + i, True) for i in range(good_requests)]]
    for b, batch in enumerate(batches):
        calls["apply"] = 0
        grouped.update_batch([req for req, _ in batch])
        for req, values in batch:
            looped.update(["all", "predicted=1"], values, 1.0, request_index=req.request_index)
        if b == 1:
            assert 0 < max(grouped.slices["all"].streams["top1_agree"].alarm.s) and \
                not grouped.slices["all"].streams["top1_agree"].alarm.crossed(grouped.h)
    assert calls["apply"] == 0, "the agreeing batch must be composed"
    _assert_same(grouped, looped)
    for key in ("all", "predicted=1"):
        a, b = grouped.slices[key], looped.slices[key]
        assert a.version == b.version and math.isclose(a.peak, b.peak, rel_tol=1e-9, abs_tol=1e-12)
        ca, cb = a.streams["top1_agree"].alarm, b.streams["top1_agree"].alarm
        assert ca.start == cb.start and ca.start_request == cb.start_request
        assert np.allclose(ca.walk, cb.walk, rtol=1e-9, atol=1e-12)
    cusum = grouped.slices["all"].streams["top1_agree"].alarm.s
    assert (max(cusum) > 0) == (good_requests == 3)
