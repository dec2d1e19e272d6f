"""Evidence units: a sampled request's rows reduced to the sums the slice statistics add (monitoring/detector.py).

A request (or one slice group of its rows, per-row slices) becomes one `Prepared`: its row count, the display
estimate's decayed weight sums and value sums (each row weighted by the decay of its place: the group's last row
weighs 1, so adding a group of n rows is s <- decay^n s + (these sums), one recursion step per group), and per
bounded metric its evidence units (`cusum.request_units`: the clipped excess sums the bets are taken on). Nothing
here reads or changes a slice's state; `SliceStatistics` applies the sums in arrival order.
`RowReducer.reduce_batch` reduces a whole micro-batch (every group of every request) with one segmented sum into
`BatchSums` tables, which `SliceStatistics.apply_batch` composes per slice key without building a `Prepared` for the
common case.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from tailguard.monitoring.config import Bound
from tailguard.monitoring.cusum import Betting, request_units

Prepared = tuple[int, float, float, list[float], list[float], list[float] | None,
                 list[tuple[str, list[tuple[int, float]], list[tuple[int, float]] | None]]]
"""One request's (or one slice group's) rows reduced for the statistics, its sampling weight w applied
(`RowReducer.prepare`, `BatchSums.prepared`): (rows, w x the sum of the rows' decay weights, w^2 x that sum,
per metric in `metrics` order: w x the decay weight sum over rows with a value, w x the decayed sum of finite
values, the decayed count of infinite values (None: all 0), then [(bounded metric, alarm units, recovery units or
None)], units from `request_units`)."""


@dataclass(frozen=True)
class GroupedRequest:
    """One sampled request as its slice groups (`SliceStatistics.update_batch`).

    Attributes:
        groups: [(keys whose rows are the same, row indices (ints) into the values, or None for
            every row)] (monitoring/config.py `MonitorConfig.row_groups`; request-level slices: [(keys, None)]).
        values: {metric: (rows,) float64 per-row values} of the whole request (as `SliceStatistics.update`).
        weight: sampling weight w = 1/p of the request.
        ratios: per group, its keys' ratios pi_slice / p, or None (all 1).
        request_index: sequence number recorded in alerts.
    """

    groups: Sequence[tuple[Sequence[str], Sequence[int] | None]]
    values: Mapping[str, Any]
    weight: float
    ratios: Sequence[Sequence[float] | None] | None = None
    request_index: int | None = None


class RowReducer:
    """Reduces requests' per-row values to `Prepared` sums for one `SliceStatistics` (no slice state).

    Args:
        metrics: tracked per-row metrics, in order.
        bounds: {metric: Bound} for the metrics alerted on.
        bets: {metric: (alarm Betting, recovery Betting or None)} (`cusum.bettings`).
        decay: the display estimate's per-row decay (1 - 1 / window_size).
        max_request_rows: M, the bound on a request's rows in one slice (a larger group is split into chunks).
    """

    def __init__(self, metrics: Sequence[str], bounds: Mapping[str, Bound],
                 bets: Mapping[str, tuple[Betting, Betting | None]], decay: float, max_request_rows: int) -> None:
        self.metrics = tuple(metrics)
        self.bounds = bounds  # the statistics' own tables, shared (not copied): one source of truth
        self.bets = bets
        self.decay = decay
        self.max_request_rows = int(max_request_rows)
        self._geo: dict[int, tuple[np.ndarray, float]] = {}  # `decay_weights` memo
        self.bounded = tuple(m for m in self.metrics if m in bounds)  # the metrics alerted on, in `metrics` order
        self.excess_columns: list[tuple[str, int, int | None]] = []  # (bounded metric, its alarm and recovery
        # excess columns in `_stack_sums`' sums)
        col = 2 + len(self.metrics)
        for m in self.bounded:
            rec = bets[m][1] is not None
            self.excess_columns.append((m, col, col + 1 if rec else None))
            col += 2 if rec else 1

    def decay_weights(self, n: int) -> tuple[np.ndarray, float]:
        """(decay ** (n-1 .. 0), their sum) for an n-row update of the display estimate, memoized per n (a
        monitor sees few distinct request sizes; at most 256 kept)."""
        got = self._geo.get(n)
        if got is None:
            geo = self.decay ** np.arange(n - 1, -1, -1, dtype=np.float64)
            got = (geo, float(geo.sum()))
            if len(self._geo) < 256:
                self._geo[n] = got
        return got

    def prepare(self, values: Mapping[str, Any], weight: float) -> Prepared:
        """One request's rows (sampling weight `weight`) reduced once for all its slices (`Prepared`)."""
        arrays = {m: np.atleast_1d(np.asarray(values[m], dtype=np.float64)) for m in self.metrics if m in values}
        n0 = max((a.shape[0] for a in arrays.values()), default=0)
        for m in self.metrics:  # a metric the caller did not give has no value on these rows
            if m not in arrays:
                arrays[m] = np.full(n0, np.nan)
        n = max((a.shape[0] for a in arrays.values()), default=0)
        if n == 0:
            return 0, 0.0, 0.0, [], [], None, []
        geo, geo_sum = self.decay_weights(n)
        display: list[tuple[str, float, float, float]] = []
        excess: list[tuple[str, list[tuple[int, float]], list[tuple[int, float]] | None]] = []
        for m in self.metrics:
            a = arrays[m]
            if a.shape[0] != n:
                raise ValueError(f"metric {m!r} has {a.shape[0]} rows, the request {n}")
            all_finite = bool(np.isfinite(a).all())  # the common case: one reduction instead of three masks
            valid = None if all_finite else ~np.isnan(a)
            if n == 1:
                x = float(a[0])
                display.append((m, *(((1.0, x, 0.0) if all_finite else (1.0, 0.0, 1.0)) if x == x
                                     else (0.0, 0.0, 0.0))))
            elif all_finite:
                display.append((m, geo_sum, float(geo @ a), 0.0))
            else:
                finite = np.isfinite(a)
                display.append((m, float(geo[valid].sum()), float((geo[finite] * a[finite]).sum()),
                                float(geo[valid & ~finite].sum())))
            b = self.bounds.get(m)
            if b is None or (valid is not None and not valid.any()):
                continue
            x = a if valid is None or valid.all() else a[valid]
            if b.higher_is_better:
                y = b.value - x
            else:
                y = (np.minimum(x, b.truncate_at) if b.truncate_at is not None else x) - b.value
            y = float(y[0]) if y.shape[0] == 1 else y
            alarm_bet, rec_bet = self.bets[m]
            mr = self.max_request_rows
            excess.append((m, request_units(alarm_bet, y, mr),
                           request_units(rec_bet, y, mr) if rec_bet is not None else None))
        w = weight
        return (n, w * geo_sum, w * w * geo_sum, [w * d[1] for d in display], [w * d[2] for d in display],
                [d[3] for d in display], excess)

    def reduce_batch(self, requests: Sequence[GroupedRequest]) -> "BatchSums":
        """Every group of every request reduced at once (`BatchSums`; no state is read or changed): the requests'
        rows are stacked into one (rows, metrics) matrix X; every group's rows are gathered from X group after
        group, each weighted by the decay weight of its place in the group (the group's last row weighing 1, as
        `decay_weights`), and one segmented sum gives the display sums and the clipped excess sums
        (`_stack_sums`). A request whose values hold a NaN or infinity, lack a metric, disagree in length, or with
        a group of more than max_request_rows rows takes `prepare` per group (the rare path).
        """
        metrics, mr = self.metrics, self.max_request_rows
        batch = BatchSums(self, [len(req.groups) for req in requests])
        fast: list[int] = []
        cols: list[list[np.ndarray]] = [[] for _ in metrics]
        for i, req in enumerate(requests):
            vals = req.values
            if all(m in vals for m in metrics):
                arrays = [np.atleast_1d(np.asarray(vals[m], dtype=np.float64)) for m in metrics]
                n = arrays[0].shape[0]
                # each group holds some of the n rows: only a request of more than M rows can have a larger one
                if n and all(a.ndim == 1 and a.shape[0] == n for a in arrays) and (n <= mr or all(
                        (n if idx is None else len(idx)) <= mr for _, idx in req.groups)):
                    fast.append(i)
                    for c, a in zip(cols, arrays):
                        c.append(a)
                    continue
            batch.set_rare(i, self._prepare_each(req))
        if fast:
            sizes = [c.shape[0] for c in cols[0]]
            stacked = np.stack([np.concatenate(c) for c in cols], axis=1)  # (rows, metrics)
            bad = ~np.isfinite(stacked).all(axis=1)
            if bad.any():  # requests holding a NaN or infinity take the per-group path
                ends = np.cumsum(sizes)
                hit = set(np.searchsorted(ends, np.flatnonzero(bad), side="right").tolist())
                for j in sorted(hit):
                    batch.set_rare(fast[j], self._prepare_each(requests[fast[j]]))
                keep = [j for j in range(len(fast)) if j not in hit]
                if keep:
                    starts = ends - np.asarray(sizes)
                    stacked = stacked[np.concatenate([np.arange(starts[j], ends[j]) for j in keep])]
                fast, sizes = [fast[j] for j in keep], [sizes[j] for j in keep]
            if fast:
                chosen = [requests[i] for i in fast]
                counts, sums = self._stack_sums(chosen, sizes, stacked)
                rows = (np.arange(batch.starts[-1]) if len(fast) == len(requests) else  # the common case
                        np.concatenate([np.arange(batch.starts[i], batch.starts[i + 1]) for i in fast]))
                batch.set_stacked(rows, counts, sums)
        return batch

    def _prepare_each(self, req: GroupedRequest) -> list[Prepared]:
        """`prepare` of each group of one request on its own (the rare path of `reduce_batch`)."""
        vals = req.values
        return [self.prepare(vals if idx is None else {m: np.atleast_1d(np.asarray(vals[m]))[idx]
                                                        for m in self.metrics if m in vals}, req.weight)
                for _, idx in req.groups]

    def _stack_sums(self, requests: Sequence[GroupedRequest], sizes: Sequence[int],
                    stacked: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`reduce_batch`'s common path: requests whose (rows_i, metrics) values are stacked in `stacked`
        ((sum rows_i, metrics) float64, finite), every group of at most max_request_rows rows.

        Every group's rows are gathered group after group (each group's rows ascending, so a row's place in its
        group is its rank) into one (group rows, 1 + metrics + excess columns) matrix: the row's decay weight, its
        weighted values and its clipped excesses; one `np.add.reduceat` at the groups' starts gives every group's
        sums, and the sampling weights scale them in place. The arrays are as long as the groups' rows (a dense
        (groups, rows) membership matrix grows with their product).

        Returns:
            ((groups,) int64 rows per group, (groups, 2 + metrics + excess columns) float64 sums: w x the decay
            weight sum, w^2 x that, per metric w x the decayed value sum, then the clipped excess sums of
            `excess_columns`).
        """
        local: list[int] = []  # every group's rows, group after group, as rows of its request
        counts: list[int] = []
        offsets: list[int] = []  # per group, its request's first row in `stacked`
        offset = 0
        for req, n in zip(requests, sizes):
            whole = range(n)
            for _, idx in req.groups:
                idx = whole if idx is None else idx
                local.extend(idx)
                counts.append(len(idx))
            offsets += [offset] * len(req.groups)
            offset += n
        cnt = np.asarray(counts, dtype=np.int64)
        rows = np.asarray(local, dtype=np.int64) + np.repeat(np.asarray(offsets, dtype=np.int64), cnt)
        first = np.cumsum(cnt) - cnt
        starts = first[cnt > 0]  # a group of no rows (a caller's empty index list) adds nothing
        if rows.size > 1 and not self._ascending(rows, starts):  # a caller's unsorted group: sort within groups
            gid = np.repeat(np.arange(cnt.shape[0]), cnt)
            rows = rows[np.lexsort((rows, gid))]
        from_end = np.repeat(cnt + first - 1, cnt) - np.arange(rows.shape[0])  # 0 for each group's last row
        longest = int(cnt.max(initial=1))
        weights = self.decay_weights(longest)[0][longest - 1 - from_end]  # decay ** from_end
        k = len(self.metrics)
        ycols: list[np.ndarray] = []
        for m, _, jr in self.excess_columns:
            b = self.bounds[m]
            a = stacked[:, self.metrics.index(m)]
            if b.higher_is_better:
                y = b.value - a
            else:
                y = (np.minimum(a, b.truncate_at) if b.truncate_at is not None else a) - b.value
            alarm_bet, rec_bet = self.bets[m]
            ycols.append(np.clip(alarm_bet.sign * y, -alarm_bet.span, alarm_bet.cap))
            if jr is not None:
                ycols.append(np.clip(rec_bet.sign * y, -rec_bet.span, rec_bet.cap))  # type: ignore[union-attr]
        # every group's rows: decay weight, weighted values, excesses: (group rows, 1 + metrics + excess columns)
        gathered = np.empty((rows.shape[0], 1 + k + len(ycols)))
        gathered[:, 0] = weights
        gathered[:, 1:1 + k] = stacked[rows] * weights[:, None]
        for c, y in enumerate(ycols):
            gathered[:, 1 + k + c] = y[rows]
        sums = np.zeros((cnt.shape[0], 2 + k + len(ycols)))  # (groups, w x geo, w^2 x geo, w x sums, excess sums)
        if starts.shape[0]:
            sums[cnt > 0, 1:] = np.add.reduceat(gathered, starts, axis=0)
        gw = np.repeat(np.asarray([req.weight for req in requests], dtype=np.float64),
                       [len(req.groups) for req in requests])  # (groups,) the sampling weight of each group's request
        sums[:, 0] = gw * sums[:, 1]
        sums[:, 1] = gw * sums[:, 0]
        sums[:, 2:2 + k] *= gw[:, None]
        return cnt, sums

    @staticmethod
    def _ascending(rows: np.ndarray, starts: np.ndarray) -> bool:
        """Whether each group's rows (groups starting at `starts` in `rows`) are strictly ascending."""
        up = np.diff(rows) > 0
        up[starts[1:] - 1] = True  # a group's first row need not follow the previous group's last
        return bool(up.all())


