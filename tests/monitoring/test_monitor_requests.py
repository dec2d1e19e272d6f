"""The request is the unit of evidence (issue 27): batched requests, recovery that tests what the alarm tests,
candidate failures that count, and the shadow worker's micro-batches. Statistics tests drive SliceStatistics
directly; the service tests run real ONNX Runtime models behind the real ASGI app (Starlette's TestClient)."""

import math
import threading
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from tailguard.core.spec import parse_spec
from tailguard.monitoring import testing as T
from tailguard.monitoring.app import build_app
from tailguard.monitoring.config import Bound, resolve_config
from tailguard.monitoring.cusum import bettings
from tailguard.monitoring.detector import SliceStatistics
from tailguard.monitoring.oip import request_json
from tailguard.monitoring.service import MonitorService

NAME = "tiny-clf"
AGREE = Bound("top1_agree", 0.97, True, "min")


def _stats(bounds=None, metrics=("top1_agree",), **kw):
    bounds = bounds if bounds is not None else {"top1_agree": AGREE}
    args = dict(streams_per_request=1, alpha=0.01, horizon=1_000_000, min_support=1)
    args.update(kw)
    return SliceStatistics("m", metrics, bounds, **args)


# ------------------------------------------------------------------------------------------ request evidence
def test_detector_adds_one_bounded_bet_when_request_carries_many_disagreeing_rows():
    st = _stats()
    st.update(["all"], {"top1_agree": np.zeros(32)}, 1.0)  # one request, all 32 rows disagree
    alarm, _ = bettings(AGREE)
    most = max(math.log1p(lam * 0.97) for lam in alarm.lambdas)  # one request's largest log factor
    assert st.slices["all"].streams["top1_agree"].alarm.statistic() <= most + 1e-12
    assert most < 3.5 < st.h  # rows betting one by one added ~91 nats here (issue 27)
    assert st.slices["all"].rows == 32 and st.slices["all"].requests == 1


@pytest.mark.parametrize("rows", [8, 16, 64])
def test_detector_never_alarms_when_honest_disagreements_arrive_in_whole_requests(rows):
    # marginal agreement 0.98 > 0.97, every disagreement a fully disagreeing request (within-request correlation 1)
    rng = np.random.default_rng(rows)
    st = _stats(min_support=30)
    fired = 0
    for i in range(5000):
        bad = rng.random() < 0.02
        fired += len(st.update(["all"], {"top1_agree": np.full(rows, 0.0 if bad else 1.0)}, 1.0,
                               request_index=i).fired)
    assert fired == 0
    assert st.slices["all"].requests == 5000 and st.slices["all"].rows == 5000 * rows


def test_detector_alarms_when_whole_requests_drift_below_threshold():
    rng = np.random.default_rng(1)
    st = _stats(min_support=30)
    fired = []
    for i in range(5000):
        bad = rng.random() < 0.10  # 0.90 agreement, far below 0.97
        fired += st.update(["all"], {"top1_agree": np.full(16, 0.0 if bad else 1.0)}, 1.0, request_index=i).fired
        if fired:
            break
    assert fired and fired[0].samples_seen < 2000 and fired[0].rows_seen == 16 * fired[0].samples_seen


def test_display_mean_weights_rows_when_requests_differ_in_size():
    st = _stats(window_size=10**9)
    st.update(["all"], {"top1_agree": np.zeros(30)}, 1.0)
    st.update(["all"], {"top1_agree": np.ones(10)}, 1.0)
    assert st.slices["all"].mean("top1_agree") == pytest.approx(10 / 40, rel=1e-6)  # per row, not per request


