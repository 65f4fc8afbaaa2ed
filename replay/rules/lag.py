"""The `lag` table (REPLAY.md): a DCP capture's recorded lag, one row per lag poll and vbucket.

A lag poll is a GET_ALL_VB_SEQNOS request the capture sent with a vbucket state in its
extras (state 1, active: what `--lag-interval` sends, capture/lag.py) and its success answer
(matched by capture, connection and opaque): (vbucket, high seqno) pairs of the node's active
vbuckets. The handshake's own GET_ALL_VB_SEQNOS (no extras: every vbucket of the node, replicas
included on a real cluster) is no poll. For each pair of a vbucket the capture streams:
`seqno` is where the vbucket's stream stood when the answer arrived, the seqno of the last
change received before it (mutation, deletion, expiration, prepare, commit, abort, system
event, seqno advanced: `in` frames with a `by_seqno`) or, before any, the start seqno of its
last STREAM_REQ (none for a request from the latest, flag 0x40 of `--from now`: where such
a stream starts is not known before its first change, so a poll before it has no row for it);
`lag_items` = max(0, high_seqno - seqno). Frames are ordered by (capture rank,
frame_no), across every connection and node of the capture.

Both engines call `lag_table` on the candidate frames (`CANDIDATE_COLUMNS`, `raw` only for
GET_ALL_VB_SEQNOS frames): locally `local_lag` reads them (raw only of the row groups holding
a poll), in Spark `spark_dataframe` filters the same rows into one partition. Synapse's `lag`
has the same two shapes (`local_synapse_lag`, `spark_synapse_dataframe`): each engine's side is
one helper for both protocols (`_from_candidates`, `_one_partition`), given the columns and the
table function."""

from __future__ import annotations

import struct
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dcptool.replay.rules import tables as T
from dcptool.replay.rules.columns import as_numpy
from dcptool.replay.store import reader
from dcptool.replay.store.schema import capture_schema

GET_ALL_VB_SEQNOS = 0x48
REQUEST, RESPONSE = 0x80, 0x81
ACTIVE = 1
_PAIR = struct.Struct(">HQ")

SMALL_COLUMNS = ["capture_id", "frame_no", "ts", "node", "conn", "direction", "magic", "opcode", "status",
                 "opaque", "vbucket", "op", "by_seqno", "req_start_seqno", "req_flags"]
FROM_LATEST = 0x40       # STREAM_REQ flag: start at the vbucket's high seqno (--from now)
CANDIDATE_COLUMNS = SMALL_COLUMNS + ["raw"]

# the same rows as candidate_mask, in Spark SQL (raw kept only for the polls: see spark_dataframe)
SPARK_FILTER = (f"opcode = {GET_ALL_VB_SEQNOS} OR (direction = 'in' AND magic = {REQUEST} AND "
                "vbucket IS NOT NULL AND by_seqno IS NOT NULL) OR (direction = 'out' AND op = 'stream_req' "
                "AND vbucket IS NOT NULL AND req_start_seqno IS NOT NULL)")