class BatchSums:
    """A micro-batch's (request, slice group) units reduced at once (`RowReducer.reduce_batch`): every group of
    every request, request after request, one row of each table; a group's `Prepared` is built when asked
    (`prepared`), so the common case never builds one (`SliceStatistics.apply_batch` reads the tables).

    Attributes:
        starts: (requests + 1,) int64, the first group row of each request (and the end).
        rows: (groups,) int64, the group's rows.
        display: (groups, 2 + 2 x metrics) float64: w x the decay weight sum, w^2 x that, per metric w x the decay
            weight sum of rows with a value, per metric w x the decayed value sum (the display recursion's
            addends, `Prepared` fields 1-4); zeros for a rare group.
        alarm: (groups, bounded metrics) float64, the clipped alarm-side excess sum per metric of
            `RowReducer.bounded` (0 for a rare group).
        composable: (groups,) bool: one evidence unit (1 to max_request_rows rows), finite values, every metric
            present (so its window sums add n rows per bounded metric); False for a rare group (`prepare`'s).
    """

    def __init__(self, reducer: RowReducer, groups_per_request: Sequence[int]) -> None:
        self.reducer = reducer
        self.starts = np.zeros(len(groups_per_request) + 1, dtype=np.int64)
        np.cumsum(groups_per_request, out=self.starts[1:])
        g, k = int(self.starts[-1]), len(reducer.metrics)
        self.rows = np.zeros(g, dtype=np.int64)
        self.display = np.zeros((g, 2 + 2 * k))
        self.alarm = np.zeros((g, len(reducer.bounded)))
        self.composable = np.zeros(g, dtype=bool)
        self._raw: np.ndarray | None = None  # (groups, `_stack_sums` columns), rows of stacked groups
        self._rare: dict[int, Prepared] = {}

    def set_rare(self, i: int, prepared: Sequence[Prepared]) -> None:
        """Request i's groups reduced one by one (`RowReducer.prepare`): not composable."""
        for g, p in enumerate(prepared, start=int(self.starts[i])):
            self._rare[g] = p
            self.rows[g] = p[0]

    def set_stacked(self, at: np.ndarray, counts: np.ndarray, sums: np.ndarray) -> None:
        """The groups at rows `at`, from `_stack_sums` (counts (groups,), sums (groups, columns))."""
        k = len(self.reducer.metrics)
        raw = self._raw = np.zeros((self.rows.shape[0], sums.shape[1]))
        raw[at] = sums
        self.rows[at] = counts
        self.display[at, :2] = sums[:, :2]
        self.display[at, 2:2 + k] = sums[:, :1]  # finite rows: every metric has a value on every row
        self.display[at, 2 + k:] = sums[:, 2:2 + k]
        for b, (_, ja, _) in enumerate(self.reducer.excess_columns):
            self.alarm[at, b] = sums[:, ja]
        self.composable[at] = counts > 0

    def prepared(self, g: int) -> Prepared:
        """Group row g as `RowReducer.prepare` gives it."""
        got = self._rare.get(g)
        if got is not None:
            return got
        row = self._raw[g].tolist()  # type: ignore[index]
        n, k, gs = int(self.rows[g]), len(self.reducer.metrics), row[0]
        return (n, gs, row[1], [gs] * k, row[2:2 + k], None,
                [(m, [(n, row[ja])], [(n, row[jr])] if jr is not None else None)
                 for m, ja, jr in self.reducer.excess_columns])

    def per_request(self, i: int) -> list[Prepared]:
        """Request i's groups, each as `prepared`."""
        return [self.prepared(g) for g in range(int(self.starts[i]), int(self.starts[i + 1]))]
