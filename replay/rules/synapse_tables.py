"""The Synapse rules of REPLAY.md as whole-table functions: positions, rows, gaps per
(stream, instance) and the commands table. The Spark engine runs them per group; the local
engine streams the same rules chunk by chunk (synapse_stream.py), and tests hold the two equal."""

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
    is_in,
    ts_array,
    ts_ns,
)
from dcptool.replay.rules.synapse_catchup import CATCH_UP, CatchUpBook, caught_mask

SYN_GROUP_COMMANDS = ("RDATA", "POSITION")
SYN_STATE_COLUMNS = ["capture_id", "frame_no", "ts", "conn", "direction", "stream", "instance", "command",
                     "token", "batch", "prev_token", "new_token", "row"]
GROUP_DIRECTIONS = ("in", CATCH_UP)


def synapse_group_frames(t: pa.Table) -> np.ndarray:
    """Mask of the frames that move a (stream, instance): RDATA and POSITION coming in, live
    or caught up (synapse_catchup.py)."""
    return (is_in(t.column("direction"), GROUP_DIRECTIONS) & as_numpy(t.column("stream").is_valid(), dtype=bool)
            & as_numpy(t.column("decode_error").is_null(), dtype=bool)
            & is_in(t.column("command"), SYN_GROUP_COMMANDS))


def rdata_kinds(t: pa.Table):
    """Per row: (is RDATA, is POSITION, token (0 where null), is a `batch` row waiting for a
    token, is a numeric RDATA that commits)."""
    cmd = t.column("command")
    is_rdata, is_pos = equals(cmd, "RDATA"), equals(cmd, "POSITION")
    token_valid = as_numpy(t.column("token").is_valid(), dtype=bool)
    token = as_numpy(t.column("token"), fill=0, dtype=np.int64)
    is_batch = is_rdata & (as_numpy(t.column("batch"), fill=False, dtype=bool) | ~token_valid)
    return is_rdata, is_pos, token, is_batch, is_rdata & ~is_batch


class Kinds:
    """rdata_kinds with the caught-up lines of `book` set apart: live RDATA / POSITION only in
    the live masks (live rows equal to a caught-up one dropped), the caught-up rows in
    `caught` with the token each commits under (`caught_token`) and whether it closes a
    batch (`caught_closes`). `gid`: the group of each row, rows in group then capture order."""

    def __init__(self, t: pa.Table, gid: np.ndarray, book: CatchUpBook | None):
        n = t.num_rows
        is_rdata, is_pos, token, is_batch, is_num = rdata_kinds(t)
        caught = caught_mask(t) if book else np.zeros(n, bool)
        live = ~caught
        is_rdata, is_pos, is_batch, is_num = is_rdata & live, is_pos & live, is_batch & live, is_num & live
        self.caught = np.zeros(n, bool)
        self.caught_token = np.zeros(n, np.int64)
        self.caught_closes = np.zeros(n, bool)
        if book:
            nxt, nn = next_numeric(is_num)
            joins = is_batch & (nxt < n) & (gid[nn] == gid)
            dup = book.duplicates(t, is_num | joins, np.where(is_num, token, token[nn]))
            is_rdata, is_batch, is_num = is_rdata & ~dup, is_batch & ~dup, is_num & ~dup
            tok, ok, closes = book.lookup(t, caught & equals(t.column("command"), "RDATA"))
            self.caught, self.caught_token, self.caught_closes = ok, tok, closes & ok
        self.is_rdata, self.is_pos, self.token, self.is_batch, self.is_num = is_rdata, is_pos, token, is_batch, is_num


