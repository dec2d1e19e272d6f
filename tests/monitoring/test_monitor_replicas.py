"""Replicas: evidence exported by each monitor replica and merged by one combiner (monitoring/combine.py).

In process: the merged CUSUM equals the single-process one when merged after every row. Across processes: two
real `tailguard monitor serve` processes (a replica with --evidence-only, a combiner with --peer) on 127.0.0.1,
fed real HTTP pairs requests; only the combiner alerts, on evidence from both."""

import time

import httpx
import numpy as np
import pytest
import yaml

from tailguard.monitoring import testing as T
from tailguard.monitoring.combine import Combiner, settings_hash
from tailguard.monitoring.config import Bound
from tailguard.monitoring.detector import SliceStatistics
from tailguard.monitoring.oip import request_json, tensor_json
from tests.helpers.monitor_process import MonitorProcess

TOP1 = {"top1_agree": Bound("top1_agree", 0.97, True, "min")}
NAME = "tiny-clf"


def _stats(**kw):
    args = dict(streams_per_request=1, alpha=0.01, horizon=10_000, min_support=1)
    return SliceStatistics("m", ["top1_agree"], TOP1, **{**args, **kw})


SETTINGS = settings_hash(_stats())


def _doc(stats, since, epoch):  # a replica's /v1/evidence document
    return {**stats.evidence(since), "epoch": epoch, "role": "replica", "settings": SETTINGS}


def test_combined_cusum_equals_single_process_cusum_when_merged_after_every_row():
    rng = np.random.default_rng(0)
    rows = (rng.random(3000) < np.where(np.arange(3000) < 1000, 1.0, 0.9)).astype(float)
    single = _stats()
    replicas = [_stats(export_walks=True, alerting=False) for _ in range(2)]
    combined = _stats(source="combined")
    docs = {}
    comb = Combiner(combined, lambda name, since: docs[name], ["r0", "r1"], settings=SETTINGS)
    fired_single, fired_comb = [], []
    for i, v in enumerate(rows):
        fired_single += single.update(["all"], {"top1_agree": v}, 1.0).fired
        r = replicas[i % 2]
        assert r.update(["all"], {"top1_agree": v}, 1.0).fired == []  # replicas never alert
        docs[f"r{i % 2}"] = _doc(r, 0, f"e{i % 2}")
        fired_comb += comb.poll().fired
    assert fired_single and fired_comb
    assert fired_comb[0].samples_seen == fired_single[0].samples_seen  # same row, same decision
    assert fired_comb[0].source == "combined"
    a, b = single.slices["all"].streams["top1_agree"], combined.slices["all"].streams["top1_agree"]
    assert a.active == b.active


def test_combiner_counts_only_new_rows_when_replica_restarts():
    rep, combined = _stats(export_walks=True, alerting=False), _stats(source="combined")
    doc = {}
    comb = Combiner(combined, lambda name, since: doc["d"], ["r"], settings=SETTINGS)
    for _ in range(50):
        rep.update(["all"], {"top1_agree": 1.0}, 1.0)
    doc["d"] = _doc(rep, 0, "first")
    comb.poll()
    rep2 = _stats(export_walks=True, alerting=False)  # the replica restarted: walks start again from zero
    for _ in range(20):
        rep2.update(["all"], {"top1_agree": 1.0}, 1.0)
    doc["d"] = _doc(rep2, 0, "second")
    comb.poll()
    assert combined.slices["all"].rows == 70
    comb.poll()  # the restarted replica's walk is merged from zero once, not again
    assert combined.slices["all"].rows == combined.slices["all"].requests == 70
    assert comb.status()["r"]["new_epochs"] == 2 and comb.status()["r"]["errors"] == 0


def test_combiner_keeps_polling_others_and_counts_error_when_peer_fails():
    rep, combined = _stats(export_walks=True, alerting=False), _stats(source="combined")
    rep.update(["all"], {"top1_agree": 1.0}, 1.0)

    def fetch(name, since):
        if name == "down":
            raise ConnectionError("refused")
        return _doc(rep, since, "e")

    comb = Combiner(combined, fetch, ["down", "up"], settings=SETTINGS)
    comb.poll()
    assert comb.status()["down"]["errors"] == 1 and "refused" in comb.status()["down"]["last_error"]
    assert comb.status()["down"]["errors_by_reason"] == {"fetch_failed": 1}
    assert combined.slices["all"].rows == 1


# ------------------------------------------------------------------------------------- two real processes
def _wait(pred, what, timeout_s=90.0):
    deadline = time.monotonic() + timeout_s  # a bound on a hung process, not a timing assumption
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    pytest.fail(f"{what} not reached in {timeout_s} s")


