"""The replica combiner cannot double-count and survives garbage from peers (monitoring/combine.py).

Epoch accounting: documents of real SliceStatistics (in process), then real monitors over real HTTP: two
`--evidence-only` MonitorServices under uvicorn behind a round-robin proxy (a small real HTTP server on 127.0.0.1
that alternates between them), a combiner listing its own URL, one replica under two URLs. Garbage: a real HTTP
peer serving broken documents, slow or endless bodies, listed before a good peer that must still merge.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator

import httpx
import numpy as np
import pytest

from tailguard.core.spec import parse_spec
from tailguard.monitoring import testing as T
from tailguard.monitoring.app import build_app
from tailguard.monitoring.combine import RETIRE_AFTER_POLLS, Combiner, PeerError, settings_hash
from tailguard.monitoring.config import Bound, resolve_config
from tailguard.monitoring.oip import request_json, tensor_json
from tailguard.monitoring.peers import http_fetch
from tailguard.monitoring.prometheus import MonitorMetrics
from tailguard.monitoring.service import MonitorService
from tests.helpers.mlflow_server import bound_socket, uvicorn_in_thread

TOP1 = {"top1_agree": Bound("top1_agree", 0.97, True, "min")}
NAME = "tiny-clf"


def _stats(**kw: Any):
    from tailguard.monitoring.detector import SliceStatistics

    args = dict(streams_per_request=1, alpha=0.01, horizon=10_000, min_support=1)
    return SliceStatistics("m", ["top1_agree"], TOP1, **{**args, **kw})


SETTINGS = settings_hash(_stats())


def _replica(rows: int, *, seed: int = 0, batch: int = 1):
    """A replica's statistics after `rows` requests of `batch` rows (agreement 0.9, keys all and d=a)."""
    rep = _stats(export_walks=True, alerting=False)
    rng = np.random.default_rng(seed)
    for _ in range(rows):
        rep.update(["all", "d=a"], {"top1_agree": (rng.random(batch) < 0.9).astype(float)}, 1.0)
    return rep


def _doc(stats, since: int, epoch: str, **over: Any) -> dict[str, Any]:
    return {**stats.evidence(since), "epoch": epoch, "role": "replica", "settings": SETTINGS, **over}


def _counts(combined, key: str = "all") -> tuple[int, int]:
    s = combined.slices.get(key)
    return (s.rows, s.requests) if s is not None else (0, 0)


# ------------------------------------------------------------------------------------------ epoch accounting
def test_combiner_merges_each_epoch_once_when_a_source_alternates_between_two_replicas():
    a, b = _replica(300, seed=1, batch=3), _replica(200, seed=2)
    combined = _stats(source="combined")
    turn = itertools.cycle([("a", a), ("b", b)])

    def fetch(name, since):  # a load-balanced URL: each poll answered by the next replica
        epoch, stats = next(turn)
        return _doc(stats, since, epoch)

    comb = Combiner(combined, fetch, ["lb"], settings=SETTINGS)
    for _ in range(9):
        comb.poll()
        assert combined.slices["all"].rows <= 1100  # never more than the replicas measured
    assert _counts(combined) == (a.slices["all"].rows + b.slices["all"].rows, 500)
    assert _counts(combined, "d=a") == _counts(combined)
    st = comb.status()["lb"]
    assert st["new_epochs"] == 2 and st["errors_by_reason"] == {"epoch_flip": 7}
    assert st["ok"] and set(st["epochs"]) == {"a", "b"}


def test_combiner_merges_partial_document_later_when_a_new_epoch_answers_a_cursor_of_another():
    big, small = _replica(400, seed=3), _replica(5, seed=4)  # small's versions are all below big's cursor
    combined = _stats(source="combined")
    turn = itertools.cycle([("big", big), ("small", small)])
    sent: list[int] = []

    def fetch(name, since):
        sent.append(since)
        epoch, s = next(turn)
        return _doc(s, since, epoch)

    comb = Combiner(combined, fetch, ["lb"], settings=SETTINGS)
    for _ in range(4):
        comb.poll()
    assert sent[1] > small.version  # small answered a cursor of big's: its document was empty, not complete
    assert _counts(combined) == (405, 405)


