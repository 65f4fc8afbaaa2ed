"""The consumer's receive path, sans-IO: whole frames in, per-stream state and events out.
A part of consumer.Consumer, composed in: it reads the stream tables of streams.py (`last`,
`sopq`, `oso`) and reports what arrived through the Streams' methods (the per-stream positions
are theirs to change), answers through the shared Link (responses go to the handler of their
request) and counts what it received and what it has not acknowledged yet (flow control).

Hot path: data frames (mutation, deletion, expiration, system event, seqno advanced) are
never decoded into messages: opcode, vbucket, opaque and by_seqno are read with one
struct.unpack_from at fixed offsets and only per-vbucket state is updated; long runs of them
(a backfill) are applied column-wise. Everything else is rare and decoded fully with
protocol.dcp.messages (`_slow`).

Stream ids: a data frame of a stream with an id comes in alt framing (magic 0x08, the 3-byte
frame info 0x22 + sid, DCP_DIGEST §1.2), its fields 3 bytes further on; (vbucket, sid) picks
the stream (consumer_api.stream_key), and a sid we did not ask for is no stream of ours.

Server requests (magic 0x82, needs HELLO Duplex) are answered with magic 0x83. A cluster-map
change notification (opcode 0x01, docs/CLUSTER.md) becomes ConfigPushed when it is well
formed (key = our bucket, extras = revEpoch i64 + rev i64, or the old rev u32, a bounded
body); anything else becomes PushIgnored with the reason, never an error: the frame is in the
capture either way.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import TYPE_CHECKING, Any, Callable

from dcptool.protocol.dcp.client.link import Link
from dcptool.protocol.dcp.client.streams import DATA_OPS as DATA_OPS
from dcptool.protocol.dcp.client.streams import Streams
from dcptool.protocol.dcp.wire import columnar, snappy
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.columnar import be_uint as _be
from dcptool.protocol.dcp.wire.constants import (
    NUM_VB_SLOTS,
    SERVER_OP_CLUSTERMAP_CHANGE_NOTIFICATION,
    Opcode,
    SnapshotFlag,
    op_name,
    stream_key,
)
from dcptool.protocol.dcp.wire.frames import Frame, parse_frame
from dcptool.protocol.errors import ErrorCode, RemoteError

if TYPE_CHECKING:
    import numpy.typing as npt

_DATA_OPS_ARRAY = sorted(DATA_OPS)
# DCP messages that belong to a vbucket's stream: one for a vbucket beyond NUM_VB_SLOTS makes
# the stream meaningless
STREAM_OPS = DATA_OPS | {int(o) for o in (Opcode.DCP_STREAM_END, Opcode.DCP_SNAPSHOT_MARKER,
                                           Opcode.DCP_SET_VBUCKET_STATE, Opcode.DCP_PREPARE, Opcode.DCP_COMMIT,
                                           Opcode.DCP_ABORT, Opcode.DCP_OSO_SNAPSHOT)}
_NOOP = int(Opcode.DCP_NOOP)
_VECTOR_MIN = 48           # runs shorter than this take the per-frame loop
# bytes a pushed config may have (a 1024-vbucket map of a large cluster is well under 1 MiB)
MAX_PUSHED_CONFIG = 8 << 20
_EPOCH_REV = struct.Struct(">qq")
_SNAPPY = 0x02


def _tolist(a: Any) -> list[int]:
    return a.tolist() if hasattr(a, "tolist") else list(a)


@dataclasses.dataclass(frozen=True, slots=True)
class ConfigPushed:
    """A cluster-map change notification: (revEpoch, rev) from its extras and the config JSON
    (raw; empty for a brief notification, 0x1f: fetch it with request_config())."""
    rev_epoch: int
    rev: int
    raw: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class PushIgnored:
    """A server request (magic 0x82) that was answered and otherwise ignored, and why."""
    opcode: int
    reason: str


class Receiver:
    def __init__(self, link: Link, streams: Streams, collections: Callable[[], bool], now: float):
        self.link = link
        self.streams = streams
        self.collections = collections      # whether keys carry a collection prefix (HELLO)
        self.max_sid = streams.max_sid
        self.last_rx = now
        self.unacked = 0          # bytes received that count for flow control, not yet acknowledged
        self.acked_total = 0      # bytes acknowledged (take_unacked)
        self.frames_in = 0
        self.data_frames = 0
        self.noops_answered = 0

    def receive(self, buf: Any, offsets: Any, lengths: Any, now: float) -> None:
        """Process the whole frames at offsets/lengths in buf.

        Long runs of data frames (a backfill) are applied column-wise: per vbucket the seqnos
        are checked to rise and the last one kept; every other frame, and any run that breaks
        a rule, goes through the per-frame path in wire order."""
        n = len(offsets)
        if n == 0:
            return
        self.last_rx = now
        self.link.at(now)
        self.frames_in += n
        if n < _VECTOR_MIN or not hasattr(offsets, "dtype"):
            self._receive_frames(buf, _tolist(offsets), _tolist(lengths), now)
        else:
            self._receive_vectorised(buf, offsets, lengths, now)

    def _receive_vectorised(self, buf: Any, offsets: Any, lengths: Any, now: float) -> None:
        import numpy as np
        n = len(offsets)
        u8 = np.frombuffer(buf, dtype=np.uint8)
        h, _ = columnar.headers(buf, offsets)   # the transport's scan gathered them already
        magic = h["magic"]
        data = np.isin(h["opcode"], _DATA_OPS_ARRAY) & (magic == 0x80) & (lengths >= 32)
        if self.max_sid:    # stream ids: alt-framed data frames with exactly the sid frame info
            alt = (magic == 0x08) & (lengths >= 35)
            a = np.nonzero(alt)[0]
            alt[a] = (u8[offsets[a] + 2] == 3) & (u8[offsets[a] + 24] == 0x22) & \
                np.isin(u8[offsets[a] + 1], _DATA_OPS_ARRAY)
            data |= alt
        idx = np.nonzero(data)[0]
        # int64 ids; stream_key turns them into stream keys, typed as any integer array
        vbs: npt.NDArray[np.integer[Any]] = h["vbucket_or_status"][idx].astype(np.int64)
        opq = h["opaque"][idx].astype(np.int64)
        fe = np.zeros(len(idx), dtype=np.int64)
        if self.max_sid:
            ia = alt[idx]
            fe[ia] = 3
            sids = np.zeros(len(idx), dtype=np.int64)
            sids[ia] = _be(u8, offsets[idx[ia]] + 25, 2).astype(np.int64)
            in_range = (vbs < NUM_VB_SLOTS) & (sids <= self.max_sid)
            vbs = stream_key(vbs, sids)      # stream keys from here on
        else:
            # a vbucket id from the peer indexes nothing before it is checked: out-of-range ids
            # take the per-frame path, which reports them
            in_range = vbs < NUM_VB_SLOTS
        ok = in_range & (opq == np.asarray(self.streams.sopq, dtype=np.int64)[np.where(in_range, vbs, 0)])
        # a run ends at every frame that is not a valid data frame
        stop = np.ones(n, dtype=bool)
        stop[idx[ok]] = False
        stops = np.nonzero(stop)[0]
        seqs = _be(u8, offsets[idx] + 24 + fe, 8)
        pos_in_idx = np.full(n, -1, dtype=np.int64)
        pos_in_idx[idx] = np.arange(len(idx))
        # consecutive stops go through the per-frame loop together, in one call: it takes
        # them in wire order either way (the data frames that arrive in the same receive as
        # their stream's answer are such a run, thousands long at the start of a backfill)
        firsts: list[int] = []
        ends: list[int] = []
        if len(stops):
            gi = np.nonzero(np.r_[True, np.diff(stops) != 1])[0]     # where each group starts
            firsts = stops[gi].tolist()
            ends = (stops[np.r_[gi[1:] - 1, len(stops) - 1]] + 1).tolist()
        prev = 0
        for s, e in zip(firsts + [n], ends + [n]):
            if s > prev:
                self._apply_run(buf, offsets, lengths, prev, s, pos_in_idx, vbs, seqs, now)
            if s < n:
                self._receive_frames(buf, offsets[s:e].tolist(), lengths[s:e].tolist(), now)
            prev = e

    def _apply_run(self, buf: Any, offsets: Any, lengths: Any, a: int, b: int, pos_in_idx: Any, vbs: Any,
                   seqs: Any, now: float) -> None:
        if b - a < _VECTOR_MIN:
            self._receive_frames(buf, offsets[a:b].tolist(), lengths[a:b].tolist(), now)
            return
        sel = pos_in_idx[a:b]
        if not self.streams.apply_run(vbs[sel], seqs[sel]):
            self._receive_frames(buf, offsets[a:b].tolist(), lengths[a:b].tolist(), now)
            return
        self.unacked += int(lengths[a:b].sum())
        self.data_frames += b - a

    def _receive_frames(self, buf: Any, offsets: list[int], lengths: list[int], now: float) -> None:
        take_data = self.streams.take_data
        n = len(offsets)
        i = 0
        while True:
            i, unacked, data = take_data(buf, offsets, lengths, i)
            self.unacked += unacked
            self.data_frames += data     # counted before a frame that may raise
            if i >= n:
                return
            off = offsets[i]
            ln = lengths[i]
            magic = buf[off]
            if (magic == 0x80 or magic == 0x08) and buf[off + 1] != _NOOP:
                self.unacked += ln
            self._slow(parse_frame(buf, off, ln), now)
            i += 1

    def heard(self, now: float) -> None:
        """Silence is counted from now (we held reads back: the silence was ours)."""
        self.last_rx = now

    def take_unacked(self) -> int:
        """The bytes to acknowledge (a buffer ack is sent for them): counted as acknowledged."""
        n, self.unacked = self.unacked, 0
        self.acked_total += n
        return n

    def _slow(self, frame: Frame, now: float) -> None:
        link = self.link
        msg: Any = m.decode(frame, self.collections())
        if msg.IS_RESPONSE:
            link.answered(msg)
            return
        op = msg.op_code
        if frame.magic == 0x82:   # server-initiated request (Duplex): acknowledge, then look
            link.send(m.Response(opcode=op, opaque=msg.opaque, magic=0x83))
            link.emit(self._server_request(frame))
            return
        if op == _NOOP:
            link.send(m.Response(opcode=_NOOP, opaque=msg.opaque))
            self.noops_answered += 1
            return
        vb = getattr(msg, "vbucket", None)
        if vb is not None and vb >= NUM_VB_SLOTS and op in STREAM_OPS:
            raise RemoteError(ErrorCode.BAD_VBUCKET,
                              f"{op_name(op)} for vbucket {vb} (opaque {msg.opaque}): vbucket ids go up to "
                              f"{NUM_VB_SLOTS - 1}; the stream cannot be trusted")
        sid = msg.stream_id or 0
        if vb is None or vb >= NUM_VB_SLOTS or sid > self.max_sid:
            return   # not a stream of ours (a stream id we did not ask for): ignore
        k = stream_key(vb, sid)
        streams = self.streams
        if msg.opaque != streams.sopq[k]:
            return   # a frame of a stream we no longer have (closed, replaced, not ours): ignore
        t = type(msg)
        if t is m.SnapshotMarker:
            streams.snapshot(k, msg)
            if msg.snap_flags & SnapshotFlag.ACK:
                link.send(m.Response(opcode=Opcode.DCP_SNAPSHOT_MARKER, opaque=msg.opaque))
        elif t is m.StreamEnd:
            streams.ended(k, msg.reason)
        elif t is m.SetVbucketState:
            link.send(m.Response(opcode=Opcode.DCP_SET_VBUCKET_STATE, opaque=msg.opaque))
        elif t is m.OsoSnapshot:
            streams.oso_marker(k, msg.flags)
        elif op in DATA_OPS or t in (m.Prepare, m.Commit, m.Abort):
            seq = getattr(msg, "by_seqno", None)
            if seq is None:
                seq = getattr(msg, "commit_seqno", None) or getattr(msg, "abort_seqno", None)
            if seq is not None:
                streams.advance(k, seq)
        elif getattr(msg, "decode_error", None) and op in DATA_OPS:
            raise RemoteError(ErrorCode.BAD_EXTRAS, f"vbucket {vb}: {msg.decode_error}")

    def _server_request(self, frame: Frame) -> ConfigPushed | PushIgnored:
        """What a server request means to us: every field is checked, nothing is fatal."""
        op = frame.opcode
        if op != SERVER_OP_CLUSTERMAP_CHANGE_NOTIFICATION:
            return PushIgnored(op, f"server request 0x{op:02x} is not one we use")
        what = "cluster-map change notification"
        key = bytes(frame.key)
        bucket = self.link.cfg.bucket
        if key != bucket.encode():
            return PushIgnored(op, f"{what} for bucket {key[:64].decode('utf-8', 'replace')!r}, "
                                   f"not {bucket!r}")
        ex = bytes(frame.extras)
        if len(ex) == 16:
            epoch, rev = _EPOCH_REV.unpack(ex)
        elif len(ex) == 4:       # servers before 7.1: rev only
            epoch, rev = 0, int.from_bytes(ex, "big")
        else:
            return PushIgnored(op, f"{what} with {len(ex)} bytes of extras (16 or 4 expected)")
        value = bytes(frame.value)
        if frame.datatype & _SNAPPY and value:
            try:
                value = snappy.decompress(value, MAX_PUSHED_CONFIG)
            except snappy.TooLarge:
                return PushIgnored(op, f"{what} announces more than {MAX_PUSHED_CONFIG} bytes")
            except ValueError:
                return PushIgnored(op, f"{what}: the Snappy value does not decompress")
        if len(value) > MAX_PUSHED_CONFIG:
            return PushIgnored(op, f"{what} of {len(value)} bytes (limit {MAX_PUSHED_CONFIG})")
        return ConfigPushed(epoch, rev, value)
