"""The consumer's handshake, sans-IO: HELLO, SASL (bounded rounds), SELECT_BUCKET,
GET_ALL_VB_SEQNOS, DCP_OPEN and the DCP_CONTROLs, each answer handled by one method. A part
of consumer.Consumer, composed in: it owns its state (the connection's phase, features,
controls, the collection filter), sends through the shared Link (link.py) and, once the last
control is answered, calls `on_ready()` (the consumer starts its streams). The phase is a
ConnPhase and moves only as phases.CONN_MOVES allows."""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

from dcptool.protocol.dcp.client import manifest as dcp_collections
from dcptool.protocol.dcp.client.consumer_api import (
    ConfigReceived,
    ConsumerConfig,
    ControlRefused,
    FilterResolved,
    FilterUnknown,
    HandshakeComplete,
    ServerVbuckets,
    in_shard,
)
from dcptool.protocol.dcp.client.link import Link
from dcptool.protocol.dcp.client.phases import CONN_MOVES, ConnPhase, move
from dcptool.protocol.dcp.wire import cluster_config, sasl
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.constants import (
    NUM_VB_SLOTS,
    Feature,
    Opcode,
    OpenFlag,
    Status,
    status_name,
)
from dcptool.protocol.errors import AuthRefused, ErrorCode, RemoteError

# where a cluster lists its buckets (the REST port; the data port has no such request)
_BUCKETS_AT = "Couchbase lists the buckets at http://HOST:8091/pools/default/buckets"