def test_combiner_refuses_duplicate_epoch_when_one_replica_is_listed_under_two_sources():
    rep = _replica(50)
    combined = _stats(source="combined")
    comb = Combiner(combined, lambda name, since: _doc(rep, since, "e1"), ["pod", "pod-alias"], settings=SETTINGS)
    for _ in range(3):
        comb.poll()
    assert _counts(combined) == (50, 50)
    assert comb.status()["pod-alias"]["errors_by_reason"] == {"duplicate_epoch": 3}
    assert comb.status()["pod"]["errors"] == 0


def test_combiner_refuses_its_own_epoch_when_its_own_url_is_a_peer():
    own, rep = _replica(30, seed=5), _replica(20, seed=6)
    def own_doc(since):
        return {**own.evidence(since), "epoch": "me", "role": "combiner", "settings": SETTINGS}

    docs = {"self": own_doc, "http://me": own_doc, "http://rep": lambda since: _doc(rep, since, "r")}
    combined = _stats(source="combined")
    comb = Combiner(combined, lambda name, since: docs[name](since), list(docs), settings=SETTINGS, local="self")
    comb.poll()
    comb.poll()
    assert _counts(combined) == (50, 50)
    assert comb.status()["http://me"]["errors_by_reason"] == {"duplicate_epoch": 2}


def test_combiner_retires_old_epoch_and_never_remerges_it_when_it_comes_back_after_retirement():
    old, new = _replica(40, seed=7), _replica(10, seed=8)
    combined = _stats(source="combined")
    current = {"doc": lambda since: _doc(old, since, "old")}
    comb = Combiner(combined, lambda name, since: current["doc"](since), ["r"], settings=SETTINGS)
    comb.poll()
    current["doc"] = lambda since: _doc(new, since, "new")  # restart
    for _ in range(RETIRE_AFTER_POLLS):
        comb.poll()
    assert set(comb.status()["r"]["epochs"]) == {"new"}  # the old epoch's state is freed
    current["doc"] = lambda since: _doc(old, since, "old")
    comb.poll()
    assert _counts(combined) == (50, 50)
    assert comb.status()["r"]["errors_by_reason"] == {"retired_epoch": 1}


def test_settings_hash_differs_when_threshold_alpha_slices_or_monitoring_section_differ():
    base = settings_hash(_stats(), {"sample_rate": 0.1})
    assert base == settings_hash(_stats(export_walks=True, alerting=False, source="combined"), {"sample_rate": 0.1})
    other = {"top1_agree": Bound("top1_agree", 0.96, True, "min")}
    from tailguard.monitoring.detector import SliceStatistics

    assert settings_hash(SliceStatistics("m", ["top1_agree"], other, streams_per_request=1, alpha=0.01,
                                         horizon=10_000, min_support=1), {"sample_rate": 0.1}) != base
    assert settings_hash(_stats(alpha=0.05), {"sample_rate": 0.1}) != base
    assert settings_hash(_stats(streams_per_request=3), {"sample_rate": 0.1}) != base
    assert settings_hash(_stats(), {"sample_rate": 0.2}) != base


# ------------------------------------------------------------------------------------------ garbage peers
class _Peer:
    """A real HTTP server on 127.0.0.1 answering GET /v1/evidence with `respond(handler)` (set per test)."""

    def __init__(self) -> None:
        self.respond: Callable[[BaseHTTPRequestHandler], None] = lambda h: None
        self.stop = threading.Event()
        peer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                try:
                    peer.respond(self)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up: what the test wants
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


def _json(doc: Any, status: int = 200) -> Callable[[BaseHTTPRequestHandler], None]:
    body = (doc if isinstance(doc, bytes) else json.dumps(doc).encode())  # json.dumps writes NaN / Infinity

    def respond(h: BaseHTTPRequestHandler) -> None:
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    return respond


