"""Synapse replay in one pass over the capture, chunk by chunk, with the state carried
between chunks: memory grows with the (stream, instance) pairs, not with the capture.

`SynapseState` gives the same tables as `synapse_rules.synapse_tables` + `synapse_rules.commands_table`
over the whole capture (the oracle tests compare them, and Spark runs synapse_tables per
group): what crosses a chunk boundary is, per (stream, instance), the last token set (for
the POSITION gap check), the counters, and the `batch` rows still waiting for their token,
counted per connection (with their rows only when the `rows` table is wanted). `rows`
is as long as the capture by nature; it is built only when asked for.

Rules (REPLAY.md, as synapse_tables implements them): a waiting batch row commits at the
next numeric RDATA of its (stream, instance) if that one came on the same connection,
otherwise it is left; left and never-committed rows count as `dropped` when their
connection is older than the last connection of the replay, else as `pending`.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dcptool.replay.rules import tables as T
from dcptool.replay.rules.columns import (
    NONE_TS,
    as_numpy,
    as_strings,
    equals,
    ordered_frames,
    ts_array,
    ts_ns,
)
from dcptool.replay.rules.synapse_catchup import (
    BOOK_COLUMNS,
    CATCH_UP,
    CatchUpBook,
    gap_counts,
)
from dcptool.replay.rules.synapse_tables import (
    Kinds,
    group_bounds,
    next_numeric,
    synapse_group_frames,
)

I64_MIN = np.iinfo(np.int64).min
GROUP_COLUMNS = ["capture_id", "frame_no", "ts", "conn", "stream", "instance", "command",
                 "token", "batch", "prev_token", "new_token"]
ROW_COLUMNS = ["row"]
_ROW_PARTS = ["stream", "instance", "token", "row", "capture_id", "frame_no", "ts", "_gid", "_seq"]


class SynapseState:
    def __init__(self, want_rows: bool = True, book: CatchUpBook | None = None):
        self.want_rows = want_rows
        self.book = book if book else None     # every caught-up line of the replay, read first
        self.max_conn = -1
        self._keys: dict[tuple, int] = {}         # (stream, instance) -> group id
        self._names: list[tuple] = []
        g = 0
        self.has_val = np.zeros(g, bool)
        self.val = np.zeros(g, np.int64)
        self.n_rows = np.zeros(g, np.int64)
        self.batches = np.zeros(g, np.int64)
        self.n_gaps = np.zeros(g, np.int64)
        self.dropped = np.zeros(g, np.int64)
        self.fts = np.zeros(g, np.int64)
        self.lts = np.zeros(g, np.int64)
        # waiting batch rows per group: {conn: count}; left (never to commit): {conn: count}
        self.waiting: dict[int, dict[int, int]] = {}
        self.left: dict[int, dict[int, int]] = {}
        self.waiting_rows: dict[int, list[pa.Table]] = {}   # with want_rows
        self.gap_parts: list[pa.Table] = []
        self.row_parts: list[pa.Table] = []
        self.cmd_parts: list[pa.Table] = []

    # -- groups ------------------------------------------------------------------------------
    def _gids(self, stream: pa.Array, instance: pa.Array) -> np.ndarray:
        s = pc.dictionary_encode(stream, null_encoding="encode")
        i = pc.dictionary_encode(instance, null_encoding="encode")
        sw, iw = s.dictionary.to_pylist(), i.dictionary.to_pylist()
        local = as_numpy(s.indices, dtype=np.int64) * (len(iw) + 1) + as_numpy(i.indices, dtype=np.int64)
        uniq, inv = np.unique(local, return_inverse=True)
        lut = np.empty(len(uniq), np.int64)
        for j, code in enumerate(uniq.tolist()):
            key = (sw[code // (len(iw) + 1)], iw[code % (len(iw) + 1)])
            gid = self._keys.get(key)
            if gid is None:
                gid = self._keys[key] = len(self._names)
                self._names.append(key)
            lut[j] = gid
        self._grow(len(self._names))
        return lut[inv.reshape(-1)]

    def _grow(self, g: int) -> None:
        have = len(self.val)
        if g <= have:
            return
        extra = g - have
        self.has_val = np.concatenate([self.has_val, np.zeros(extra, bool)])
        for name, fill in (("val", 0), ("n_rows", 0), ("batches", 0), ("n_gaps", 0),
                           ("dropped", 0), ("fts", NONE_TS), ("lts", I64_MIN)):
            setattr(self, name, np.concatenate([getattr(self, name), np.full(extra, fill, np.int64)]))

    # -- one chunk -----------------------------------------------------------------------------
    def feed(self, t: pa.Table) -> None:
        """A chunk of frames in replay order: the columns of GROUP_COLUMNS (+ `row` when
        rows are wanted) and `direction`, `decode_error`, `_seq`, `_conn`."""
        if t.num_rows == 0:
            return
        self.max_conn = max(self.max_conn, int(pc.max(t.column("_conn")).as_py()))
        self._commands(t)
        keep = synapse_group_frames(t)
        if not keep.any():
            self._fold_left()
            return
        t = t.filter(pa.array(keep))
        stream, instance = as_strings(t.column("stream")), as_strings(t.column("instance"))
        gid = self._gids(stream, instance)
        order = np.argsort(gid, kind="stable")      # the chunk is in replay order already
        t = t.take(pa.array(order))
        gid = gid[order]
        self._apply(t, gid)
        self._fold_left()

    def _apply(self, t: pa.Table, gid: np.ndarray) -> None:
        n = t.num_rows
        idx = np.arange(n)
        gstart, gend, groups = group_bounds(gid)
        conn = as_numpy(t.column("_conn"), dtype=np.int64)
        kinds = Kinds(t, gid, self.book)
        is_pos, token, is_batch, is_num = kinds.is_pos, kinds.token, kinds.is_batch, kinds.is_num

        # the batch token rule inside the chunk
        nxt, nn = next_numeric(is_num)
        has_nxt = (nxt < n) & (gid[nn] == gid)
        joins = is_batch & has_nxt & (conn[nn] == conn)
        left = is_batch & has_nxt & ~joins
        waiting = is_batch & ~has_nxt
        commit_token = np.where(kinds.caught, kinds.caught_token, np.where(is_num, token, token[nn]))
        with_batch = kinds.caught_closes.copy()
        with_batch[nxt[joins]] = True

        # rows carried from earlier chunks wait on the first numeric RDATA of their group
        first_num = nxt[gstart]
        first_ok = (first_num < n) & (gid[np.minimum(first_num, n - 1)] == groups)
        carried_rows: list[pa.Table] = []
        for g, f, ok in zip(groups.tolist(), first_num.tolist(), first_ok.tolist()):
            if not ok or g not in self.waiting:
                continue
            counts = self.waiting.pop(g)
            c = int(conn[f])
            joined = counts.pop(c, 0)
            lf = self.left.setdefault(g, {})
            for cc, k in counts.items():
                lf[cc] = lf.get(cc, 0) + k
            if joined:
                self.n_rows[g] += joined
                with_batch[f] = True
            parts = self.waiting_rows.pop(g, None)
            if parts and joined:
                w = pa.concat_tables(parts)
                w = w.filter(pc.equal(w.column("_conn"), c))
                carried_rows.append(w.set_column(w.column_names.index("token"), "token",
                                                 pa.array(np.full(w.num_rows, token[f]), pa.int64())))
        self._count(self.left, gid[left], conn[left])
        self._count(self.waiting, gid[waiting], conn[waiting])

        committed = is_num | joins | kinds.caught
        ng = len(self.val)
        self.n_rows += np.bincount(gid[committed], minlength=ng)
        self.batches += np.bincount(gid[with_batch], minlength=ng)

        # POSITION prev new: a gap when the last token set is below prev; then it is new
        pos_val = pc.coalesce(t.column("new_token"), t.column("token"))
        setter = is_num | (is_pos & as_numpy(pos_val.is_valid(), dtype=bool))
        value = np.where(is_num, token, as_numpy(pos_val, fill=0, dtype=np.int64))
        last_set = np.maximum.accumulate(np.where(setter, idx, -1))
        before = np.concatenate([[-1], last_set[:-1]])
        bb = np.maximum(before, 0)
        in_chunk = (before >= 0) & (gid[bb] == gid)
        value_before = np.where(in_chunk, value[bb], self.val[gid])
        has_before = in_chunk | self.has_val[gid]
        prev_valid = as_numpy(t.column("prev_token").is_valid(), dtype=bool)
        prev_tok = as_numpy(t.column("prev_token"), fill=0, dtype=np.int64)
        gap = is_pos & prev_valid & has_before & (value_before < prev_tok)
        if gap.any():
            gi = np.flatnonzero(gap)
            self.n_gaps += np.bincount(gid[gi], minlength=len(self.val))
            self.gap_parts.append(pa.table({
                "stream": as_strings(t.column("stream")).take(gi),
                "instance": as_strings(t.column("instance")).take(gi),
                "capture_id": as_strings(t.column("capture_id")).take(gi),
                "frame_no": t.column("frame_no").take(gi), "ts": t.column("ts").take(gi),
                "from_token": pa.array(value_before[gi], pa.int64()),
                "to_token": pa.array(prev_tok[gi], pa.int64())}))
        ls = last_set[gend]
        set_here = (ls >= 0) & (gid[np.maximum(ls, 0)] == groups)
        self.val[groups[set_here]] = value[ls[set_here]]
        self.has_val[groups[set_here]] = True

        ts = ts_ns(t.column("ts"))
        self.fts[groups] = np.minimum(self.fts[groups], np.minimum.reduceat(ts, gstart))
        lts = np.where(ts == NONE_TS, I64_MIN, ts)
        self.lts[groups] = np.maximum(self.lts[groups], np.maximum.reduceat(lts, gstart))

        if self.want_rows:
            ci = np.flatnonzero(committed)
            part = self._row_table(t, ci, gid, commit_token[ci])
            self.row_parts.extend(carried_rows)
            self.row_parts.append(part)
            if waiting.any():
                wi = np.flatnonzero(waiting)
                w = self._row_table(t, wi, gid, np.zeros(len(wi), np.int64))
                w = w.append_column("_conn", pa.array(conn[wi], pa.int64()))
                wg = gid[wi]
                for g in np.unique(wg).tolist():
                    self.waiting_rows.setdefault(g, []).append(
                        w.filter(pa.array(wg == g)))

    @staticmethod
    def _row_table(t: pa.Table, rows: np.ndarray, gid: np.ndarray, tokens: np.ndarray) -> pa.Table:
        take = pa.array(rows, pa.int64())
        return pa.table({
            "stream": as_strings(t.column("stream")).take(take),
            "instance": as_strings(t.column("instance")).take(take),
            "token": pa.array(tokens, pa.int64()), "row": t.column("row").take(take),
            "capture_id": as_strings(t.column("capture_id")).take(take),
            "frame_no": t.column("frame_no").take(take), "ts": t.column("ts").take(take),
            "_gid": pa.array(gid[rows], pa.int64()),
            "_seq": t.column("_seq").take(take)})

    @staticmethod
    def _count(into: dict, gids: np.ndarray, conns: np.ndarray) -> None:
        if not len(gids):
            return
        pairs, counts = np.unique(np.stack([gids, conns]), axis=1, return_counts=True)
        for (g, c), k in zip(pairs.T.tolist(), counts.tolist()):
            d = into.setdefault(g, {})
            d[c] = d.get(c, 0) + k

    def _fold_left(self) -> None:
        # left rows of a connection older than the newest seen are dropped whatever comes
        for g, d in self.left.items():
            for c in [c for c in d if c < self.max_conn]:
                self.dropped[g] += d.pop(c)

    def _commands(self, t: pa.Table) -> None:
        c = pa.table({"command": as_strings(t.column("command")), "ts": t.column("ts")})
        c = c.filter(c.column("command").is_valid())
        agg = c.group_by(["command"], use_threads=False).aggregate(
            [("ts", "count", pc.CountOptions(mode="all")), ("ts", "min"), ("ts", "max")])
        self.cmd_parts.append(agg)
        if len(self.cmd_parts) >= 64:
            self.cmd_parts = [self._merge_commands()]

    def _merge_commands(self) -> pa.Table:
        if not self.cmd_parts:
            return pa.table({"command": pa.array([], pa.string()),
                             "ts_count": pa.array([], pa.int64()),
                             "ts_min": pa.array([], T.TS), "ts_max": pa.array([], T.TS)})
        t = pa.concat_tables(self.cmd_parts)
        agg = t.group_by(["command"], use_threads=False).aggregate(
            [("ts_count", "sum"), ("ts_min", "min"), ("ts_max", "max")])
        return pa.table({"command": agg.column("command"),
                         "ts_count": agg.column("ts_count_sum").cast(pa.int64()),
                         "ts_min": agg.column("ts_min_min"), "ts_max": agg.column("ts_max_max")})

    # -- the result ---------------------------------------------------------------------------
    def finish(self) -> dict[str, pa.Table]:
        g = len(self._names)
        pending = np.zeros(g, np.int64)
        dropped = self.dropped.copy()
        for src in (self.left, self.waiting):
            for gi, d in src.items():
                for c, k in d.items():
                    if c < self.max_conn:
                        dropped[gi] += k
                    else:
                        pending[gi] += k
        names = self._names
        positions = pa.table({
            "stream": pa.array([s for s, _ in names], pa.string()),
            "instance": pa.array([i for _, i in names], pa.string()),
            "token": pa.array(self.val, pa.int64(), mask=~self.has_val),
            "rows": pa.array(self.n_rows, pa.int64()),
            "batches": pa.array(self.batches, pa.int64()),
            "gaps": pa.array(self.n_gaps, pa.int64()),
            "dropped": pa.array(dropped, pa.int64()),
            "pending": pa.array(pending, pa.int64()),
            "first_ts": ts_array(self.fts, self.fts != NONE_TS),
            "last_ts": ts_array(self.lts, self.lts != I64_MIN)})
        gaps_schema, _ = T.SYNAPSE_TABLES["gaps"]
        gaps = pa.concat_tables(self.gap_parts) if self.gap_parts else gaps_schema.empty_table()
        if self.book is not None:       # gaps a catch-up fetched whole are no gaps
            gaps = self.book.open_gaps(gaps)
            positions = positions.set_column(positions.column_names.index("gaps"), "gaps",
                                             pa.array(gap_counts(gaps, names), pa.int64()))
        cmds = self._merge_commands()
        out = {"positions": T.canonical("synapse", "positions", positions),
               "gaps": T.canonical("synapse", "gaps", gaps),
               "commands": T.canonical("synapse", "commands", pa.table({
                   "command": cmds.column("command"), "count": cmds.column("ts_count"),
                   "first_ts": cmds.column("ts_min"), "last_ts": cmds.column("ts_max")}))}
        if self.want_rows:
            out["rows"] = self._rows()
        return out

    def _rows(self) -> pa.Table:
        schema, _ = T.SYNAPSE_TABLES["rows"]
        parts = [p for p in self.row_parts if p.num_rows]
        if not parts:
            return T.canonical("synapse", "rows", schema.empty_table())
        r = pa.concat_tables([p.select(_ROW_PARTS) for p in parts], promote_options="default")
        self.row_parts = []
        gid = as_numpy(r.column("_gid"), dtype=np.int64)
        tok = as_numpy(r.column("token"), dtype=np.int64)
        seq = as_numpy(r.column("_seq"), dtype=np.int64)
        o = np.lexsort((seq, tok, gid))
        run = np.ones(len(o), bool)
        run[1:] = (gid[o][1:] != gid[o][:-1]) | (tok[o][1:] != tok[o][:-1])
        run_start = np.maximum.accumulate(np.where(run, np.arange(len(o)), 0))
        index = np.empty(len(o), np.int64)
        index[o] = np.arange(len(o)) - run_start
        r = r.drop_columns(["_gid", "_seq"])
        r = r.add_column(3, "index", pa.array(index, pa.int64()))
        return T.canonical("synapse", "rows", r)


class PositionScan:
    """`dcptool inspect`'s positions per (stream, instance), chunk by chunk: the `in` RDATA
    and POSITION rows (decode errors included) in capture order. A numeric RDATA commits
    the batch rows waiting before it (`rows`, `batches`); a POSITION whose prev_token is
    above the last token is a gap; any change of (capture, connection) drops the rows
    still waiting, in every stream."""

    FIELDS = ("token", "rows", "batches", "positions", "gaps", "dropped", "waiting")

    def __init__(self):
        self._keys: dict[tuple, int] = {}
        self._names: list[tuple] = []
        self.has_tok = np.zeros(0, bool)
        self.c = {k: np.zeros(0, np.int64) for k in self.FIELDS}
        self.gaps: list[dict] = []
        self._conn = None

    def connection(self, conn) -> None:
        if conn != self._conn:
            if self._conn is not None:
                self.c["dropped"] += self.c["waiting"]
                self.c["waiting"][:] = 0
            self._conn = conn

    def _gids(self, stream: list, instance: list) -> np.ndarray:
        out = np.empty(len(stream), np.int64)
        keys = self._keys
        for j, key in enumerate(zip(stream, instance)):
            g = keys.get(key)
            if g is None:
                g = keys[key] = len(self._names)
                self._names.append(key)
            out[j] = g
        extra = len(self._names) - len(self.has_tok)
        if extra:
            self.has_tok = np.concatenate([self.has_tok, np.zeros(extra, bool)])
            for k in self.FIELDS:
                self.c[k] = np.concatenate([self.c[k], np.zeros(extra, np.int64)])
        return out

    def feed(self, capture_id: str, t: pa.Table) -> None:
        """Relevant rows of one chunk (columns frame_no, conn, command, stream, instance,
        token, batch, prev_token, new_token)."""
        conn = as_numpy(t.column("conn"), fill=-1, dtype=np.int64)
        cut = np.flatnonzero(conn[1:] != conn[:-1]) + 1
        for a, b in zip(np.concatenate([[0], cut]).tolist(), np.concatenate([cut, [len(conn)]]).tolist()):
            c = t.column("conn")[a].as_py()
            self.connection((capture_id, c))
            self._segment(capture_id, t.slice(a, b - a))

    def _segment(self, capture_id: str, t: pa.Table) -> None:
        n = t.num_rows
        # few distinct (stream, instance) pairs: map them through their dictionaries
        s = pc.dictionary_encode(as_strings(t.column("stream")), null_encoding="encode")
        i = pc.dictionary_encode(as_strings(t.column("instance")), null_encoding="encode")
        ni = len(i.dictionary) + 1
        local = as_numpy(s.indices, dtype=np.int64) * ni + as_numpy(i.indices, dtype=np.int64)
        uniq, inv = np.unique(local, return_inverse=True)
        sw, iw = s.dictionary.to_pylist(), i.dictionary.to_pylist()
        lut = self._gids([sw[u // ni] for u in uniq.tolist()], [iw[u % ni] for u in uniq.tolist()])
        gid_orig = lut[inv.reshape(-1)]
        order = np.argsort(gid_orig, kind="stable")
        gid = gid_orig[order]
        tt = t.take(pa.array(order))
        gstart, gend, groups = group_bounds(gid)
        cmd = tt.column("command")
        is_rd, is_pos = equals(cmd, "RDATA"), equals(cmd, "POSITION")
        batch = is_rd & as_numpy(tt.column("batch"), fill=False, dtype=bool)
        tok_valid = as_numpy(tt.column("token").is_valid(), dtype=bool)
        tok = as_numpy(tt.column("token"), fill=0, dtype=np.int64)
        numeric = is_rd & ~batch & tok_valid
        ng = len(self.has_tok)
        c = self.c

        # batch rows commit with the next numeric RDATA of their stream
        nxt, nn = next_numeric(numeric)
        has_nxt = (nxt < n) & (gid[nn] == gid)
        joins = batch & has_nxt
        with_batch = np.zeros(n, bool)
        with_batch[nxt[joins]] = True
        first = nxt[gstart]
        first_ok = (first < n) & (gid[np.minimum(first, n - 1)] == groups)
        carried = c["waiting"][groups] > 0
        take_carried = first_ok & carried
        with_batch[first[take_carried]] = True
        c["rows"][groups[take_carried]] += c["waiting"][groups[take_carried]]
        c["waiting"][groups[first_ok]] = 0
        c["rows"] += np.bincount(gid[numeric | joins], minlength=ng)
        c["batches"] += np.bincount(gid[with_batch], minlength=ng)
        c["waiting"] += np.bincount(gid[batch & ~has_nxt], minlength=ng)
        c["positions"] += np.bincount(gid[is_pos], minlength=ng)

        # tokens and gaps
        new_valid = as_numpy(tt.column("new_token").is_valid(), dtype=bool)
        new = as_numpy(tt.column("new_token"), fill=0, dtype=np.int64)
        setter = numeric | (is_pos & new_valid)
        value = np.where(numeric, tok, new)
        last_set = np.maximum.accumulate(np.where(setter, np.arange(n), -1))
        before = np.concatenate([[-1], last_set[:-1]])
        bb = np.maximum(before, 0)
        in_seg = (before >= 0) & (gid[bb] == gid)
        value_before = np.where(in_seg, value[bb], c["token"][gid])
        has_before = in_seg | self.has_tok[gid]
        prev_valid = as_numpy(tt.column("prev_token").is_valid(), dtype=bool)
        prev = as_numpy(tt.column("prev_token"), fill=0, dtype=np.int64)
        gap = is_pos & prev_valid & has_before & (value_before < prev)
        if gap.any():
            gi = np.flatnonzero(gap)
            c["gaps"] += np.bincount(gid[gi], minlength=ng)
            gi = gi[np.argsort(order[gi], kind="stable")]   # capture order
            frame = tt.column("frame_no").take(pa.array(gi)).to_pylist()
            for j, fno in zip(gi.tolist(), frame):
                stream, inst = self._names[gid[j]]
                self.gaps.append({"stream": stream, "instance": inst,
                                  "from_token": int(value_before[j]), "to_token": int(prev[j]),
                                  "capture_id": capture_id, "frame_no": fno})
        ls = last_set[gend]
        here = (ls >= 0) & (gid[np.maximum(ls, 0)] == groups)
        c["token"][groups[here]] = value[ls[here]]
        self.has_tok[groups[here]] = True

    def result(self) -> tuple[list[dict], list[dict]]:
        out = []
        for g in sorted(range(len(self._names)), key=lambda g: tuple(map(str, self._names[g]))):
            stream, inst = self._names[g]
            d = {"stream": stream, "instance": inst}
            for k in self.FIELDS:
                d[k] = int(self.c[k][g])
            if not self.has_tok[g]:
                d["token"] = None
            out.append(d)
        return out, self.gaps


# -- the engine's entry: one pass over the capture (replay/local/engine.py calls it) ----------------

def lazy_results(files, ranks, tables, chunk_rows: int) -> dict[str, pa.Table]:
    """The Synapse tables but `frames`. The `rows` table, as long as the capture by
    nature, is built only when `tables` asks for it (None: every table); asking for it
    later takes a second pass. With `tables` given the pass runs now, else on first use."""
    out = _LazySynapse(files, ranks, tables, chunk_rows)
    first = next((n for n in (tables or ()) if n in _LazySynapse.NAMES), None)
    if first is not None:
        out[first]
    return out


class _LazySynapse(dict):
    """The Synapse results, computed on first use."""

    NAMES = ("positions", "rows", "gaps", "commands")

    def __init__(self, files, ranks, tables, chunk_rows):
        super().__init__()
        self._args = (files, ranks, chunk_rows)
        self._want_rows = tables is None or "rows" in tables

    def __contains__(self, name) -> bool:
        return name in self.NAMES or super().__contains__(name)

    def __missing__(self, name):
        if name not in self.NAMES:
            raise KeyError(name)
        self.update(synapse_pass(*self._args, want_rows=self._want_rows or name == "rows"))
        return super().__getitem__(name)


def _catch_up_configured(f) -> bool:
    """The capture run of segment `f` had --catch-up (its recorded options say so)."""
    import json
    try:
        opts = json.loads(getattr(f, "metadata", {}).get("dcptool.options") or "{}")
    except ValueError:
        return True        # unreadable options: look at the lines themselves
    return bool((opts.get("synapse") or {}).get("catch_up"))


def catch_up_book(files, ranks, chunk_rows: int) -> CatchUpBook:
    """Every caught-up line of the replay (synapse_catchup.py), read before the main pass:
    a live row equal to a caught-up one is dropped wherever in the capture it came."""
    book = CatchUpBook()
    if not any(_catch_up_configured(f) for f in files):    # no run of these captures fetched
        return book
    for t in ordered_frames(files, ["direction"], ranks, batch_rows=chunk_rows):
        if pc.any(pc.equal(t.column("direction").cast(pa.string()), CATCH_UP)).as_py():
            break
    else:
        return book
    for t in ordered_frames(files, BOOK_COLUMNS, ranks, batch_rows=chunk_rows):
        book.add(t)
    return book


def synapse_pass(files, ranks, chunk_rows: int, want_rows: bool = True) -> dict[str, pa.Table]:
    book = catch_up_book(files, ranks, chunk_rows)
    cols = list(dict.fromkeys(["direction", "decode_error"] + GROUP_COLUMNS
                              + (ROW_COLUMNS if want_rows or book else [])))
    state = SynapseState(want_rows, book)
    for t in ordered_frames(files, cols, ranks, batch_rows=chunk_rows):
        state.feed(t)
    return state.finish()
