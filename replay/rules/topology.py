"""The `topology` table (REPLAY.md): every cluster map a DCP capture holds, one row per
(config revision, vbucket) with the vbucket's active node and replicas.

A cluster config reaches a capture as the value of an `in` frame: a GET_CLUSTER_CONFIG
(0xb5) success response, a NOT_MY_VBUCKET (0x07) response of any request whose body is a
config, or a cluster-map change notification (server request 0x82, opcode 0x01) that
carries one. Frames are taken in replay order (capture rank, frame_no); each distinct
(revEpoch, rev) counts once, where it was first seen. `$HOST` in a config is the host of
the frame's `node` (the address the connection went to); in a version 1 capture, which has
no `node`, it stays `$HOST`. A value that is not a bucket config (an empty NOT_MY_VBUCKET
body, an error JSON) is no row.

Both engines call `topology_table` on the candidate frames (`CANDIDATE_COLUMNS`, selected by
`candidate_mask` locally and by `SPARK_FILTER` in Spark, which keep the same rows): configs
are few, so the whole table is built in one place, never per vbucket group."""

from __future__ import annotations

from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dcptool.protocol.dcp.wire import cluster_config, snappy
from dcptool.protocol.dcp.wire.frames import parse_frame
from dcptool.replay.rules import tables as T
from dcptool.replay.rules.columns import as_numpy
from dcptool.replay.store import reader
from dcptool.replay.store.schema import capture_schema

GET_CLUSTER_CONFIG = 0xB5
NOT_MY_VBUCKET = 0x07
CLUSTERMAP_NOTIFICATION = 0x01
RESPONSE_MAGICS = (0x81, 0x18)
SERVER_REQUEST = 0x82
SNAPPY = 0x02

FILTER_COLUMNS = ["capture_id", "frame_no", "direction", "magic", "opcode", "status"]
CANDIDATE_COLUMNS = ["capture_id", "frame_no", "ts", "node", "magic", "opcode", "status", "datatype", "raw"]
VIA = {"get_cluster_config": "get_cluster_config", "nmvb": "not_my_vbucket",
       "notification": "clustermap_notification"}

# the same rows as candidate_mask, in Spark SQL (unsigned columns are widened, never negative)
SPARK_FILTER = (
    "direction = 'in' AND raw IS NOT NULL AND ("
    f"(magic IN ({RESPONSE_MAGICS[0]}, {RESPONSE_MAGICS[1]}) AND opcode = {GET_CLUSTER_CONFIG} AND status = 0)"
    f" OR (magic IN ({RESPONSE_MAGICS[0]}, {RESPONSE_MAGICS[1]}) AND status = {NOT_MY_VBUCKET})"
    f" OR (magic = {SERVER_REQUEST} AND opcode = {CLUSTERMAP_NOTIFICATION}))")


def candidate_mask(t: pa.Table) -> np.ndarray:
    """Frames of `t` (FILTER_COLUMNS) that may carry a cluster config."""
    n = t.num_rows
    inbound = as_numpy(pc.equal(t.column("direction").cast(pa.string()), "in"), fill=False, dtype=bool)
    # a null never matches (as in Spark): filled with values the tests below never accept
    magic = as_numpy(t.column("magic"), fill=0, dtype=np.int64)
    opcode = as_numpy(t.column("opcode"), fill=0xFF, dtype=np.int64)
    status = as_numpy(t.column("status"), fill=0xFFFF, dtype=np.int64)
    response = np.isin(magic, RESPONSE_MAGICS)
    hit = ((response & (opcode == GET_CLUSTER_CONFIG) & (status == 0))
           | (response & (status == NOT_MY_VBUCKET))
           | ((magic == SERVER_REQUEST) & (opcode == CLUSTERMAP_NOTIFICATION)))
    return inbound & hit if n else np.zeros(0, bool)


def _via(magic: int, opcode: int, status) -> str:
    if magic == SERVER_REQUEST:
        return VIA["notification"]
    if status == NOT_MY_VBUCKET:
        return VIA["nmvb"]
    return VIA["get_cluster_config"]


def _host_of(node: str | None) -> str:
    if not node:
        return cluster_config.HOST_PLACEHOLDER
    host, sep, port = node.rpartition(":")
    return host if sep and port.isdigit() and host else node


MAX_CONFIG = 64 << 20   # bytes a decompressed config may have (a 1024-vbucket map is ~30 KB)


def config_of(raw: bytes | None, node: str | None) -> cluster_config.ClusterConfig | None:
    """The bucket config a frame's value carries, or None (no value, not a config)."""
    if not raw or len(raw) < 24:
        return None
    try:
        frame = parse_frame(raw, 0, len(raw))
        value = frame.value
        if frame.datatype & SNAPPY and value:
            value = snappy.decompress(value, MAX_CONFIG)   # a hostile preamble: ValueError, no allocation
        if not value:
            return None
        return cluster_config.parse(value, _host_of(node))
    except Exception:  # noqa: BLE001 - a value that does not parse (any way) is no config
        return None