def next_numeric(is_num: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each row, the index of the next numeric RDATA at or after it (n if none), and that
    index clipped into the table (for gathers): the batch token rule's lookup."""
    n = len(is_num)
    nxt = np.where(is_num, np.arange(n), n)
    nxt = np.minimum.accumulate(nxt[::-1])[::-1] if n else nxt
    return nxt, np.minimum(nxt, max(n - 1, 0))


def group_bounds(gid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For rows sorted by group id: first row, last row and id of each group."""
    start = np.ones(len(gid), bool)
    start[1:] = gid[1:] != gid[:-1]
    gstart = np.flatnonzero(start)
    return gstart, np.append(gstart[1:], len(gid)) - 1, gid[gstart]


def _uncover(book: CatchUpBook, gap: np.ndarray, stream: pa.Array, instance: pa.Array,
             lo: np.ndarray, hi: np.ndarray) -> None:
    """Clear the gaps (in place) whose whole range a catch-up fetched; only the gap rows'
    keys are read out."""
    gj = np.flatnonzero(gap)
    take = pa.array(gj)
    for j, s, i in zip(gj.tolist(), stream.take(take).to_pylist(), instance.take(take).to_pylist()):
        if book.cover.covers((s, i), int(lo[j]), int(hi[j])):
            gap[j] = False


def synapse_tables(t: pa.Table, max_conn: int) -> dict[str, pa.Table]:
    """`positions`, `rows` and `gaps` for the group frames in `t` (any order; columns
    SYN_STATE_COLUMNS + _seq + _conn). `max_conn` is the highest `_conn` of the whole
    replay: rows still waiting on an older connection were dropped by a reconnect."""
    n = t.num_rows
    stream, instance = as_strings(t.column("stream")), as_strings(t.column("instance"))
    s_codes = as_numpy(pc.dictionary_encode(stream, null_encoding="encode").indices, dtype=np.int64)
    i_enc = pc.dictionary_encode(instance, null_encoding="encode")
    i_codes = as_numpy(i_enc.indices, dtype=np.int64)
    gcode = s_codes * (len(i_enc.dictionary) + 1) + i_codes
    order = np.lexsort((as_numpy(t.column("_seq"), dtype=np.int64), gcode))
    t = t.take(order)
    gcode = gcode[order]
    start = np.ones(n, bool)
    start[1:] = gcode[1:] != gcode[:-1]
    gid = np.cumsum(start) - 1
    ng = int(gid[-1]) + 1 if n else 0
    idx = np.arange(n)
    conn = as_numpy(t.column("_conn"), dtype=np.int64)
    caught_lines = caught_mask(t)
    book = None
    if caught_lines.any():          # caught-up rows of this group: synapse_catchup.py
        book = CatchUpBook()
        book.add(t.filter(pa.array(caught_lines)))
    k = Kinds(t, gid, book)
    is_pos, token, is_batch, is_num = k.is_pos, k.token, k.is_batch, k.is_num

    # the batch token rule: waiting rows commit at the next numeric RDATA of the group,
    # unless a reconnect came first (then they are dropped)
    nxt, nn = next_numeric(is_num)
    joins = is_batch & (nxt < n) & (gid[nn] == gid) & (conn[nn] == conn)
    committed = is_num | joins | k.caught
    commit_token = np.where(k.caught, k.caught_token, np.where(is_num, token, token[nn]))
    left = is_batch & ~joins
    dropped = left & (conn < max_conn)
    pending = left & ~dropped

    # rows: index = order of commit among the rows of the same token
    ci = np.flatnonzero(committed)
    ci = ci[np.lexsort((ci, commit_token[ci], gid[ci]))]
    run = np.ones(len(ci), bool)
    run[1:] = (gid[ci][1:] != gid[ci][:-1]) | (commit_token[ci][1:] != commit_token[ci][:-1])
    run_start = np.maximum.accumulate(np.where(run, np.arange(len(ci)), 0)) if len(ci) else np.zeros(0, np.int64)
    index = np.arange(len(ci)) - run_start
    rows = pa.table({
        "stream": stream.take(order).take(ci), "instance": instance.take(order).take(ci),
        "token": pa.array(commit_token[ci], pa.int64()), "index": pa.array(index, pa.int64()),
        "row": t.column("row").take(ci), "capture_id": as_strings(t.column("capture_id")).take(ci),
        "frame_no": t.column("frame_no").take(ci), "ts": t.column("ts").take(ci)})

    # POSITION prev new: a gap when the last token is below prev; then the token is new
    pos_val = pc.coalesce(t.column("new_token"), t.column("token"))
    setter = is_num | (is_pos & as_numpy(pos_val.is_valid(), dtype=bool))
    value = np.where(is_num, token, as_numpy(pos_val, fill=0, dtype=np.int64))
    last_set = np.maximum.accumulate(np.where(setter, idx, -1)) if n else np.zeros(0, np.int64)
    before = np.concatenate([[-1], last_set[:-1]]) if n else last_set
    bb = np.maximum(before, 0)
    has_before = (before >= 0) & (gid[bb] == gid)
    prev_valid = as_numpy(t.column("prev_token").is_valid(), dtype=bool)
    prev_tok = as_numpy(t.column("prev_token"), fill=0, dtype=np.int64)
    gap = is_pos & prev_valid & has_before & (value[bb] < prev_tok)
    if book is not None:            # a gap a catch-up fetched whole is no gap
        _uncover(book, gap, stream.take(order), instance.take(order), value[bb], prev_tok)
    gi = np.flatnonzero(gap)
    gaps = pa.table({
        "stream": stream.take(order).take(gi), "instance": instance.take(order).take(gi),
        "capture_id": as_strings(t.column("capture_id")).take(gi), "frame_no": t.column("frame_no").take(gi),
        "ts": t.column("ts").take(gi), "from_token": pa.array(value[bb][gi], pa.int64()),
        "to_token": pa.array(prev_tok[gi], pa.int64())})

    # positions
    gstart = np.flatnonzero(start)
    gend = np.append(gstart[1:], n) - 1
    ls = last_set[gend] if n else np.zeros(0, np.int64)
    has_tok = (ls >= 0) & (gid[np.maximum(ls, 0)] == np.arange(ng)) if n else np.zeros(0, bool)
    batches = np.zeros(ng, np.int64)
    commits_of_batches = np.unique(nxt[joins])
    np.add.at(batches, gid[commits_of_batches], 1)
    np.add.at(batches, gid[k.caught_closes], 1)
    ts = ts_ns(t.column("ts"))
    fts = np.full(ng, NONE_TS, np.int64)
    np.minimum.at(fts, gid, ts)
    lts = np.full(ng, np.iinfo(np.int64).min, np.int64)
    np.maximum.at(lts, gid, np.where(ts == NONE_TS, np.iinfo(np.int64).min, ts))
    positions = pa.table({
        "stream": stream.take(order).take(gstart), "instance": instance.take(order).take(gstart),
        "token": pa.array(value[np.maximum(ls, 0)] if n else np.zeros(0, np.int64), pa.int64(), mask=~has_tok),
        "rows": pa.array(np.bincount(gid[committed], minlength=ng), pa.int64()),
        "batches": pa.array(batches, pa.int64()),
        "gaps": pa.array(np.bincount(gid[gap], minlength=ng), pa.int64()),
        "dropped": pa.array(np.bincount(gid[dropped], minlength=ng), pa.int64()),
        "pending": pa.array(np.bincount(gid[pending], minlength=ng), pa.int64()),
        "first_ts": ts_array(fts, fts != NONE_TS),
        "last_ts": ts_array(lts, lts != np.iinfo(np.int64).min)})
    return {"positions": T.canonical("synapse", "positions", positions),
            "rows": T.canonical("synapse", "rows", rows),
            "gaps": T.canonical("synapse", "gaps", gaps)}


def commands_table(t: pa.Table) -> pa.Table:
    """count, first_ts, last_ts per command over every frame (both directions)."""
    t = pa.table({"command": as_strings(t.column("command")), "ts": t.column("ts")})
    t = t.filter(t.column("command").is_valid())
    agg = t.group_by(["command"], use_threads=False).aggregate(
        [("ts", "count", pc.CountOptions(mode="all")), ("ts", "min"), ("ts", "max")])
    return T.canonical("synapse", "commands", pa.table({
        "command": agg.column("command"), "count": agg.column("ts_count"),
        "first_ts": agg.column("ts_min"), "last_ts": agg.column("ts_max")}))
