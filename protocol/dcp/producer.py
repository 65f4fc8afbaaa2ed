"""The producer side of DCP, sans-IO: a generated bucket (deterministic documents, per-
vbucket history, failover tables with branch points) and one state machine per client
connection (handshake, SASL, controls, stream requests with the exact rollback decision of
DCP_DIGEST §6.2, snapshots with de-duplication, flow control with the server's sizes,
noops and idle drops, failure scenarios).

Speed: the documents generated at start-up are pre-encoded per vbucket into one numpy
record array (one fixed-size mutation frame per seqno), so a backfill is a slice of one
bytes blob with the stream's opaque patched in bulk; flow control on fixed-size frames is
arithmetic, never a Python loop per frame. Live updates (`rate`) and the new branch after a
failover live in memory checkpoints and go through the codec one item at a time.

Time is always an argument: `receive(data, now)`, `pull(now)`, `tick(now)`.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import math
import random
import zlib

import numpy as np

from dcptool.protocol.dcp import messages as m
from dcptool.protocol.dcp import sasl
from dcptool.protocol.dcp.constants import (Feature, OpenFlag, SnapshotFlag,
                                            Status, StreamEndReason, StreamRequestFlag)
from dcptool.protocol.dcp.frames import FrameParser
from dcptool.protocol.errors import ProtocolError

MAX_VBUCKETS = 1024
NOOP_OPAQUE_BASE = 10_000_000     # kv_engine starts its noop opaques here
MIN_NOOP_INTERVAL = 0.1           # connection_manager_interval: smaller intervals are refused
GRANTED_FEATURES = (Feature.TCP_NODELAY, Feature.MUTATION_SEQNO, Feature.XATTR, Feature.XERROR,
                    Feature.SELECT_BUCKET, Feature.SNAPPY, Feature.JSON, Feature.DUPLEX,
                    Feature.ALT_REQUEST_SUPPORT, Feature.SYNC_REPLICATION, Feature.COLLECTIONS)
STREAM_CHUNK = 64 * 1024          # bytes taken from one stream before moving to the next
PULL_LIMIT = 1024 * 1024          # bytes handed to the transport per pull


# --------------------------------------------------------------------------- rollback

def rollback_seqno(*, start: int, vb_uuid: int, snap_start: int, snap_end: int,
                   failover_log, high_seqno: int, purge_seqno: int = 0,
                   client_purge_seqno: int | None = None, strict: bool = False) -> int | None:
    """The producer's decision (DCP_DIGEST §6.2, kv_engine FailoverTable::needsRollback):
    None for no rollback, else the seqno to roll back to. failover_log is newest first."""
    if start == 0 and (not strict or vb_uuid == 0):
        return None
    if start < purge_seqno and start != 0 and client_purge_seqno != purge_seqno:
        return 0
    upper = None
    for i, (uuid, _seqno) in enumerate(failover_log):
        if uuid == vb_uuid:
            upper = failover_log[i - 1][1] if i > 0 else high_seqno
            break
    if upper is None:
        return 0
    if start == snap_start:
        snap_end = start
    if snap_end <= upper:
        return None
    if start == snap_end:
        snap_start = start
    return upper if upper < snap_start else snap_start


def vbucket_of(key: bytes, num_vbuckets: int) -> int:
    """Couchbase's key -> vbucket hash (CRC32, bits 16..30)."""
    return ((zlib.crc32(key) >> 16) & 0x7FFF) % num_vbuckets


# --------------------------------------------------------------------------- bucket

@dataclasses.dataclass(slots=True)
class Item:
    seqno: int
    key: bytes
    value: bytes
    rev: int
    cas: int
    kind: str = "m"        # m mutation, d deletion, x expiration
    datatype: int = 1      # JSON


def _mutation_dtype(key_len: int, value_len: int) -> np.dtype:
    fields = [("magic", "u1"), ("opcode", "u1"), ("keylen", ">u2"), ("extlen", "u1"),
              ("datatype", "u1"), ("vbucket", ">u2"), ("bodylen", ">u4"), ("opaque", ">u4"),
              ("cas", ">u8"), ("by_seqno", ">u8"), ("rev_seqno", ">u8"), ("flags", ">u4"),
              ("expiration", ">u4"), ("lock_time", ">u4"), ("nmeta", ">u2"), ("nru", "u1"),
              ("key", f"V{key_len}")]
    if value_len:
        fields.append(("value", f"V{value_len}"))
    return np.dtype(fields)


