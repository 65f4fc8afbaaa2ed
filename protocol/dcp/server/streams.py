"""The producer's streams, sans-IO: one Stream per vbucket stream of a connection, which
queues snapshots as segments: Fixed (pre-encoded, fixed-size disk frames, a slice of one
blob) and Var (frames of any size). Used by producer.py."""

from __future__ import annotations

import bisect
import struct
from typing import Any

import cramjam
import numpy as np

from dcptool.protocol.dcp.server import history as history
from dcptool.protocol.dcp.server import oso as producer_oso
from dcptool.protocol.dcp.server.bucket import Item, VBucket
from dcptool.protocol.dcp.server.compress import compressed_disk_frames, with_opaque
from dcptool.protocol.dcp.server.manifest import system_event_frame
from dcptool.protocol.dcp.server.sync_writes import sync_frame
from dcptool.protocol.dcp.wire import leb128
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.constants import SnapshotFlag, StreamEndReason

# --------------------------------------------------------------------------- segments

class Fixed:
    """n frames of size f in data (a pre-encoded blob). With `opaque`, data is the shared
    blob of the vbucket (opaque 0) and each chunk taken is a copy with the stream's opaque
    written in: a stream holds no copy of its backfill, so a client that does not read
    costs the server what its transport buffers hold, and nothing once it goes."""
    __slots__ = ("data", "f", "n", "i", "data_frames", "opaque")

    def __init__(self, data: Any, f: int, n: int, data_frames: bool = True, opaque: int | None = None) -> None:
        self.data, self.f, self.n, self.i, self.data_frames = memoryview(data), f, n, 0, data_frames
        self.opaque = opaque

    def take(self, budget: int, max_frames: int) -> tuple[memoryview, int]:
        k = min(self.n - self.i, max(1, -(-budget // self.f)), max_frames)
        out = self.data[self.i * self.f:(self.i + k) * self.f]
        self.i += k
        if self.opaque is not None:
            chunk = np.frombuffer(out, np.uint8).reshape(k, self.f).copy()
            chunk[:, 12:16] = np.frombuffer(self.opaque.to_bytes(4, "big"), np.uint8)
            out = chunk.reshape(-1).data
        return out, k

    @property
    def done(self) -> bool:
        return self.i >= self.n


class Var:
    """Frames of any size: data with frame start offsets."""
    __slots__ = ("data", "starts", "i", "data_frames")

    def __init__(self, frames: list[bytes]) -> None:
        self.data = memoryview(b"".join(frames))
        starts = [0]
        for fr in frames:
            starts.append(starts[-1] + len(fr))
        self.starts = starts
        self.i = 0

    def take(self, budget: int, max_frames: int) -> tuple[memoryview, int]:
        s = self.starts
        lo = s[self.i]
        j = bisect.bisect_left(s, lo + budget, self.i + 1)   # frames starting before the budget ends
        j = min(j, len(s) - 1, self.i + max_frames)
        j = max(j, self.i + 1)
        out = self.data[lo:s[j]]
        k = j - self.i
        self.i = j
        return out, k

    @property
    def done(self) -> bool:
        return self.i >= len(self.starts) - 1

    @classmethod
    def of_blob(cls, data: Any, starts: list[int]) -> "Var":
        """Frames already joined in `data`, frame i at starts[i]:starts[i + 1]."""
        v = cls.__new__(cls)
        v.data, v.starts, v.i = memoryview(data), starts, 0
        return v


# --------------------------------------------------------------------------- streams

class Stream:
    def __init__(self, conn: Any, vb: VBucket, opaque: int, start: int, end: int,
                 end_reason: int | None, partial_snap_start: int | None = None):
        self.conn = conn
        self.vb = vb
        self.opaque = opaque
        self.cursor = start          # last seqno covered
        self.end = end               # inclusive, SEQNO_INFINITY for ever
        self.first_marker = True
        self.segments: list[Any] = []
        self.ended = False
        self.injected_end = end_reason   # scenario: end after the first data chunk
        self.sent_data = False
        self.partial_snap_start = partial_snap_start   # requested snap_start when start was inside it
        self.flt: Any = None         # manifest.Filter: what this stream sends
        self.sid = 0                 # its stream id (producer_sid.py), 0: none
        self.sid_seg: Any = None     # the segment last tagged with the stream id

    def _marker(self, start: int, end: int, flags: int, disk: bool, mvs: int | None = None) -> bytes:
        c = self.conn
        if c.marker_v22 and disk:
            msg = m.SnapshotMarker(vbucket=self.vb.vbid, opaque=self.opaque, snap_version="2.2",
                                   snap_start=start, snap_end=end, snap_flags=flags, max_visible_seqno=end,
                                   high_completed_seqno=0, purge_seqno=self.vb.purge_seqno,
                                   high_prepared_seqno=0)
        elif c.sync_writes:
            msg = m.SnapshotMarker(vbucket=self.vb.vbid, opaque=self.opaque, snap_version="2.0",
                                   snap_start=start, snap_end=end, snap_flags=flags,
                                   max_visible_seqno=end if mvs is None else mvs, high_completed_seqno=0)
        else:
            msg = m.SnapshotMarker(vbucket=self.vb.vbid, opaque=self.opaque, snap_start=start, snap_end=end,
                                   snap_flags=flags)
        return m.encode(msg)

    def end_frame(self, reason: int) -> bytes:
        if reason in (StreamEndReason.FILTER_EMPTY, StreamEndReason.LOST_PRIVILEGES) and not self.conn.collections:
            reason = StreamEndReason.OK   # what kv_engine sends to a connection without collections
        self.ended = True
        return m.encode(m.StreamEnd(vbucket=self.vb.vbid, opaque=self.opaque, reason=reason))

    def refill(self) -> bool:
        """Queue the next snapshot (or the stream end). False when there is nothing yet."""
        vb = self.vb
        if self.ended:
            return False
        if self.injected_end is not None and self.sent_data:
            self.segments.append(Var([self.end_frame(self.injected_end)]))
            return True
        if self.cursor >= self.end:
            self.segments.append(Var([self.end_frame(StreamEndReason.OK)]))
            return True
        high = vb.high_seqno
        if self.cursor >= high:
            if getattr(self.conn.server, "drain", False):   # tests: every stream ends where the bucket is
                self.segments.append(Var([self.end_frame(StreamEndReason.OK)]))
                return True
            return False
        c = self.conn
        snap_from = self.cursor if self.first_marker else self.cursor + 1
        if self.first_marker and self.partial_snap_start is not None:
            snap_from = min(snap_from, self.partial_snap_start)   # kv_engine: min(requested, marker start)
        if self.cursor < vb.disk_high:
            last = min(vb.disk_high, self.end)
            if producer_oso.uses_oso(self):     # out of sequence order, between OSO markers
                self.segments.extend(Var(p) if isinstance(p, list) else Fixed(p.tobytes(), p.dtype.itemsize, len(p))
                                     for _kind, p in producer_oso.oso_backfill(self, last))   # "frames": a list
                self.first_marker = False
                self.cursor = last
                return True
            flags = SnapshotFlag.DISK | SnapshotFlag.CHECKPOINT | history.disk_flags(c, vb, self.cursor + 1, last)
            self.segments.append(Var([self._marker(snap_from, last, flags, True)]))
            # a collection filter (producer_collections.Filter): a mask over the disk items
            mask = None if self.flt is None else self.flt.disk_mask(vb.disk_cids[self.cursor:last],
                                                                     c.bucket.manifest)
            if c.compress and mask is None and getattr(c.server.scenarios, "corrupt_value_at", None) is None:
                blob, starts = compressed_disk_frames(vb, c.collections, c.no_value, c.json)   # built once
                self.segments.append(Var.of_blob(*with_opaque(blob, starts, self.cursor, last, self.opaque)))
            elif c.compress:   # values differ in size once compressed: through the codec
                self.segments.append(Var([c.encode_item(vb.vbid, self.opaque, vb.disk_item(s))
                                          for s in range(self.cursor + 1, last + 1)
                                          if mask is None or mask[s - self.cursor - 1]]))
            else:
                recs = vb.disk_records(c.collections, c.no_value, c.json)[self.cursor:last]
                if mask is None and not getattr(self, "sid", 0) and len(recs):
                    # the shared records, the opaque written in as chunks are taken (no copy kept)
                    self.segments.append(Fixed(recs.view(np.uint8).reshape(-1), recs.dtype.itemsize, len(recs),
                                               opaque=self.opaque))
                else:
                    recs = recs.copy() if mask is None else recs[mask]
                    recs["opaque"] = self.opaque
                    if len(recs):
                        self.segments.append(Fixed(recs.tobytes(), recs.dtype.itemsize, len(recs)))
            if mask is not None and not mask[-1] and not self.flt.legacy:
                # kv_engine: a filtered snapshot whose end is not this stream's item ends with
                # a seqno advanced to it (collection-aware connections only)
                self.segments.append(Var([m.encode(m.SeqnoAdvanced(vbucket=vb.vbid, opaque=self.opaque,
                                                                    by_seqno=last))]))
        else:
            last = min(vb.checkpoint_end(self.cursor + 1), high, self.end)
            first = self.cursor + 1
            items = vb.mem[first - vb.disk_high - 1:last - vb.disk_high]
            filter_empty = False
            if self.flt is not None:    # collections: this stream's items and system events
                items, filter_empty = self.flt.memory_items(items, c.bucket.manifest)
            # de-duplication within the snapshot; sync writes as the connection gets them
            # (change history: every version of a history collection's keys, producer_history.py)
            items, mvs, hflags = history.memory_snapshot(c, items)
            flags = SnapshotFlag.MEMORY | hflags
            if (first - vb.disk_high - 1) % vb.checkpoint_items == 0:
                flags |= SnapshotFlag.CHECKPOINT
            if not c.sync_writes and mvs is None:   # nothing it can see: no snapshot
                self.cursor = last
                return self.refill()
            snap_last = last if c.sync_writes else mvs
            frames = [self._marker(snap_from, snap_last or 0, flags, False, mvs or 0)]
            frames.extend(c.encode_item(vb.vbid, self.opaque, it) for it in items)
            self.segments.append(Var(frames[:1]))
            self.segments.append(Var(frames[1:]) if len(frames) > 1 else None)
            if self.segments[-1] is None:
                self.segments.pop()
            if filter_empty:
                self.segments.append(Var([self.end_frame(StreamEndReason.FILTER_EMPTY)]))
        self.first_marker = False
        self.cursor = last
        return True


_MUTATION = struct.Struct(">BBHBBHIIQQQIIIHB")   # header + DCP_MUTATION extras (lock time, nmeta, nru 0)


def encode_item(c: Any, vbid: int, opaque: int, it: Item) -> bytes:
    """One memory item as the connection `c` (a ProducerConnection) gets it."""
    cid = it.cid if c.collections else None
    if it.kind in ("sc", "sd"):
        return system_event_frame(vbid, opaque, it)
    if it.kind in ("p", "a") or (it.kind == "c" and c.sync_writes):
        return sync_frame(c, vbid, opaque, it, cid)
    if it.kind in ("m", "c"):        # a commit, to a connection without sync writes: the mutation
        value = b"" if c.no_value else it.value
        dt = it.datatype if (c.json and value) else 0
        if value and c.compress:     # force_value_compression: snappy, datatype bit 0x02
            value = corrupt_value(c, bytes(cramjam.snappy.compress_raw(value)))
            dt |= 0x02
        # the frame m.encode(m.Mutation(...)) makes, packed at once (every KV write comes here)
        key = it.key if cid is None else leb128.encode(cid) + it.key
        return _MUTATION.pack(0x80, 0x57, len(key), 31, dt, vbid, 31 + len(key) + len(value), opaque, it.cas,
                              it.seqno, it.rev, it.flags, it.expiry, 0, 0, 0) + key + value
    if it.kind == "x" and c.delete_times and c.controls.get("enable_expiry_opcode") == "true":
        return m.encode(m.Expiration(vbucket=vbid, opaque=opaque, cas=it.cas, key=it.key, collection_id=cid,
                                     by_seqno=it.seqno, rev_seqno=it.rev, delete_time=0))
    del_dt = 0 if c.delete_times else None
    return m.encode(m.Deletion(vbucket=vbid, opaque=opaque, cas=it.cas, key=it.key, collection_id=cid,
                               by_seqno=it.seqno, rev_seqno=it.rev, delete_time=del_dt))


def corrupt_value(c: Any, value: bytes) -> bytes:
    """Scenario `--corrupt-value-at N`: the N-th compressed value the server sends (counted
    over every connection, once) loses its last bytes, so it does not decompress."""
    srv = c.server
    at = getattr(srv.scenarios, "corrupt_value_at", None)
    if at is None:
        return value
    srv.compressed_values = getattr(srv, "compressed_values", 0) + 1
    return value[:max(1, len(value) - 4)] if srv.compressed_values == at else value