def _pair(i, domain, flip):  # a request and a live response (flipped top-1 when `flip`)
    x = np.random.default_rng(i).normal(size=(1, 4)).astype(np.float32)
    logits = x @ T.weights()
    if flip:
        logits = T.flip_top1(logits, np.ones(1, bool), 1.0)
    return {"request": request_json({"x": x}, {"domain": domain}, request_id=f"r{i}"),
            "response": {"model_name": NAME, "outputs": [tensor_json("logits", logits)]}}


@pytest.mark.integration
def test_only_combiner_alerts_on_evidence_from_both_replicas_when_rows_split_across_processes(tmp_path):
    ref = T.linear_classifier(tmp_path / "ref.onnx")
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(T.spec_dict({"sample_rate": 1.0, "seed": 0, "slice_columns": ["domain"],
                                                "min_support": 10, "horizon": 1000, "max_request_rows": 1})))
    procs = [MonitorProcess(["--spec", str(spec), "--reference", str(ref), "--evidence-only"], tmp_path / "rep.log")]
    try:
        procs.append(MonitorProcess(["--spec", str(spec), "--reference", str(ref), "--peer", procs[0].url,
                                     "--poll-interval", "0.2"], tmp_path / "comb.log"))
        urls = [p.url for p in procs]
        with httpx.Client(timeout=10) as c:
            for u in urls:
                _wait(lambda u=u: c.get(u + "/readyz").status_code == 200, f"{u}/readyz")
            # "legal" rows disagree with the reference one time in five (agreement 0.8 vs threshold 0.97): with
            # these settings one detector needs 61 such rows (h = log(1000 x 2 / 0.01) = 12.2). Phase 1: 40 rows to
            # the replica (not enough alone); phase 2: 40 more to the combiner (enough together).
            def send(url, start):
                for j in range(start, start + 40):
                    r = c.post(f"{url}/v2/models/{NAME}/pairs", json=_pair(j, "legal", j % 5 == 0))
                    assert r.status_code == 200

            def combined_rows():
                return c.get(urls[1] + "/v1/slices").json()["slices"].get("domain=legal", {}).get("samples_total")

            send(urls[0], 0)
            _wait(lambda: combined_rows() == 40, "the replica's 40 rows merged by the combiner")
            assert c.get(urls[1] + "/v1/alerts").json() == []  # 40 rows are not enough evidence
            send(urls[1], 40)
            _wait(lambda: any(a["slice"] == "domain=legal" for a in c.get(urls[1] + "/v1/alerts").json()),
                  "a combined alert on domain=legal")
            alert = next(a for a in c.get(urls[1] + "/v1/alerts").json() if a["slice"] == "domain=legal")
            assert alert["source"] == "combined" and alert["detector"] == "betting_cusum"
            assert alert["samples_seen"] > 40  # it used the replica's rows as well as its own
            # the value is the row-weighted agreement since the change point, from the merged window sums
            assert alert["reason"] is None and alert["value"] < 0.97, alert
            assert alert["value_ci_low"] <= alert["value"] <= alert["value_ci_high"]
            assert c.get(urls[0] + "/v1/alerts").json() == []  # the replica measures, never alerts
            ev = c.get(urls[0] + "/v1/evidence").json()
            assert ev["role"] == "replica" and ev["slices"]["domain=legal"]["rows"] == 40
            # polls before the replica listened count as errors (how many depends on start-up order); it merged since
            assert c.get(urls[1] + "/readyz").json()["peers"][urls[0]]["cursor"] > 0
    finally:
        for p in procs:
            p.end()


def test_combiner_counts_each_row_once_when_several_metrics_have_thresholds():
    bounds = {"top1_agree": Bound("top1_agree", 0.97, True, "min"),
              "kl_divergence": Bound("kl_divergence", 0.05, False, "max")}
    rep = SliceStatistics("m", list(bounds), bounds, streams_per_request=1, alpha=0.01, horizon=1000,
                          export_walks=True, alerting=False)
    combined = SliceStatistics("m", list(bounds), bounds, streams_per_request=1, alpha=0.01, horizon=1000,
                               source="combined")
    for _ in range(25):
        rep.update(["all"], {"top1_agree": 1.0, "kl_divergence": 0.01}, 1.0)
    doc = {**rep.evidence(0), "epoch": "e", "role": "replica", "settings": settings_hash(rep)}
    Combiner(combined, lambda name, since: doc, ["r"], settings=settings_hash(combined)).poll()
    assert combined.slices["all"].rows == 25