class VBucket:
    """One vbucket: seqno == position + 1 over disk items then memory items."""

    def __init__(self, vbid: int, uuid: int, disk_keys: np.ndarray, disk_values: np.ndarray,
                 cas_base: int, checkpoint_items: int):
        self.vbid = vbid
        self.failover_log: list[tuple[int, int]] = [(uuid, 0)]
        self.disk_keys = disk_keys            # (n, key_len) uint8
        self.disk_values = disk_values        # (n, value_len) uint8
        self.disk_high = len(disk_keys)
        self.cas_base = cas_base
        self.mem: list[Item] = []             # seqnos disk_high+1 ... high
        self.checkpoint_items = checkpoint_items
        self.purge_seqno = 0
        self._encoded: dict[tuple, np.ndarray] = {}

    @property
    def high_seqno(self) -> int:
        return self.disk_high + len(self.mem)

    @property
    def uuid(self) -> int:
        return self.failover_log[0][0]

    def disk_item(self, seqno: int) -> Item:
        i = seqno - 1
        return Item(seqno, bytes(self.disk_keys[i]), bytes(self.disk_values[i]), 1, self.cas_base + seqno)

    def items(self):
        """Every item of the history, in seqno order (tests and tools)."""
        for s in range(1, self.disk_high + 1):
            yield self.disk_item(s)
        yield from self.mem

    def latest(self) -> dict[bytes, Item]:
        out = {}
        for it in self.items():
            out[it.key] = it
        return out

    def disk_records(self, collections: bool, no_value: bool, json: bool) -> np.ndarray:
        """The pre-encoded disk mutations (opaque 0) for one connection variant."""
        variant = (collections, no_value, json)
        recs = self._encoded.get(variant)
        if recs is not None and len(recs) >= self.disk_high:
            return recs[:self.disk_high]
        n = self.disk_high
        keys = self.disk_keys[:n]
        if collections:  # default collection: LEB128 prefix 0x00
            keys = np.concatenate([np.zeros((n, 1), np.uint8), keys], axis=1)
        kl = keys.shape[1]
        vl = 0 if no_value else self.disk_values.shape[1]
        recs = np.zeros(n, dtype=_mutation_dtype(kl, vl))
        recs["magic"] = 0x80
        recs["opcode"] = 0x57
        recs["keylen"] = kl
        recs["extlen"] = 31
        recs["datatype"] = 1 if (json and not no_value) else 0
        recs["vbucket"] = self.vbid
        recs["bodylen"] = 31 + kl + vl
        seqnos = np.arange(1, n + 1, dtype=np.uint64)
        recs["cas"] = np.uint64(self.cas_base) + seqnos
        recs["by_seqno"] = seqnos
        recs["rev_seqno"] = 1
        if n:
            recs["key"] = np.ascontiguousarray(keys).view(f"V{kl}").reshape(n)
            if vl:
                recs["value"] = np.ascontiguousarray(self.disk_values[:n]).view(f"V{vl}").reshape(n)
        self._encoded[variant] = recs
        return recs

    def fail_over(self, new_uuid: int, keep: int, rng: random.Random, now_cas: int) -> int:
        """Promote a replica that had only `keep` seqnos: a new branch at R = keep; the lost
        tail is rewritten (same keys, new values) on the new branch. Returns R."""
        r = max(0, min(keep, self.high_seqno))
        lost = [it.key for it in self.items() if it.seqno > r]
        if r < self.disk_high:
            self.disk_high = r
            self.mem = []
        else:
            self.mem = self.mem[: r - self.disk_high]
        self.failover_log.insert(0, (new_uuid, r))
        del self.failover_log[25:]
        for key in lost:
            self.append(key, b'{"branch":%d,"r":%d}' % (len(self.failover_log), rng.randrange(1 << 30)),
                        "m", now_cas)
        return r

    def append(self, key: bytes, value: bytes, kind: str, cas: int) -> Item:
        it = Item(self.high_seqno + 1, key, value if kind == "m" else b"", 1, cas, kind,
                  1 if kind == "m" else 0)
        self.mem.append(it)
        return it

    def checkpoint_end(self, seqno: int) -> int:
        """Last seqno of the memory checkpoint holding seqno."""
        c = self.checkpoint_items
        return self.disk_high + ((seqno - self.disk_high - 1) // c + 1) * c


class Bucket:
    """A generated bucket: `items` documents spread over `num_vbuckets` by the key hash,
    values deterministic from `seed`. Frames of disk documents are `value_size` + 67 bytes
    (128 with the default 61)."""

    def __init__(self, name: str = "default", num_vbuckets: int = 64, items: int = 10_000,
                 seed: int = 0, value_size: int = 61, checkpoint_items: int = 100):
        if not 1 <= num_vbuckets <= MAX_VBUCKETS:
            raise ValueError(f"vbuckets must be 1..{MAX_VBUCKETS}")
        value_size = max(value_size, 24)
        self.name = name
        self.num_vbuckets = num_vbuckets
        self.seed = seed
        self.rng = random.Random(seed)
        self.next_doc = items
        keys = np.frombuffer(b"".join(b"doc-%08d" % i for i in range(items)), np.uint8).reshape(items, 12)
        vbs = np.array([vbucket_of(bytes(keys[i]), num_vbuckets) for i in range(items)], dtype=np.int64) \
            if items else np.zeros(0, np.int64)
        values = self._values(items, value_size)
        order = np.argsort(vbs, kind="stable")
        bounds = np.searchsorted(vbs[order], np.arange(num_vbuckets + 1))
        self.cas_base = 0x1800_0000_0000_0000 + (seed % 1000) * 1_000_000_000
        self.vbuckets: list[VBucket] = []
        for vb in range(num_vbuckets):
            sel = order[bounds[vb]:bounds[vb + 1]]
            uuid = self.rng.randrange(1, 1 << 48)
            self.vbuckets.append(VBucket(vb, uuid, keys[sel], values[sel],
                                         self.cas_base + vb * 10_000_000_000, checkpoint_items))
        self.live_keys: list[list[bytes]] | None = None
        self.cas_clock = self.cas_base + (1 << 58)
        self.generation = 0        # bumps when items are added (wakes idle streams)

    def _values(self, n: int, size: int) -> np.ndarray:
        """`{"n":"NNNNNNNN","r":"<hex>"}` exactly `size` bytes, hex from the seeded RNG."""
        out = np.zeros((n, size), np.uint8)
        if n == 0:
            return out
        gen = np.random.default_rng(self.seed)
        out[:, 0:6] = np.frombuffer(b'{"n":"', np.uint8)
        digits = np.arange(n, dtype=np.int64)
        for j in range(8):
            out[:, 13 - j] = 48 + (digits // 10 ** j) % 10
        out[:, 14:21] = np.frombuffer(b'","r":"', np.uint8)
        hexchars = np.frombuffer(b"0123456789abcdef", np.uint8)
        out[:, 21:size - 2] = hexchars[gen.integers(0, 16, size=(n, size - 23))]
        out[:, size - 2:] = np.frombuffer(b'"}', np.uint8)
        return out

    def next_cas(self) -> int:
        self.cas_clock += 1
        return self.cas_clock

    def mutate_random(self, count: int) -> None:
        """Live traffic: updates of existing documents (most), new documents, deletions and
        expirations, on vbuckets chosen by the seeded RNG."""
        if self.live_keys is None:
            self.live_keys = [[bytes(k) for k in vb.disk_keys[:vb.disk_high]] for vb in self.vbuckets]
        rng = self.rng
        for _ in range(count):
            roll = rng.random()
            if roll < 0.15:
                key = b"doc-%08d" % self.next_doc
                self.next_doc += 1
                vb = vbucket_of(key, self.num_vbuckets)
                self.live_keys[vb].append(key)
                kind = "m"
            else:
                vb = rng.randrange(self.num_vbuckets)
                keys = self.live_keys[vb]
                if not keys:
                    continue
                key = keys[rng.randrange(len(keys))]
                kind = "m" if roll < 0.85 else ("d" if roll < 0.95 else "x")
            value = b'{"u":%d,"r":"%08x"}' % (self.vbuckets[vb].high_seqno + 1, rng.randrange(1 << 32))
            self.vbuckets[vb].append(key, value, kind, self.next_cas())
        self.generation += 1

    def fail_over_all(self, loss: int) -> dict[int, int]:
        """Every vbucket fails over, losing its last `loss` seqnos: {vb: branch seqno}."""
        out = {}
        for vb in self.vbuckets:
            out[vb.vbid] = vb.fail_over(self.rng.randrange(1, 1 << 48), vb.high_seqno - loss, self.rng,
                                        self.next_cas())
        self.generation += 1
        return out


# --------------------------------------------------------------------------- scenarios

@dataclasses.dataclass
class Scenarios:
    """Failure scenarios a test can ask for (each fires once per server unless noted)."""
    failover_at: int | None = None     # after N stream frames: fail over every vbucket, drop
    failover_loss: int = 10            # seqnos each vbucket loses in that failover
    disconnect_after: int | None = None  # drop the first connection after N stream frames
    end_reasons: tuple[int, ...] = ()  # vbucket i's first stream ends with end_reasons[i]
    slow: float = 0.0                  # seconds between small send batches
    slow_frames: int = 16              # frames per batch when slow
    silent: bool = False               # after the first stream request: send nothing at all
    refuse_controls: tuple[str, ...] = ()  # DCP_CONTROL keys answered NOT_SUPPORTED


class ServerModel:
    """What all connections of one server share: buckets, users, scenario state."""

    def __init__(self, buckets: list[Bucket], users: dict[str, str] | None = None,
                 scenarios: Scenarios | None = None, seed: int = 0):
        self.buckets = {b.name: b for b in buckets}
        self.scenarios = scenarios or Scenarios()
        self.users = dict(users or {})
        self._creds = {}
        for user, password in self.users.items():
            for mech in sasl.SCRAM_HASHES:
                salt = hashlib.sha256(f"{seed}:{user}:{mech}".encode()).digest()[:16]
                self._creds[(user, mech)] = sasl.ScramCredentials.derive(mech, password, salt, 4096)
        self.connections_by_name: dict[bytes, "ProducerConnection"] = {}
        self.stream_frames = 0          # stream frames sent by every connection together
        self.failover_done = False
        self.disconnect_done = False
        self.end_reason_done: set[int] = set()
        self.silent_active = False
        self.accepted = 0
        self.stats: list[dict] = []     # one dict per connection, kept after it closes

    def credentials(self, user: str, mech: str):
        return self._creds.get((user, mech))

    def check_plain(self, user: str, password: str) -> bool:
        import hmac
        expected = self.users.get(user)
        return expected is not None and hmac.compare_digest(expected.encode(), password.encode())

    def connect(self, now: float) -> "ProducerConnection":
        self.accepted += 1
        return ProducerConnection(self, now, self.accepted)


# --------------------------------------------------------------------------- segments

class _Fixed:
    """n frames of size f in data (a pre-encoded blob)."""
    __slots__ = ("data", "f", "n", "i", "data_frames")

    def __init__(self, data, f: int, n: int, data_frames: bool = True):
        self.data, self.f, self.n, self.i, self.data_frames = memoryview(data), f, n, 0, data_frames

    def take(self, budget: int, max_frames: int):
        k = min(self.n - self.i, max(1, -(-budget // self.f)), max_frames)
        out = self.data[self.i * self.f:(self.i + k) * self.f]
        self.i += k
        return out, k

    @property
    def done(self):
        return self.i >= self.n


class _Var:
    """Frames of any size: data with frame start offsets."""
    __slots__ = ("data", "starts", "i", "data_frames")

    def __init__(self, frames: list[bytes]):
        self.data = memoryview(b"".join(frames))
        starts = [0]
        for fr in frames:
            starts.append(starts[-1] + len(fr))
        self.starts = starts
        self.i = 0

    def take(self, budget: int, max_frames: int):
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
    def done(self):
        return self.i >= len(self.starts) - 1


# --------------------------------------------------------------------------- streams

class Stream:
    def __init__(self, conn: "ProducerConnection", vb: VBucket, opaque: int, start: int, end: int,
                 end_reason: int | None):
        self.conn = conn
        self.vb = vb
        self.opaque = opaque
        self.cursor = start          # last seqno covered
        self.end = end               # inclusive, SEQNO_INFINITY for ever
        self.first_marker = True
        self.segments: list = []
        self.ended = False
        self.injected_end = end_reason   # scenario: end after the first data chunk
        self.sent_data = False

    def _marker(self, start: int, end: int, flags: int, disk: bool) -> bytes:
        c = self.conn
        if c.marker_v22 and disk:
            msg = m.SnapshotMarker(vbucket=self.vb.vbid, opaque=self.opaque, snap_version="2.2",
                                   snap_start=start, snap_end=end, snap_flags=flags, max_visible_seqno=end,
                                   high_completed_seqno=0, purge_seqno=self.vb.purge_seqno,
                                   high_prepared_seqno=0)
        elif c.sync_writes:
            msg = m.SnapshotMarker(vbucket=self.vb.vbid, opaque=self.opaque, snap_version="2.0",
                                   snap_start=start, snap_end=end, snap_flags=flags, max_visible_seqno=end,
                                   high_completed_seqno=0)
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
            self.segments.append(_Var([self.end_frame(self.injected_end)]))
            return True
        if self.cursor >= self.end:
            self.segments.append(_Var([self.end_frame(StreamEndReason.OK)]))
            return True
        high = vb.high_seqno
        if self.cursor >= high:
            return False
        c = self.conn
        snap_from = self.cursor if self.first_marker else self.cursor + 1
        if self.cursor < vb.disk_high:
            last = min(vb.disk_high, self.end)
            recs = vb.disk_records(c.collections, c.no_value, c.json)[self.cursor:last].copy()
            recs["opaque"] = self.opaque
            flags = SnapshotFlag.DISK | SnapshotFlag.CHECKPOINT
            self.segments.append(_Var([self._marker(snap_from, last, flags, True)]))
            self.segments.append(_Fixed(recs.tobytes(), recs.dtype.itemsize, len(recs)))
        else:
            last = min(vb.checkpoint_end(self.cursor + 1), high, self.end)
            first = self.cursor + 1
            items = vb.mem[first - vb.disk_high - 1:last - vb.disk_high]
            latest = {}
            for it in items:               # de-duplication within the snapshot
                latest[it.key] = it.seqno
            flags = SnapshotFlag.MEMORY
            if (first - vb.disk_high - 1) % vb.checkpoint_items == 0:
                flags |= SnapshotFlag.CHECKPOINT
            frames = [self._marker(snap_from, last, flags, False)]
            frames.extend(c.encode_item(vb.vbid, self.opaque, it) for it in items if latest[it.key] == it.seqno)
            self.segments.append(_Var(frames[:1]))
            self.segments.append(_Var(frames[1:]) if len(frames) > 1 else None)
            if self.segments[-1] is None:
                self.segments.pop()
        self.first_marker = False
        self.cursor = last
        return True


# --------------------------------------------------------------------------- connection

class ProducerConnection:
    """One client connection. receive() requests, pull() bytes to send, tick() timers.
    `closed` is set (to the reason) when the server drops the connection."""

    def __init__(self, server: ServerModel, now: float, conn_id: int = 1):
        self.server = server
        self.conn_id = conn_id
        self.parser = FrameParser()
        self.features: set[int] = set()
        self.user: str | None = None
        self.bucket: Bucket | None = None
        self.dcp_open = False
        self.name = b""
        self.open_flags = 0
        self.controls: dict[str, str] = {}
        self.buffer_size = 0
        self.outstanding = 0
        self.noop_interval: float | None = None
        self.noop_enabled = False
        self.noop_due: float | None = None
        self.noop_waiting: int | None = None    # opaque of an unanswered noop
        self.noop_opaque = NOOP_OPAQUE_BASE
        self.streams: dict[int, Stream] = {}
        self._order: list[int] = []
        self._rr = 0
        self._out: list[bytes] = []
        self._sasl = None
        self.closed: str | None = None
        self.next_send = 0.0
        self.last_rx = now
        self.stats = {"conn": conn_id, "max_outstanding": 0, "flow_blocked": 0, "noops_sent": 0,
                      "noops_answered": 0, "stream_frames": 0, "bytes_sent": 0, "acked": 0,
                      "stream_requests": 0, "rollbacks": 0, "closed": None}
        server.stats.append(self.stats)

    # ---- derived settings
    @property
    def collections(self) -> bool:
        return Feature.COLLECTIONS in self.features

    @property
    def json(self) -> bool:
        return Feature.JSON in self.features

    @property
    def no_value(self) -> bool:
        return bool(self.open_flags & (OpenFlag.NO_VALUE | OpenFlag.NO_VALUE_WITH_DATATYPE))

    @property
    def delete_times(self) -> bool:
        return bool(self.open_flags & OpenFlag.INCLUDE_DELETE_TIMES)

    @property
    def marker_v22(self) -> bool:
        return self.controls.get("max_marker_version") == "2.2"

    @property
    def sync_writes(self) -> bool:
        return self.controls.get("enable_sync_writes") == "true"

    def close(self, reason: str) -> None:
        if self.closed is None:
            self.closed = reason
            self.stats["closed"] = reason
        if self.server.connections_by_name.get(self.name) is self:
            del self.server.connections_by_name[self.name]

    # ---- input
    def receive(self, data: bytes, now: float) -> None:
        if self.closed:
            return
        self.last_rx = now
        try:
            frames = self.parser.feed(data)
        except ProtocolError as exc:
            for fr in getattr(exc, "frames", []):
                self._handle(m.decode(fr, self.collections), now)
            self.close(f"bad frame: {exc.message}")
            return
        for fr in frames:
            if self.closed:
                return
            self._handle(m.decode(fr, self.collections), now)

    def _reply(self, req, status: int = Status.SUCCESS, value: bytes = b"", cls=None, **kw) -> None:
        if cls is not None:
            msg = cls(opaque=req.opaque, status=status, **kw)
        else:
            msg = m.Response(opcode=req.op_code, opaque=req.opaque, status=status, value=value)
        self._out.append(m.encode(msg))

    def _handle(self, msg, now: float) -> None:
        t = type(msg)
        if msg.IS_RESPONSE:
            if msg.op_code == 0x5C and self.noop_waiting == msg.opaque:
                self.noop_waiting = None
                self.stats["noops_answered"] += 1
            return
        if t is m.BufferAck:
            self.outstanding = max(0, self.outstanding - msg.bytes_acked)
            self.stats["acked"] += msg.bytes_acked
            return
        if t is m.Hello:
            self.features = {f for f in msg.features if f in GRANTED_FEATURES}
            self._reply(msg, cls=m.HelloResponse, features=tuple(f for f in msg.features if f in self.features))
            return
        if t is m.SaslListMechs:
            self._reply(msg, value=sasl.SERVER_MECHS.encode())
            return
        if t is m.SaslAuth or t is m.SaslStep:
            self._sasl_step(msg)
            return
        if self.server.users and self.user is None:
            self._reply(msg, Status.EACCESS)
            return
        if t is m.SelectBucket:
            bucket = self.server.buckets.get(msg.bucket.decode("utf-8", "replace"))
            if bucket is None:
                self._reply(msg, Status.KEY_ENOENT)
            else:
                self.bucket = bucket
                self._reply(msg)
            return
        if t is m.DcpOpen:
            self._open(msg)
            return
        if t is m.GetAllVbSeqnos:
            if self.bucket is None:
                self._reply(msg, Status.NO_BUCKET)
            else:
                self._reply(msg, cls=m.GetAllVbSeqnosResponse,
                            seqnos=tuple((vb.vbid, vb.high_seqno) for vb in self.bucket.vbuckets))
            return
        if msg.op_code in (0x51, 0x52, 0x53, 0x54, 0x5C, 0x5D, 0x5E) and not self.dcp_open:
            self._reply(msg, Status.EINVAL)
            return
        if t is m.Control:
            self._control(msg, now)
        elif t is m.StreamRequest:
            self._stream_request(msg)
        elif t is m.GetFailoverLog:
            vb = self._vb(msg.vbucket)
            if vb is None:
                self._reply(msg, Status.NOT_MY_VBUCKET)
            else:
                self._reply(msg, cls=m.FailoverLogResponse, failover_log=tuple(vb.failover_log))
        elif t is m.CloseStream:
            st = self.streams.pop(msg.vbucket, None)
            if st is None:
                self._reply(msg, Status.KEY_ENOENT)
                return
            self._order.remove(msg.vbucket)
            self._reply(msg)
            if self.controls.get("send_stream_end_on_client_close_stream") == "true":
                self._out.append(st.end_frame(StreamEndReason.CLOSED))
                self.outstanding += 28
        elif t is m.Noop:   # a consumer must never send DCP_NOOP: kv_engine disconnects
            self.close("DCP_NOOP received from the client")
        else:
            self._reply(msg, Status.UNKNOWN_COMMAND)

    def _vb(self, vbid: int) -> VBucket | None:
        if self.bucket is None or vbid >= self.bucket.num_vbuckets:
            return None
        return self.bucket.vbuckets[vbid]

    def _sasl_step(self, msg) -> None:
        mech = msg.mechanism.decode("ascii", "replace")
        try:
            if mech == "PLAIN":
                self.user = sasl.check_plain(msg.data, self.server.check_plain)
                self._reply(msg)
                return
            if mech not in sasl.SCRAM_HASHES:
                self._reply(msg, Status.AUTH_ERROR)
                return
            if type(msg) is m.SaslAuth:
                self._sasl = sasl.ScramServer(mech, self.server.credentials)
                self._reply(msg, Status.AUTH_CONTINUE, self._sasl.first(msg.data))
                return
            if self._sasl is None or self._sasl.mechanism != mech:
                self._reply(msg, Status.EINVAL)
                return
            final = self._sasl.final(msg.data)
            self.user = self._sasl.user
            self._sasl = None
            self._reply(msg, Status.SUCCESS, final)
        except ProtocolError:
            self._sasl = None
            self._reply(msg, Status.AUTH_ERROR)

    def _open(self, msg) -> None:
        if self.bucket is None:
            self._reply(msg, Status.NO_BUCKET)
            return
        flags = msg.flags
        bad = flags & (OpenFlag.NOTIFIER | 0x10 | 0x80)
        both = (flags & OpenFlag.NO_VALUE) and (flags & OpenFlag.NO_VALUE_WITH_DATATYPE)
        if self.dcp_open or bad or both or not msg.name or len(msg.name) > 200:
            self._reply(msg, Status.EINVAL)
            return
        if not flags & OpenFlag.PRODUCER:   # a consumer-type connection: not offered here
            self._reply(msg, Status.NOT_SUPPORTED)
            return
        older = self.server.connections_by_name.get(msg.name)
        if older is not None and older is not self:
            older.close("replaced by a connection with the same name")
        self.server.connections_by_name[msg.name] = self
        self.name = msg.name
        self.open_flags = flags
        self.dcp_open = True
        self._reply(msg)

    def _control(self, msg, now: float) -> None:
        key = msg.key.decode("utf-8", "replace")
        val = msg.value.decode("utf-8", "replace")
        ok = Status.SUCCESS
        if not key or not val:
            ok = Status.EINVAL
        elif key in self.server.scenarios.refuse_controls:
            ok = Status.NOT_SUPPORTED
        elif key == "connection_buffer_size":
            if not val.isdigit() or int(val) > 0xFFFFFFFF:
                ok = Status.EINVAL
            else:
                self.buffer_size = int(val)
        elif key == "enable_noop":
            if val not in ("true", "false"):
                ok = Status.EINVAL
            else:
                self.noop_enabled = val == "true"
                self.noop_due = now + (self.noop_interval or 20.0) if self.noop_enabled else None
        elif key == "set_noop_interval":
            try:
                interval = float(val)
            except ValueError:
                interval = -1
            if interval < MIN_NOOP_INTERVAL:
                ok = Status.EINVAL
            else:
                self.noop_interval = interval
                if self.noop_enabled:
                    self.noop_due = now + interval
        elif key in ("send_stream_end_on_client_close_stream", "v7_dcp_status_codes", "enable_expiry_opcode"):
            ok = Status.SUCCESS if val == "true" else Status.EINVAL
        elif key == "set_priority":
            ok = Status.SUCCESS if val in ("high", "medium", "low") else Status.EINVAL
        elif key in ("supports_cursor_dropping", "supports_cursor_dropping_vulcan", "supports_hifi_MFU",
                     "enable_sync_writes"):
            ok = Status.SUCCESS if val in ("true", "false") else Status.EINVAL
        elif key == "consumer_name":
            ok = Status.SUCCESS
        elif key == "max_marker_version":
            ok = Status.SUCCESS if (val == "2.2" and self.collections) else Status.NOT_SUPPORTED
        elif key in ("enable_stream_id", "enable_out_of_order_snapshots", "change_streams",
                     "flatbuffers_system_events", "stream_buffer_size", "force_value_compression",
                     "include_deleted_user_xattrs", "backfill_order"):
            ok = Status.NOT_SUPPORTED   # features this producer does not implement
        else:
            ok = Status.EINVAL
        if ok == Status.SUCCESS:
            self.controls[key] = val
        self._reply(msg, ok)

    def _stream_request(self, req) -> None:
        self.stats["stream_requests"] += 1
        vb = self._vb(req.vbucket)
        sc = self.server.scenarios
        if vb is None:
            self._reply(req, Status.NOT_MY_VBUCKET)
            return
        if (self.collections or self.open_flags & OpenFlag.INCLUDE_XATTRS) and not self.noop_enabled:
            self._reply(req, Status.NOT_SUPPORTED)   # dcp_noop_mandatory_for_v5_features
            return
        if req.flags & (StreamRequestFlag.NO_VALUE | StreamRequestFlag.TAKEOVER | StreamRequestFlag.CACHE_TRANSFER):
            self._reply(req, Status.EINVAL)
            return
        start, end, uuid = req.start_seqno, req.end_seqno, req.vbucket_uuid
        snap_start, snap_end = req.snap_start, req.snap_end
        high = vb.high_seqno
        if req.flags & StreamRequestFlag.FROM_LATEST:
            start = snap_start = snap_end = high
            if uuid == 0:
                uuid = vb.uuid
        if start > end or not snap_start <= start <= snap_end:
            self._reply(req, Status.ERANGE)
            return
        if req.vbucket in self.streams:
            self._reply(req, Status.KEY_EEXISTS)
            return
        rb = rollback_seqno(start=start, vb_uuid=uuid, snap_start=snap_start, snap_end=snap_end,
                            failover_log=vb.failover_log, high_seqno=high, purge_seqno=vb.purge_seqno,
                            strict=bool(req.flags & StreamRequestFlag.STRICT_VB_UUID))
        if rb is not None:
            self.stats["rollbacks"] += 1
            self._reply(req, Status.ROLLBACK, cls=m.StreamRequestResponse, rollback_seqno=rb)
            return
        if req.flags & StreamRequestFlag.TO_LATEST:
            end = high
        if start > end or start > high:
            self._reply(req, Status.ERANGE)
            return
        self._reply(req, cls=m.StreamRequestResponse, failover_log=tuple(vb.failover_log))
        reason = None
        if req.vbucket < len(sc.end_reasons) and req.vbucket not in self.server.end_reason_done:
            self.server.end_reason_done.add(req.vbucket)
            reason = sc.end_reasons[req.vbucket]
        self.streams[req.vbucket] = Stream(self, vb, req.opaque, start, end, reason)
        self._order.append(req.vbucket)
        if sc.silent:
            self.server.silent_active = True

    def encode_item(self, vbid: int, opaque: int, it: Item) -> bytes:
        cid = 0 if self.collections else None
        if it.kind == "m":
            value = b"" if self.no_value else it.value
            dt = it.datatype if (self.json and value) else 0
            return m.encode(m.Mutation(vbucket=vbid, opaque=opaque, cas=it.cas, datatype=dt, key=it.key,
                                       collection_id=cid, value=value, by_seqno=it.seqno, rev_seqno=it.rev))
        if it.kind == "x" and self.delete_times and self.controls.get("enable_expiry_opcode") == "true":
            return m.encode(m.Expiration(vbucket=vbid, opaque=opaque, cas=it.cas, key=it.key, collection_id=cid,
                                         by_seqno=it.seqno, rev_seqno=it.rev, delete_time=0))
        dt = 0 if self.delete_times else None
        return m.encode(m.Deletion(vbucket=vbid, opaque=opaque, cas=it.cas, key=it.key, collection_id=cid,
                                   by_seqno=it.seqno, rev_seqno=it.rev, delete_time=dt))

    # ---- timers
    def tick(self, now: float) -> None:
        if self.closed or self.server.silent_active:
            return
        if self.noop_enabled and self.noop_due is not None and now >= self.noop_due:
            if self.noop_waiting is not None:
                self.close("noop not answered")
                return
            self.noop_opaque += 1
            self.noop_waiting = self.noop_opaque
            self._out.append(m.encode(m.Noop(opaque=self.noop_opaque)))
            self.stats["noops_sent"] += 1
            self.noop_due = now + (self.noop_interval or 20.0)

    def next_deadline(self) -> float | None:
        """When tick() or pull() next has something to do on its own."""
        times = [t for t in (self.noop_due if self.noop_enabled else None,
                             self.next_send if self.server.scenarios.slow else None) if t is not None]
        return min(times) if times else None

    # ---- output
    def pull(self, now: float, limit: int = PULL_LIMIT) -> list:
        """Bytes to send now: responses and noops first, then stream data within the flow
        control window. An empty list means wait (for input, an ack, a timer or new items)."""
        out = self._out
        self._out = []
        if self.closed:
            return out
        srv = self.server
        if srv.silent_active:
            return out
        sc = srv.scenarios
        if sc.slow and now < self.next_send:
            return out
        total = 0
        max_frames = sc.slow_frames if sc.slow else 1 << 60
        idle_rounds = 0
        while total < limit and self._order and max_frames > 0:
            if self.buffer_size:
                budget = self.buffer_size - self.outstanding
                if budget <= 0:
                    self.stats["flow_blocked"] += 1
                    break
            else:
                budget = STREAM_CHUNK
            budget = min(budget, STREAM_CHUNK, limit - total)
            frames_cap = max_frames
            for limit_at, done_flag in ((sc.disconnect_after, srv.disconnect_done),
                                        (sc.failover_at, srv.failover_done)):
                if limit_at is not None and not done_flag:
                    frames_cap = min(frames_cap, limit_at - srv.stream_frames)
            if frames_cap <= 0:
                self._fire_scenarios()
                break
            self._rr %= len(self._order)
            vbid = self._order[self._rr]
            st = self.streams[vbid]
            if not st.segments and not st.refill():
                self._rr += 1
                idle_rounds += 1
                if idle_rounds >= len(self._order):
                    break
                continue
            idle_rounds = 0
            seg = st.segments[0]
            data, k = seg.take(budget, frames_cap)
            if seg.done:
                st.segments.pop(0)
            if isinstance(seg, _Fixed):
                st.sent_data = True
                if st.injected_end is not None:   # scenario: end in the middle of the snapshot
                    st.segments.clear()
            out.append(data)
            n = len(data)
            total += n
            self.outstanding += n
            if self.outstanding > self.stats["max_outstanding"]:
                self.stats["max_outstanding"] = self.outstanding
            self.stats["stream_frames"] += k
            srv.stream_frames += k
            max_frames -= k
            if st.ended and not st.segments:
                del self.streams[vbid]
                self._order.remove(vbid)
            else:
                self._rr += 1
            self._fire_scenarios()
            if self.closed:
                break
        self.stats["bytes_sent"] += sum(len(x) for x in out)
        if sc.slow and total:
            self.next_send = now + sc.slow
        return out

    def _fire_scenarios(self) -> None:
        srv, sc = self.server, self.server.scenarios
        if sc.disconnect_after is not None and not srv.disconnect_done and srv.stream_frames >= sc.disconnect_after:
            srv.disconnect_done = True
            self.close(f"scenario: disconnect after {sc.disconnect_after} frames")
        if sc.failover_at is not None and not srv.failover_done and srv.stream_frames >= sc.failover_at:
            srv.failover_done = True
            if self.bucket is not None:
                self.bucket.fail_over_all(sc.failover_loss)
            self.close(f"scenario: failover after {sc.failover_at} frames")

    @property
    def wants_write(self) -> bool:
        return bool(self._out)


def server_from_options(*, bucket: str = "default", vbuckets: int = 64, items: int = 10_000, seed: int = 0,
                        value_size: int = 61, users: dict | None = None, scenarios: Scenarios | None = None,
                        checkpoint_items: int = 100) -> ServerModel:
    return ServerModel([Bucket(bucket, vbuckets, items, seed, value_size, checkpoint_items)], users,
                       scenarios, seed)


def rate_items(rate: float, since: float, now: float, carry: float) -> tuple[int, float]:
    """How many live items to generate for `rate` per second between since and now."""
    want = rate * max(0.0, now - since) + carry
    n = int(math.floor(want))
    return n, want - n