def topology_rows(frames: Iterable[dict]) -> list[dict]:
    """Rows of `topology` from candidate frames given in replay order (dicts with
    CANDIDATE_COLUMNS; `ts` as int nanoseconds)."""
    seen: set[tuple[int, int]] = set()
    out: list[dict] = []
    for f in frames:
        cfg = config_of(f["raw"], f["node"])
        if cfg is None or cfg.key in seen:
            continue
        seen.add(cfg.key)
        via = _via(f["magic"], f["opcode"], f["status"])
        servers = cfg.server_list
        for vb, row in enumerate(cfg.vbucket_map):
            if vb > 0xFFFF:
                break
            out.append(dict(rev_epoch=cfg.rev_epoch, rev=cfg.rev, capture_id=f["capture_id"],
                            frame_no=f["frame_no"], ts=f["ts"], node=f["node"], via=via, vbucket=vb,
                            active=servers[row[0]] if row[0] >= 0 else None,
                            replicas=[servers[i] for i in row[1:] if i >= 0]))
    return out


def topology_table(candidates: pa.Table, ranks: dict[str, int]) -> pa.Table:
    """The canonical `topology` table from the candidate frames (CANDIDATE_COLUMNS, any
    order; `ts` a timestamp or int64 nanoseconds, unsigned columns possibly widened)."""
    i = candidates.column_names.index("ts")
    if pa.types.is_timestamp(candidates.column(i).type):
        candidates = candidates.set_column(i, "ts", candidates.column(i).cast(pa.int64()))
    rows = candidates.to_pylist()
    rows.sort(key=lambda r: (ranks.get(r["capture_id"], len(ranks)), r["frame_no"]))
    out = topology_rows(rows)
    schema = T.schema_of("dcp", "topology")
    cols = {}
    for fld in schema:
        vals = [r[fld.name] for r in out]
        typ = pa.int64() if pa.types.is_timestamp(fld.type) else fld.type
        cols[fld.name] = pa.array(vals, typ).cast(fld.type)
    return T.canonical("dcp", "topology", pa.table(cols, schema=schema))


def _segment_candidates(f, cols: list[str], as_of) -> Iterable[pa.Table]:
    """The candidate frames of one segment: the small columns are read first, `raw` only
    for the row groups that hold a candidate."""
    groups: list[int | None] = [None]
    if not f.in_progress:
        groups = list(range(reader.footer(f.path).num_row_groups))
    for rg in groups:
        small = (reader.read_file(f, cols) if rg is None else
                 pa.concat_tables(list(reader.stream_file(f, cols, 1 << 20, False, [rg]))))
        keep = candidate_mask(small)
        if as_of is not None and keep.any():
            keep &= as_of.mask(small)
        if not keep.any():
            continue
        rest = [c for c in CANDIDATE_COLUMNS if c not in cols]
        more = (reader.read_file(f, rest) if rg is None else
                pa.concat_tables(list(reader.stream_file(f, rest, 1 << 20, False, [rg]))))
        mask = pa.array(keep)
        t = small.filter(mask)
        for c in rest:
            t = t.append_column(c, more.column(c).filter(mask))
        yield t.select(CANDIDATE_COLUMNS)


def _run_candidates(run, cols: list[str], as_of) -> Iterable[pa.Table]:
    """The candidate frames of a run of small segments (reader.runs), read together."""
    small = reader.read_segments(run, cols)
    keep = candidate_mask(small)
    if as_of is not None and keep.any():
        keep &= as_of.mask(small)
    if not keep.any():
        return
    rest = [c for c in CANDIDATE_COLUMNS if c not in cols]
    more = reader.read_segments(run, rest) if rest else small
    mask = pa.array(keep)
    t = small.filter(mask)
    for c in rest:
        t = t.append_column(c, more.column(c).filter(mask))
    yield t.select(CANDIDATE_COLUMNS)


def local_topology(files, ranks: dict[str, int] | None = None, as_of=None) -> pa.Table:
    """`topology` of DCP captures, read in bounded memory (the in-process engine)."""
    from dcptool.replay.rules.as_of import AS_OF_COLUMNS
    ranks = reader.capture_ranks(files) if ranks is None else ranks
    cols = list(dict.fromkeys(FILTER_COLUMNS + (AS_OF_COLUMNS if as_of else [])))
    parts: list[pa.Table] = []
    for group, streamable in reader.capture_groups(files):   # runs of small segments in one scan
        for run in (reader.runs(group, 1 << 20) if streamable else ([f] for f in group)):
            parts.extend(_run_candidates(run, cols, as_of or None) if len(run) > 1
                         else _segment_candidates(run[0], cols, as_of or None))
    cap = capture_schema("dcp")
    empty = pa.schema([cap.field(c) for c in CANDIDATE_COLUMNS]).empty_table()
    return topology_table(pa.concat_tables(parts) if parts else empty, ranks)


def spark_dataframe(df, spark_schema, to_spark_arrow, ranks: dict[str, int]):
    """`topology` as a Spark DataFrame from the frames DataFrame `df` (replay/spark/engine.py
    read_frames, Spark types): the candidates go to one partition, where the same
    `topology_table` builds it. `spark_schema` and `to_spark_arrow` are the engine's type
    mappings (passed in: this module does not import the engine)."""
    schema = T.schema_of("dcp", "topology")

    def build(batches):
        parts = list(batches)
        if not parts:
            return
        t = topology_table(pa.Table.from_batches(parts), ranks)
        yield from to_spark_arrow(t).to_batches()

    return (df.filter(SPARK_FILTER).select(*CANDIDATE_COLUMNS).repartition(1)
              .mapInArrow(build, spark_schema(schema)))