class Handshake:
    def __init__(self, link: Link, on_ready: Callable[[], None]) -> None:
        self.link = link
        self.on_ready = on_ready
        self.phase = ConnPhase.HELLO
        self.features: tuple[int, ...] = ()
        self.controls: dict[str, str] = {}
        self.refused: dict[str, int] = {}
        self.noop_active = False
        self.buffer_active = False
        self.filter: dict[str, Any] | None = None       # the collection filter, once resolved
        self.bucket_uuid = ""       # the selected bucket's UUID, from the set-up's config
        cfg = link.cfg
        # stream ids: each group's filter (sid 1..n)
        self.sid_filters: dict[int, dict[str, Any] | None] = {}
        if cfg.stream_ids and cfg.stream_filters is not None:
            self.sid_filters = {i + 1: (dict(f) if f else None) for i, f in enumerate(cfg.stream_filters)}
        self._sasl: sasl.ScramClient | None = None
        self._mech = ""
        self._sasl_rounds = 0
        self._controls_left = 0

    @property
    def cfg(self) -> ConsumerConfig:
        return self.link.cfg

    def _move(self, to: ConnPhase) -> None:
        self.phase = move(CONN_MOVES, self.phase, to, "the connection")

    @property
    def streaming(self) -> bool:
        """The handshake is complete: the streams run."""
        return self.phase is ConnPhase.STREAMING

    @property
    def collections(self) -> bool:
        """Keys carry a collection id (HELLO collections)."""
        return Feature.COLLECTIONS in self.features

    def idle_limit(self) -> float | None:
        """Seconds of silence after which a streaming connection is dead: 2x the noop
        interval when noops run; when the server refused them, max(2x interval, timeout);
        None before streaming and when the user turned noops off (--noop-interval 0)."""
        cfg = self.cfg
        if self.phase is not ConnPhase.STREAMING or not cfg.noop_interval:
            return None
        if self.noop_active:
            return 2 * cfg.noop_interval
        limit: float = max(2 * cfg.noop_interval, cfg.timeout or 0.0)
        return limit or None

    def _request(self, msg: Any, handler: Callable[[Any], None]) -> int:
        return self.link.request(msg, handler)

    def _emit(self, event: Any) -> None:
        self.link.emit(event)

    def start(self, features: Iterable[int]) -> None:
        """Queue HELLO asking for `features`."""
        self._request(m.Hello(agent=self.cfg.agent.encode(), features=tuple(int(f) for f in features)),
                      self._on_hello)

    def _on_hello(self, rsp: Any) -> None:
        if rsp.status != Status.SUCCESS:
            raise RemoteError(ErrorCode.STATUS, f"HELLO refused: {status_name(rsp.status)}", rsp.status)
        self.features = tuple(getattr(rsp, "features", ()))
        if self.cfg.collections and Feature.COLLECTIONS not in self.features:
            raise RemoteError(ErrorCode.UNSUPPORTED, "the server does not offer collections")
        if self.cfg.user:
            self._move(ConnPhase.SASL)
            self._request(m.SaslListMechs(), self._on_mechs)
        else:
            self._select()

    def _on_mechs(self, rsp: Any) -> None:
        if rsp.status != Status.SUCCESS:
            raise AuthRefused(f"SASL mechanisms not listed: {status_name(rsp.status)}", rsp.status)
        mech = sasl.choose_mechanism(rsp.value, allow_plain=self.cfg.tls or self.cfg.allow_plain)
        self._mech = mech
        if mech == "PLAIN":
            data = sasl.plain_message(self.cfg.user or "", self.cfg.password or "")
        else:
            self._sasl = sasl.ScramClient(mech, self.cfg.user or "", self.cfg.password or "")
            data = self._sasl.first()
        self._request(m.SaslAuth(mechanism=mech.encode(), data=data), self._on_sasl)

    def _on_sasl(self, rsp: Any) -> None:
        st = rsp.status
        self._sasl_rounds += 1
        if st == Status.AUTH_CONTINUE and self._sasl_rounds >= sasl.MAX_SASL_ROUNDS:
            raise RemoteError(ErrorCode.SASL_LIMIT, f"{self._mech}: the server still asks for more after "
                              f"{self._sasl_rounds} SASL rounds (limit {sasl.MAX_SASL_ROUNDS})")
        if st == Status.AUTH_CONTINUE and self._sasl is not None:
            data = self._sasl.final(rsp.value)
            self._request(m.SaslStep(mechanism=self._mech.encode(), data=data), self._on_sasl)
            return
        if st != Status.SUCCESS:
            raise AuthRefused(f"authentication as {self.cfg.user!r} refused ({self._mech}): "
                              f"{status_name(st)}; check the user and DCPTOOL_PASSWORD", st)
        if self._sasl is not None:
            self._sasl.verify(rsp.value)
            self._sasl = None
        self._select()

    def _select(self) -> None:
        self._move(ConnPhase.SELECT)
        self._request(m.SelectBucket(bucket=self.cfg.bucket.encode()), self._on_select)

    def _on_select(self, rsp: Any) -> None:
        st = rsp.status
        bucket = self.cfg.bucket
        if st in (Status.EACCESS, Status.AUTH_ERROR, Status.AUTH_STALE):
            raise AuthRefused(f"the DCP server refused bucket {bucket!r} ({status_name(st)}): the user needs the "
                              "Data DCP Reader role on it, and Couchbase answers the same for a bucket that does "
                              f"not exist: check the name (case-sensitive); {_BUCKETS_AT}", st)
        if st in (Status.KEY_ENOENT, Status.NO_BUCKET):
            raise RemoteError(ErrorCode.STATUS, f"the DCP server has no bucket {bucket!r}: check the name in the "
                              f"source URL (case-sensitive); {_BUCKETS_AT}", st)
        if st != Status.SUCCESS:
            raise RemoteError(ErrorCode.STATUS, f"SELECT_BUCKET {self.cfg.bucket!r} failed: {status_name(st)}", st)
        if self.cfg.fetch_config:
            self._move(ConnPhase.CONFIG)
            self._request(m.Request(opcode=Opcode.GET_CLUSTER_CONFIG), self._on_config)
            return
        self.after_select()

    def request_config(self) -> None:
        """Ask GET_CLUSTER_CONFIG (a poll); the answer comes as ConfigReceived(bootstrap=False)."""
        self._request(m.Request(opcode=Opcode.GET_CLUSTER_CONFIG), self._on_config)

    def _on_config(self, rsp: Any) -> None:
        body = bytes(getattr(rsp, "value", b"") or b"")
        boot = self.phase is ConnPhase.CONFIG
        if boot and rsp.status == Status.SUCCESS:
            self.bucket_uuid = cluster_config.bucket_uuid(body)
        if boot:
            self._move(ConnPhase.ROUTING)     # route() continues the handshake
        self._emit(ConfigReceived(body, rsp.status, boot))

    # ---- collection filter: GET_COLLECTIONS_MANIFEST once, before the vbuckets and DCP_OPEN
    @property
    def stream_value(self) -> bytes:
        """The STREAM_REQ value: the collection filter JSON, or nothing."""
        return dcp_collections.filter_value(self.filter or self.cfg.stream_filter)

    def stream_value_of(self, sid: int) -> bytes:
        """The STREAM_REQ value of stream id sid: its group's filter and the sid."""
        if not sid:
            return self.stream_value
        flt = self.sid_filters.get(sid) if self.sid_filters else None
        return dcp_collections.filter_value({**(flt or {}), "sid": sid})

    def filters_by_sid(self) -> tuple[dict[str, Any] | None, ...]:
        """The filter of each stream id (1, 2, ...) for the FilterResolved event; () without."""
        return tuple(self.sid_filters.get(sid) for sid in self.link.sids) if self.sid_filters else ()

    def _resolve_filters(self, manifest: dcp_collections.Manifest) -> dict[str, Any]:
        """The filter of --scope / --collection (raises UnknownNames); with stream ids, each
        group's too (self.sid_filters)."""
        cfg = self.cfg
        if cfg.stream_ids and cfg.stream_groups:
            self.sid_filters = {i + 1: dcp_collections.resolve(manifest, tuple(sc), tuple(co))
                                for i, (sc, co) in enumerate(cfg.stream_groups)}
        return dcp_collections.resolve(manifest, tuple(cfg.scopes), tuple(cfg.collection_names))

    def _wants_manifest(self) -> bool:
        cfg = self.cfg
        return bool(cfg.scopes or cfg.collection_names) and cfg.stream_filter is None and self.filter is None

    def _on_manifest(self, rsp: Any) -> None:
        if rsp.status != Status.SUCCESS:
            raise RemoteError(ErrorCode.STATUS, "GET_COLLECTIONS_MANIFEST refused: "
                              f"{status_name(rsp.status)}; the server cannot filter collections", rsp.status)
        raw = bytes(getattr(rsp, "value", b"") or b"")
        manifest = dcp_collections.parse_manifest(raw)
        try:
            self.filter = self._resolve_filters(manifest)    # per stream id too
        except dcp_collections.UnknownNames as exc:
            # stops here, in ConnPhase.MANIFEST: the caller reports the names
            self._emit(FilterUnknown(str(exc)))
            return
        self._emit(FilterResolved(dict(self.filter), raw, self.filters_by_sid()))
        self.after_select()

    def after_select(self) -> None:
        """The bucket is selected (or routed, Consumer.route): the filter, the vbuckets, DCP_OPEN."""
        if self._wants_manifest():
            self._move(ConnPhase.MANIFEST)
            self._request(m.Request(opcode=Opcode.GET_COLLECTIONS_MANIFEST), self._on_manifest)
            return
        if self.cfg.stream_filter is not None and self.filter is None:
            self.filter = dict(self.cfg.stream_filter)
            self._emit(FilterResolved(dict(self.filter), b"", self.filters_by_sid()))
        if self.cfg.vbuckets is None or self.cfg.check_vbuckets:
            self._request(m.GetAllVbSeqnos(), self._on_vb_seqnos)
        else:
            self._open()

    def _on_vb_seqnos(self, rsp: Any) -> None:
        if self.cfg.vbuckets is not None:   # given: the caller checks them against the server's
            if rsp.status == Status.SUCCESS and getattr(rsp, "seqnos", None):
                self._emit(ServerVbuckets(tuple(sorted({v for v, _ in rsp.seqnos}))))
            self._open()
            return
        if rsp.status == Status.SUCCESS and getattr(rsp, "seqnos", None):
            vbs = sorted({v for v, _ in rsp.seqnos})
            if vbs[-1] >= NUM_VB_SLOTS:
                raise RemoteError(ErrorCode.BAD_VBUCKET, f"GET_ALL_VB_SEQNOS lists vbucket {vbs[-1]}: vbucket "
                                  f"ids go up to {NUM_VB_SLOTS - 1}; use --vbuckets to choose them")
            self.link.reconfigure(vbuckets=in_shard(vbs, self.cfg.shard))
        else:
            self.link.reconfigure(vbuckets=in_shard(range(NUM_VB_SLOTS), self.cfg.shard))
        self._open()

    def _open(self) -> None:
        self._move(ConnPhase.OPEN)
        flags = OpenFlag.PRODUCER | OpenFlag.INCLUDE_DELETE_TIMES
        if self.cfg.no_value:
            flags |= OpenFlag.NO_VALUE
        if self.cfg.xattrs:
            flags |= OpenFlag.INCLUDE_XATTRS
        self._request(m.DcpOpen(name=self.cfg.name.encode(), flags=int(flags)), self._on_open)

    def _on_open(self, rsp: Any) -> None:
        st = rsp.status
        if st in (Status.EACCESS, Status.AUTH_ERROR):
            raise AuthRefused(f"DCP_OPEN on {self.cfg.bucket!r} denied: {status_name(st)}", st)
        if st != Status.SUCCESS:
            raise RemoteError(ErrorCode.STATUS, f"DCP_OPEN refused: {status_name(st)}", st)
        self._move(ConnPhase.CONTROL)
        cfg = self.cfg
        controls = []
        if cfg.buffer_size:
            controls.append(("connection_buffer_size", str(cfg.buffer_size)))
        if cfg.noop_interval:
            controls.append(("set_noop_interval", f"{cfg.noop_interval:g}"))
            controls.append(("enable_noop", "true"))
        controls.append(("send_stream_end_on_client_close_stream", "true"))
        if cfg.expiry_opcode:
            controls.append(("enable_expiry_opcode", "true"))
        if cfg.sync_writes:
            controls.append(("enable_sync_writes", "true"))
        if cfg.compress:
            controls.append(("force_value_compression", "true"))
        if cfg.stream_ids:
            controls.append(("enable_stream_id", "true"))
        if cfg.change_streams:
            controls.append(("change_streams", "true"))
        if cfg.oso:     # what the Java client and gocbcore send (OSO backfills, consumer_receive.py)
            controls.append(("enable_out_of_order_snapshots", "true_with_seqno_advanced"))
        if cfg.collections:
            controls.append(("max_marker_version", "2.2"))
        self._controls_left = len(controls)
        for key, val in controls:
            self._request(m.Control(key=key.encode(), value=val.encode()),
                          functools.partial(self._on_control, key, val))

    def _required(self, key: str) -> str | None:
        """Why a refusal of `key` is fatal, or None when the run goes on without it."""
        if key in self.cfg.required:
            return "asked for on the command line"
        if (self.cfg.collections or self.cfg.xattrs) and key in ("enable_noop", "set_noop_interval"):
            return "noops are required with collections or xattrs"
        return None

    def _on_control(self, key: str, val: str, rsp: Any) -> None:
        if rsp.status == Status.SUCCESS:
            self.controls[key] = val
        else:
            self.refused[key] = rsp.status
            why = self._required(key)
            if why:
                raise RemoteError(ErrorCode.UNSUPPORTED,
                                  f"DCP_CONTROL {key}={val} refused ({status_name(rsp.status)}); {why}",
                                  rsp.status)
            self._emit(ControlRefused(key, val, rsp.status))
        self._controls_left -= 1
        if self._controls_left == 0:
            self.noop_active = self.controls.get("enable_noop") == "true"
            self.buffer_active = "connection_buffer_size" in self.controls
            self._move(ConnPhase.STREAMING)
            self._emit(HandshakeComplete(self.features, dict(self.controls), self.bucket_uuid))
            self.on_ready()
