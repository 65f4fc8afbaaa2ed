"""The playback source of `dcptool serve dcp|synapse --from CAPTURE`: reads captures (via the
store's reader) and hands the protocol's playback servers plain bytes and integers.

DCP: per vbucket, every recorded stream request (the `out` STREAM_REQ) with its recorded
answer and the `in` stream frames that followed on that stream (markers, mutations,
deletions, expirations, system events, seqno advanced, prepares, commits, aborts, OSO
markers, the stream end), in recorded order, as one bytes blob per stream with numpy
arrays of frame offsets, mono_ns, global order, opcode, by_seqno and snap_start; plus the
recorded GET_ALL_VB_SEQNOS answers and failover logs. Synapse: the `in` lines of each
recorded connection that a server sends on a replication stream (POSITION, RDATA and the
other server commands except SERVER, PING and ERROR), with their mono_ns.

Memory: the raw bytes of the recorded stream frames (or lines) are held in memory, plus
about 40 bytes per frame; a capture is read in row batches, but the frames it keeps are
not bounded, so a capture to play back should fit in memory (1M 128-byte frames: ~170 MB).
"""

from __future__ import annotations

import dataclasses
from urllib.parse import urlsplit

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dcptool.protocol.dcp.server.recorded_producer import DcpRecording, RecordedStream
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.constants import Opcode
from dcptool.protocol.errors import DcptoolError
from dcptool.replay.store.reader import (
    CaptureError,
    find_captures,
    iter_capture_tables,
    protocol_of,
    schema_of,
)

STREAM_OPCODES = (0x55, 0x56, 0x57, 0x58, 0x59, 0x5F, 0x60, 0x62, 0x63, 0x64, 0x65)
REQUEST_MAGICS = (0x80, 0x08)
RESPONSE_MAGICS = (0x81, 0x18)
SYNAPSE_SKIPPED = ("SERVER", "PING", "ERROR")
_DCP_COLUMNS = ["capture_id", "conn", "mono_ns", "direction", "magic", "opcode", "status", "vbucket", "opaque",
                "by_seqno", "snap_start", "rollback_seqno", "failover_log", "req_flags", "req_start_seqno",
                "req_end_seqno", "req_vbucket_uuid", "req_snap_start", "req_snap_end", "raw"]


class PlaybackError(DcptoolError):
    """A capture that cannot be played back (unreadable, empty, or of the other protocol)."""


class NotPlayable(PlaybackError):
    """A readable capture that lacks what playback needs (the `raw` column): a usage error."""


HEADER = 24     # bytes of a memcached frame header


def open_capture(paths: list[str], protocol: str) -> list:
    """The capture files of `paths`, checked to be readable captures of `protocol`."""
    try:
        files = find_captures(paths)
        got = protocol_of(files)
    except CaptureError as exc:
        raise PlaybackError(str(exc)) from None
    if got != protocol:
        raise PlaybackError(f"{paths[0]}: a {got} capture, not {protocol}")
    return files


def _tables(files, columns):
    try:
        yield from iter_capture_tables(files, columns)
    except CaptureError as exc:
        raise PlaybackError(str(exc)) from None
    except (OSError, pa.ArrowException) as exc:
        raise PlaybackError(f"unreadable capture: {exc}") from None


def _np(col, dtype, fill=-1) -> np.ndarray:
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if col.null_count:
        col = pc.fill_null(col, fill)
    return col.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


def _bucket_of(files) -> str:
    source = files[0].metadata.get("dcptool.source", "")
    path = urlsplit(source).path.strip("/") if source else ""
    return path or "default"


def _needs_raw(files) -> None:
    """Playback sends the recorded bytes: every file must have the `raw` column."""
    for f in files:
        try:
            names = schema_of(f.path, f.in_progress).names
        except (OSError, pa.ArrowException) as exc:
            raise PlaybackError(f"{f.path}: unreadable capture: {exc}") from None
        if "raw" not in names:
            raise NotPlayable(f"{f.path}: no `raw` column (the recorded frames): this capture cannot be "
                              "played back")


def load_dcp(paths: list[str]) -> DcpRecording:
    """The recording of `paths`; recorded stream frames whose raw bytes are shorter than a
    header or than their header says are left out and counted (`skipped`)."""
    files = open_capture(paths, "dcp")
    _needs_raw(files)
    t, gconn = _frames_with_global_conns(files, paths)
    incoming = _np(pc.equal(t.column("direction").cast(pa.string()), "in"), bool, False)
    opcode = _np(t.column("opcode"), np.int64, 0)
    streams, sessions, vb_seqnos, flogs = _controls(t, gconn, incoming, opcode)
    skipped = _assign_frames(t, gconn, incoming, opcode, sessions)
    _mark_ends(streams)
    if not streams:
        raise PlaybackError(f"{paths[0]}: the capture holds no stream request to play back")
    return DcpRecording(bucket=_bucket_of(files), streams=streams, vb_seqnos=vb_seqnos, failover_logs=flogs,
                        skipped=skipped)


