"""A combiner that loses nothing, or says so (issue 41, item 3; monitoring/combine.py Ordering, Incomplete views,
Restart).

At the combine layer (real SliceStatistics, CheckpointLog and Combiner; the fetch is a function that builds each
replica's document, and the clock is the request number, so the figures are deterministic): a replica paused while
a drift starts delays detection by less than 10%, ordered; the old merge (one increment per poll) is shown to
lose more. A restarted combiner skips the history an earlier one read. Over real HTTP: three real
`--evidence-only` monitors (MonitorService under uvicorn) behind a real TCP round-robin proxy (per-connection
balancing, as a Kubernetes Service: keep-alive pins a client to one pod): /readyz reports the URL incomplete; one
replica's link paused then resumed: the others' evidence waits, the backlog merges checkpoint by checkpoint. Real
processes (`tailguard monitor serve`): a combiner restarted after an alert fired and cleared raises no stale alert.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Any, Callable, Iterator

import httpx
import numpy as np
import pytest
import yaml

from tailguard.core.spec import parse_spec
from tailguard.monitoring import testing as T
from tailguard.monitoring.app import build_app
from tailguard.monitoring.combine import CheckpointLog, Combiner, settings_hash
from tailguard.monitoring.config import Bound, resolve_config
from tailguard.monitoring.detector import SliceStatistics
from tailguard.monitoring.oip import request_json, tensor_json
from tailguard.monitoring.service import MonitorService
from tests.helpers.mlflow_server import bound_socket, uvicorn_in_thread
from tests.helpers.monitor_process import MonitorProcess
from tests.helpers.tcp_proxy import TcpRoundRobin

TOP1 = {"top1_agree": Bound("top1_agree", 0.97, True, "min")}
NAME = "tiny-clf"


def _stats(**kw: Any) -> SliceStatistics:
    # one-row requests
    args = dict(streams_per_request=1, alpha=0.01, horizon=100_000, min_support=1, max_request_rows=1)
    return SliceStatistics("m", ["top1_agree"], TOP1, **{**args, **kw})


SETTINGS = settings_hash(_stats())


# ------------------------------------------------------------------------------------------ ordering (simulation)
def _detection_delay(seed: int, *, pause: tuple[int, int] | None = None, ordered: bool = True, change: int = 8000,
                     n: int = 40_000, poll_every: int = 500, every: int = 64, p1: float = 0.955
                     ) -> tuple[float, Combiner]:
    """Three replicas share one-row requests round-robin (agreement 0.995, then `p1` from request `change`;
    threshold 0.97); the combiner polls every `poll_every` requests; replica 2 is unreachable for requests in
    `pause`. `ordered=False` sends documents without checkpoints and clock (the merge before issue 41: one
    increment per poll, merged at once). Returns (requests from the change to the alarm, the combiner)."""
    clock = [0.0]
    reps = [_stats(export_walks=True, alerting=False) for _ in range(3)]
    logs = [CheckpointLog(r, every=every, clock=lambda: clock[0]) for r in reps]

    def fetch(name: str, since: int) -> dict[str, Any]:
        i = int(name)
        if pause is not None and i == 2 and pause[0] <= clock[0] < pause[1]:
            raise ConnectionError("paused")
        doc = {**reps[i].evidence(since), "epoch": f"e{i}", "role": "replica", "settings": SETTINGS}
        if ordered:
            doc.update(as_of=clock[0], checkpoints=logs[i].after(since), checkpoint_floor=logs[i].floor)
        return doc

    comb = Combiner(_stats(source="combined"), fetch, ["0", "1", "2"], settings=SETTINGS)
    rng = np.random.default_rng(seed)
    for t in range(n):
        clock[0] = float(t)
        i = t % 3
        reps[i].update(["all"], {"top1_agree": float(rng.random() < (0.995 if t < change else p1))}, 1.0)
        logs[i].tick()
        if (t + 1) % poll_every == 0 and comb.poll().fired:
            return float(t + 1 - change), comb
    return math.inf, comb


def test_combined_detection_delay_within_10pct_of_no_pause_when_one_replica_paused_across_the_change():
    seeds = range(5)
    quiet = logging.getLogger("tailguard.monitoring.combine")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # one fetch_failed warning per poll of the paused replica
    try:
        kw = dict(change=5000, p1=0.95)  # agreement 0.995 -> 0.95 against 0.97 from request 5000
        base = [_detection_delay(s, **kw)[0] for s in seeds]
        runs = [_detection_delay(s, pause=(2000, 6000), **kw) for s in seeds]  # 8 polls down, across the change
        old = [_detection_delay(s, pause=(2000, 6000), ordered=False, **kw)[0] for s in seeds]
    finally:
        quiet.setLevel(level)
    paused = [d for d, _ in runs]
    assert all(math.isfinite(d) for d in base + paused)
    ratio = np.mean(paused) / np.mean(base)
    assert ratio <= 1.10, (base, paused)
    for _, comb in runs:  # the backlog merged checkpoint by checkpoint, in time order with the others
        st = comb.status()["2"]
        assert st["late"] == 0 and st["increments"] >= (6000 - 2000) / 3 / 64 and st["coarse"] == 0
    # the merge before: the backlog lands as one increment mixing pre-change rows with drift rows
    assert np.mean(old) / np.mean(base) > 1.2, (base, old)


def test_checkpoint_log_keeps_the_newest_and_reports_floor_when_backlog_exceeds_its_capacity():
    rep = _stats(export_walks=True, alerting=False)
    log_ = CheckpointLog(rep, every=2, keep=3, clock=lambda: 1.0)
    for _ in range(10):
        rep.update(["all"], {"top1_agree": 1.0}, 1.0)
        log_.tick()
    kept = log_.after(0)
    assert [c["slices"]["all"]["requests"] for c in kept] == [6, 8, 10]  # the two oldest were dropped
    assert kept[0]["version"] > log_.floor > 0  # the newest dropped one's version: older cursors are coarse
    assert [c["slices"]["all"]["requests"] for c in log_.after(kept[0]["version"])] == [8, 10]


def test_combiner_counts_coarse_backlog_when_cursor_is_older_than_peers_oldest_checkpoint():
    rep = _stats(export_walks=True, alerting=False)
    log_ = CheckpointLog(rep, every=2, keep=3, clock=lambda: 1.0)
    for _ in range(10):
        rep.update(["all"], {"top1_agree": 1.0}, 1.0)
        log_.tick()
    def doc(since):
        return {**rep.evidence(since), "epoch": "e", "role": "replica", "settings": SETTINGS,
                         "as_of": 2.0, "checkpoints": log_.after(since), "checkpoint_floor": log_.floor}
    combined = _stats(source="combined")
    comb = Combiner(combined, lambda name, since: doc(since), ["r"], settings=SETTINGS)
    comb.poll()
    st = comb.status()["r"]
    assert st["coarse"] == 1 and st["increments"] == 3  # oldest part (6 requests) in one, then 8 and 10
    assert combined.slices["all"].requests == 10


def test_combiner_waits_for_a_late_source_then_merges_all_when_it_is_past_wait_polls():
    reps = {n: _stats(export_walks=True, alerting=False) for n in "ab"}
    clock = [0.0]
    down = {"a": False, "b": False}

    def fetch(name: str, since: int) -> dict[str, Any]:
        if down[name]:
            raise ConnectionError("down")
        return {**reps[name].evidence(since), "epoch": name, "role": "replica", "settings": SETTINGS,
                "as_of": clock[0]}

    combined = _stats(source="combined")
    comb = Combiner(combined, fetch, ["a", "b"], settings=SETTINGS, wait_polls=2)
    for n in "ab":
        reps[n].update(["all"], {"top1_agree": 1.0}, 1.0)
    comb.poll()
    assert combined.slices["all"].requests == 2
    down["b"] = True
    for k in range(1, 4):
        clock[0] = float(k)
        reps["a"].update(["all"], {"top1_agree": 1.0}, 1.0)
        comb.poll()
        # polls 1 and 2: a's evidence waits for b (late evidence is delayed, not mixed); past wait_polls it merges
        assert combined.slices["all"].requests == (2 if k <= 2 else 5), k
    assert comb.status()["b"]["waited"] is False and comb.status()["a"]["pending"] == 0


# ------------------------------------------------------------------------------------------ incomplete views
def test_combiner_reports_replicas_missing_when_fewer_live_replicas_answer_than_expected():
    rep = _stats(export_walks=True, alerting=False)
    doc = lambda since: {**rep.evidence(since), "epoch": "only", "role": "replica", "settings": SETTINGS}  # noqa
    seen: list[str] = []
    comb = Combiner(_stats(source="combined"), lambda name, since: doc(since), ["lb"], settings=SETTINGS,
                    expect_replicas=3, on_incomplete=seen.append)
    comb.poll()
    comb.poll()
    assert comb.incomplete()["replicas"].startswith("replicas_missing: 1 live replica process(es) answer, 3")
    assert seen == ["replicas_missing", "replicas_missing"] and comb.incomplete_polls["replicas_missing"] == 2


def test_combiner_reports_several_processes_until_the_flip_is_retire_after_polls_old():
    from tailguard.monitoring.combine import RETIRE_AFTER_POLLS

    a, b = _stats(export_walks=True, alerting=False), _stats(export_walks=True, alerting=False)
    order = iter(["a", "b", "a"] + ["a"] * (RETIRE_AFTER_POLLS + 1))
    docs = {"a": a, "b": b}

    def fetch(name: str, since: int) -> dict[str, Any]:
        e = next(order)
        return {**docs[e].evidence(since), "epoch": e, "role": "replica", "settings": SETTINGS}

    comb = Combiner(_stats(source="combined"), fetch, ["lb"], settings=SETTINGS)
    comb.poll()
    comb.poll()
    assert comb.incomplete() == {}  # a second epoch alone may be a restart
    comb.poll()  # back to a: two live processes behind one URL
    assert comb.incomplete()["lb"].startswith("several_processes")
    for _ in range(RETIRE_AFTER_POLLS):
        comb.poll()
    assert comb.incomplete() == {} and set(comb.status()["lb"]["epochs"]) == {"a"}


def test_combiner_polls_discovered_peers_and_forgets_those_the_lookup_dropped():
    from tailguard.monitoring.combine import RETIRE_AFTER_POLLS

    reps = {n: _stats(export_walks=True, alerting=False) for n in ("http://a", "http://b")}
    for r in reps.values():
        r.update(["all"], {"top1_agree": 1.0}, 1.0)
    found = [["http://a", "http://b"]]
    comb = Combiner(_stats(source="combined"), lambda n, s: {**reps[n].evidence(s), "epoch": n, "role": "replica",
                                                              "settings": SETTINGS}, [], settings=SETTINGS,
                    discover=lambda: found[0])
    comb.poll()
    assert comb.stats.slices["all"].requests == 2 and comb.discovery["peers"] == ["http://a", "http://b"]
    found[0] = ["http://a"]
    comb.poll()
    assert comb.status()["http://b"]["listed"] is False

    def failing() -> list[str]:
        raise OSError("DNS down")
    comb.discover = failing
    comb.poll()  # a failed lookup keeps the last list
    assert comb.discovery["errors"] == 1 and comb.status()["http://a"]["accepted"] == 3
    comb.discover = lambda: ["http://a"]
    for _ in range(RETIRE_AFTER_POLLS):
        comb.poll()
    assert "http://b" not in comb.status() and "http://b" in comb.retired


def test_peers_from_dns_gives_one_url_per_address_when_name_resolves_to_several():
    from tailguard.monitoring.peers import peers_from_dns

    def resolver(name: str, port: int, family: int = 0, type: int = 0) -> list[tuple]:  # noqa: A002
        assert name == "replicas.test"
        return [(2, 1, 6, "", (f"127.0.0.{i}", port)) for i in (3, 1, 2, 1)] + [(10, 1, 6, "", ("::1", port, 0, 0))]

    assert peers_from_dns("replicas.test:8080", resolver) == [
        "http://127.0.0.1:8080", "http://127.0.0.2:8080", "http://127.0.0.3:8080", "http://[::1]:8080"]
    assert "http://127.0.0.1:9" in peers_from_dns("localhost:9")  # the stdlib resolver itself
    with pytest.raises(ValueError, match="NAME:PORT"):
        peers_from_dns("replicas.test")


# ------------------------------------------------------------------------------------------ restart (in process)
def _history(rep: SliceStatistics, bad: int, good: int) -> None:
    for i in range(bad + good):
        rep.update(["all"], {"top1_agree": 0.0 if i < bad else 1.0}, 1.0)


def test_restarted_combiner_raises_no_stale_alert_when_replica_history_holds_a_cleared_incident():
    rep = _stats(export_walks=True, alerting=False)
    last_reader = [""]

    def fetch_as(reader: str) -> Callable[[str, int], dict[str, Any]]:
        def fetch(name: str, since: int) -> dict[str, Any]:
            doc = {**rep.evidence(since), "epoch": "r1", "role": "replica", "settings": SETTINGS,
                   "last_reader": last_reader[0]}
            last_reader[0] = reader
            return doc
        return fetch

    first = Combiner(_stats(source="combined"), fetch_as("c1"), ["r"], settings=SETTINGS, reader="c1")
    for bad, good in [(100, 0), (0, 1500)]:  # drift, then back: fired, then cleared
        for _ in range(bad + good):
            _history(rep, 1 if bad else 0, 0 if bad else 1)
            first.poll()
    hist = first.stats.history
    assert len(hist) == 1 and hist[0].cleared_at is not None
    second = Combiner(_stats(source="combined"), fetch_as("c2"), ["r"], settings=SETTINGS, reader="c2")
    for _ in range(3):
        assert not second.poll().fired
    assert second.stats.history == [] and second.status()["r"]["skipped_requests"] == 1600
    _history(rep, 0, 5)  # what arrives after the restart is merged
    second.poll()
    assert second.stats.slices["all"].requests == 5
    # the merge before (no reader): the whole history in one increment re-fires the cleared incident
    legacy = Combiner(_stats(source="combined"), lambda n, s: {**rep.evidence(s), "epoch": "r1", "role": "replica",
                                                                "settings": SETTINGS}, ["r"], settings=SETTINGS)
    assert legacy.poll().fired


def test_combiner_merges_from_zero_when_a_new_epoch_was_never_read_before():
    rep = _stats(export_walks=True, alerting=False)
    _history(rep, 0, 40)
    doc = {**rep.evidence(0), "epoch": "new", "role": "replica", "settings": SETTINGS, "last_reader": ""}
    comb = Combiner(_stats(source="combined"), lambda n, s: doc, ["r"], settings=SETTINGS, reader="c2")
    comb.poll()
    assert comb.stats.slices["all"].requests == 40 and comb.status()["r"]["skipped_requests"] == 0


# ------------------------------------------------------------------------------------------ real HTTP
def _wait(pred: Callable[[], bool], what: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s  # a bound on a hung server, not a timing assumption
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    pytest.fail(f"{what} not reached in {timeout_s} s")


def _pair(i: int, batch: int, domain: str = "", flip: bool | None = None) -> dict[str, Any]:
    x = np.random.default_rng(i).normal(size=(batch, 4)).astype(np.float32)
    logits = x @ T.weights()
    if flip if flip is not None else i % 4 == 0:
        logits = T.flip_top1(logits, np.ones(batch, bool), 1.0)
    return {"request": request_json({"x": x}, {"domain": domain or ("legal" if i % 3 else "news")},
                                    request_id=f"r{i}"),
            "response": {"model_name": NAME, "outputs": [tensor_json("logits", logits)]}}


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    d = tmp_path_factory.mktemp("combine-order")
    ref = T.linear_classifier(d / "ref.onnx")
    spec = T.spec_dict({"sample_rate": 1.0, "seed": 0, "slice_columns": ["domain"], "min_support": 10,
                        "horizon": 1000})
    return resolve_config(parse_spec(spec)), ref


@contextlib.contextmanager
def _three_replicas(cfg, every: int | None = None) -> Iterator[tuple[list[MonitorService], list[str]]]:
    conf, ref = cfg
    svcs = [MonitorService(conf, ref, None, evidence_only=True) for _ in range(3)]
    if every is not None:
        for s in svcs:
            s.monitor.checkpoints.every = every
    try:
        with contextlib.ExitStack() as stack:
            urls = [stack.enter_context(uvicorn_in_thread(build_app(s))) for s in svcs]
            for s in svcs:
                _wait(lambda s=s: s.readiness()[0], "replica ready")
            yield svcs, urls
    finally:
        for s in svcs:
            s.stop()


def _feed(c: httpx.Client, url: str, start: int, n: int) -> int:
    rows = 0
    for i in range(start, start + n):
        r = c.post(f"{url}/v2/models/{NAME}/pairs", json=_pair(i, 1 + i % 3))
        assert r.status_code == 200, r.text
        rows += 1 + i % 3
    return rows


def _totals(c: httpx.Client, urls: list[str]) -> tuple[int, int]:
    ev = [c.get(u + "/v1/evidence").json()["slices"].get("all", {}) for u in urls]
    return sum(e.get("rows", 0) for e in ev), sum(e.get("requests", 0) for e in ev)


def _counts(svc: MonitorService) -> tuple[int, int]:
    s = svc.monitor.combined.slices.get("all")
    return (s.rows, s.requests) if s is not None else (0, 0)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.mark.integration
def test_readyz_reports_peer_incomplete_when_peer_url_is_a_keep_alive_round_robin_over_three_real_replicas(cfg):
    conf, ref = cfg
    with _three_replicas(cfg) as (svcs, urls), httpx.Client(timeout=30) as c:
        proxy = TcpRoundRobin([("127.0.0.1", _port(u)) for u in urls])
        try:
            with httpx.Client(timeout=30) as pinned:  # keep-alive: one connection, one pod, whatever the count
                assert len({pinned.get(proxy.url + "/v1/evidence").json()["epoch"] for _ in range(6)}) == 1
            sent = sum(_feed(c, u, 1000 * k, 7 + 3 * k) for k, u in enumerate(urls))
            _wait(lambda: _totals(c, urls)[0] == sent, "the replicas compared every request")
            # one URL per pod: complete, ready, and every sampled request merged
            direct = MonitorService(conf, ref, None, peers=urls, expect_replicas=3, poll_interval_s=0.1)
            try:
                with uvicorn_in_thread(build_app(direct)) as du:
                    _wait(lambda: c.get(du + "/readyz").status_code == 200 and _counts(direct) == _totals(c, urls),
                          "the per-pod combiner ready with every request merged")
                    assert c.get(du + "/readyz").json()["incomplete"] == {}
            finally:
                direct.stop()
            # the Service URL: the combiner (a restart: it skips what the first one read) reports it incomplete
            comb = MonitorService(conf, ref, None, peers=[proxy.url], expect_replicas=3, poll_interval_s=0.1)
            try:
                with uvicorn_in_thread(build_app(comb)) as cu:
                    def incomplete() -> bool:
                        r = c.get(cu + "/readyz")
                        return r.status_code == 503 and "several_processes" in (
                            r.json()["incomplete"].get(proxy.url) or "")
                    _wait(incomplete, "/readyz reporting the load-balanced peer incomplete")
                    body = c.get(cu + "/readyz").json()
                    # either every sampled request was merged, or the peer is reported incomplete
                    assert _counts(comb)[0] == sent or not body["ready"]
                    assert body["peers"][proxy.url]["incomplete"].startswith("several_processes")
                    assert comb.metrics.registry.get_sample_value(
                        "tailguard_monitor_incomplete_polls_total", {"reason": "several_processes"}) >= 1
            finally:
                comb.stop()
        finally:
            proxy.close()


@pytest.mark.integration
def test_combiner_holds_others_and_merges_backlog_in_checkpoints_when_one_real_replica_is_paused(cfg):
    conf, ref = cfg
    with _three_replicas(cfg, every=4) as (svcs, urls), httpx.Client(timeout=30) as c:
        links = [TcpRoundRobin([("127.0.0.1", _port(u))]) for u in urls]  # a pausable path to each pod
        comb = MonitorService(conf, ref, None, peers=[ln.url for ln in links], start=False)
        try:
            sent = sum(_feed(c, u, 100 * k, 12) for k, u in enumerate(urls))
            _wait(lambda: _totals(c, urls)[0] == sent, "the replicas compared every request")
            comb.combine()
            comb.combine()
            before = _counts(comb)
            assert before == _totals(c, urls)
            links[2].pause()
            sent += sum(_feed(c, u, 1000 + 100 * k, 40) for k, u in enumerate(urls))
            _wait(lambda: _totals(c, urls)[0] == sent, "the replicas compared every request")
            for _ in range(3):
                comb.combine()
            st = comb.combiner.status()
            assert st[links[2].url]["failed_polls"] == 3 and st[links[2].url]["waited"]
            # a late replica delays the others' evidence, it never lets them run ahead of it
            assert _counts(comb) == before and st[links[0].url]["pending"] > 0
            done = {n: s["increments"] for n, s in st.items()}
            links[2].pause(False)
            comb.combine()
            comb.combine()
            assert _counts(comb) == _totals(c, urls)
            st = comb.combiner.status()
            assert st[links[2].url]["increments"] - done[links[2].url] >= 40 // 4  # one per checkpoint
            assert all(s["late"] == 0 and s["coarse"] == 0 and s["pending"] == 0 for s in st.values())
        finally:
            comb.stop()
            for ln in links:
                ln.close()


@pytest.mark.integration
def test_combiner_merges_every_request_of_three_real_replicas_found_by_dns_and_reports_a_dropped_one(cfg):
    conf, ref = cfg
    hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    socks = [bound_socket(hosts[0])]  # the kernel's port on the first address, then the same on the others
    port = socks[0].getsockname()[1]
    socks += [bound_socket(h, port) for h in hosts[1:]]
    answer = {"replicas.test": hosts}

    def resolver(name: str, p: int, family: int = 0, type: int = 0) -> list[tuple]:  # noqa: A002
        # the one seam: stands in for a DNS server answering a headless Service's A records (/etc/hosts untouched)
        return [(2, 1, 6, "", (h, p)) for h in answer[name]]

    svcs = [MonitorService(conf, ref, None, evidence_only=True) for _ in hosts]
    comb = MonitorService(conf, ref, None, peer_dns=[f"replicas.test:{port}"], expect_replicas=3,
                          resolver=resolver, start=False)
    try:
        with contextlib.ExitStack() as stack, httpx.Client(timeout=30) as c:
            urls = [stack.enter_context(uvicorn_in_thread(build_app(s), sock=k)) for s, k in zip(svcs, socks)]
            for s in svcs:
                _wait(lambda s=s: s.readiness()[0], "replica ready")
            sent = sum(_feed(c, u, 100 * k, 5 + k) for k, u in enumerate(urls))
            _wait(lambda: _totals(c, urls)[0] == sent, "the replicas compared every request")
            comb.combine()
            comb.combine()
            assert _counts(comb) == _totals(c, urls)
            assert sorted(comb.combiner.status()) == sorted(["self", *urls]) and comb.combiner.incomplete() == {}
            answer["replicas.test"] = hosts[:2]  # a pod left the Service
            comb.combine()
            st = comb.readiness()[1]
            assert st["peers"][urls[2]]["listed"] is False
            assert st["incomplete"]["replicas"].startswith("replicas_missing: 2 live")
            assert st["discovery"]["peers"] == urls[:2]
    finally:
        comb.stop()
        for s in svcs:
            s.stop()


def test_monitor_serve_exits_2_naming_the_option_when_peer_dns_is_not_name_and_port(cfg):
    from typer.testing import CliRunner

    from tailguard.cli import app
    from tailguard.core.errors import InputError

    conf, ref = cfg
    with pytest.raises(InputError, match="--peer-dns 'replicas' is not NAME:PORT"):
        MonitorService(conf, ref, None, peer_dns=["replicas"], start=False)
    spec = T.spec_dict({"sample_rate": 1.0})
    path = ref.parent / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    r = CliRunner().invoke(app, ["monitor", "serve", "--spec", str(path), "--reference", str(ref),
                                 "--peer-dns", "replicas:http"])
    assert r.exit_code == 2 and "--peer-dns 'replicas:http' is not NAME:PORT" in r.output


# ------------------------------------------------------------------------------------------ real processes
@pytest.mark.integration
def test_restarted_combiner_process_raises_no_stale_alert_when_incident_fired_and_cleared_before(tmp_path):
    ref = T.linear_classifier(tmp_path / "ref.onnx")
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(T.spec_dict({"sample_rate": 1.0, "seed": 0, "slice_columns": ["domain"],
                                                "min_support": 10, "horizon": 1000, "max_request_rows": 1})))
    rep = MonitorProcess(["--spec", str(spec), "--reference", str(ref), "--evidence-only"], tmp_path / "rep.log")
    procs = [rep]
    rep_url = rep.url
    comb_args = ["--spec", str(spec), "--reference", str(ref), "--peer", rep_url, "--poll-interval", "0.1"]
    try:
        procs.append(MonitorProcess(comb_args, tmp_path / "comb.log"))
        comb_url = procs[-1].url
        with httpx.Client(timeout=30) as c:
            for u in (rep_url, comb_url):
                _wait(lambda u=u: c.get(u + "/readyz").status_code == 200, f"{u}/readyz")

            def send(start: int, n: int, flip: bool) -> None:
                for j in range(start, start + n):
                    r = c.post(f"{rep_url}/v2/models/{NAME}/pairs", json=_pair(j, 1, "legal", flip))
                    assert r.status_code == 200

            def alerts() -> list[dict[str, Any]]:
                return c.get(comb_url + "/v1/alerts").json()

            send(0, 100, True)  # the candidate disagrees on every row: an incident
            _wait(lambda: any(a["slice"] == "domain=legal" for a in alerts()), "the incident fired")
            send(100, 1500, False)  # back to agreement: the alerts clear on evidence
            _wait(lambda: alerts() and all(a["cleared_at"] for a in alerts()), "the incident cleared", 180)
            procs.pop().end()  # the combiner restarts (on a new port: its reader id is its epoch, not its URL)
            procs.append(MonitorProcess(comb_args, tmp_path / "comb2.log"))
            comb_url = procs[-1].url
            _wait(lambda: c.get(comb_url + "/readyz").json()["peers"][rep_url]["accepted"] >= 3,
                  "the restarted combiner read the replica")
            assert alerts() == []  # the cleared incident is not raised again from the replica's history
            peer = c.get(comb_url + "/readyz").json()["peers"][rep_url]
            assert peer["skipped_requests"] == 1600 and peer["errors"] == 0
            send(2000, 30, False)
            _wait(lambda: c.get(comb_url + "/v1/slices").json()["slices"].get("domain=legal", {})
                  .get("samples_total") == 30, "the new requests merged")
            assert alerts() == []
    finally:
        for p in procs:
            p.end()
