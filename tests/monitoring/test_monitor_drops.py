"""Drops that are seen (issue 38 items 6 and 7).

With the defaults (reference_timeout_s 2, 256-row micro-batches) binary clients at ~84 requests/s of 8-row requests
had 1,467 of 1,500 sampled requests dropped as `reference_timeout` while /readyz stayed ready and the latency
histogram left the timed-out calls out. Now: a drop rate past monitoring.max_drop_rate makes /readyz 503
`degraded: ...`; a timed-out call is observed in tailguard_monitor_inference_seconds; the micro-batch size adapts
to the measured inference time (service.BatchSizer), so the same traffic drops nothing.

Real parts: a MonitorService served by uvicorn (real HTTP, httpx), the reference and candidate are real tiny ONNX
models run by ONNX Runtime. One narrow seam, declared here: the reference's inference *time* is not measured on the
wall clock but on a fake timer (MonitorService's `timer`) that the slowed reference advances by PER_ROW_S per row
it runs, so a 256-row call "takes" 2.56 s, past the 2 s timeout, on any machine. The drop window's clock is fixed
(no drop ages out during a test). No test waits on, or asserts, a wall-clock duration.
"""

from __future__ import annotations

import threading
from typing import Any

import httpx
import numpy as np
import pytest

from tailguard.core.runtime import runner_for_file
from tailguard.monitoring import testing as T
from tailguard.monitoring.app import build_app
from tailguard.monitoring.oip import request_json
from tailguard.monitoring.readiness import DROP_MIN_SAMPLED
from tailguard.monitoring.service import MonitorService
from tailguard.monitoring.worker import ADAPT_START_ROWS, BatchSizer
from tests.helpers.mlflow_server import uvicorn_in_thread
from tests.monitoring.test_monitor_hardening import NAME, _cfg, _value

HUNG_S = 60.0  # bounds a hung server; never a timing assumption
PER_ROW_S = 0.01  # the slowed reference's declared time per row: 256 rows = 2.56 s > reference_timeout_s 2
REQUESTS, ROWS = 40, 8  # 320 rows queued at once: the 8-row requests, more than one 256-row batch