def _masks(t: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(polls, changes, stream requests) of `t` (SMALL_COLUMNS); a null never matches."""
    direction = t.column("direction").cast(pa.string())
    inbound = as_numpy(pc.equal(direction, "in"), fill=False, dtype=bool)
    outbound = as_numpy(pc.equal(direction, "out"), fill=False, dtype=bool)
    opcode = as_numpy(t.column("opcode"), fill=0xFF, dtype=np.int64)
    magic = as_numpy(t.column("magic"), fill=0, dtype=np.int64)
    vb_ok = as_numpy(pc.is_valid(t.column("vbucket")), fill=False, dtype=bool)
    polls = opcode == GET_ALL_VB_SEQNOS
    changes = inbound & (magic == REQUEST) & vb_ok & as_numpy(pc.is_valid(t.column("by_seqno")), fill=False,
                                                               dtype=bool)
    op = t.column("op").cast(pa.string())
    reqs = (outbound & vb_ok & as_numpy(pc.equal(op, "stream_req"), fill=False, dtype=bool)
            & as_numpy(pc.is_valid(t.column("req_start_seqno")), fill=False, dtype=bool))
    return polls, changes, reqs


def candidate_mask(t: pa.Table) -> np.ndarray:
    polls, changes, reqs = _masks(t)
    return polls | changes | reqs


def _extras_state(raw: bytes | None) -> int | None:
    if not raw or len(raw) < 28 or raw[4] not in (4, 8):
        return None
    return int.from_bytes(raw[24:28], "big")


def _pairs(raw: bytes | None) -> list[tuple[int, int]]:
    """The (vbucket, high seqno) pairs of a GET_ALL_VB_SEQNOS answer (checked lengths)."""
    if not raw or len(raw) < 24:
        return []
    ext, klen, blen = raw[4], int.from_bytes(raw[2:4], "big"), int.from_bytes(raw[8:12], "big")
    value = raw[24 + ext + klen:24 + blen]
    if len(raw) < 24 + blen or len(value) % _PAIR.size:
        return []
    return [(vb, seq if seq < 1 << 63 else seq - (1 << 64)) for vb, seq in _PAIR.iter_unpack(value)]


def _order(t: pa.Table, ranks: dict[str, int]) -> np.ndarray:
    """(capture rank, frame_no) as one int64 per row."""
    cid = t.column("capture_id").cast(pa.string())
    uniq = pc.unique(cid)
    rank_of = np.array([ranks.get(c, len(ranks)) for c in uniq.to_pylist()] or [0], dtype=np.int64)
    idx = as_numpy(pc.index_in(cid, value_set=uniq), fill=0, dtype=np.int64)
    return rank_of[idx] * (1 << 40) + as_numpy(t.column("frame_no"), fill=0, dtype=np.int64)


def _poll_rows(t: pa.Table, order: np.ndarray, polls: np.ndarray) -> list[dict]:
    """One dict per (answered active-state poll, vbucket pair), in frame order."""
    idx = np.nonzero(polls)[0]
    sub = t.select(["capture_id", "frame_no", "ts", "node", "conn", "direction", "magic", "status", "opaque",
                    "raw"]).take(pa.array(idx, pa.int64())).to_pylist()
    asked: set = set()
    out = []
    for i, r in sorted(zip(idx.tolist(), sub), key=lambda p: order[p[0]]):
        conv = (r["capture_id"], r["conn"], r["opaque"])
        if r["direction"] == "out" and r["magic"] == REQUEST:
            if _extras_state(r["raw"]) == ACTIVE:
                asked.add(conv)
        elif r["direction"] == "in" and r["magic"] == RESPONSE and r["status"] == 0 and conv in asked:
            asked.discard(conv)
            for vb, high in _pairs(r["raw"]):
                out.append(dict(order=int(order[i]), ts=r["ts"], node=r["node"], vbucket=vb, high_seqno=high,
                                capture_id=r["capture_id"], frame_no=r["frame_no"]))
    return out


def lag_rows(t: pa.Table, ranks: dict[str, int]) -> list[dict]:
    """Rows of `lag` (not yet canonical) from candidate frames in any order."""
    if t.num_rows == 0:
        return []
    order = _order(t, ranks)
    polls, changes, reqs = _masks(t)
    rows = _poll_rows(t, order, polls)
    if not rows:
        return []
    vb = as_numpy(t.column("vbucket"), fill=0, dtype=np.int64)
    latest = reqs & ((as_numpy(t.column("req_flags"), fill=0, dtype=np.int64) & FROM_LATEST) != 0)
    seq = np.where(changes, as_numpy(t.column("by_seqno"), fill=0, dtype=np.int64),
                   np.where(latest, -1, as_numpy(t.column("req_start_seqno"), fill=0, dtype=np.int64)))
    pos = np.nonzero(changes | reqs)[0]
    pos = pos[np.lexsort((order[pos], vb[pos]))]
    pvb, pkey, pseq = vb[pos], order[pos], seq[pos]
    uv, first = np.unique(pvb, return_index=True)
    starts = {int(v): (int(a), int(b)) for v, a, b in zip(uv, first, np.append(first[1:], len(pvb)))}
    out = []
    for r in rows:
        span = starts.get(r["vbucket"])
        if span is None:         # a vbucket this capture does not stream
            continue
        a, b = span
        j = a + int(np.searchsorted(pkey[a:b], r["order"], side="left")) - 1
        if j < a or pseq[j] < 0:     # polled before its stream was asked for, or asked from the
            continue                 # latest (--from now) and no change of it came yet
        r["seqno"] = int(pseq[j])
        r["lag_items"] = max(0, r["high_seqno"] - r["seqno"])
        out.append(r)
    return out


def lag_table(candidates: pa.Table, ranks: dict[str, int]) -> pa.Table:
    """The canonical `lag` table from the candidate frames (CANDIDATE_COLUMNS, any order;
    `ts` a timestamp or int64 nanoseconds, unsigned columns possibly widened)."""
    i = candidates.column_names.index("ts")
    if pa.types.is_timestamp(candidates.column(i).type):
        candidates = candidates.set_column(i, "ts", candidates.column(i).cast(pa.int64()))
    return _lag_of_rows("dcp", lag_rows(candidates, ranks))


def _lag_of_rows(protocol: str, rows: list[dict]) -> pa.Table:
    """The canonical `lag` of `protocol` from its rows (dicts; `ts` as int64 nanoseconds)."""
    schema = T.schema_of(protocol, "lag")
    cols = {}
    for fld in schema:
        typ = pa.int64() if pa.types.is_timestamp(fld.type) else fld.type
        cols[fld.name] = pa.array([r[fld.name] for r in rows], typ).cast(fld.type)
    return T.canonical(protocol, "lag", pa.table(cols, schema=schema))


def _file_candidates(f, as_of) -> Iterable[pa.Table]:
    """The candidate frames of one segment; `raw` only of the row groups that hold a poll."""
    groups = [None] if f.in_progress else list(range(reader.footer(f.path).num_row_groups))
    from dcptool.replay.rules.as_of import AS_OF_COLUMNS
    cols = list(dict.fromkeys(SMALL_COLUMNS + (AS_OF_COLUMNS if as_of else [])))
    for rg in groups:
        def read(c):
            return (reader.read_file(f, c) if rg is None else
                    pa.concat_tables(list(reader.stream_file(f, c, 1 << 20, False, [rg]))))
        small = read(cols)
        polls, changes, reqs = _masks(small)
        keep = polls | changes | reqs
        if as_of is not None and keep.any():
            keep &= as_of.mask(small)
            polls &= keep
        if not keep.any():
            continue
        raw = (read(["raw"]).column("raw") if polls.any() else pa.nulls(small.num_rows, pa.binary()))
        raw = pc.if_else(pa.array(polls), raw, pa.scalar(None, pa.binary()))
        mask = pa.array(keep)
        yield small.select(SMALL_COLUMNS).append_column("raw", raw).filter(mask)


def _from_candidates(protocol: str, columns: list[str], table_fn, parts: list[pa.Table],
                     ranks: dict[str, int]) -> pa.Table:
    """In-process: `table_fn(candidates, ranks)` over the candidate parts (`columns`) as one
    table in the capture's types (an empty one when there are none)."""
    cap = capture_schema(protocol)
    empty = pa.schema([cap.field(c) for c in columns]).empty_table()
    parts = [p.cast(empty.schema) if p.schema != empty.schema else p for p in parts]
    return table_fn(pa.concat_tables(parts) if parts else empty, ranks)


def _one_partition(df, protocol: str, where: str, columns: list[str], table_fn, ranks: dict[str, int],
                   spark_schema, to_spark_arrow):
    """In Spark: the rows of the frames DataFrame `df` that match `where`, with `columns` (SQL
    expressions), in one partition, where `table_fn(candidates, ranks)` builds `lag`.
    `spark_schema` and `to_spark_arrow` are the engine's type mappings (this module does not
    import the engine)."""
    schema = T.schema_of(protocol, "lag")

    def build(batches):
        parts = list(batches)
        if not parts:
            return
        yield from to_spark_arrow(table_fn(pa.Table.from_batches(parts), ranks)).to_batches()

    return df.filter(where).selectExpr(*columns).repartition(1).mapInArrow(build, spark_schema(schema))


def local_lag(files, ranks: dict[str, int] | None = None, as_of=None) -> pa.Table:
    """`lag` of DCP captures (the in-process engine)."""
    ranks = reader.capture_ranks(files) if ranks is None else ranks
    parts = [t for f in files for t in _file_candidates(f, as_of or None)]
    return _from_candidates("dcp", CANDIDATE_COLUMNS, lag_table, parts, ranks)


def spark_dataframe(df, spark_schema, to_spark_arrow, ranks: dict[str, int]):
    """`lag` as a Spark DataFrame from the frames DataFrame `df` (replay/spark/engine.py
    read_frames): the candidate frames, `raw` only of the polls."""
    cols = SMALL_COLUMNS + [f"CASE WHEN opcode = {GET_ALL_VB_SEQNOS} THEN raw END AS raw"]
    return _one_partition(df, "dcp", SPARK_FILTER, cols, lag_table, ranks, spark_schema, to_spark_arrow)


# ----------------------------------------------------------------------------- Synapse
# `lag` of a Synapse capture: one row per POSITION received, against the token of the last
# RDATA row of the same stream and instance received before it (a row in a `batch` has no
# token of its own and does not count); lag_tokens = max(0, position - rdata_token), null
# (with rdata_token) when no RDATA of that stream and instance came before.

SYN_COLUMNS = ["capture_id", "frame_no", "ts", "node", "direction", "decode_error", "command", "stream",
               "instance", "token", "batch", "new_token"]
SYN_SPARK_FILTER = ("direction = 'in' AND decode_error IS NULL AND stream IS NOT NULL AND "
                    "((command = 'RDATA' AND token IS NOT NULL AND NOT coalesce(batch, false)) OR "
                    "(command = 'POSITION' AND new_token IS NOT NULL))")


def synapse_mask(t: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(POSITIONs, RDATA rows with a token) of `t` (SYN_COLUMNS): received, decoded."""
    inbound = as_numpy(pc.equal(t.column("direction").cast(pa.string()), "in"), fill=False, dtype=bool)
    ok = inbound & as_numpy(pc.is_null(t.column("decode_error")), fill=False, dtype=bool) \
        & as_numpy(pc.is_valid(t.column("stream")), fill=False, dtype=bool)
    command = t.column("command").cast(pa.string())
    pos = ok & as_numpy(pc.equal(command, "POSITION"), fill=False, dtype=bool) \
        & as_numpy(pc.is_valid(t.column("new_token")), fill=False, dtype=bool)
    rdata = ok & as_numpy(pc.equal(command, "RDATA"), fill=False, dtype=bool) \
        & as_numpy(pc.is_valid(t.column("token")), fill=False, dtype=bool) \
        & ~as_numpy(t.column("batch"), fill=False, dtype=bool)
    return pos, rdata


def synapse_lag_table(candidates: pa.Table, ranks: dict[str, int]) -> pa.Table:
    """The canonical Synapse `lag` table from frames (SYN_COLUMNS, any order)."""
    t = candidates
    i = t.column_names.index("ts")
    if pa.types.is_timestamp(t.column(i).type):
        t = t.set_column(i, "ts", t.column(i).cast(pa.int64()))
    out: list[dict] = []
    if t.num_rows:
        pos, rdata = synapse_mask(t)
        order = _order(t, ranks)
        key = pc.binary_join_element_wise(t.column("stream").cast(pa.string()),
                                          t.column("instance").cast(pa.string()), "\x00")
        uniq = pc.unique(key)
        code = as_numpy(pc.index_in(key, value_set=uniq), fill=-1, dtype=np.int64)
        token = as_numpy(t.column("token"), fill=0, dtype=np.int64)
        ri = np.nonzero(rdata)[0]
        ri = ri[np.lexsort((order[ri], code[ri]))]
        uc, first = np.unique(code[ri], return_index=True)
        spans = {int(c): (int(a), int(b)) for c, a, b in zip(uc, first, np.append(first[1:], len(ri)))}
        pi = np.nonzero(pos)[0]
        rows = t.select(["capture_id", "frame_no", "ts", "node", "stream", "instance", "new_token"]) \
            .take(pa.array(pi, pa.int64())).to_pylist()
        for p, r in zip(pi.tolist(), rows):
            a, b = spans.get(int(code[p]), (0, 0))
            j = a + int(np.searchsorted(order[ri[a:b]], order[p], side="left")) - 1
            rd = int(token[ri[j]]) if j >= a else None
            out.append(dict(ts=r["ts"], node=r["node"], stream=r["stream"], instance=r["instance"],
                            position=r["new_token"], rdata_token=rd,
                            lag_tokens=None if rd is None else max(0, r["new_token"] - rd),
                            capture_id=r["capture_id"], frame_no=r["frame_no"]))
    return _lag_of_rows("synapse", out)


def local_synapse_lag(files, ranks: dict[str, int] | None = None) -> pa.Table:
    """Synapse `lag` (the in-process engine), read part by part, keeping only candidates."""
    ranks = reader.capture_ranks(files) if ranks is None else ranks
    parts = []
    for part in reader.iter_capture_tables(files, SYN_COLUMNS):
        part = part.select(SYN_COLUMNS)
        pos, rdata = synapse_mask(part)
        if (pos | rdata).any():
            parts.append(part.filter(pa.array(pos | rdata)))
    return _from_candidates("synapse", SYN_COLUMNS, synapse_lag_table, parts, ranks)


def spark_synapse_dataframe(df, spark_schema, to_spark_arrow, ranks: dict[str, int]):
    """Synapse `lag` in Spark: the candidates in one partition, the same `synapse_lag_table`."""
    cols = [f"`{c}`" for c in SYN_COLUMNS]
    return _one_partition(df, "synapse", SYN_SPARK_FILTER, cols, synapse_lag_table, ranks, spark_schema,
                          to_spark_arrow)
