"""The producer side of DCP, sans-IO: one state machine per client connection (handshake,
SASL, controls, cluster config and NOT_MY_VBUCKET, stream requests with the exact rollback
decision of DCP_DIGEST §6.2, snapshots with de-duplication, flow control with the server's
sizes, noops and idle drops, failure scenarios and scripted topology events).

The generated bucket is producer_bucket.py, the streams and their pre-encoded segments
producer_streams.py, what connections share (users, scenarios, topology events)
producer_server.py, the cluster map and its events cluster.py, the DCP_CONTROL keys
producer_controls.py.

Speed: the documents generated at start-up are pre-encoded per vbucket into one numpy
record array (one fixed-size mutation frame per seqno), so a backfill is a slice of one
bytes blob with the stream's opaque patched in bulk; flow control on fixed-size frames is
arithmetic, never a Python loop per frame. Live updates (`rate`) and the new branch after a
failover live in memory checkpoints and go through the codec one item at a time.

Time is always an argument: `receive(data, now)`, `pull(now)`, `tick(now)`.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from dcptool.protocol.dcp.server import kv
from dcptool.protocol.dcp.server import manifest as pcol
from dcptool.protocol.dcp.server import stream_ids as producer_sid
from dcptool.protocol.dcp.server.bucket import Bucket as Bucket
from dcptool.protocol.dcp.server.bucket import Item, VBucket
from dcptool.protocol.dcp.server.bucket import rollback_seqno as rollback_seqno
from dcptool.protocol.dcp.server.controls import control_status
from dcptool.protocol.dcp.server.shared import Scenarios as Scenarios
from dcptool.protocol.dcp.server.shared import ServerModel as ServerModel
from dcptool.protocol.dcp.server.shared import rate_items as rate_items
from dcptool.protocol.dcp.server.shared import (
    server_from_options as server_from_options,
)
from dcptool.protocol.dcp.server.stream_request import (
    LIVE_RANGE,
    Decision,
    decide,
    requested,
)
from dcptool.protocol.dcp.server.streams import Fixed, Stream, Var, encode_item
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire import sasl
from dcptool.protocol.dcp.wire.constants import (
    Feature,
    Opcode,
    OpenFlag,
    Status,
    StreamEndReason,
    StreamRequestFlag,
    stream_key,
)
from dcptool.protocol.dcp.wire.error_map import error_map
from dcptool.protocol.dcp.wire.frames import FrameParser
from dcptool.protocol.errors import ProtocolError

NOOP_OPAQUE_BASE = 10_000_000     # kv_engine starts its noop opaques here
GRANTED_FEATURES = (Feature.TCP_NODELAY, Feature.MUTATION_SEQNO, Feature.XATTR, Feature.XERROR,
                    Feature.SELECT_BUCKET, Feature.SNAPPY, Feature.JSON, Feature.DUPLEX,
                    Feature.ALT_REQUEST_SUPPORT, Feature.SYNC_REPLICATION, Feature.COLLECTIONS,
                    Feature.CLUSTERMAP_CHANGE_NOTIFICATION, Feature.CLUSTERMAP_CHANGE_NOTIFICATION_BRIEF)
STREAM_CHUNK = 64 * 1024          # bytes taken from one stream before moving to the next
PULL_LIMIT = 1024 * 1024          # bytes handed to the transport per pull
# the DCP requests refused (EINVAL) before DCP_OPEN
NEEDS_DCP_OPEN = frozenset({Opcode.DCP_ADD_STREAM, Opcode.DCP_CLOSE_STREAM, Opcode.DCP_STREAM_REQ,
                            Opcode.DCP_GET_FAILOVER_LOG, Opcode.DCP_NOOP, Opcode.DCP_BUFFER_ACK,
                            Opcode.DCP_CONTROL})



class Route(NamedTuple):
    """How a request is answered: its handler (connection, request, now); the message class its
    opcode decodes to (None: any; another class, a layout that did not decode, is an unknown
    command); whether it waits for authentication and, in NEEDS_DCP_OPEN, for DCP_OPEN."""
    handler: Callable[[Any, Any, float], None]
    cls: Any
    after_auth: bool = True


def _unknown(conn: Any, msg: Any, now: float) -> None:
    conn.push(m.encode(m.Response(opcode=msg.op_code, opaque=msg.opaque, status=Status.UNKNOWN_COMMAND)))


def refusal(req: Any, d: Decision, stats: dict[str, Any]) -> Any:
    """The answer to a STREAM_REQ that the decision `d` refuses (a rollback is counted in
    `stats`), None when it is accepted: the generated producer and playback alike."""
    if d.status == Status.ROLLBACK:
        stats["rollbacks"] += 1
        return m.StreamRequestResponse(opaque=req.opaque, status=Status.ROLLBACK, rollback_seqno=d.rollback_seqno)
    if d.status != Status.SUCCESS:
        return m.Response(opcode=req.op_code, opaque=req.opaque, status=d.status)
    return None


# --------------------------------------------------------------------------- connection

class ProducerConnection:
    """One client connection. receive() requests, pull() bytes to send, tick() timers.
    `closed` is set (to the reason) when the server drops the connection."""

    def __init__(self, server: ServerModel, now: float, conn_id: int = 1, node: int = 0) -> None:
        self.server = server
        self.conn_id = conn_id
        self.node = node
        self.parser = FrameParser()
        self.features: set[int] = set()
        self.user: str | None = None
        self.bucket: Bucket | None = None
        self.dcp_open = False
        self.name = b""
        self.name_key: tuple[int, str, bytes] | None = None      # (node, bucket, name): DCP names are per node and bucket
        self.open_flags = 0
        self.controls: dict[str, str] = {}
        self.buffer_size = 0
        self.outstanding = 0
        self.noop_interval: float | None = None
        self.noop_enabled = False
        self.noop_due: float | None = None
        self.noop_waiting: int | None = None    # opaque of an unanswered noop
        self.noop_opaque = NOOP_OPAQUE_BASE
        self.streams: dict[int, Stream] = {}    # by stream_key(vbucket, sid)
        self._order: list[int] = []
        self._rr = 0
        self._out: list[bytes] = []
        self._sasl: sasl.ScramServer | None = None
        self.closed: str | None = None
        self.next_send = 0.0
        self.last_rx = now
        self.stats: dict[str, Any] = {"conn": conn_id, "max_outstanding": 0, "flow_blocked": 0, "noops_sent": 0,
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

    @property
    def compress(self) -> bool:
        return self.controls.get("force_value_compression") == "true"

    @property
    def stream_ids(self) -> bool:
        return self.controls.get("enable_stream_id") == "true"

    @property
    def sequential(self) -> bool:
        return self.controls.get("backfill_order") == "sequential"

    def close(self, reason: str) -> None:
        kv.complete(self)       # durable writes under way complete, whoever is there to hear it
        if self.closed is None:
            self.closed = reason
            self.stats["closed"] = reason
        if self.name_key is not None and self.server.connections_by_name.get(self.name_key) is self:
            del self.server.connections_by_name[self.name_key]
        self.server.connections.discard(self)

    def end_stream(self, vbid: int, reason: int) -> None:
        """End the vbucket's streams now (what is queued is dropped: frames are whole)."""
        for st in self.streams.values():
            if st.vb.vbid == vbid and not st.ended:
                st.segments.clear()
                st.injected_end = None
                st.segments.append(Var([st.end_frame(reason)]))

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

    def push(self, frame: bytes) -> None:
        """Queue a frame to send, before any more stream data: a KV answer (kv.py) or a frame
        the server sends unasked (a cluster-map notification)."""
        self._out.append(frame)

    def _reply(self, req: Any, status: int = Status.SUCCESS, value: bytes = b"", cls: Any = None, **kw: Any) -> None:
        if cls is not None:
            msg = cls(opaque=req.opaque, status=status, **kw)
        else:
            msg = m.Response(opcode=req.op_code, opaque=req.opaque, status=status, value=value)
        self._out.append(m.encode(msg))

    def _reply_json(self, req: Any, status: int, body: bytes) -> None:
        dt = 1 if (body and self.json) else 0
        self._out.append(m.encode(m.Response(opcode=req.op_code, opaque=req.opaque, status=status, value=body,
                                             datatype=dt)))

    def not_my_vbucket(self, req: Any) -> None:
        """NOT_MY_VBUCKET with this node's current config as the body, as Couchbase does."""
        cl = self.server.cluster_for(self.bucket)
        self._reply_json(req, Status.NOT_MY_VBUCKET, cl.render(self.node) if cl is not None else b"")

    def owned(self, vbid: int) -> bool:
        cl = self.server.cluster_for(self.bucket)
        return cl is None or cl.is_active(self.node, vbid)

    def _cluster_config(self, req: Any, now: float) -> None:
        """GET_CLUSTER_CONFIG (0xb5), before authentication too: the bucket's config once a
        bucket is selected, else the cluster part of it; KEY_ENOENT without a cluster."""
        cl = self.server.cluster_for(self.bucket) if self.bucket is not None else self.server.cluster
        if cl is None:
            self._reply(req, Status.KEY_ENOENT)
        elif self.bucket is None:
            self._reply_json(req, Status.SUCCESS, cl.render_global(self.node))
        else:
            self._reply_json(req, Status.SUCCESS, cl.render(self.node))

    # ---- requests: one handler per opcode, found in ROUTES (below the handlers)
    def _handle(self, msg: Any, now: float) -> None:
        if msg.IS_RESPONSE:
            if msg.op_code == Opcode.DCP_NOOP and self.noop_waiting == msg.opaque:
                self.noop_waiting = None
                self.stats["noops_answered"] += 1
            return
        route = self.ROUTES.get(msg.op_code)
        if route is not None and route.cls is not None and type(msg) is not route.cls:
            route = None    # a known opcode in a layout that does not decode: an unknown command
        if route is None or route.after_auth:
            if self.server.users and self.user is None:
                self._reply(msg, Status.EACCESS)
                return
            if msg.op_code in NEEDS_DCP_OPEN and not self.dcp_open:
                self._reply(msg, Status.EINVAL)
                return
        (_unknown if route is None else route.handler)(self, msg, now)

    def _buffer_ack(self, msg: Any, now: float) -> None:
        self.outstanding = max(0, self.outstanding - msg.bytes_acked)
        self.stats["acked"] += msg.bytes_acked

    def _hello(self, msg: Any, now: float) -> None:
        self.features = {f for f in msg.features if f in GRANTED_FEATURES}
        if Feature.CLUSTERMAP_CHANGE_NOTIFICATION_BRIEF in self.features:   # brief wins (CLUSTER.md)
            self.features.discard(Feature.CLUSTERMAP_CHANGE_NOTIFICATION)
        self._reply(msg, cls=m.HelloResponse, features=tuple(f for f in msg.features if f in self.features))

    def _sasl_mechs(self, msg: Any, now: float) -> None:
        self._reply(msg, value=sasl.SERVER_MECHS.encode())

    def _error_map(self, msg: Any, now: float) -> None:
        status, body = error_map(msg.version)
        self._reply_json(msg, status, body)

    def _kv(self, msg: Any, now: float) -> None:
        kv.handle(self, msg, now)     # documents (KV): kv.py

    def _select_bucket(self, msg: Any, now: float) -> None:
        bucket = self.server.buckets.get(msg.bucket.decode("utf-8", "replace"))
        if bucket is None:
            self._reply(msg, Status.KEY_ENOENT)
        else:
            self.bucket = bucket
            self._reply(msg)

    def _manifest(self, msg: Any, now: float) -> None:
        self._reply_json(msg, *pcol.manifest_reply(self.bucket))

    def _all_vb_seqnos(self, msg: Any, now: float) -> None:
        if self.bucket is None:
            self._reply(msg, Status.NO_BUCKET)
        else:
            self._reply(msg, cls=m.GetAllVbSeqnosResponse,
                        seqnos=tuple((vb.vbid, vb.high_seqno) for vb in self._vbuckets_in_state(msg.extras)))

    def _failover_log(self, msg: Any, now: float) -> None:
        vb = self._vb(msg.vbucket)
        if vb is None:
            self._reply(msg, Status.NOT_MY_VBUCKET)
        elif not self.owned(msg.vbucket):
            self.not_my_vbucket(msg)
        else:
            self._reply(msg, cls=m.FailoverLogResponse, failover_log=tuple(vb.failover_log))

    def _close_stream(self, msg: Any, now: float) -> None:
        sid = msg.stream_id
        if (sid is not None) != self.stream_ids or sid == 0:
            self._reply(msg, Status.DCP_STREAM_ID_INVALID)
            return
        key = stream_key(msg.vbucket, sid or 0)
        st = self.streams.pop(key, None)
        if st is None:
            self._reply(msg, Status.KEY_ENOENT)
            return
        self._order.remove(key)
        self._reply(msg)
        if self.controls.get("send_stream_end_on_client_close_stream") == "true":
            end = st.end_frame(StreamEndReason.CLOSED)
            end = producer_sid.tag_frame(end, sid) if sid else end
            self._out.append(end)
            self.outstanding += len(end)

    def _client_noop(self, msg: Any, now: float) -> None:
        self.close("DCP_NOOP received from the client")   # a consumer must never send one: kv_engine disconnects

    def _vbuckets_in_state(self, extras: bytes) -> list[VBucket]:
        cl = self.server.cluster_for(self.bucket)
        vbs = self.bucket.vbuckets if self.bucket is not None else []
        return vbs if cl is None else [vbs[i] for i in cl.vbuckets_in_state(self.node, extras)]

    def _vb(self, vbid: int) -> VBucket | None:
        if self.bucket is None or vbid >= self.bucket.num_vbuckets:
            return None
        return self.bucket.vbuckets[vbid]

    def _sasl_step(self, msg: Any, now: float) -> None:
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

    def _open(self, msg: Any, now: float) -> None:
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
        # as kv_engine: a name is one connection's on a node and bucket (each node of a
        # cluster keeps its own), so a second DCP_OPEN of the name there replaces the first
        key = (self.node, self.bucket.name, msg.name)
        older = self.server.connections_by_name.get(key)
        if older is not None and older is not self:
            older.close("replaced by a connection with the same name")
            self.server.topology_changes += 1   # the transports wake: the older one closes now
        self.server.connections_by_name[key] = self
        self.name_key = key
        self.name = msg.name
        self.open_flags = flags
        self.dcp_open = True
        self._reply(msg)

    def _control(self, msg: Any, now: float) -> None:
        key = msg.key.decode("utf-8", "replace")
        val = msg.value.decode("utf-8", "replace")
        ok = control_status(self, key, val, now)
        if ok == Status.SUCCESS:
            self.controls[key] = val
        self._reply(msg, ok)

    def _stream_request(self, req: Any, now: float) -> None:
        self.stats["stream_requests"] += 1
        vb = self._vb(req.vbucket)
        sc = self.server.scenarios
        if vb is None:
            self._reply(req, Status.NOT_MY_VBUCKET)
            return
        if not self.owned(req.vbucket):
            self.not_my_vbucket(req)
            return
        if (self.collections or self.open_flags & OpenFlag.INCLUDE_XATTRS) and not self.noop_enabled:
            self._reply(req, Status.NOT_SUPPORTED)   # dcp_noop_mandatory_for_v5_features
            return
        if req.flags & (StreamRequestFlag.NO_VALUE | StreamRequestFlag.TAKEOVER | StreamRequestFlag.CACHE_TRANSFER):
            self._reply(req, Status.EINVAL)
            return
        high = vb.high_seqno
        r = requested(req, high, vb.uuid)
        if r is None:
            self._reply(req, Status.ERANGE)
            return
        sstatus, sid, value = producer_sid.split_sid(req.value, self.stream_ids)
        if sstatus != Status.SUCCESS:
            self._reply(req, sstatus)
            return
        key = stream_key(req.vbucket, sid)
        if key in self.streams:
            self._reply(req, Status.KEY_EEXISTS)
            return
        fstatus, flt, fbody = pcol.parse_filter(value, getattr(self.bucket, "manifest", None), self.collections)
        if fstatus != Status.SUCCESS:
            self._reply_json(req, fstatus, fbody)
            return
        d = decide(req, r, failover_log=vb.failover_log, high=high, purge_seqno=vb.purge_seqno,
                   in_range=LIVE_RANGE)
        no = refusal(req, d, self.stats)
        if no is not None:
            self._out.append(m.encode(no))
            return
        start, end, snap_start, snap_end = r.start, d.end, r.snap_start, r.snap_end
        self._reply(req, cls=m.StreamRequestResponse, failover_log=tuple(vb.failover_log))
        reason = None
        if req.vbucket < len(sc.end_reasons) and req.vbucket not in self.server.end_reason_done:
            self.server.end_reason_done.add(req.vbucket)
            reason = sc.end_reasons[req.vbucket]
        # kv_engine: a first marker never starts after the snapshot the client was inside
        partial = snap_start if snap_start < start <= snap_end else None
        st = self.streams[key] = Stream(self, vb, req.opaque, start, end, reason, partial)
        st.flt = flt
        st.sid = sid
        st.sid_seg = None          # the segment last tagged with the stream id
        self._order.append(key)
        if sc.silent:
            self.server.silent_active = True

    def encode_item(self, vbid: int, opaque: int, it: Item) -> bytes:
        return encode_item(self, vbid, opaque, it)

    # ---- timers
    def tick(self, now: float) -> None:
        if self.closed or self.server.silent_active:
            return
        kv.tick(self, now)      # durable writes complete, the expiry pager
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
                             self.next_send if self.server.scenarios.slow else None,
                             kv.deadline(self, self.last_rx)) if t is not None]
        return min(times) if times else None

    # ---- output
    def pull(self, now: float, limit: int = PULL_LIMIT) -> list[bytes]:
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
                                        (sc.failover_at, srv.failover_done),
                                        (srv.cluster.next_event_at() if srv.cluster else None, False),
                                        (pcol.next_event_at(self.bucket), False)):
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
            if st.sid and seg is not st.sid_seg:    # alt framing with the stream id (producer_sid.py)
                seg = st.segments[0] = st.sid_seg = producer_sid.tag_segment(seg, st.sid)
            data, k = seg.take(budget, frames_cap)
            if seg.done:
                st.segments.pop(0)
            if isinstance(seg, Fixed):
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
            elif not self.sequential:
                self._rr += 1
            self._fire_scenarios()
            if self._out:       # a cluster map pushed just now goes before any more data
                out.extend(self._out)
                self._out = []
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
        pcol.fire_due(srv, self.bucket)
        cl = srv.cluster
        if cl is not None and cl.events and srv.stream_frames >= cl.events[0].at:
            srv.apply_changes(cl.fire_due(srv.stream_frames, sc.failover_loss))

    @property
    def wants_write(self) -> bool:
        return bool(self._out)

    # opcode -> Route, as the codec's REQUEST_READERS: answered before authentication, then the
    # KV commands (kv.py), then the DCP requests; an opcode not here is an unknown command
    ROUTES: dict[int, Route] = {
        **{r.cls.OPCODE: r for r in (
            Route(_select_bucket, m.SelectBucket), Route(_open, m.DcpOpen), Route(_all_vb_seqnos, m.GetAllVbSeqnos),
            Route(_control, m.Control), Route(_stream_request, m.StreamRequest),
            Route(_failover_log, m.GetFailoverLog), Route(_close_stream, m.CloseStream),
            Route(_client_noop, m.Noop))},
        Opcode.GET_COLLECTIONS_MANIFEST: Route(_manifest, None),
        **dict.fromkeys(kv.OPCODES, Route(_kv, m.Request)),
        **dict.fromkeys((c.OPCODE for c in kv.TYPED_REQUESTS), Route(_kv, None)),   # with-meta: any form
        **{r.cls.OPCODE: r for r in (
            Route(_buffer_ack, m.BufferAck, False), Route(_hello, m.Hello, False),
            Route(_sasl_mechs, m.SaslListMechs, False), Route(_sasl_step, m.SaslAuth, False),
            Route(_sasl_step, m.SaslStep, False), Route(_error_map, m.GetErrorMap, False))},
        Opcode.GET_CLUSTER_CONFIG: Route(_cluster_config, None, False),
    }


ServerModel.connection_class = ProducerConnection  # shared.py: None until here