# ------------------------------------------------------------------------------------------------- recovery
def _heavy_tail_run(bound, n=40_000, seed=0):
    """threshold 0.05 on a lower-is-better metric; x = 0.3 w.p. 0.2 else 0: mean 0.06 (bad), truncated at 0.2
    (the old recovery's 2 x threshold) the mean is 0.04 (looks fine)."""
    rng = np.random.default_rng(seed)
    st = _stats({"kl_divergence": bound}, metrics=("kl_divergence",), min_support=30, max_request_rows=1)
    fired = cleared = 0
    for i in range(n):
        x = 0.3 if rng.random() < 0.2 else 0.0
        ev = st.update(["all"], {"kl_divergence": x}, 1.0, request_index=i)
        fired += len(ev.fired)
        cleared += len(ev.cleared)
    return st, fired, cleared


def test_alert_never_clears_falsely_when_lower_is_better_metric_is_unbounded_and_not_truncated():
    st, fired, cleared = _heavy_tail_run(Bound("kl_divergence", 0.05, False, "max"))
    assert fired == 1 and cleared == 0  # the old recovery cleared 7 times on this stream
    assert st.history[0].clears == "never" and st.slice_entry("all")["metrics"]["kl_divergence"]["clears"] == "never"


def test_alert_never_clears_falsely_when_truncated_mean_is_still_bad():
    st, fired, cleared = _heavy_tail_run(Bound("kl_divergence", 0.05, False, "max", truncate_at=1.0))
    assert fired == 1 and cleared == 0 and st.history[0].clears == "on_recovery"


def test_alert_clears_when_truncated_metric_recovers():
    st = _stats({"kl_divergence": Bound("kl_divergence", 0.05, False, "max", truncate_at=1.0)},
                metrics=("kl_divergence",), min_support=30, max_request_rows=1)  # one-row requests
    fired = cleared = 0
    for i in range(20_000):
        x = 0.5 if i < 2000 else 0.0  # bad, then fully recovered
        ev = st.update(["all"], {"kl_divergence": x}, 1.0, request_index=i)
        fired, cleared = fired + len(ev.fired), cleared + len(ev.cleared)
    assert fired == 1 and cleared == 1


def test_spec_refuses_truncate_at_when_metric_is_bounded_or_below_threshold():
    from tailguard.core.spec.monitor import MonitorThreshold

    assert MonitorThreshold(min=0.97, truncate_at=2.0).problems("top1_agree", "p")[0].loc == "p.truncate_at"
    assert MonitorThreshold(max=0.5, truncate_at=0.4).problems("kl_divergence", "p")[0].loc == "p.truncate_at"
    assert MonitorThreshold(max=0.05, truncate_at=1.0).problems("kl_divergence", "p") == []


# ------------------------------------------------------------------------------------ service: failures, batches
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("req")
    return {"ref": T.linear_classifier(d / "ref.onnx"), "cand": T.linear_classifier(d / "cand.onnx"), "dir": d}


class CountingRunner:
    """A real ONNX Runtime runner that counts calls and rows; raises on rows whose first feature is >= `raise_at`
    (an input-dependent crash), or on any call of more than `max_batch` rows (a fixed batch dimension); calls wait
    while `gate` is closed."""

    def __init__(self, path, raise_at=None, max_batch=None):
        from tailguard.core.runtime import OrtRunner

        self.inner = OrtRunner(path)
        self.output_names = self.inner.output_names
        self.raise_at, self.max_batch = raise_at, max_batch
        self.calls, self.rows = 0, 0
        self.gate = threading.Event()
        self.gate.set()

    def run(self, feeds):
        self.gate.wait(300)  # bounded: a test that fails before opening the gate must not hang the process at exit
        x = feeds["x"]
        self.calls += 1
        self.rows += x.shape[0]
        if self.raise_at is not None and (x[:, 0] >= self.raise_at).any():
            raise RuntimeError("candidate crashed on this input")
        if self.max_batch is not None and x.shape[0] > self.max_batch:
            raise RuntimeError(f"batch {x.shape[0]} > {self.max_batch}")
        return self.inner.run(feeds)


