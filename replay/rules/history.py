"""The `history` table of REPLAY.md (change history, issue 13): every document change of the
capture, not only the last one: the rule as this docstring states it, and `history_table`, the
same rule over Arrow (a check for the SQL both engines run: replay/rules/plans.py `history`,
by DuckDB in-process and by Spark).

One row per change (mutation, deletion, expiration, commit) that no rollback undid (the rule
of `documents`: a later ROLLBACK answer of its vbucket to a seqno below its by_seqno undoes
it), keyed by (vbucket, collection_id, key, by_seqno): a change received twice (a stream
re-sent after a reconnect) is one row, the one received last. A commit takes the columns of
the last prepare of its document received before it and not undone (replay/rules/dcp_sync.py),
its `op` stays `commit` and its `state` is `live`. `snap_flags` are those of the snapshot
marker the change arrived under: the last marker of its stream (vbucket and stream id)
before it; null when none came, or a stream end, a stream-request answer or an OSO snapshot
marker came after it. Changes of a dropped collection stay: the
history says what happened.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dcptool.replay.rules import bodies
from dcptool.replay.rules import tables as T
from dcptool.replay.rules.columns import as_numpy, lookup_codes
from dcptool.replay.rules.dcp_sync import FROM_PREPARE

CHANGE_OPS = ("mutation", "deletion", "expiration", "commit")
# rows after which no snapshot marker counts any more (their stream's changes get null flags)
SNAPSHOT_CLOSERS = {"stream_end", "stream_req", "oso_snapshot"}
STATE_OF = {"mutation": "live", "deletion": "deleted", "expiration": "expired", "commit": "live"}
# the capture columns the rule reads (all among dcp_rules.DCP_STATE_COLUMNS; `stream_id` too
# where the capture has it)
HISTORY_COLUMNS = ["vbucket", "collection_id", "key", "by_seqno", "op", "rev_seqno", "cas", "datatype",
                   "item_flags", "expiration", "value_len", "snap_flags", "capture_id", "frame_no", "ts"]


def history_table(t: pa.Table) -> pa.Table:
    """The canonical `history` table from the kept rows (changes and prepares not undone,
    markers, stream ends; any order, `_seq` gives frame order). Works on row numbers of `t`
    and takes each output column once, already in canonical order."""
    vb = as_numpy(t.column("vbucket"), dtype=np.int64)
    seq = as_numpy(t.column("_seq"), dtype=np.int64)
    is_change, is_prep, is_marker, is_end, is_commit = lookup_codes(
        t.column("op"), set(CHANGE_OPS), {"prepare"}, {"snapshot_marker"}, SNAPSHOT_CLOSERS, {"commit"})
    # the snapshot each row is under: the last marker (or closer) of its stream before it
    stream = vb << 17
    if "stream_id" in t.column_names:
        sid = t.column("stream_id")
        stream |= np.where(as_numpy(sid.is_valid(), dtype=bool), as_numpy(sid, fill=0, dtype=np.int64) + 1, 0)
    o = np.lexsort((seq, stream))               # rows in (stream, frame order)
    pos = np.arange(len(o))
    ov = stream[o]
    run_start = np.maximum.accumulate(np.where(np.r_[True, ov[1:] != ov[:-1]], pos, 0))
    closer = np.maximum.accumulate(np.where((is_marker | is_end)[o], pos, -1))
    under = np.full(len(o), -1, np.int64)
    under[o] = np.where(closer >= run_start, o[np.maximum(closer, 0)], -1)    # a row of t, or -1
    flags_col = t.column("snap_flags")
    at = np.maximum(under, 0)
    snap_ok = (under >= 0) & is_marker[at] & as_numpy(flags_col.is_valid(), dtype=bool)[at]
    flags = as_numpy(flags_col, fill=0, dtype=np.int64)[at]

    # documents: (vbucket, collection_id with null first, key rank in bytewise order)
    cid_col = t.column("collection_id")
    cid = np.where(as_numpy(cid_col.is_valid(), dtype=bool), as_numpy(cid_col, fill=0, dtype=np.int64) + 1, 0)
    key_col = t.column("key")
    kenc = pc.dictionary_encode(key_col.combine_chunks() if isinstance(key_col, pa.ChunkedArray) else key_col)
    rank = np.empty(len(kenc.dictionary), np.int64)
    rank[as_numpy(pc.sort_indices(kenc.dictionary), dtype=np.int64)] = np.arange(len(kenc.dictionary))
    kcode = np.append(rank, -1)[as_numpy(kenc.indices, fill=-1, dtype=np.int64)]   # a null key first

    # a commit takes its prepare's columns: the last prepare of the document before it
    src = np.arange(t.num_rows)
    if is_commit.any() and is_prep.any():
        docs = np.flatnonzero(is_change | is_prep)
        d = docs[np.lexsort((seq[docs], kcode[docs], cid[docs], vb[docs]))]
        same = np.r_[False, (vb[d][1:] == vb[d][:-1]) & (cid[d][1:] == cid[d][:-1]) & (kcode[d][1:] == kcode[d][:-1])]
        dpos = np.arange(len(d))
        doc_start = np.maximum.accumulate(np.where(~same, dpos, 0))
        last_prep = np.maximum.accumulate(np.where(is_prep[d], dpos, -1))
        found = is_commit[d] & (last_prep >= doc_start)
        src[d[found]] = d[last_prep[found]]

    # one row per (vbucket, collection_id, key, by_seqno), the one received last; sorted by
    # that key (nulls first), which is the canonical order
    rows = np.flatnonzero(is_change)
    sq_col = t.column("by_seqno")
    sq = as_numpy(sq_col, fill=0, dtype=np.int64)
    sq_ok = as_numpy(sq_col.is_valid(), dtype=bool)
    r = rows[np.lexsort((seq[rows], sq[rows], sq_ok[rows], kcode[rows], cid[rows], vb[rows]))]
    last = np.ones(len(r), bool)
    if len(r) > 1:
        last[:-1] = ~((vb[r][1:] == vb[r][:-1]) & (cid[r][1:] == cid[r][:-1]) & (kcode[r][1:] == kcode[r][:-1])
                      & (sq_ok[r][1:] == sq_ok[r][:-1]) & (sq[r][1:] == sq[r][:-1]))
    r = r[last]
    idx = pa.array(r)
    from_prep = pa.array(src[r])
    ops = t.column("op").take(idx)
    out = {name: (t.column(name).take(from_prep) if name in FROM_PREPARE else t.column(name).take(idx))
           for name in HISTORY_COLUMNS if name != "snap_flags"}
    out["snap_flags"] = pa.array(flags[r], pa.uint32(), mask=~snap_ok[r])
    out["state"] = _states(ops)
    out.update(_bodies(t, from_prep, ops))
    return T.canonical("dcp", "history", pa.table(out), presorted=True)


def _bodies(t: pa.Table, rows: pa.Array, ops) -> dict:
    """The body columns (replay/rules/bodies.py) of the rows taken, one row at a time (this is
    the rule's statement, not an engine): from `raw` when `t` has it (a commit's from the
    prepare it took its columns from; none when it took none), else null."""
    n = len(rows)
    if "raw" not in t.column_names:
        return {"value": pa.nulls(n, pa.binary()), "xattrs": pa.nulls(n, pa.string()),
                "value_json": pa.nulls(n, pa.string())}
    values, xattrs, texts = [], [], []
    raws = t.column("raw").take(rows).to_pylist()
    lens = t.column("value_len").take(rows).to_pylist()
    dts = t.column("datatype").take(rows).to_pylist()
    took = t.column("op").take(rows).to_pylist()
    for raw, vlen, dt, op in zip(raws, lens, dts, took):
        sent = None
        if op != "commit" and raw is not None and vlen is not None and vlen <= len(raw) - 24:
            sent = raw[len(raw) - vlen:]
        v, x = bodies.split(sent, dt) if sent is not None and (dt or 0) & bodies.CODED else (sent, None)
        text = None
        if v is not None and (dt or 0) & 1:
            try:
                text = v.decode("utf-8")
            except UnicodeDecodeError:
                pass
        values.append(v)
        xattrs.append(x)
        texts.append(text)
    return {"value": pa.array(values, pa.binary()), "xattrs": pa.array(xattrs, pa.string()),
            "value_json": pa.array(texts, pa.string())}


def _states(ops) -> pa.Array:
    words = pa.array(list(STATE_OF))
    idx = pc.index_in(ops, value_set=words)
    return pa.array(list(STATE_OF.values())).take(idx)
