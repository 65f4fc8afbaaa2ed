"""The reads of `dcptool trace` in this process (replay/check/trace.py tells the story; the
Spark engine's reads are replay/spark/trace.py): the rows of a few keys, read from the row
groups their key index (replay/store/key_index.py) says may hold them (every row group of a
segment without the index, the `key` column first), the stream rows of a few vbuckets, and
the cluster maps of the segments whose statistics say they can hold one."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from dcptool.replay.rules.topology import local_topology
from dcptool.replay.store import key_index, reader

KEY_COLUMNS = ["capture_id", "frame_no", "ts", "node", "conn", "direction", "op", "vbucket", "cas",
               "collection_id", "key", "by_seqno", "stream_id", "decode_error"]
VB_COLUMNS = ["capture_id", "frame_no", "ts", "node", "conn", "direction", "op", "status", "vbucket",
              "stream_id", "collection_id", "by_seqno", "snap_start", "snap_end", "snap_flags",
              "stream_end_reason", "rollback_seqno", "system_event_id", "req_start_seqno", "decode_error"]
VB_OPS = ("stream_req", "stream_end", "snapshot_marker", "oso_snapshot", "system_event")

# cluster-map candidates (replay/rules/topology.candidate_mask) by row-group statistics
_RESPONSES, _SERVER_REQUEST = (0x81, 0x18), 0x82
_GET_CLUSTER_CONFIG, _NOT_MY_VBUCKET, _CLUSTERMAP_NOTIFICATION = 0xB5, 0x07, 0x01

STATS = {"indexed": 0, "unindexed": 0, "row_groups": 0, "row_groups_read": 0}


def read_where(f, columns: list[str], expr) -> pa.Table:
    """The rows of one segment matching `expr`, in the capture schema (`columns`)."""
    if f.in_progress:
        t = reader.read_file(f, columns)
        return t.filter(expr)
    try:
        dset = ds.dataset(f.path, format="parquet")
        present = [c for c in columns if c in dset.schema.names]
        t = dset.to_table(columns=present, filter=expr)
    except (OSError, pa.ArrowException) as exc:
        raise reader.CaptureError(f"{f.path}: unreadable ({exc})") from exc
    full = reader.capture_schema(f.protocol)
    return reader.conform(t, pa.schema([full.field(c) for c in columns]))


def rows_where(files, columns, expr) -> list[dict]:
    out = []
    for f in files:
        t = read_where(f, columns, expr)
        if t.num_rows:
            out.extend(pylist(t))
    return out


def pylist(t: pa.Table) -> list[dict]:
    if "ts" in t.column_names:
        t = t.set_column(t.column_names.index("ts"), "ts", t.column("ts").cast(pa.int64()))
    return t.to_pylist()


def op_in(ops) -> ds.Expression:
    return pc.field("op").cast(pa.string()).isin(list(ops))


PROBE_GROUPS = 8      # row groups whose probe columns are read at once: memory stays bounded


class Probe:
    """The rows of some row groups of a finished segment where a mask of the probe columns
    holds: `table` (their probe columns), `where` (their row groups), `at` (their indices
    within them). The probe columns are read PROBE_GROUPS row groups at a time and only the
    rows that hit are kept."""

    def __init__(self, f, probe: list[str], mask, groups: list[int] | None):
        full = reader.capture_schema(f.protocol)
        schema = pa.schema([full.field(c) for c in probe])
        self.f, self.pf = f, reader.parquet_file(f, pre_buffer=True)
        md = self.pf.metadata
        todo = list(range(md.num_row_groups)) if groups is None else groups
        STATS["row_groups"] += md.num_row_groups
        self.names = set(self.pf.schema_arrow.names)
        cols = [c for c in probe if c in self.names]
        parts, wheres, ats = [schema.empty_table()], [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        for i in range(0, len(todo), PROBE_GROUPS):
            chunk = todo[i:i + PROBE_GROUPS]
            t = reader.conform(self.pf.read_row_groups(chunk, columns=cols, use_threads=True), schema)
            hit = np.flatnonzero(as_bool(mask(t))) if t.num_rows else np.zeros(0, np.int64)
            sizes = np.array([md.row_group(rg).num_rows for rg in chunk], np.int64)
            ends = np.cumsum(sizes)
            k = np.searchsorted(ends, hit, side="right")
            parts.append(t.take(pa.array(hit, pa.int64())))
            wheres.append(np.asarray(chunk, np.int64)[k])
            ats.append(hit - (ends - sizes)[k])
        self.table = pa.concat_tables(parts)
        self.where, self.at = np.concatenate(wheres), np.concatenate(ats)
        self.hit = np.arange(self.table.num_rows)

    def rows(self, pick: np.ndarray, columns: list[str]) -> list[dict]:
        """The hits `pick` (indices into `table`) with every column of `columns`: those not
        probed are read only from the row groups that hold one, in one read."""
        full = reader.capture_schema(self.f.protocol)
        t = self.table.take(pa.array(pick, pa.int64()))
        rest = [c for c in columns if c not in t.column_names]
        if rest and len(pick):
            chosen = np.unique(self.where[pick])
            STATS["row_groups_read"] += len(chosen)
            md = self.pf.metadata
            sizes = np.array([md.row_group(int(rg)).num_rows for rg in chosen], np.int64)
            starts = np.cumsum(sizes) - sizes
            pos = starts[np.searchsorted(chosen, self.where[pick])] + self.at[pick]
            more = self.pf.read_row_groups([int(x) for x in chosen], use_threads=True,
                                           columns=[c for c in rest if c in self.names])
            more = more.take(pa.array(pos, pa.int64()))
            for c in rest:
                t = t.append_column(full.field(c), more.column(c) if c in more.column_names
                                    else pa.nulls(len(pick), full.field(c).type))
        elif rest:
            t = pa.schema([full.field(c) for c in columns]).empty_table()
        return pylist(reader.conform(t.select(columns), pa.schema([full.field(c) for c in columns])))


def as_bool(arr) -> np.ndarray:
    if isinstance(arr, np.ndarray):
        return arr
    arr = pc.fill_null(arr, False)
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    return arr.to_numpy(zero_copy_only=False).astype(bool, copy=False)


def _whole(f, columns: list[str], mask) -> list[dict]:
    """The rows of an in-progress segment (read whole) where `mask` holds."""
    t = reader.read_file(f, columns)
    return pylist(t.filter(mask(t)))


def _unreadable(f, exc) -> reader.CaptureError:
    return reader.CaptureError(f"{f.path}: unreadable ({exc})")


def key_groups(f, keys: list[bytes], vbuckets: set[int] | None) -> list[int] | None:
    """The row groups of a segment that may hold the keys (None: all, no index)."""
    if f.in_progress:
        return None
    try:
        groups = key_index.row_groups_for(f.path, reader.footer(f.path), keys, vbuckets)
    except (OSError, ValueError, pa.ArrowException):
        groups = None     # a filter that cannot be read: the segment is read whole
    STATS["indexed" if groups is not None else "unindexed"] += 1
    return groups




def key_rows(files, keys: list[bytes], vbuckets: set[int] | None = None) -> list[dict]:
    """The frames of the keys (any direction and op: the caller keeps what it needs; with
    `vbuckets`, in those only), of the row groups their key index (and vbucket statistics)
    say may hold them: the `key` column first, the others only of the row groups with a hit."""
    want = pa.array(keys, pa.binary())

    def mask(t):
        return pc.is_in(t.column("key"), value_set=want)

    out = []
    for f in files:
        try:
            if f.in_progress:
                out.extend(_whole(f, KEY_COLUMNS, mask))
                continue
            p = Probe(f, ["key"], mask, key_groups(f, keys, vbuckets))
            out.extend(p.rows(np.arange(len(p.hit)), KEY_COLUMNS))
        except (OSError, pa.ArrowException) as exc:
            raise _unreadable(f, exc) from exc
    # the rows of the vbuckets only, whatever the layout of the row groups (as on Spark)
    return out if not vbuckets else [r for r in out if r["vbucket"] in vbuckets]


VB_PROBE = ["vbucket", "op", "direction", "stream_id", "snap_end"]
MARKERS = ("snapshot_marker", "oso_snapshot")


def vbucket_rows(files, vbuckets: set[int], ranks: dict, anchors: list[tuple] | None = None) -> list[dict]:
    """The stream frames (VB_OPS, both directions) of the vbuckets. With `anchors` (the
    (capture order, vbucket) of the key's changes), of the inbound snapshot markers only
    those the story needs: the last of each stream before each anchor, and the one with the
    highest end. The probe columns (VB_PROBE) are read for every row group the vbucket
    statistics take in, the others only from the row groups holding a frame kept."""
    if not vbuckets:
        return []
    vbs = pa.array(sorted(vbuckets), pa.uint16())
    ops = pa.array(VB_OPS, pa.string())

    def mask(t):      # the op (a dictionary) only of the rows of the vbuckets: 10x cheaper
        rows = np.flatnonzero(as_bool(pc.is_in(t.column("vbucket"), value_set=vbs)))
        hit = as_bool(pc.is_in(t.column("op").take(pa.array(rows)).cast(pa.string()), value_set=ops))
        out = np.zeros(t.num_rows, bool)
        out[rows[hit]] = True
        return out

    out, probes = [], []
    for f in files:
        try:
            if f.in_progress:
                out.extend(_whole(f, VB_COLUMNS, mask))
                continue
            groups = [rg for rg in range(reader.footer(f.path).num_row_groups)
                      if _stat_may(f, rg, "vbucket", lambda lo, hi: any(lo <= v <= hi for v in vbuckets))]
            probes.append(Probe(f, VB_PROBE, mask, groups))
        except (OSError, pa.ArrowException) as exc:
            raise _unreadable(f, exc) from exc
    for p, pick in zip(probes, markers_needed(probes, ranks, anchors)):
        try:
            out.extend(p.rows(pick, VB_COLUMNS))
        except (OSError, pa.ArrowException) as exc:
            raise _unreadable(p.f, exc) from exc
    return out


def markers_needed(probes: list[Probe], ranks: dict, anchors) -> list[np.ndarray]:
    """Per probe, the hits to read whole: every one but inbound snapshot markers, and of
    those, for each anchor, the markers of its vbucket in its row group and the last one
    before that row group (per stream), and the one with the highest end. Rows are in
    frame order (CAPTURE_FORMAT.md), so the last marker before a change is among them and
    the story is the same as with every marker. All of them without anchors, or when an
    anchor's row group is not told by the frame_no statistics."""
    everything = [np.arange(len(p.hit)) for p in probes]
    if anchors is None:
        return everything
    groups = []
    for order, vb in anchors:
        g = _group_of(probes, ranks, order)
        if g is None:
            return everything
        groups.append((g, vb))
    keep: list[set] = [set() for _ in probes]
    markers: dict = {}      # (vbucket, stream id) -> [(position, probe, hit index, snap end)]
    for i, p in enumerate(probes):
        rank = ranks.get(p.f.capture_id, len(ranks))
        hits = p.table.to_pydict()
        for j in range(len(p.hit)):
            if hits["op"][j] in MARKERS and hits["direction"][j] == "in":
                pos = (rank, p.f.segment, int(p.where[j]), int(p.at[j]))
                markers.setdefault((hits["vbucket"][j], hits["stream_id"][j]), []).append(
                    (pos, i, j, hits["snap_end"][j]))
            else:
                keep[i].add(j)
    for (vb, _), ms in markers.items():
        ms.sort(key=lambda m: m[0])
        for g, avb in groups:
            if avb != vb:
                continue
            before = [m for m in ms if m[0][:3] < g]       # (rank, segment, row group) < the anchor's
            for m in before[-1:] + [m for m in ms if m[0][:3] == g]:
                keep[m[1]].add(m[2])
        ends = [m for m in ms if m[3] is not None]
        if ends:
            top = max(ends, key=lambda m: m[3])
            keep[top[1]].add(top[2])
    return [np.array(sorted(k), np.int64) for k in keep]


LAST = 1 << 62


def _group_of(probes: list[Probe], ranks: dict, order: tuple) -> tuple | None:
    """(capture rank, segment, row group) holding the frame at capture order `order`, by
    the frame_no statistics of the row groups; a frame no finished row group holds is in its
    capture's in-progress segment, after all of them: (rank, LAST, LAST). None when a row
    group has no statistics to tell."""
    rank, frame = order
    for p in probes:
        if ranks.get(p.f.capture_id, len(ranks)) != rank:
            continue
        md = p.pf.metadata
        i = reader.leaf_index(md, "frame_no")
        if i is None:
            return None
        for rg in range(md.num_row_groups):
            st = md.row_group(rg).column(i).statistics
            if st is None or not st.has_min_max:
                return None
            if st.min <= frame <= st.max:
                return rank, p.f.segment, rg
    return rank, LAST, LAST


def _stat_may(f, rg: int, column: str, test) -> bool:
    """Whether row group `rg`'s min/max of `column` may pass `test(lo, hi)` (True when the
    footer has no statistics for it)."""
    md = reader.footer(f.path)
    i = reader.leaf_index(md, column)
    if i is None:
        return False        # a column the segment lacks is all null: it passes no test
    st = md.row_group(rg).column(i).statistics
    if st is None or not st.has_min_max:
        return st is None or st.null_count != md.row_group(rg).num_rows
    return test(st.min, st.max)


def may_hold_cluster_maps(f) -> bool:
    """Whether a segment can hold a cluster map (topology.candidate_mask), by the min/max of
    magic, opcode and status of its row groups."""
    if f.in_progress:
        return True
    for rg in range(reader.footer(f.path).num_row_groups):
        def has(column, values):
            return _stat_may(f, rg, column, lambda lo, hi: any(lo <= v <= hi for v in values))
        if has("magic", _RESPONSES) and ((has("opcode", [_GET_CLUSTER_CONFIG]) and has("status", [0]))
                                         or has("status", [_NOT_MY_VBUCKET])):
            return True
        if has("magic", [_SERVER_REQUEST]) and has("opcode", [_CLUSTERMAP_NOTIFICATION]):
            return True
    return False


def topology(files, ranks: dict) -> list[dict]:
    """The cluster maps of the captures (replay/rules/topology.py), of the segments that can
    hold one."""
    maybe = [f for f in files if may_hold_cluster_maps(f)]
    if not maybe:
        return []
    return pylist(local_topology(maybe, ranks))