def _service(reference, candidate, **mon):
    # a generous timeout: on a loaded machine a slow call must not turn into a candidate_timeout failure
    mon = {"sample_rate": 1.0, "seed": 0, "min_support": 5, "reference_timeout_s": 600.0, **mon}
    cfg = resolve_config(parse_spec(T.spec_dict(mon)))
    svc = MonitorService(cfg, reference, candidate)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (svc.readiness()[0] or svc.load_errors):
        time.sleep(0.02)
    return svc, TestClient(build_app(svc))


def _body(i, domain, batch=1, marked=False):
    x = np.random.default_rng(i).normal(size=(batch, 4)).astype(np.float32)
    if marked:
        x[:, 0] = 50.0
    return request_json({"x": x}, {"domain": domain}, request_id=f"r{i}")


def test_candidate_failure_alerts_on_its_slice_only_when_candidate_raises_on_that_slices_inputs(models):
    cand = CountingRunner(models["cand"], raise_at=10.0)
    svc, client = _service(models["ref"], cand)
    with client:
        for i in range(120):
            domain = "legal" if i % 4 == 0 else "web"
            r = client.post(f"/v2/models/{NAME}/infer", json=_body(i, domain, batch=2, marked=domain == "legal"))
            assert r.status_code == 200
        assert svc.wait_idle(60)
        alerts = svc.alerts()
        slices = {a["slice"] for a in alerts}
        assert "domain=legal" in slices and "domain=web" not in slices
        assert {a["metric"] for a in alerts if a["slice"] == "domain=legal"} >= {"candidate_error_rate"}
        doc = svc.slices()
        legal, web = doc["slices"]["domain=legal"]["metrics"], doc["slices"]["domain=web"]["metrics"]
        assert legal["candidate_error_rate"]["mean"] == 1.0 and legal["top1_agree"]["mean"] == 0.0
        assert web["candidate_error_rate"]["mean"] == 0.0
        assert doc["compared_requests"] == 120  # failures are compared (as disagreement), not dropped
        failures = svc.metrics.registry.get_sample_value("tailguard_monitor_candidate_failures_total",
                                                         {"reason": "candidate_error"})
        assert failures == 30


def test_reference_failure_is_excluded_and_counted_per_slice_when_reference_crashes(models):
    ref = CountingRunner(models["ref"], raise_at=10.0)
    svc, client = _service(ref, models["cand"])
    with client:
        for i in range(40):
            domain = "legal" if i % 4 == 0 else "web"
            client.post(f"/v2/models/{NAME}/infer", json=_body(i, domain, batch=3, marked=domain == "legal"))
        assert svc.wait_idle(60)
        doc = svc.slices()
        assert doc["slices"]["domain=legal"]["reference_failures"] == 30  # 10 requests x 3 rows
        assert doc["slices"]["domain=legal"]["sampled_requests"] == 0
        assert doc["slices"]["domain=web"]["reference_failures"] == 0
        assert doc["compared_requests"] == 30 and svc.alerts() == []
        assert svc.metrics.registry.get_sample_value("tailguard_monitor_dropped_total",
                                                     {"reason": "reference_error"}) == 10


def test_worker_runs_queued_requests_in_one_call_per_model_when_signatures_match(models):
    ref = CountingRunner(models["ref"])
    cand = CountingRunner(models["cand"])
    ref.gate.clear()  # hold the worker on its first request while the others queue up
    svc, client = _service(ref, cand, shadow_batch_rows=1024, shadow_batch_wait_ms=0, shadow_batch_adapt=False)
    with client:
        for i in range(50):  # each answer comes after its request is queued (or in the worker's hands)
            client.post(f"/v2/models/{NAME}/infer", json=_body(i, "web", batch=1 + i % 3))
        ref.gate.set()
        assert svc.wait_idle(60)
        assert cand.calls <= 2 and cand.rows == sum(1 + i % 3 for i in range(50))
        doc = svc.slices()
        assert doc["compared_requests"] == 50 and doc["compared_rows"] == cand.rows
        assert doc["slices"]["all"]["sampled_requests"] == 50