class FakeTimer:
    """Monotonic seconds that only move when a slowed model runs (thread-safe)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


class SlowedRunner:
    """A real ONNX Runtime runner whose call 'takes' PER_ROW_S per row on `timer` (the test's declared seam)."""

    def __init__(self, path: Any, inputs: Any, timer: FakeTimer) -> None:
        self.inner = runner_for_file(path, inputs)
        self.output_names = self.inner.output_names
        self.timer = timer
        self.calls: list[int] = []

    def run(self, feeds: dict[str, np.ndarray]) -> Any:
        rows = int(next(iter(feeds.values())).shape[0])
        self.calls.append(rows)
        self.timer.advance(rows * PER_ROW_S)
        return self.inner.run(feeds)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("drops")
    return {"ref": T.linear_classifier(d / "ref.onnx"),
            "cand": T.linear_classifier(d / "cand.onnx", T.weights(noise=0.02))}


def _run_traffic(models: dict, **mon: Any) -> tuple[MonitorService, SlowedRunner, httpx.Response, list[float]]:
    """Queue REQUESTS sampled 8-row requests over HTTP before the worker starts (so the worker sees the backlog a
    burst leaves), then let it compare them; returns the service, the reference, /readyz's answer, the clock."""
    cfg = _cfg(**mon)
    timer, clock = FakeTimer(), [0.0]
    ref = SlowedRunner(models["ref"], cfg.inputs, timer)
    svc = MonitorService(cfg, ref, models["cand"], start=False, timer=timer, clock=lambda: clock[0])
    svc._load_models()
    rng = np.random.default_rng(0)
    try:
        with uvicorn_in_thread(build_app(svc)) as url, httpx.Client(base_url=url, timeout=HUNG_S) as http:
            for i in range(REQUESTS):
                x = rng.normal(size=(ROWS, 4)).astype(np.float32)
                r = http.post(f"/v2/models/{NAME}/infer", json=request_json({"x": x}, request_id=f"r{i}"))
                assert r.status_code == 200 and r.json()["parameters"]["tailguard.sampled"] is True
            assert svc.queue.qsize() == REQUESTS
            svc.start()
            assert svc.wait_idle(HUNG_S)
            ready = http.get("/readyz")
    except BaseException:
        svc.stop()
        raise
    return svc, ref, ready, clock


def test_readyz_degraded_and_timeouts_in_histogram_when_fixed_batches_exceed_the_timeout(models):
    svc, ref, ready, clock = _run_traffic(models, shadow_batch_adapt=False)
    try:
        assert ref.calls[0] == 256  # the default micro-batch: 2.56 s against a 2 s timeout
        dropped = _value(svc, "tailguard_monitor_dropped_total", reason="reference_timeout")
        assert dropped == 256 // ROWS and svc.monitor.compared_requests == REQUESTS - dropped
        assert ready.status_code == 503, ready.text
        doc = ready.json()
        assert doc["ready"] is False and doc["reason"].startswith("degraded: 32 of 40 sampled requests")
        assert "monitoring.max_drop_rate" in doc["reason"] and "reference_timeout 32" in doc["reason"]
        assert doc["drops"]["reasons"] == {"reference_timeout": 32} and doc["drops"]["sampled"] == REQUESTS
        # the timed-out call is in the histogram, past the timeout; the 64-row call that answered below it
        labels = {"model": NAME, "role": "reference"}
        count = _value(svc, "tailguard_monitor_inference_seconds_count", **labels)
        under_timeout = _value(svc, "tailguard_monitor_inference_seconds_bucket", le="2.5", **labels)
        assert count == 2 and under_timeout == 1
        assert _value(svc, "tailguard_monitor_inference_seconds_sum", **labels) == pytest.approx(2.56 + 0.64)
        # the window is in seconds: once the drops are older than it, the monitor is ready again (an unready pod
        # gets no mirrored traffic, so a window of requests would never empty)
        clock[0] = 1000.0
        assert svc.readiness()[0] is True
    finally:
        svc.stop()


def test_same_traffic_drops_nothing_when_micro_batch_adapts_to_inference_time(models):
    svc, ref, ready, _ = _run_traffic(models)  # defaults: shadow_batch_adapt true, 256 rows, timeout 2 s
    try:
        assert _value(svc, "tailguard_monitor_dropped_total", reason="reference_timeout") == 0
        assert svc.monitor.compared_requests == REQUESTS and sum(ref.calls) == REQUESTS * ROWS
        # slow start from 16 rows, doubling while a call takes <= 1/4 of the timeout; 64 rows (0.64 s) is kept
        assert ref.calls[:3] == [ADAPT_START_ROWS, 32, 64] and max(ref.calls) == 64
        assert all(c * PER_ROW_S <= 2.0 for c in ref.calls)
        assert ready.status_code == 200 and ready.json()["drops"]["dropped"] == 0
        assert _value(svc, "tailguard_monitor_shadow_batch_rows", role="reference") == 64
    finally:
        svc.stop()


def test_readyz_stays_ready_when_drops_are_fewer_than_the_minimum_sample(models):
    cfg = _cfg()
    svc = MonitorService(cfg, models["ref"], models["cand"], start=False, clock=lambda: 0.0)
    for _ in range(DROP_MIN_SAMPLED - 1):
        svc._drop("queue_full")
    assert svc.degraded() is None  # 19 of 19 dropped: too few to judge
    svc._drop("queue_full")
    assert svc.degraded().startswith("degraded: 20 of 20")
    for _ in range(400):
        svc.drops.add(1)  # compared
    assert svc.degraded() is None  # 20 of 420 = 4.8% <= 5%
    svc.stop()


@pytest.mark.parametrize("steps, want", [
    ([(16, 0.1), (32, 0.2), (64, 0.6)], [32, 64, 64]),  # slow start doubles; a call in the band keeps the size
    ([(16, 0.1), (32, 1.2)], [32, 16]),  # slower than half the timeout: half the call's rows
    ([(16, 0.1), (32, None)], [32, 16]),  # a timeout halves too
    ([(16, 1.5), (8, 0.1), (9, 0.1)], [8, 9, 10]),  # after the first slow call: grow by 1/8 (at least 1)
    ([(4, 0.01)], [16]),  # a call smaller than the size says nothing about a full one: no growth
])
def test_batch_sizer_halves_on_slow_calls_and_grows_slowly_when_fast(steps, want):
    sizer = BatchSizer(256, 2.0)
    assert sizer.rows == ADAPT_START_ROWS
    assert [sizer.observe(r, s) for r, s in steps] == want


def test_batch_sizer_never_exceeds_shadow_batch_rows_and_is_fixed_when_adapt_is_off():
    sizer = BatchSizer(40, 2.0)
    assert [sizer.observe(r, 0.01) for r in (16, 32, 40)] == [32, 40, 40]
    fixed = BatchSizer(256, 2.0, adapt=False)
    assert fixed.rows == 256 and fixed.observe(256, None) == 256