def _frames_with_global_conns(files, paths) -> tuple[pa.Table, np.ndarray]:
    """Every frame of the captures, and its connection numbered over all captures: (capture,
    conn) in order."""
    parts: list[pa.Table] = []
    conn_base, last_key = -1, None
    gconns = []
    for t in _tables(files, _DCP_COLUMNS):
        if t.num_rows == 0:
            continue
        cap = t.column("capture_id").cast(pa.string()).to_numpy(zero_copy_only=False)
        conn = _np(t.column("conn"), np.int64, 0)
        change = np.ones(len(conn), bool)
        change[1:] = (cap[1:] != cap[:-1]) | (conn[1:] != conn[:-1])
        if last_key is not None and (cap[0], conn[0]) == last_key:
            change[0] = False
        gconns.append(conn_base + np.cumsum(change))
        conn_base = int(gconns[-1][-1])
        last_key = (cap[-1], conn[-1])
        parts.append(t.drop_columns(["capture_id"]))
    if not parts:
        raise PlaybackError(f"{paths[0]}: the capture has no frames")
    return pa.concat_tables(parts), np.concatenate(gconns)


def _controls(t: pa.Table, gconn, incoming, opcode):
    """The control rows (few): stream requests and their answers (one RecordedStream each),
    GET_ALL_VB_SEQNOS answers and failover logs."""
    ctl = np.nonzero(np.isin(opcode, (Opcode.DCP_STREAM_REQ, Opcode.GET_ALL_VB_SEQNOS, Opcode.DCP_GET_FAILOVER_LOG)))[0]
    rows = t.take(pa.array(ctl)).to_pylist() if len(ctl) else []
    requests: dict[tuple[int, int], dict] = {}
    streams: dict[int, list[RecordedStream]] = {}
    sessions: list[tuple[int, int, RecordedStream]] = []   # (gconn, position, stream)
    vb_seqnos: list[dict[int, int]] = []
    answered: set[int] = set()
    flogs: dict[int, tuple] = {}
    for idx, r in zip(ctl.tolist(), rows):
        g = int(gconn[idx])
        is_in = bool(incoming[idx])
        if r["opcode"] == Opcode.DCP_STREAM_REQ and not is_in and r["magic"] in REQUEST_MAGICS:
            requests[(g, r["opaque"])] = r
        elif r["opcode"] == Opcode.DCP_STREAM_REQ and is_in and r["magic"] in RESPONSE_MAGICS:
            req = requests.pop((g, r["opaque"]), None)
            if req is None or req["vbucket"] is None:
                continue
            rs = RecordedStream(
                vbucket=req["vbucket"], conn=g,
                request=(req["req_flags"] or 0, req["req_start_seqno"] or 0, req["req_end_seqno"] or 0,
                         req["req_vbucket_uuid"] or 0, req["req_snap_start"] or 0, req["req_snap_end"] or 0),
                status=r["status"] or 0, rollback_seqno=r["rollback_seqno"],
                failover_log=tuple((e["vbucket_uuid"], e["seqno"]) for e in (r["failover_log"] or ())),
                resp_mono=r["mono_ns"] or 0)
            streams.setdefault(rs.vbucket, []).append(rs)
            sessions.append((g, idx, rs))
        elif r["opcode"] == Opcode.GET_ALL_VB_SEQNOS and is_in and r["magic"] in RESPONSE_MAGICS \
                and not r["status"] and g not in answered:
            answered.add(g)      # a connection's first answer (the set-up's); later ones are lag polls
            try:
                msg = m.decode_bytes(r["raw"])
                if isinstance(msg, m.GetAllVbSeqnosResponse):   # else a damaged answer: not served
                    vb_seqnos.append({int(v): int(s) for v, s in msg.seqnos})
            except Exception:  # noqa: BLE001 - a damaged answer is not served
                pass
        elif r["opcode"] == Opcode.DCP_GET_FAILOVER_LOG and is_in and r["failover_log"] and r["vbucket"] is not None:
            flogs.setdefault(r["vbucket"], tuple((e["vbucket_uuid"], e["seqno"]) for e in r["failover_log"]))
    return streams, sessions, vb_seqnos, flogs