def _endless(peer: _Peer, chunk: bytes, pause_s: float = 0.0) -> Callable[[BaseHTTPRequestHandler], None]:
    """A body without Content-Length that never ends (until the client disconnects or the test ends)."""

    def respond(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.end_headers()
        h.wfile.write(b'{"epoch": "x", "slices": {"')
        while not peer.stop.is_set():
            h.wfile.write(chunk)
            h.wfile.flush()
            if pause_s:
                peer.stop.wait(pause_s)

    return respond


def _lying_length(h: BaseHTTPRequestHandler) -> None:
    h.send_response(200)
    h.send_header("Content-Length", str(2**40))
    h.end_headers()
    h.wfile.write(b"{")


def _garbage(case: str) -> Any:
    """(a broken variant of a real replica's document, its expected reason)."""
    good = _doc(_replica(20, seed=9), 0, "bad-peer")
    d = copy.deepcopy(good)
    walk = d["slices"]["all"]["metrics"]["top1_agree"]
    if case == "nan":
        walk["alarm"][3] = float("nan")
    elif case == "infinity":
        walk["recovery"][0] = float("inf")
    elif case == "huge_increment":
        walk["alarm"][0] = 1e6
    elif case == "more_entries_than_bets":
        walk["alarm"].append(0.0)
    elif case == "missing_epoch":
        del d["epoch"]
    elif case == "numeric_epoch":
        d["epoch"] = 12345
    elif case == "negative_count":
        d["slices"]["all"]["rows"] = -5
    elif case == "requests_over_rows":
        d["slices"]["all"]["requests"] = d["slices"]["all"]["rows"] + 1
    elif case == "standalone_role":
        d["role"] = "standalone"
    elif case == "other_settings":
        d["settings"] = "0" * 64
    elif case == "list_document":
        d = [d]
    return d


GARBAGE = {"nan": PeerError.NON_FINITE, "infinity": PeerError.NON_FINITE,
           "huge_increment": PeerError.IMPOSSIBLE_INCREMENT, "more_entries_than_bets": PeerError.BAD_DOCUMENT,
           "missing_epoch": PeerError.BAD_EPOCH, "numeric_epoch": PeerError.BAD_EPOCH,
           "negative_count": PeerError.BAD_COUNT, "requests_over_rows": PeerError.BAD_COUNT,
           "standalone_role": PeerError.WRONG_ROLE, "other_settings": PeerError.SETTINGS_MISMATCH,
           "list_document": PeerError.BAD_DOCUMENT}


@pytest.fixture
def peers() -> Iterator[tuple[_Peer, _Peer]]:
    bad, good = _Peer(), _Peer()
    yield bad, good
    bad.close()
    good.close()


def _combiner(bad: _Peer, good: _Peer, **fetch_kw: Any) -> tuple[Combiner, Any, MonitorMetrics]:
    metrics = MonitorMetrics()
    combined = _stats(source="combined")
    comb = Combiner(combined, http_fetch(**fetch_kw), [bad.url, good.url], settings=SETTINGS,
                    on_error=lambda peer, reason: metrics.peer_errors.labels(peer, reason).inc())
    return comb, combined, metrics


def _assert_refused_and_other_merged(comb, combined, metrics, bad, reason, good_rows, times=1):
    st = comb.status()
    assert st[bad.url]["errors_by_reason"] == {reason.value: times}, st[bad.url]
    assert not st[bad.url]["ok"] and st[bad.url]["last_error_reason"] == reason.value
    assert metrics.registry.get_sample_value("tailguard_monitor_peer_errors_total",
                                             {"peer": bad.url, "reason": reason.value}) == times
    assert _counts(combined) == (good_rows, good_rows)  # the good peer (listed after) merged, the bad one not
    assert st[list(st)[1]]["errors"] == 0


@pytest.mark.parametrize("case", sorted(GARBAGE))
def test_combiner_counts_error_and_merges_other_peer_when_peer_document_is_garbage(peers, case):
    bad, good = peers
    rep = _replica(30, seed=10)
    bad.respond = _json(_garbage(case))
    good.respond = _json(_doc(rep, 0, "good"))
    comb, combined, metrics = _combiner(bad, good)
    comb.poll()
    _assert_refused_and_other_merged(comb, combined, metrics, bad, GARBAGE[case], 30)


def test_combiner_refuses_decreasing_count_and_keeps_merged_part_when_peer_counts_go_back(peers):
    bad, good = peers
    rep, bad_rep = _replica(30, seed=11), _replica(20, seed=12)
    first = _doc(bad_rep, 0, "bad-peer")
    bad.respond, good.respond = _json(first), _json(_doc(rep, 0, "good"))
    comb, combined, metrics = _combiner(bad, good)
    comb.poll()
    assert _counts(combined) == (50, 50)
    back = copy.deepcopy(first)
    back["version"] += 1
    back["slices"]["all"]["rows"] = back["slices"]["all"]["requests"] = 10
    bad.respond = _json(back)
    comb.poll()
    _assert_refused_and_other_merged(comb, combined, metrics, bad, PeerError.BAD_COUNT, 50)


@pytest.mark.parametrize("case, reason", [("not_json", PeerError.INVALID_JSON), ("http_500", PeerError.FETCH_FAILED),
                                          ("lying_length", PeerError.BODY_TOO_LARGE),
                                          ("endless", PeerError.BODY_TOO_LARGE),
                                          ("slow_drip", PeerError.READ_TIMEOUT)])
def test_combiner_counts_error_and_merges_other_peer_when_peer_body_is_broken(peers, case, reason):
    bad, good = peers
    rep = _replica(30, seed=13)
    good.respond = _json(_doc(rep, 0, "good"))
    bad.respond = {"not_json": _json(b'{"epoch": "x", "slices": {'), "http_500": _json({"error": "x"}, 500),
                   "lying_length": _lying_length, "endless": _endless(bad, b"a" * 65536),
                   "slow_drip": _endless(bad, b"a", pause_s=0.01)}[case]
    # endless: the 1 MiB cap ends it (the generous deadline never does); slow drip (1 byte per 10 ms, forever): the
    # short deadline ends it long before the cap
    kw = {"max_bytes": 2**20, "deadline_s": 0.5 if case == "slow_drip" else 60.0}
    comb, combined, metrics = _combiner(bad, good, **kw)
    comb.poll()
    _assert_refused_and_other_merged(comb, combined, metrics, bad, reason, 30)


# ------------------------------------------------------------------------------------------ real replicas, HTTP
class _RoundRobin:
    """A real HTTP proxy on 127.0.0.1: each GET goes to the next upstream in turn (a Service / round-robin DNS)."""

    def __init__(self, upstreams: list[str]) -> None:
        turn = itertools.cycle(upstreams)
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                with lock:
                    up = next(turn)
                r = httpx.get(up + self.path, timeout=30)
                self.send_response(r.status_code)
                self.send_header("Content-Type", r.headers.get("content-type", "application/json"))
                self.send_header("Content-Length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _served(svc: MonitorService, sock: socket.socket | None = None) -> contextlib.AbstractContextManager[str]:
    return uvicorn_in_thread(build_app(svc), sock=sock)


def _wait(pred: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s  # a bound on a hung server, not a timing assumption
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    pytest.fail(f"{what} not reached in {timeout_s} s")


def _pair(i: int, batch: int) -> dict[str, Any]:
    x = np.random.default_rng(i).normal(size=(batch, 4)).astype(np.float32)
    logits = x @ T.weights()
    if i % 4 == 0:
        logits = T.flip_top1(logits, np.ones(batch, bool), 1.0)
    return {"request": request_json({"x": x}, {"domain": "legal" if i % 3 else "news"}, request_id=f"r{i}"),
            "response": {"model_name": NAME, "outputs": [tensor_json("logits", logits)]}}


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    d = tmp_path_factory.mktemp("combine")
    ref = T.linear_classifier(d / "ref.onnx")
    spec = T.spec_dict({"sample_rate": 1.0, "seed": 0, "slice_columns": ["domain"], "min_support": 10,
                        "horizon": 1000})
    return resolve_config(parse_spec(spec)), ref


@contextlib.contextmanager
def _replicas(cfg) -> Iterator[tuple[list[MonitorService], list[str]]]:
    conf, ref = cfg
    svcs = [MonitorService(conf, ref, None, evidence_only=True) for _ in range(2)]
    try:
        with _served(svcs[0]) as u0, _served(svcs[1]) as u1:
            for svc in svcs:
                _wait(lambda svc=svc: svc.readiness()[0], "replica ready")
            yield svcs, [u0, u1]
    finally:
        for svc in svcs:
            svc.stop()


def _feed(client: httpx.Client, url: str, start: int, n: int) -> tuple[int, int]:
    """Send n pairs requests of 1-3 rows; returns (rows, requests) sent."""
    rows = 0
    for i in range(start, start + n):
        batch = 1 + i % 3
        r = client.post(f"{url}/v2/models/{NAME}/pairs", json=_pair(i, batch))
        assert r.status_code == 200, r.text
        rows += batch
    return rows, n


def _totals(client: httpx.Client, urls: list[str], key: str) -> tuple[int, int]:
    ev = [client.get(u + "/v1/evidence").json()["slices"].get(key, {}) for u in urls]
    return sum(e.get("rows", 0) for e in ev), sum(e.get("requests", 0) for e in ev)


@pytest.mark.integration
def test_combined_counts_equal_replica_totals_when_peer_url_round_robins_between_two_real_replicas(cfg):
    conf, ref = cfg
    with _replicas(cfg) as (svcs, urls), httpx.Client(timeout=30) as c:
        proxy = _RoundRobin(urls)
        comb = MonitorService(conf, ref, None, peers=[proxy.url], start=False)
        try:
            sent = {"all": (0, 0)}
            for phase, (n0, n1) in enumerate([(17, 11), (5, 23), (9, 0)]):
                r0, q0 = _feed(c, urls[0], 1000 * phase, n0)
                r1, q1 = _feed(c, urls[1], 1000 * phase + 500, n1)
                sent["all"] = (sent["all"][0] + r0 + r1, sent["all"][1] + q0 + q1)
                _wait(lambda: _totals(c, urls, "all") == sent["all"], "the replicas compared every request")
                for _ in range(5):  # however many polls: each epoch's increments merged once
                    comb.combine()
                    assert _counts(comb.monitor.combined)[0] <= sent["all"][0]
                for key in ("all", "domain=legal", "domain=news"):
                    assert _counts(comb.monitor.combined, key) == _totals(c, urls, key), key
            peer = comb.readiness()[1]["peers"][proxy.url]
            assert peer["new_epochs"] == 2 and set(peer["epochs"]) == {s.monitor.epoch for s in svcs}
            assert peer["errors_by_reason"]["epoch_flip"] >= 10  # shown: the URL reaches two processes
            assert comb.metrics.registry.get_sample_value(
                "tailguard_monitor_peer_errors_total", {"peer": proxy.url, "reason": "epoch_flip"}) >= 10
        finally:
            comb.stop()
            proxy.close()


@pytest.mark.integration
def test_combined_counts_equal_replica_totals_when_own_url_and_one_replica_under_two_urls_are_peers(cfg):
    conf, ref = cfg
    with _replicas(cfg) as (svcs, urls), httpx.Client(timeout=30) as c:
        alias = _RoundRobin([urls[0]])  # a second URL of replica 0
        sock = bound_socket()
        own = f"http://127.0.0.1:{sock.getsockname()[1]}"
        comb = MonitorService(conf, ref, None, peers=[own, urls[0], alias.url, urls[1]], start=False)
        try:
            with _served(comb, sock):
                sent = (0, 0)
                for phase in range(2):
                    r0, q0 = _feed(c, urls[0], 100 * phase, 13)
                    r1, q1 = _feed(c, urls[1], 100 * phase + 50, 8)
                    sent = (sent[0] + r0 + r1, sent[1] + q0 + q1)
                    _wait(lambda sent=sent: _totals(c, urls, "all") == sent, "the replicas compared every request")
                    for _ in range(3):
                        comb.combine()
                    assert _counts(comb.monitor.combined) == sent
                peers = c.get(own + "/readyz").json()["peers"]
                assert peers[own]["errors_by_reason"] == {"duplicate_epoch": 6}  # its epoch is source self's
                assert peers[alias.url]["errors_by_reason"] == {"duplicate_epoch": 6}
                assert peers[urls[0]]["errors"] == peers[urls[1]]["errors"] == peers["self"]["errors"] == 0
                assert f'tailguard_monitor_peer_errors_total{{peer="{own}",reason="duplicate_epoch"}} 6.0' in \
                    c.get(own + "/metrics").text
        finally:
            comb.stop()
            alias.close()


def test_combiner_refuses_a_document_with_more_slices_than_a_replica_can_track():
    small = _stats(source="combined", max_tracked_slices=2)
    settings = settings_hash(small)
    rep = _replica(10, seed=3)  # slices all and d=a
    doc = {**rep.evidence(0), "epoch": "e", "role": "replica", "settings": settings}
    fits = Combiner(small, lambda name, since: doc, ["r"], settings=settings)
    fits.poll()
    assert fits.status()["r"]["errors"] == 0 and _counts(small) == (10, 10)
    doc["slices"]["d=b"] = copy.deepcopy(doc["slices"]["d=a"])  # 3 slices: more than max_tracked_slices (2)
    over = _stats(source="combined", max_tracked_slices=2)
    refused = Combiner(over, lambda name, since: doc, ["r"], settings=settings)
    refused.poll()
    st = refused.status()["r"]
    assert st["errors_by_reason"] == {PeerError.BAD_DOCUMENT.value: 1}, st
    assert "more than monitoring.max_tracked_slices (2)" in st["last_error"] and _counts(over) == (0, 0)
