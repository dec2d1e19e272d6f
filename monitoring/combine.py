"""Replicas: one change detector over the traffic of N monitor replicas, from the evidence each one exports.

A Kubernetes Service spreads the mirrored traffic over N replicas at random, so each replica sees about 1/N of
every slice: alone, each would need N times the traffic to detect a drift. The detector's evidence is additive
across replicas: a slice's betting CUSUM multiplies one e-value factor per sampled request (monitoring/detector.py),
and a product over a set of requests does not depend on the order or the replica that computed each factor. So
every replica exports, per (slice, metric), the running sums of its requests' log factors for each bet (the
"walks", alarm and recovery side) and its row and sampled-request counts (`GET /v1/evidence`); one combiner
(`tailguard monitor serve --peer URL ...`) polls them, adds each replica's increments since the last poll, and
runs the CUSUM recursion on the merged increments, clipping at zero only between polls (fewer candidate change
points: the false-alarm bound still holds, monitoring/detector.py). The combiner's own traffic is merged the same way
(source "self").

Accounting is per **epoch**, not per URL. An epoch identifies one monitor process's evidence (a fresh UUID at
start), so the walks of an epoch are one cumulative record whatever URL served them: the combiner keeps, per
epoch, its cursor and the walks it merged last, and merges each epoch's increments exactly once. Hence:

* a `--peer` URL that load-balances (a Service name, round-robin DNS) and answers from different pods on
  different polls merges each pod's increments once (no double counting); the change back to an epoch it showed
  before is counted (`epoch_flip`) and makes the view incomplete (below);
* an epoch already read under another source (one pod listed under two URLs, or the combiner's own URL in its
  `--peer` list: its epoch is the one of source "self") is refused from the second source (`duplicate_epoch`);
* a replica that restarts shows a new epoch, merged from zero once; its old epoch, not seen again for
  RETIRE_AFTER_POLLS successful polls of its source, is retired (state freed; if it ever comes back it is refused,
  `retired_epoch`, never merged twice). A restart is told from a load balancer by the old epoch coming back;
* a peer whose role is not "replica", or whose detector settings differ (`settings_hash`: h, G, B, bets,
  thresholds, alpha, horizon, min_support and the spec's monitoring section), is refused.

Peers' documents are checked whole before any of it is merged: types, counts (non-negative, not decreasing,
requests <= rows), one walk entry per bet, finite values, and each increment within what the bets allow for the
new sampled requests (`Betting`: n log1p(-lambda_j span) <= increment_j <= n log1p(lambda_j cap)). A failure is
counted per (peer, reason) (`PeerError`; the service exports `tailguard_monitor_peer_errors_total`), shown in
/readyz, and that peer's document is not merged; the other peers are unaffected. The HTTP fetch
(monitoring/peers.py) caps the body size and the total read time.

**Incomplete views.** A Service URL does not reach every pod: HTTP keep-alive pins a client to one pod, and a new
connection reaches a random one. The combiner opens a new connection per fetch, so such a URL shows its pods'
epochs in turn, and an epoch flip (back to an epoch it showed before; a restart never does that) marks it
`several_processes` for RETIRE_AFTER_POLLS of its documents. With `expect_replicas` (`--expect-replicas N`) fewer
live replica epochs than N (a URL pinned to one pod, a pod down or not listed) is `replicas_missing`. Either makes
`incomplete()` non-empty: /readyz answers 503 with the reasons, and `tailguard_monitor_incomplete_polls_total`
counts the polls. Supported layouts: one `--peer` URL per pod, or `--peer-dns NAME:PORT` of a headless Service
(every address of the name is one peer, looked up at every poll: monitoring/peers.py `peers_from_dns`).

**Ordering.** A replica (and the combiner's own evidence) keeps a `CheckpointLog`: every CHECKPOINT_EVERY sampled
requests, the cumulative entries of the slices updated since the last checkpoint, with the version and its wall
clock; a document carries the checkpoints after the reader's cursor and `as_of` (the clock when it was read). The
combiner turns each document into one increment per checkpoint plus the tail, queues them, and merges, in time
order, those at or before the watermark: the smallest `as_of` of the sources it waits for (every source that
answered before and has failed fewer than `wait_polls` polls in a row). So a replica that could not be read while a
drift started delays the others' evidence (up to `wait_polls` polls) instead of landing later as one increment
that mixes rows from before the change with rows after it; its backlog merges checkpoint by checkpoint, between
the others' increments of the same time. The CUSUM clips at zero only between increments, as before (each
increment is a product of e-value factors over requests: any merge order keeps the bound). A source past
`wait_polls` is merged when it comes back, in its own order (`late` counts increments merged after newer ones);
a backlog older than the replica's oldest checkpoint (MAX_CHECKPOINTS) arrives partly as one increment
(`coarse`). Clocks are the processes' wall clocks: keep them in sync (NTP), the ordering grain is one poll.

**Restart.** The combiner sends its epoch as `reader`; a replica reports the reader before (`last_reader`). The
first document of an epoch whose previous reader was another combiner (this one restarted, or replaced another)
is not merged: the detectors start after the replicas' current walks (`skipped_requests`), so history an earlier
combiner judged (an incident that fired and cleared) is never judged again. An epoch no combiner read yet (a new
replica) merges from zero.

Family accounting: the replicas run with `--evidence-only` (they measure, export parity gauges for their share
and never alert), so the alerts of a deployment are the combiner's, and its alpha covers the horizon counted in
sampled requests of all replicas together.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import itertools
import json
import logging
import math
import time
from collections import Counter, OrderedDict, deque
from dataclasses import asdict, dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, Callable, Mapping, Sequence

from tailguard.monitoring.config import ALL_SLICE
from tailguard.monitoring.cusum import ACC_FIELDS, N_BETS, Betting
from tailguard.monitoring.detector import DETECTOR, Evaluation, SliceStatistics

log = logging.getLogger("tailguard.monitoring.combine")

Fetch = Callable[[str, int], Mapping[str, Any]]  # (peer, since) -> evidence document
OnError = Callable[[str, str], None]  # (source, PeerError value) -> None
INCOMPLETE_REASONS = ("several_processes", "replicas_missing")  # Combiner.incomplete, per poll

RETIRE_AFTER_POLLS = 20  # an epoch its source has not shown for this many accepted documents is retired
MAX_RETIRED_EPOCHS = 100_000  # retired epoch ids remembered (about 10 MB); the oldest are forgotten past it
MAX_EPOCH_CHARS = 128
MAX_COUNT = 2**62  # a row / request count or cursor above this is not a real one
CHECKPOINT_EVERY = 256  # sampled requests between two checkpoints of a replica's walks (CheckpointLog)
MAX_CHECKPOINTS = 128  # checkpoints a replica keeps: a backlog of up to 128 x 256 sampled requests merges in order
WAIT_POLLS = 12  # a source that answered before is waited for through this many failed polls (Combiner, Ordering)
REPLICA = "replica"
COMBINER = "combiner"


class PeerError(StrEnum):
    """Why a source's evidence was not (or not only) merged: the `reason` label of
    `tailguard_monitor_peer_errors_total` and the keys of /readyz `peers[source].errors_by_reason`."""

    FETCH_FAILED = "fetch_failed"  # connection refused, timeout, HTTP status >= 400
    BODY_TOO_LARGE = "body_too_large"  # body over peers.MAX_EVIDENCE_BYTES (or the declared Content-Length)
    READ_TIMEOUT = "read_timeout"  # body not read within peers.FETCH_DEADLINE_S (slow drip)
    INVALID_JSON = "invalid_json"
    BAD_DOCUMENT = "bad_document"  # wrong types, missing fields, walks of the wrong length, unknown metrics
    BAD_EPOCH = "bad_epoch"  # epoch missing, not a string, empty or too long
    WRONG_ROLE = "wrong_role"  # a peer that is not an --evidence-only replica
    SETTINGS_MISMATCH = "settings_mismatch"  # detector settings differ from the combiner's
    DUPLICATE_EPOCH = "duplicate_epoch"  # an epoch already read under another source
    RETIRED_EPOCH = "retired_epoch"  # an epoch retired earlier came back
    EPOCH_FLIP = "epoch_flip"  # the source went back to an epoch it showed before (merged: per-epoch accounting)
    NON_FINITE = "non_finite"  # NaN or infinity in a walk
    IMPOSSIBLE_INCREMENT = "impossible_increment"  # a walk moved more than its bets allow
    BAD_COUNT = "bad_count"  # negative or decreasing counts or cursor, requests > rows


class PeerDocumentError(Exception):
    """A source's evidence refused (raised by a Fetch or by the document check).

    Args:
        reason: the counted reason.
        message: what was wrong, for /readyz `last_error` and the log.
    """

    def __init__(self, reason: PeerError, message: str) -> None:
        super().__init__(message)
        self.reason = PeerError(reason)
        self.message = message


def settings_hash(stats: SliceStatistics, monitoring: Mapping[str, Any] | None = None) -> str:
    """The detector settings a combiner and its peers must share, as a sha256 hex digest.

    Covers the model name, the detector, h, G (slice keys per request), B (thresholded metrics), N_BETS and every
    bet (lambdas, span, cap of both sides), the resolved thresholds, alpha, horizon, min_support, the tracked
    metrics, and the spec's monitoring section, serialized as canonical JSON (sorted keys, no spaces).

    Args:
        stats: the process's SliceStatistics (its role-specific flags are not part of the hash).
        monitoring: the spec's monitoring section as JSON-ready data (`MonitoringSpec.model_dump(mode="json")`).

    Returns:
        64 hex characters.
    """
    doc = {"model": stats.model, "detector": DETECTOR, "h": stats.h, "G": stats.streams_per_request,
           "B": sorted(stats.bounds), "n_bets": N_BETS, "alpha": stats.alpha, "horizon": stats.horizon,
           "min_support": stats.min_support, "metrics": list(stats.metrics),
           "thresholds": {m: asdict(b) for m, b in sorted(stats.bounds.items())},
           "bets": {m: [asdict(a), asdict(r) if r is not None else None] for m, (a, r) in sorted(stats.bets.items())},
           "monitoring": dict(monitoring or {})}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _window_sums(value: Any) -> tuple[float, ...] | None:
    """A peer's cumulative window sums of one (slice, metric) (`evidence` "sums", detector.ACC_FIELDS order), or
    None when absent or malformed (the merge then leaves the combined alert without a value, with the reason)."""
    if not isinstance(value, list) or len(value) != len(ACC_FIELDS):
        return None
    try:
        out = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        return None
    return out if all(math.isfinite(v) for v in out) else None


@dataclass
class _SliceMark:
    """What was merged last of one slice of one epoch: its incarnation, counts, and per metric the walks."""

    incarnation: int
    rows: int
    requests: int
    walks: dict[str, tuple[tuple[float, ...], tuple[float, ...]]]
    sums: dict[str, tuple[float, ...]] = field(default_factory=dict)  # per metric: cumulative window sums


@dataclass
class _EpochState:
    """Accounting of one epoch (one process's cumulative evidence), owned by the source that first showed it."""

    source: str
    cursor: int = 0  # next `since` for this epoch (advanced only by a document complete since the last one)
    version: int = -1  # highest document version read
    seen: int = 0  # the source's accepted-document number when this epoch was last shown
    last: dict[str, _SliceMark] = field(default_factory=dict)  # what was queued last per slice (merged, or pending)
    time: float = -math.inf  # time stamp of the last increment queued (increments of an epoch stay in order)


@dataclass
class _SourceState:
    local: bool  # the combiner's own evidence (expects role "combiner")
    ok: bool = False  # its last poll was merged
    epoch: str = ""  # epoch of the last accepted document
    accepted: int = 0
    new_epochs: int = 0
    errors: Counter = field(default_factory=Counter)
    last_error: str = ""
    last_error_reason: str = ""
    failed: int = 0  # polls failed in a row
    as_of: float | None = None  # the clock of its last accepted document (None: it sends none, not ordered)
    flip_at: int = 0  # `accepted` at its last epoch flip (0: never)
    increments: int = 0  # increments queued (checkpoints and tails)
    late: int = 0  # increments merged after newer evidence of other sources (it was not waited for)
    coarse: int = 0  # documents whose backlog reached past the peer's oldest checkpoint (partly merged in one step)
    skipped_requests: int = 0  # sampled requests of epochs read by an earlier combiner, not merged (Restart)
    discovered: bool = False  # found by --peer-dns (else listed by --peer, or `self`)
    listed: bool = True  # polled: a discovered source the last lookup did not return is not
    unlisted_at: int = 0  # the combiner's poll number when it was last dropped from the lookup


@dataclass
class _Update:
    key: str
    mark: _SliceMark
    rows: int
    requests: int
    walks: dict[str, tuple[list[float], list[float]]]
    sums: dict[str, list[float]] = field(default_factory=dict)  # per metric: window-sum increments (alert values)


@dataclass
class _Stage:
    """One increment of one epoch: a checkpoint's (or the document's tail's) per-slice increments and its time."""

    time: float | None
    updates: list[_Update]
    tail: bool = False


@dataclass
class _Read:
    """An accepted document, checked: what the merge step queues."""

    epoch: str
    version: int
    stages: list[_Stage]
    as_of: float | None
    baseline: bool  # first read of an epoch an earlier combiner read: its history is not merged
    coarse: bool  # the backlog reached past the peer's oldest checkpoint
    since: int  # the cursor it was read with


class Combiner:
    """Merges evidence documents (SliceMonitor.evidence) from several sources into one SliceStatistics, once per
    epoch, in time order (module docstring).

    Args:
        stats: the combined statistics (source "combined"); its alerts are the deployment's.
        fetch: gets a source's evidence document since a cursor; raises on failure (PeerDocumentError with its
            reason, anything else counts as fetch_failed; retried next poll).
        sources: source names (peer base URLs, and `local`).
        lock: held while merging (the service's worker lock), not while fetching or checking.
        settings: the combiner's `settings_hash`; a document with other settings is refused.
        local: the source that is the combiner's own evidence (role "combiner"); every other must be "replica".
        on_error: called with (source, reason) for every counted error (the service's Prometheus counter).
        reader: this combiner's id (its epoch), sent with every fetch; a replica whose previous reader differs
            was read by an earlier combiner: its history up to the first read is not merged (Restart).
        expect_replicas: the number of replica processes the deployment runs (`--expect-replicas`); fewer live
            replica epochs than this makes the combined view incomplete (`incomplete`). None: not checked.
        wait_polls: a source that answered before is waited for (its evidence ordered with the others') through
            this many failed polls in a row; past them the others' evidence is merged without it.
        on_incomplete: called once per poll and INCOMPLETE_REASONS reason while the combined view is incomplete
            (the service's `tailguard_monitor_incomplete_polls_total`).
        discover: called at the start of every poll for the current peer URLs found by name (`--peer-dns`:
            `peers.peers_from_dns`); sources it stops returning are no longer polled and, RETIRE_AFTER_POLLS polls
            later, forgotten (their epochs retired). A lookup that raises keeps the last list (counted in
            `discovery`). None: the static `sources` only.
    """

    def __init__(self, stats: SliceStatistics, fetch: Fetch, sources: Sequence[str], lock: Any = None, *,
                 settings: str, local: str | None = None, on_error: OnError | None = None, reader: str = "",
                 expect_replicas: int | None = None, wait_polls: int = WAIT_POLLS,
                 on_incomplete: Callable[[str], None] | None = None,
                 discover: Callable[[], Sequence[str]] | None = None) -> None:
        if expect_replicas is not None and expect_replicas < 1:
            raise ValueError(f"expect_replicas must be >= 1, got {expect_replicas}")
        self.stats = stats
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.fetch = fetch
        self.settings = settings
        self.on_error = on_error
        self.reader = reader
        self.expect_replicas = expect_replicas
        self.wait_polls = int(wait_polls)
        self.sources = {s: _SourceState(local=s == local) for s in dict.fromkeys(sources)}
        self.epochs: dict[str, _EpochState] = {}
        self.retired: OrderedDict[str, str] = OrderedDict()  # epoch -> the source it was read from
        self.polls = 0
        self.pending: list[tuple[float, int, str, list[_Update]]] = []  # heap of (time, order, source, updates)
        self._order = itertools.count()
        self.merged_through = -math.inf  # time of the newest increment merged
        self.incomplete_polls: Counter = Counter()  # polls that found the combined view incomplete, by reason
        self.on_incomplete = on_incomplete
        self.discover = discover
        self.discovery: dict[str, Any] = {"lookups": 0, "errors": 0, "last_error": "", "peers": []}

    # ------------------------------------------------------------------------------------------ polling
    def poll(self, now: datetime | None = None) -> Evaluation:
        """Fetch every source once, check each document whole, queue its increments (one per checkpoint, and
        the tail), and merge, in time order, every queued increment up to the watermark (module docstring).

        Args:
            now: time stamp for alert records (default now).

        Returns:
            Alerts fired and cleared by the merge.
        """
        if self.discover is not None:
            self._rediscover()
        reads = {name: r for name, s in list(self.sources.items())
                 if s.listed and (r := self._poll_one(name)) is not None}
        # the round: every tail read now is ordered at the earliest clock of the round (one poll is the grain)
        round_mark = min((r.as_of for r in reads.values() if r.as_of is not None), default=math.inf)
        waited = [s.as_of for s in self.sources.values()
                  if s.listed and s.as_of is not None and s.accepted and s.failed <= self.wait_polls]
        watermark = min(waited, default=math.inf)  # a late source still waited for holds the others back
        for name, r in reads.items():
            self._queue(name, r, round_mark)
        ev = self._merge_until(watermark, now)
        self.polls += 1
        for reason in sorted({r.split(":", 1)[0] for r in self.incomplete().values()}):
            self.incomplete_polls[reason] += 1
            if self.on_incomplete is not None:
                self.on_incomplete(reason)
        return ev

    def _rediscover(self) -> None:
        """Refresh the discovered sources from `discover` (a failed lookup keeps the last list)."""
        d = self.discovery
        d["lookups"] += 1
        try:
            found = list(dict.fromkeys(self.discover()))  # type: ignore[misc]
        except Exception as exc:  # DNS down: keep polling what was found before
            d["errors"] += 1
            d["last_error"] = f"{type(exc).__name__}: {exc}"[:300]
            log.warning("peer discovery failed: %s (polling the %d peers found before)", d["last_error"],
                        len(d["peers"]))
            return
        d["peers"] = found
        for name in found:
            src = self.sources.get(name)
            if src is None:
                self.sources[name] = _SourceState(local=False, discovered=True)
                log.info("peer %s discovered", name)
            elif src.discovered:
                src.listed = True
        for name, src in list(self.sources.items()):
            if not src.discovered or name in found:
                continue
            if src.listed:
                src.listed, src.unlisted_at = False, self.polls
                log.info("peer %s no longer in the lookup: not polled", name)
            elif self.polls - src.unlisted_at >= RETIRE_AFTER_POLLS and not any(
                    n == name for _, _, n, _ in self.pending):
                for epoch in [e for e, st in self.epochs.items() if st.source == name]:
                    del self.epochs[epoch]
                    self.retired[epoch] = name
                del self.sources[name]

    def _poll_one(self, name: str) -> _Read | None:
        src = self.sources[name]
        owned = [e for e in self.epochs.values() if e.source == name]
        since = min((e.cursor for e in owned), default=0)  # complete for every epoch this source may answer from
        try:
            try:
                doc = self.fetch(name, since)
            except PeerDocumentError:
                raise
            except Exception as exc:  # a peer down must not stop the others: count, retry next poll
                raise PeerDocumentError(PeerError.FETCH_FAILED, f"{type(exc).__name__}: {exc}") from None
            try:
                read = self._check(name, doc, since)
            except PeerDocumentError:
                raise
            except Exception as exc:  # a check this module did not foresee: still this document's fault
                raise PeerDocumentError(PeerError.BAD_DOCUMENT, f"{type(exc).__name__}: {exc}") from None
        except PeerDocumentError as exc:
            src.failed += 1
            self._error(name, exc.reason, exc.message)
            return None
        epoch = read.epoch
        es = self.epochs.get(epoch)
        if es is None:
            es = self.epochs[epoch] = _EpochState(name)
            src.new_epochs += 1
            if src.epoch:
                log.info("source %s shows a new epoch %s (was %s): a restart, or another process behind it",
                         name, epoch, src.epoch)
        elif src.epoch and src.epoch != epoch:
            src.flip_at = src.accepted + 1
            self._error(name, PeerError.EPOCH_FLIP, f"epoch went back from {src.epoch} to {epoch}: the URL reaches "
                        "more than one live process (merged once per epoch, but a pod it does not reach is lost: "
                        "list each pod, or --peer-dns a headless Service)")
        src.accepted += 1
        src.ok = True
        src.failed = 0
        src.epoch = epoch
        if read.as_of is not None:
            src.as_of = read.as_of if src.as_of is None else max(src.as_of, read.as_of)
        es.seen = src.accepted
        self._retire(name, src)
        return read

    def _queue(self, name: str, read: _Read, round_mark: float) -> None:
        """Queue a checked document's increments in order (or, for a baseline, only record what it showed)."""
        src, es = self.sources[name], self.epochs.get(read.epoch)
        if es is None:  # retired within this poll (cannot happen for the epoch just shown); nothing to do
            return
        if read.coarse and not read.baseline:
            src.coarse += 1
            log.warning("evidence from %s: backlog older than the peer's oldest checkpoint, partly merged in one "
                        "increment", name)
        for st in read.stages:
            for u in st.updates:
                es.last[u.key] = u.mark  # per slice: state says exactly what was queued
            if read.baseline:
                src.skipped_requests += sum(u.requests for u in st.updates if u.key == ALL_SLICE)
                continue
            t = -math.inf if st.time is None else st.time
            if st.tail and st.time is not None:
                t = min(t, round_mark)  # a tail is ordered with the poll round that read it
            t = max(t, es.time)  # an epoch's increments stay in its own order whatever its clock did
            es.time = t
            ups = [u for u in st.updates if u.requests > 0]
            if ups:
                heapq.heappush(self.pending, (t, next(self._order), name, ups))
                src.increments += 1
        if read.since <= es.cursor:  # the document holds every slice updated since this epoch's cursor
            es.cursor = max(es.cursor, read.version)
        es.version = max(es.version, read.version)

    def _merge_until(self, watermark: float, now: datetime | None) -> Evaluation:
        ev = Evaluation()
        with self.lock:
            while self.pending and self.pending[0][0] <= watermark:
                t, _, name, ups = heapq.heappop(self.pending)
                if t < self.merged_through:
                    self.sources[name].late += 1
                self.merged_through = max(self.merged_through, t)
                for u in ups:
                    part = self.stats.merge(u.key, u.walks, u.rows, u.requests, now=now,
                                            sums=u.sums if len(u.sums) == len(u.walks) else None)
                    ev.fired += part.fired
                    ev.cleared += part.cleared
        return ev

    def incomplete(self) -> dict[str, str]:
        """Why the combined evidence is known to miss processes: {source: reason} for a source URL that reached
        several live processes (an epoch flip within the last RETIRE_AFTER_POLLS documents: a load-balanced
        Service, whose pods it does not all reach), and {"replicas": reason} while fewer replica processes answer
        (distinct current epochs of the sources whose last poll was merged) than `expect_replicas`. Empty: nothing
        known to be missing."""
        out: dict[str, str] = {}
        sources, epochs = list(self.sources.items()), list(self.epochs.values())  # the poll thread may change them
        for name, s in sources:
            if s.listed and s.flip_at and s.accepted - s.flip_at < RETIRE_AFTER_POLLS:
                live = sum(1 for e in epochs if e.source == name)
                out[name] = (f"several_processes: this URL answered from {live} processes (epochs flip; HTTP "
                             "keep-alive or a load balancer pins it to one at a time, so some of their evidence "
                             "is never read): list one URL per pod, or --peer-dns a headless Service")
        if self.expect_replicas is not None:
            live = len({s.epoch for _, s in sources if not s.local and s.ok and s.listed})
            if live < self.expect_replicas:
                out["replicas"] = (f"replicas_missing: {live} live replica process(es) answer, "
                                   f"{self.expect_replicas} expected (--expect-replicas): list one URL per pod")
        return out

    def _retire(self, name: str, src: _SourceState) -> None:
        for epoch in [e for e, s in self.epochs.items()
                      if s.source == name and src.accepted - s.seen >= RETIRE_AFTER_POLLS]:
            del self.epochs[epoch]
            self.retired[epoch] = name
            log.info("epoch %s of %s retired (not shown for %d polls)", epoch, name, RETIRE_AFTER_POLLS)
        while len(self.retired) > MAX_RETIRED_EPOCHS:
            self.retired.popitem(last=False)

    def _error(self, name: str, reason: PeerError, message: str) -> None:
        src = self.sources[name]
        src.ok = src.ok and reason is PeerError.EPOCH_FLIP  # a flip is still merged
        src.errors[reason.value] += 1
        src.last_error, src.last_error_reason = message[:300], reason.value
        log.warning("evidence from %s: %s (%s)", name, src.last_error, reason.value)
        if self.on_error is not None:
            self.on_error(name, reason.value)

    # ------------------------------------------------------------------------------------------ checks
    def _check(self, name: str, doc: Any, since: int = 0) -> _Read:
        """The whole document checked against this source's and epoch's state; nothing is changed.

        Returns:
            The epoch, version, and the per-slice increments of each checkpoint after the epoch's cursor and of
            the tail, in order.

        Raises:
            PeerDocumentError: the first thing wrong (its reason is counted).
        """
        if not isinstance(doc, Mapping):
            raise PeerDocumentError(PeerError.BAD_DOCUMENT, f"evidence is a {type(doc).__name__}, not an object")
        epoch = doc.get("epoch")
        if not isinstance(epoch, str) or not 0 < len(epoch) <= MAX_EPOCH_CHARS:
            raise PeerDocumentError(PeerError.BAD_EPOCH, f"epoch must be a non-empty string of at most "
                                    f"{MAX_EPOCH_CHARS} characters, got {_show(epoch)}")
        if epoch in self.retired:
            raise PeerDocumentError(PeerError.RETIRED_EPOCH, f"epoch {epoch} was retired (not shown for "
                                    f"{RETIRE_AFTER_POLLS} polls) and came back: not merged again")
        es = self.epochs.get(epoch)
        if es is not None and es.source != name:
            raise PeerDocumentError(PeerError.DUPLICATE_EPOCH, f"epoch {epoch} is already read from {es.source}: "
                                    "one process listed twice (two URLs, or the combiner's own URL as a --peer)")
        src = self.sources[name]
        want = COMBINER if src.local else REPLICA
        if doc.get("role") != want:
            raise PeerDocumentError(PeerError.WRONG_ROLE, f"role {_show(doc.get('role'))}, expected {want!r} "
                                    "(start peers with --evidence-only)")
        if doc.get("settings") != self.settings:
            raise PeerDocumentError(PeerError.SETTINGS_MISMATCH, f"detector settings {_show(doc.get('settings'))} "
                                    f"differ from the combiner's {self.settings[:12]}...: every process must load "
                                    "the same spec (thresholds, alpha, horizon, slices, monitoring section)")
        version = _count(doc.get("version"), "version")
        if es is not None and version < es.version:
            raise PeerDocumentError(PeerError.BAD_COUNT, f"version went back from {es.version} to {version}")
        as_of = _time(doc.get("as_of"), "as_of", optional=True)
        reader = doc.get("last_reader")
        if reader is not None and (not isinstance(reader, str) or len(reader) > MAX_EPOCH_CHARS):
            raise PeerDocumentError(PeerError.BAD_DOCUMENT, f"last_reader must be a string of at most "
                                    f"{MAX_EPOCH_CHARS} characters, got {_show(reader)}")
        floor = _count(doc.get("checkpoint_floor", 0), "checkpoint_floor")
        slices = doc.get("slices")
        if not isinstance(slices, Mapping):
            raise PeerDocumentError(PeerError.BAD_DOCUMENT, "slices must be an object")
        # a process of the same settings tracks at most max_tracked_slices slices: a document holding more was not
        # written by one, and keeping a mark per slice of it would grow the combiner without bound (issue 36: a
        # 120 MB document of 300k slices left 864 MB resident)
        limit = self.stats.max_tracked_slices
        if len(slices) > limit:
            raise PeerDocumentError(PeerError.BAD_DOCUMENT, f"{len(slices)} slices, more than "
                                    f"monitoring.max_tracked_slices ({limit}) a replica can track")
        checkpoints = doc.get("checkpoints", [])
        if not isinstance(checkpoints, list):
            raise PeerDocumentError(PeerError.BAD_DOCUMENT, "checkpoints must be a list")
        marks = dict(es.last) if es is not None else {}
        cursor = es.cursor if es is not None else 0
        stages, prev_v, prev_t = [], cursor, -math.inf
        for i, cp in enumerate(checkpoints):
            if not isinstance(cp, Mapping) or not isinstance(cp.get("slices"), Mapping):
                raise PeerDocumentError(PeerError.BAD_DOCUMENT, f"checkpoint {i}: not an object with slices")
            if len(cp["slices"]) > limit:
                raise PeerDocumentError(PeerError.BAD_DOCUMENT, f"checkpoint {i}: {len(cp['slices'])} slices, more "
                                        f"than monitoring.max_tracked_slices ({limit})")
            cv = _count(cp.get("version"), f"checkpoint {i} version")
            ct = _time(cp.get("time"), f"checkpoint {i} time")
            if cv > version or ct < prev_t or (as_of is not None and ct > as_of):
                raise PeerDocumentError(PeerError.BAD_DOCUMENT, f"checkpoint {i}: version {cv} / time {ct} out of "
                                        f"order (document version {version}, as_of {as_of})")
            prev_t = ct
            if cv <= prev_v:  # already queued from an earlier document
                continue
            prev_v = cv
            ups = []
            for key, entry in cp["slices"].items():
                u = self._increment(key, entry, marks.get(key), version, covered_ok=True)
                if u is not None:
                    marks[key] = u.mark
                    ups.append(u)
            stages.append(_Stage(ct, ups))
        ups = []
        for key, entry in slices.items():
            u = self._increment(key, entry, marks.get(key), version)
            assert u is not None
            marks[key] = u.mark
            ups.append(u)
        stages.append(_Stage(as_of, ups, tail=True))
        baseline = es is None and bool(reader) and reader != self.reader
        return _Read(epoch, version, stages, as_of, baseline, coarse=since < floor, since=since)

    def _increment(self, key: Any, entry: Any, prev: _SliceMark | None, version: int, *,
                   covered_ok: bool = False) -> _Update | None:
        if not isinstance(key, str) or not isinstance(entry, Mapping):
            raise PeerDocumentError(PeerError.BAD_DOCUMENT, f"slice {_show(key)}: not a key and an object")
        inc = _count(entry.get("incarnation"), f"slice {key!r} incarnation")
        rows = _count(entry.get("rows"), f"slice {key!r} rows")
        requests = _count(entry.get("requests"), f"slice {key!r} requests")
        if inc > version:
            raise PeerDocumentError(PeerError.BAD_DOCUMENT, f"slice {key!r}: incarnation {inc} after version "
                                    f"{version}")
        if requests > rows:
            raise PeerDocumentError(PeerError.BAD_COUNT, f"slice {key!r}: {requests} requests but {rows} rows")
        if covered_ok and prev is not None and (inc < prev.incarnation or (
                inc == prev.incarnation and requests <= prev.requests and rows <= prev.rows)):
            return None  # a checkpoint older than what an earlier document's tail already showed of this slice
        if prev is not None and inc < prev.incarnation:
            raise PeerDocumentError(PeerError.BAD_DOCUMENT, f"slice {key!r}: incarnation went back from "
                                    f"{prev.incarnation} to {inc}")
        if prev is None or prev.incarnation != inc:  # new slice, or evicted and re-created: walks start at zero
            prev = _SliceMark(inc, 0, 0, {})
        d_rows, d_req = rows - prev.rows, requests - prev.requests
        if d_rows < 0 or d_req < 0:
            raise PeerDocumentError(PeerError.BAD_COUNT, f"slice {key!r}: counts went back (rows {prev.rows} -> "
                                    f"{rows}, requests {prev.requests} -> {requests})")
        if d_rows < d_req or (d_req == 0 and d_rows):
            raise PeerDocumentError(PeerError.BAD_COUNT, f"slice {key!r}: {d_rows} new rows for {d_req} new "
                                    "requests (every request has at least one row)")
        metrics = entry.get("metrics")
        if not isinstance(metrics, Mapping) or set(metrics) != set(self.stats.bets):
            raise PeerDocumentError(PeerError.BAD_DOCUMENT, f"slice {key!r}: metrics "
                                    f"{sorted(map(str, metrics)) if isinstance(metrics, Mapping) else _show(metrics)}"
                                    f", expected {sorted(self.stats.bets)}")
        walks, marks, sums, sum_marks = {}, {}, {}, {}
        for m, (alarm_bet, rec_bet) in self.stats.bets.items():
            w = metrics[m]
            if not isinstance(w, Mapping):
                raise PeerDocumentError(PeerError.BAD_DOCUMENT, f"slice {key!r} metric {m!r}: not an object")
            old = prev.walks.get(m)
            alarm = _walk(w.get("alarm"), N_BETS, f"slice {key!r} metric {m!r} alarm")
            rec = w.get("recovery")
            # no recovery test: [] (or N_BETS unused walks, as stats.py keeps them), ignored
            recovery = _walk(rec, N_BETS if rec_bet is not None or (isinstance(rec, list) and rec) else 0,
                             f"slice {key!r} metric {m!r} recovery")
            a_inc = _within(alarm_bet, alarm, old[0] if old else None, d_req, f"slice {key!r} metric {m!r} alarm")
            r_inc = (_within(rec_bet, recovery, old[1] if old else None, d_req, f"slice {key!r} metric {m!r} recovery")
                     if rec_bet is not None else [])
            walks[m] = (a_inc, r_inc)
            marks[m] = (alarm, recovery)
            cum = _window_sums(w.get("sums"))  # the alert's value only: a peer without them still detects
            if cum is not None:
                before = prev.sums.get(m, (0.0,) * len(ACC_FIELDS))
                sums[m] = [a - b for a, b in zip(cum, before)]
                sum_marks[m] = cum
        return _Update(key, _SliceMark(inc, rows, requests, marks, sum_marks), d_rows, d_req, walks, sums)

    # ------------------------------------------------------------------------------------------ reports
    def status(self) -> dict[str, Any]:
        """Per source (served in /readyz `peers`): whether its last poll was merged (`ok`), its current epoch and
        cursor, documents accepted, epochs first seen from it, errors (total and by PeerError reason) and the last
        one, the live epochs it owns with their cursors; and for ordering (module docstring): `as_of` (its clock
        at its last document), `failed_polls` in a row, `waited` (the merge waits for it), `pending` increments
        queued and not merged yet, `late` increments merged after newer ones of other sources, `coarse` documents
        whose backlog reached past the peer's oldest checkpoint, `skipped_requests` of epochs an earlier combiner
        read (not merged after a restart), and `incomplete` (why its evidence is known to miss a process, or
        null)."""
        out: dict[str, Any] = {}
        pending = Counter(name for _, _, name, _ in list(self.pending))
        incomplete = self.incomplete()
        epochs = list(self.epochs.items())  # the poll thread may change them meanwhile
        for name, s in list(self.sources.items()):
            owned = {e: {"cursor": st.cursor, "slices": len(st.last)} for e, st in epochs if st.source == name}
            cur = self.epochs.get(s.epoch)
            out[name] = {"ok": s.ok, "epoch": s.epoch, "cursor": cur.cursor if cur is not None else 0,
                         "accepted": s.accepted, "new_epochs": s.new_epochs, "epochs": owned,
                         "errors": sum(s.errors.values()), "errors_by_reason": dict(s.errors),
                         "last_error": s.last_error, "last_error_reason": s.last_error_reason,
                         "as_of": s.as_of, "failed_polls": s.failed,
                         "waited": (s.listed and s.as_of is not None and s.accepted > 0
                                    and s.failed <= self.wait_polls),
                         "discovered": s.discovered, "listed": s.listed,
                         "pending": pending[name], "increments": s.increments, "late": s.late, "coarse": s.coarse,
                         "skipped_requests": s.skipped_requests, "incomplete": incomplete.get(name)}
        return out


def _show(v: Any) -> str:
    return repr(v)[:80]


def _count(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise PeerDocumentError(PeerError.BAD_DOCUMENT, f"{what} must be an integer, got {_show(v)}")
    if not 0 <= v <= MAX_COUNT:
        raise PeerDocumentError(PeerError.BAD_COUNT, f"{what} must be in [0, 2^62], got {_show(v)}")
    return v


def _time(v: Any, what: str, optional: bool = False) -> float | None:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise PeerDocumentError(PeerError.BAD_DOCUMENT, f"{what} must be a finite number (seconds), got {_show(v)}")
    return float(v)


def _walk(v: Any, n: int, what: str) -> tuple[float, ...]:
    if not isinstance(v, list) or len(v) != n:
        raise PeerDocumentError(PeerError.BAD_DOCUMENT, f"{what}: expected a list of {n} numbers (one per bet), got "
                                f"{_show(v) if not isinstance(v, list) else f'{len(v)} entries'}")
    out = []
    for x in v:
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise PeerDocumentError(PeerError.BAD_DOCUMENT, f"{what}: {_show(x)} is not a number")
        try:
            f = float(x)
        except OverflowError:  # an integer past the float range
            f = math.inf
        if not math.isfinite(f):
            raise PeerDocumentError(PeerError.NON_FINITE, f"{what}: {_show(x)} is not finite")
        out.append(f)
    return tuple(out)


def _within(bet: Betting, now: tuple[float, ...], before: tuple[float, ...] | None, n: int, what: str
            ) -> list[float]:
    """Increments now - before per bet, each checked against what `n` new sampled requests can add: every
    request adds log1p(lambda_j r ybar) with r in (0, 1] and ybar in [-span, cap] (monitoring/detector.py Betting),
    so n log1p(-lambda_j span) <= increment_j <= n log1p(lambda_j cap), up to float rounding of the sums."""
    before = before or (0.0,) * len(now)
    inc = []
    for j, lam in enumerate(bet.lambdas):
        d = now[j] - before[j]
        lo, hi = n * math.log1p(-lam * bet.span), n * math.log1p(lam * bet.cap)
        tol = 1e-7 * (abs(now[j]) + abs(before[j])) + 1e-9
        if not lo - tol <= d <= hi + tol:
            raise PeerDocumentError(PeerError.IMPOSSIBLE_INCREMENT, f"{what} bet {j}: increment {d:.6g} outside "
                                    f"[{lo:.6g}, {hi:.6g}] allowed for {n} new sampled requests")
        inc.append(d)
    return inc


class CheckpointLog:
    """A replica's (and the combiner's own) checkpoints: every `every` sampled requests, the cumulative evidence
    entries of the slices updated since the previous checkpoint, with the version and the clock at that moment.
    A combiner that reads a backlog (it could not reach this process for a while) merges it one checkpoint at a
    time, in time order with the other processes' evidence (Ordering, module docstring), instead of as one
    increment that would mix rows from before a change with rows after it.

    Memory: at most `keep` checkpoints, each at most `every` x G slice entries (G: slice keys per request), each
    entry 2 x N_BETS floats per thresholded metric. Past `keep` the oldest is dropped, and `floor` (its version)
    tells a reader whose cursor is older that part of its backlog arrives as one increment (counted, `coarse`).

    Args:
        stats: the process's SliceStatistics (export_walks=True).
        every: sampled requests between two checkpoints.
        keep: checkpoints kept.
        clock: wall clock (s); replicas and combiner compare these, so they must share time (NTP).
    """

    def __init__(self, stats: SliceStatistics, every: int = CHECKPOINT_EVERY, keep: int = MAX_CHECKPOINTS,
                 clock: Callable[[], float] = time.time) -> None:
        if every < 1 or keep < 1:
            raise ValueError("every and keep must be >= 1")
        self.stats = stats
        self.every = int(every)
        self.clock = clock
        self.items: deque[tuple[int, float, dict[str, Any]]] = deque(maxlen=int(keep))
        self.count = 0  # sampled requests since the last checkpoint
        self.version = 0  # the last checkpoint's version
        self.floor = 0  # version of the newest checkpoint dropped (0: none)

    def tick(self, requests: int = 1) -> None:
        """Count sampled requests added to the statistics; take a checkpoint every `every` of them (call under
        the lock that guards the statistics)."""
        self.count += requests
        if self.count >= self.every:
            self.take()

    def take(self) -> None:
        """Checkpoint now (the slices updated since the last checkpoint; nothing when none was)."""
        self.count = 0
        version, keys = self.stats.evidence_keys(self.version)
        if version == self.version:
            return
        if len(self.items) == self.items.maxlen:
            self.floor = self.items[0][0]
        self.items.append((version, self.clock(), self.stats.evidence_entries(keys)))
        self.version = version

    def after(self, since: int) -> list[dict[str, Any]]:
        """The checkpoints with a version above `since`, oldest first: [{"version", "time", "slices"}]."""
        return [{"version": v, "time": t, "slices": sl} for v, t, sl in self.items if v > since]