def _assign_frames(t: pa.Table, gconn, incoming, opcode, sessions) -> int:
    """Each stream frame to the open stream of its (connection, vbucket); returns how many
    were left out (raw shorter than a header or than it says)."""
    magic = _np(t.column("magic"), np.int64, 0)
    vbucket = _np(t.column("vbucket").cast(pa.int32()), np.int64, -1)   # uint16: -1 needs a signed type
    data_rows = np.nonzero(incoming & np.isin(magic, REQUEST_MAGICS) & np.isin(opcode, STREAM_OPCODES)
                           & (vbucket >= 0))[0]
    ok = [(g, i, rs) for g, i, rs in sessions if rs.status == 0]
    skipped = 0
    if not ok or not len(data_rows):
        return skipped
    skey = np.array([(g * 2048 + rs.vbucket) << 40 | i for g, i, rs in ok], np.int64)
    sort = np.argsort(skey, kind="stable")
    skey = skey[sort]
    dkey = ((gconn[data_rows] * 2048 + vbucket[data_rows]) << 40) | data_rows
    at = np.searchsorted(skey, dkey, side="right") - 1
    valid = at >= 0
    valid[valid] = (skey[at[valid]] >> 40) == (dkey[valid] >> 40)
    data_rows, at = data_rows[valid], sort[at[valid]]
    group = np.argsort(at, kind="stable")
    data_rows, at = data_rows[group], at[group]
    bounds = np.searchsorted(at, np.arange(len(ok) + 1))
    mono = _np(t.column("mono_ns"), np.int64, 0)
    seqno = _np(t.column("by_seqno"), np.int64, -1)
    snap = _np(t.column("snap_start"), np.int64, -1)
    raw = t.column("raw")
    for k, (_, _, rs) in enumerate(ok):
        sel = data_rows[bounds[k]:bounds[k + 1]]
        if len(sel):
            skipped += _fill(rs, raw.take(pa.array(sel)), mono[sel], sel, opcode[sel], seqno[sel], snap[sel])
    return skipped


def _mark_ends(streams: dict[int, list[RecordedStream]]) -> None:
    """How each recorded stream ended: a STREAM_END, or its connection was replaced."""
    last_conn_of_vb = {vb: max(rs.conn for rs in ss) for vb, ss in streams.items()}
    for vb, ss in streams.items():
        for rs in ss:
            if rs.frames and rs.opcode[-1] == Opcode.DCP_STREAM_END:
                rs.ended_by = "end"
            elif rs.conn < last_conn_of_vb[vb]:
                rs.ended_by = "disconnect"


def _fill(rs: RecordedStream, raw: pa.ChunkedArray, mono, order, opcode, seqno, snap) -> int:
    """The stream's frames from their raw bytes; returns how many were left out (damaged)."""
    arr = raw.combine_chunks()
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.chunk(0) if arr.num_chunks else pa.array([], pa.binary())
    off_type = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
    offs = np.frombuffer(arr.buffers()[1], off_type)[arr.offset:arr.offset + len(arr) + 1].astype(np.int64)
    blob = arr.buffers()[2]
    data = blob.to_pybytes()[offs[0]:offs[-1]] if blob is not None else b""
    offs = offs - offs[0]
    whole = _whole_frames(data, offs)
    skipped = int(len(whole) - whole.sum())
    if skipped:
        keep = np.nonzero(whole)[0]
        data = b"".join(data[offs[i]:offs[i + 1]] for i in keep.tolist())
        offs = np.concatenate(([0], np.cumsum(np.diff(offs)[keep]))).astype(np.int64)
        mono, order, opcode, seqno, snap = (a[keep] for a in (mono, order, opcode, seqno, snap))
    rs.data = data
    rs.offsets = offs
    rs.mono = np.ascontiguousarray(mono)
    rs.order = np.ascontiguousarray(order)
    rs.opcode = opcode.astype(np.uint8)
    is_item = np.isin(opcode, (0x57, 0x58, 0x59, 0x5F, 0x60, 0x62, 0x63, 0x64))
    rs.seqno = np.where(is_item, seqno, -1).astype(np.int64)
    rs.snap_start = np.where(opcode == 0x56, snap, -1).astype(np.int64)
    return skipped


def _whole_frames(data: bytes, offs: np.ndarray) -> np.ndarray:
    """Per frame: its raw bytes are a header and exactly the body length the header says."""
    lens = np.diff(offs)
    whole = lens >= HEADER
    if whole.any():
        b = np.frombuffer(data, np.uint8)
        at = offs[:-1][whole]
        body = np.zeros(len(at), np.int64)
        for j in range(8, 12):
            body = (body << 8) | b[at + j]
        whole[whole] = lens[whole] == HEADER + body
    return whole


@dataclasses.dataclass
class SynapseRecording:
    """Per recorded connection, the server's replication lines and their mono_ns."""
    connections: list[tuple[list[bytes], list[int]]]

    @property
    def lines(self) -> int:
        return sum(len(c[0]) for c in self.connections)


def load_synapse(paths: list[str]) -> SynapseRecording:
    files = open_capture(paths, "synapse")
    conns: dict[tuple, tuple[list[bytes], list[int]]] = {}
    for t in _tables(files, ["capture_id", "conn", "mono_ns", "direction", "command", "raw"]):
        for r in t.to_pylist():
            if r["direction"] != "in" or r["command"] in SYNAPSE_SKIPPED or r["raw"] is None:
                continue
            lines, monos = conns.setdefault((r["capture_id"], r["conn"]), ([], []))
            lines.append(bytes(r["raw"]))
            monos.append(r["mono_ns"] or 0)
    rec = SynapseRecording(list(conns.values()))
    if not rec.lines:
        raise PlaybackError(f"{paths[0]}: the capture has no replication lines to play back")
    return rec