def test_worker_compares_one_request_per_call_when_model_cannot_batch(models):
    ref = CountingRunner(models["ref"])
    cand = CountingRunner(models["cand"], max_batch=3)  # e.g. a fixed batch dimension
    ref.gate.clear()
    svc, client = _service(ref, cand, shadow_batch_rows=1024, shadow_batch_wait_ms=0, shadow_batch_adapt=False)
    with client:
        for i in range(20):
            client.post(f"/v2/models/{NAME}/infer", json=_body(i, "web", batch=2))
        ref.gate.set()
        assert svc.wait_idle(60)
        doc = svc.slices()
        assert doc["compared_requests"] == 20 and svc.alerts() == []
        assert svc.metrics.registry.get_sample_value("tailguard_monitor_candidate_failures_total",
                                                     {"reason": "candidate_error"}) == 0
        assert doc["slices"]["all"]["metrics"]["candidate_error_rate"]["mean"] == 0.0


def test_replay_alerts_on_the_failing_slice_only_when_candidate_raises_on_its_rows(models, tmp_path):
    from tailguard.monitoring.replay import replay

    frame = T.requests_frame(400, seed=5, rare_share=0.2)
    legal = (frame["domain"] == "legal").to_numpy()
    frame["x"] = [np.r_[50.0, x[1:]].astype(np.float32) if bad else x for x, bad in zip(frame["x"], legal)]
    frame.to_parquet(tmp_path / "req.parquet")
    spec = parse_spec(T.spec_dict({"sample_rate": 1.0, "min_support": 5}, data_uri=str(tmp_path / "req.parquet")))
    cand = CountingRunner(models["cand"], raise_at=10.0)
    r = replay(spec, models["ref"], cand, tmp_path / "req.parquet", tmp_path / "out", seed=0)
    slices = {a["slice"] for a in r["alerts"]}
    assert "domain=legal" in slices and not slices & {"domain=web", "domain=news"}
    assert r["exit_code"] == 4 and r["slices"]["compared_requests"] == 400  # nothing dropped, failures compared
    assert r["slices"]["slices"]["domain=legal"]["metrics"]["candidate_error_rate"]["mean"] == 1.0


def test_worker_gives_the_same_statistics_when_requests_are_micro_batched_or_compared_one_by_one(models):
    noisy = T.linear_classifier(models["dir"] / "noisy.onnx", T.weights(noise=0.5, seed=4))
    docs = []
    for batch_rows in (1, 1024):
        ref = CountingRunner(models["ref"])
        ref.gate.clear()  # everything queues first, so the batched worker really batches
        svc, client = _service(ref, noisy, shadow_batch_rows=batch_rows, shadow_batch_wait_ms=0,
                               shadow_batch_adapt=False, window_size=10**9)
        with client:
            for i in range(60):
                client.post(f"/v2/models/{NAME}/infer", json=_body(i, "web" if i % 3 else "legal", batch=1 + i % 4))
            ref.gate.set()
            assert svc.wait_idle(60)
            docs.append((svc.slices(), ref.calls))
    (one, calls_one), (batched, calls_batched) = docs
    assert calls_batched < calls_one == 60
    for key in ("all", "domain=web", "domain=legal"):
        a, b = one["slices"][key], batched["slices"][key]
        assert a["sampled_requests"] == b["sampled_requests"] and a["samples_total"] == b["samples_total"]
        assert 0.0 < a["metrics"]["top1_agree"]["mean"] < 1.0  # the noisy candidate disagrees on some rows
        for m in ("top1_agree", "kl_divergence", "abs_error"):
            assert a["metrics"][m]["mean"] == pytest.approx(b["metrics"][m]["mean"], rel=1e-9)
