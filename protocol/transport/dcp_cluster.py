"""A DCP session over a cluster (docs/CLUSTER.md): bootstrap from the first seed that
answers, one connection per KV node that owns requested vbuckets (or `conn_per_node`), and
the map followed as it changes (protocol/dcp/client/routing.py decides, this module does the I/O).

Bootstrap: every connection does HELLO, auth, SELECT_BUCKET and GET_CLUSTER_CONFIG before
DCP_OPEN (the consumer's `fetch_config`), so a capture holds every config received. When the
first answer is "no map" (UNKNOWN_COMMAND, NOT_SUPPORTED, KEY_ENOENT, an empty body) or a map
of one node, the run is today's single-connection Session on that same connection.

Per-vbucket state (VbState) belongs to the vbucket: a stream that ends "state changed", is
refused NOT_MY_VBUCKET, or whose node stops answering hands its state back here, waits for a
map that names its owner (pushed by the server where HELLO negotiated cluster-map change
notifications, polled with GET_CLUSTER_CONFIG every `config_poll` seconds, and at once after
a handoff the current map does not explain), and is reopened there from its last
consistent point. A vbucket that
finds no owner within the timeout is unserved, with the reason (`unserved`).

Connection numbers count from 1 across every node and reconnect, so (conn, opaque) is unique
in a capture; the tap learns the connection and node of each frame through
`tap.attach(conn, consumer, node)` before it sees the frame.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import ssl
import time
from typing import Any, Callable

from dcptool.protocol.dcp.client import routing
from dcptool.protocol.dcp.client.consumer import (
    NUM_VB_SLOTS,
    ConfigPushed,
    ConfigReceived,
    Consumer,
    ConsumerConfig,
    Handoff,
    NotMyVbucket,
    PushIgnored,
    ServerVbuckets,
    StreamEnded,
    StreamFailed,
    StreamOpened,
    VbState,
)
from dcptool.protocol.dcp.client.routing import MapApplied, Rerouted, Router, Unserved
from dcptool.protocol.errors import (
    ConnectFailed,
    ConnectionLost,
    ErrorCode,
    ProtocolError,
    RemoteError,
)
from dcptool.protocol.transport import probe
from dcptool.protocol.transport.dcp_client import OnEvents, Session, open_connection

log = logging.getLogger("dcptool.transport.dcp_cluster")

_DEAD = (ErrorCode.DEAD_CONNECTION, ErrorCode.TIMEOUT)
RETRY_AFTER = 0.2           # seconds before a node that stopped answering is tried again (doubles
                            # per failure up to 2 s, and starts again once one of its streams opens)


@dataclasses.dataclass(eq=False)
class _Link:
    conn: int
    host: str
    port: int
    consumer: Consumer
    want: dict[int, VbState]          # vbuckets to hand it once its config arrives
    proto: Any = None          # its ClientProtocol once connected
    routed: bool = False

    @property
    def node(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class _LinkTap:
    """Tells the tap which connection and node the next frames belong to."""
    __slots__ = ("s", "link")

    def __init__(self, session: "ClusterSession", link: _Link) -> None:
        self.s, self.link = session, link

    def on_received(self, buf: Any, offsets: Any, lengths: Any, ts_ns: int, mono_ns: int) -> None:
        self.s.switch_to(self.link)
        self.s.tap.on_received(buf, offsets, lengths, ts_ns, mono_ns)

    def on_sent(self, frame: bytes, ts_ns: int, mono_ns: int) -> None:
        self.s.switch_to(self.link)
        self.s.tap.on_sent(frame, ts_ns, mono_ns)


@dataclasses.dataclass
class ClusterResult:
    """What a cluster run returns in place of a consumer: every vbucket's state."""
    states: dict[int, VbState]
    unserved: dict[int, str]
    finished: bool = True

    def vb_states(self) -> dict[int, VbState]:
        return self.states


class ClusterSession:
    def __init__(self, cfg: ConsumerConfig, seeds: list[tuple[str, int]], *, tls: ssl.SSLContext | None = None,
                 server_hostname: str | None = None, tap: Any = None, on_events: OnEvents | None = None,
                 on_connect: Callable[[int, Consumer], None] | None = None, resume: dict[int, VbState] | None = None,
                 should_pause: Callable[[], bool] | None = None, reconnects: int = 3,
                 connect_timeout: float | None = None, conn_per_node: int = 1, config_poll: float = 2.5) -> None:
        self.cfg = cfg
        self.seeds = list(seeds)
        self.tls, self.server_hostname = tls, server_hostname
        self.tap, self.on_events, self.on_connect = tap, on_events, on_connect
        self.should_pause = should_pause
        self.reconnects = reconnects
        self.connect_timeout = connect_timeout or cfg.timeout or 30.0
        self.conn_per_node = max(1, conn_per_node)
        self.config_poll = config_poll
        self.router = Router(cfg.vbuckets, tls is not None, shard=cfg.shard)
        self.states: dict[int, VbState] = {vb: dataclasses.replace(s, failover_log=list(s.failover_log))
                                           for vb, s in (resume or {}).items() if 0 <= vb < NUM_VB_SLOTS}
        self.final: dict[int, VbState] = {}    # ended for good or failed
        self.links: dict[int, _Link] = {}
        self.opening: set[asyncio.Task[None]] = set()
        self.down: dict[str, float] = {}       # node -> when to try it again
        self._backoff: dict[str, float] = {}
        self.conn = 0
        self.single: Session | None = None
        self.stopped = False
        self._stop = asyncio.Event()     # both made again by run(), on its loop
        self._wake = asyncio.Event()
        self._current: _Link | None = None
        self._last_consumer: Consumer | None = None
        self._next_spawn = 0.0
        self._mode: str | None = None          # None until the first answer, "single" or "cluster"

    # ---- the Session interface the CLI uses
    @property
    def consumer(self) -> Consumer | None:
        if self.single is not None:
            return self.single.consumer
        return self._last_consumer

    @property
    def unserved(self) -> dict[int, str]:
        return dict(self.router.unserved)

    def stop(self) -> None:
        self.stopped = True
        if self.single is not None:
            self.single.stop()
        if self._stop is not None:
            self._stop.set()

    # ---- run
    async def run(self) -> Consumer | ClusterResult | None:
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        if self.stopped:
            self._stop.set()
        first = await self._bootstrap()
        if first is None:
            return self._last_consumer
        if self._mode == "single":
            return await self._run_single(first)
        return await self._run_cluster()

    async def _bootstrap(self) -> _Link | None:
        """Connect to the seeds in order until one answers GET_CLUSTER_CONFIG (or says it has
        no map); that connection stays open."""
        errors: list[ConnectFailed | ConnectionLost] = []
        for host, port in self.seeds:
            if self._stop.is_set():
                return None
            try:
                link = await self._open(host, port, {}, bootstrap=True)
            except ConnectFailed as exc:
                errors.append(exc)
                continue
            while self._mode is None and not link.proto.done.done() and not self._stop.is_set():
                self._wake.clear()
                waits = [asyncio.ensure_future(self._stop.wait()), asyncio.ensure_future(self._wake.wait())]
                try:
                    await asyncio.wait({link.proto.done, *waits}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()
            if self._mode is not None:
                return link
            if self._stop.is_set():
                link.proto.close()
                return None
            why = link.proto.done.exception()
            self.links.pop(link.conn, None)
            link.proto.close()
            if why is None:
                why = ConnectionLost("the server closed the connection during the set-up")
            wrong = None if link.proto.bytes_in else await probe.wrong_server(    # not a byte back: who is it?
                host, port, "couchbases" if self.tls else "couchbase")
            if wrong is not None:
                raise wrong
            if isinstance(why, RemoteError) and why.code == ErrorCode.TIMEOUT:
                why = ConnectFailed(f"{link.node}: {why.message}")
            if not isinstance(why, (ConnectFailed, ConnectionLost)):
                raise why
            errors.append(why)
        if len(errors) == 1:
            raise errors[0]
        raise ConnectFailed(f"none of the {len(self.seeds)} seeds answered: "
                            + "; ".join(str(getattr(e, 'message', e)) for e in errors))

    async def _run_single(self, link: _Link) -> Consumer:
        """No map, or one node: the single-connection Session continues on this connection."""
        self.links.pop(link.conn, None)
        node = link.node
        tap = self.tap

        def on_connect(conn: int, consumer: Consumer) -> None:
            if self.on_connect is not None:
                self.on_connect(conn, consumer)
            if tap is not None:
                tap.attach(conn, consumer, node)

        self.single = Session(dataclasses.replace(self.cfg, fetch_config=False), link.host, link.port,
                              tls=self.tls, server_hostname=self.server_hostname, tap=tap,
                              on_events=self.on_events, on_connect=on_connect, resume=self.states or None,
                              should_pause=self.should_pause, reconnects=self.reconnects,
                              connect_timeout=self.connect_timeout)
        self.single.conn = self.conn
        if self.stopped:
            self.single.stop()
        return await self.single.run(first=link.proto)

    async def _run_cluster(self) -> ClusterResult:
        last_poll = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                if self._stop.is_set():
                    await self._close_all()
                    break
                self._reroute(now)
                if not self.links and not self.opening and not self.router.waiting:
                    break
                interval = 0.25 if self.router.waiting else self.config_poll
                if now - last_poll >= interval:
                    self._poll()
                    last_poll = now
                next_poll = last_poll + interval
                waits = {lk.proto.done for lk in self.links.values() if lk.proto is not None} | set(self.opening)
                self._wake.clear()
                wake_wait = asyncio.ensure_future(self._wake.wait())
                stop_wait = asyncio.ensure_future(self._stop.wait())
                due = [next_poll] + [t for t in self.down.values()]
                due += [t for t in (self.router.next_deadline(), self.router.next_retry(set(self.down)))
                        if t is not None]
                timeout = max(0.0, min(due) - time.monotonic())
                try:
                    await asyncio.wait(waits | {wake_wait, stop_wait}, timeout=timeout,
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    wake_wait.cancel()
                    stop_wait.cancel()
                for link in [lk for lk in self.links.values() if lk.proto is not None and lk.proto.done.done()]:
                    self._ended(link)
                for task in [t for t in self.opening if t.done()]:
                    self.opening.discard(task)
                    task.result()       # _open_for handles its own connect errors
        finally:
            for link in list(self.links.values()):
                if link.proto is not None:
                    link.proto.close()
        return self._result()

    def _result(self) -> ClusterResult:
        states = dict(self.final)
        for link in self.links.values():
            states.update(link.consumer.streams.vb_states())
        states.update(self.states)
        return ClusterResult(states, dict(self.router.unserved))

    # ---- connections
    def switch_to(self, link: _Link) -> None:
        if self._current is not link:
            self._current = link
            if self.tap is not None:
                self.tap.attach(link.conn, link.consumer, link.node)

    async def _open(self, host: str, port: int, want: dict[int, VbState], bootstrap: bool = False) -> _Link:
        self.conn += 1
        # a DCP name is one connection's (a server replaces the older connection of a name)
        name = self.cfg.name if self.conn == 1 else f"{self.cfg.name}-{self.conn}"
        cfg = dataclasses.replace(self.cfg, fetch_config=True, vbuckets=None, check_vbuckets=False, name=name)
        consumer = Consumer(cfg, None, time.monotonic())
        consumer.should_pause = self.should_pause
        self._last_consumer = consumer
        link = _Link(self.conn, host, port, consumer, dict(want))
        self.links[link.conn] = link
        if self.on_connect is not None:
            self.on_connect(link.conn, consumer)
        try:
            link.proto = await open_connection(consumer, host, port, tls=self.tls,
                                               server_hostname=self.server_hostname,
                                               tap=_LinkTap(self, link) if self.tap is not None else None,
                                               on_events=functools.partial(self._events, link),
                                               timeout=self.connect_timeout)
        except ConnectFailed:
            self.links.pop(link.conn, None)
            if self.conn == link.conn:   # never made: its number goes to the next connection
                self.conn -= 1
            raise
        return link

    async def _open_for(self, node: str, want: dict[int, VbState]) -> None:
        host, _, port = node.rpartition(":")
        host = host[1:-1] if host.startswith("[") else host
        try:
            await self._open(host, int(port), want)
        except ConnectFailed as exc:
            log.info("cannot connect to %s: %s", node, exc)
            self._node_down(node, want, time.monotonic())
        self._wake.set()

    def _ended(self, link: _Link) -> None:
        self.links.pop(link.conn, None)
        if self._current is link:
            self._current = None
        exc = link.proto.done.exception()
        consumer = link.consumer
        if exc is None:     # finished: every stream it kept ended or failed
            for vb, st in consumer.streams.vb_states().items():
                self.final[vb] = st
            now = time.monotonic()
            for vb, st in link.want.items():
                self.states[vb] = st
                self.router.wait(vb, None, now, self.cfg.timeout, routing.NO_ACTIVE)
            self._wake.set()
            return
        if isinstance(exc, RemoteError) and exc.code not in _DEAD:
            raise exc
        if not isinstance(exc, (ConnectionLost, RemoteError, ConnectFailed)):
            raise exc
        log.info("connection %d to %s lost (%s)", link.conn, link.node, exc)
        self._give_back(link, dead=True)

    def _give_back(self, link: _Link, dead: bool) -> None:
        """The vbuckets of a lost connection that have not ended wait for an owner."""
        states = dict(link.want)
        if link.routed:
            going = set(link.consumer.unfinished())
            for vb, st in link.consumer.streams.resume_state().items():
                if vb in going:
                    states[vb] = st
                else:
                    self.final[vb] = st
        self._node_down(link.node, states, time.monotonic())
        self._wake.set()

    def _node_down(self, node: str, states: dict[int, VbState], now: float) -> None:
        back = min(self._backoff.get(node, RETRY_AFTER / 2) * 2, 2.0)
        self._backoff[node] = back
        self.down[node] = now + back
        for vb, st in states.items():
            self.states[vb] = st
            self.router.wait(vb, node, now, self.cfg.timeout, routing.NODE_DOWN)
        self._poll()

    def _poll(self) -> None:
        """Ask a streaming connection for the map; with none, open one to a live node."""
        for link in self.links.values():
            c = link.consumer
            if link.proto is not None and c.streaming:
                c.handshake.request_config()
                link.proto.flush()
                return
        if self.opening or any(not lk.routed for lk in self.links.values()):
            return          # a connection on its way will bring a map
        now = time.monotonic()
        nodes = [n for n in self.router.node_addresses() if self.down.get(n, 0) <= now]
        nodes += [f"{h}:{p}" for h, p in self.seeds if f"{h}:{p}" not in nodes]
        if nodes and self.router.waiting and now >= self._next_spawn:
            self._next_spawn = now + 1.0
            self._spawn(nodes[0], {})

    def _spawn(self, node: str, want: dict[int, VbState]) -> None:
        task = asyncio.ensure_future(self._open_for(node, want))
        self.opening.add(task)

    # ---- routing
    def _reroute(self, now: float) -> None:
        for node, when in list(self.down.items()):
            if when <= now:      # try it again: its vbuckets may go back to it
                del self.down[node]
                for w in self.router.waiting.values():
                    if w.left == node:
                        w.left = None
        moved = {vb for vb, w in self.router.waiting.items() if w.why != routing.NO_ACTIVE}
        for node, vbs in self.router.ready(set(self.down), now).items():
            self._assign(node, vbs, moved=bool(moved.intersection(vbs)))
        gone = self.router.expire(now)
        if gone:
            for vb in gone:
                st = self.states.pop(vb, None)
                if st is not None:
                    self.final[vb] = st
            if self.on_events is not None:
                self.on_events([Unserved(vb, why) for vb, why in sorted(gone.items())])

    def _assign(self, node: str, vbs: list[int], moved: bool = False) -> None:
        """Give vbuckets to node: an open streaming connection to it takes them, else new ones."""
        states = {vb: self.states.get(vb) or VbState() for vb in vbs}
        for vb in vbs:
            self.states.pop(vb, None)
        if moved and self.on_events is not None:
            self.on_events([Rerouted(vb, node) for vb in vbs])
        for link in self.links.values():
            c = link.consumer
            if link.node == node and link.routed and c.streaming:
                c.add_vbuckets(states)
                link.proto.flush()
                return
        for group in routing.split(list(states), self.conn_per_node):
            self._spawn(node, {vb: states[vb] for vb in group})

    def _events(self, link: _Link, evs: list[Any]) -> None:
        """A connection's consumer events (called inside its read): routing acts here, the
        rest goes on to the caller."""
        if self._mode == "single":
            if self.on_events is not None:
                self.on_events(evs)
            return
        fwd: list[Any] = []
        now = time.monotonic()
        for e in evs:
            t = type(e)
            if t is ConfigReceived:
                self._config(link, e, fwd)
            elif t is ConfigPushed:
                self._pushed(link, e, fwd)
            elif t is PushIgnored:
                log.info("connection %d: %s", link.conn, e.reason)
                fwd.append(e)
            elif t is Handoff or t is NotMyVbucket:
                if t is NotMyVbucket and e.config_raw:
                    self._apply(link, e.config_raw, fwd)
                fwd.append(e)
                for vb, st in link.consumer.take_states([e.vbucket]).items():
                    self.states[vb] = st
                    # a refusal goes back to the same node under the same map after a backoff;
                    # a handoff goes to the newest map's owner at once, whichever node that is
                    self.router.wait(vb, link.node, now, self.cfg.timeout, routing.REFUSED,
                                     backoff=t is NotMyVbucket)
                # ask for the map unless the one we hold (a notification may have brought it
                # before the stream end) already names another owner
                if (link.consumer.handshake.streaming and not link.consumer.finished
                        and self.router.owner(e.vbucket) in (None, link.node)):
                    link.consumer.handshake.request_config()
                self._wake.set()
            else:
                if t is StreamOpened:
                    self.router.served(e.vbucket)
                    # the node serves again: its next failure backs off from the first step
                    self._backoff.pop(link.node, None)
                elif t is StreamFailed or (t is StreamEnded and e.final):
                    self._wake.set()
                fwd.append(e)
        if fwd and self.on_events is not None:
            self.on_events(fwd)

    def _apply(self, link: _Link, raw: bytes, fwd: list[Any]) -> bool:
        if not self.router.apply(raw, link.host):
            return False
        cfg = self.router.config
        assert cfg is not None     # apply() made it current
        fwd.append(MapApplied(cfg.rev_epoch, cfg.rev, tuple(self.router.node_addresses())))
        self._wake.set()
        return True

    def _pushed(self, link: _Link, e: ConfigPushed, fwd: list[Any]) -> None:
        """A cluster-map change notification: applied as a poll answer would be; a brief one
        (no body) that is newer than our map is fetched at once. A malformed pushed config
        is reported and ignored (the next poll or NOT_MY_VBUCKET body still counts)."""
        if self._mode != "cluster":
            return          # the bootstrap answer is on its way
        if not e.raw:
            if self.router.key is None or (e.rev_epoch, e.rev) > self.router.key:
                link.consumer.handshake.request_config()
            return
        try:
            self._apply(link, e.raw, fwd)
        except RemoteError as exc:
            if exc.code != ErrorCode.BAD_CLUSTER_CONFIG:
                raise
            ign = PushIgnored(0x01, f"cluster-map change notification: {exc.message}")
            log.info("connection %d: %s", link.conn, ign.reason)
            fwd.append(ign)

    def _config(self, link: _Link, e: ConfigReceived, fwd: list[Any]) -> None:
        has_map = e.status == 0 and bool(e.raw)
        if self._mode is None:
            if has_map:
                self._apply(link, e.raw, fwd)
            cfg = self.router.config
            if not has_map or cfg is None or len(cfg.nodes) <= 1:
                self._mode = "single"
                self._wake.set()
                if fwd and self.on_events is not None:
                    self.on_events(fwd)
                fwd.clear()
                link.routed = True
                link.consumer.route(self.cfg.vbuckets, states=self.states, check=self.cfg.check_vbuckets)
                self.states = {}
                return
            self._mode = "cluster"
            self._wake.set()
            if self.cfg.vbuckets is not None:
                fwd.append(ServerVbuckets(tuple(range(cfg.num_vbuckets))))
            now = time.monotonic()
            for vb in self.router.wanted():
                if vb >= cfg.num_vbuckets:
                    continue
                self.states.setdefault(vb, VbState())
                self.router.wait(vb, None, now, self.cfg.timeout, routing.NO_ACTIVE)
            # this connection takes a share of its own node's vbuckets
            mine = self.router.plan(sorted(self.router.waiting)).get(link.node, [])
            group = routing.split(mine, self.conn_per_node)[0] if mine else []
            for vb in group:
                del self.router.waiting[vb]
            link.want = {vb: self.states.pop(vb) for vb in group}
        elif has_map:
            self._apply(link, e.raw, fwd)
        if not e.bootstrap:
            return
        # a new connection: it takes what is still this node's, the rest waits again
        now = time.monotonic()
        keep = {}
        for vb, st in link.want.items():
            if self.router.owner(vb) == link.node or self.router.config is None:
                keep[vb] = st
            else:
                self.states[vb] = st
                self.router.wait(vb, None, now, self.cfg.timeout, routing.NO_ACTIVE)
        link.want = {}
        link.routed = True
        link.consumer.route(sorted(keep), states=keep, handoff=True)

    async def _close_all(self, wait: float = 1.0) -> None:
        for task in self.opening:
            task.cancel()
        procs = []
        for link in self.links.values():
            c, proto = link.consumer, link.proto
            if proto is None:
                continue
            if c.handshake.streaming and not c.finished:
                c.close_streams()
                proto.flush()
                procs.append(proto)
            else:
                proto.close()
        if procs:
            try:
                await asyncio.wait_for(asyncio.gather(*(asyncio.shield(p.done) for p in procs),
                                                      return_exceptions=True), wait)
            except (asyncio.TimeoutError, TimeoutError, ConnectionLost, ProtocolError):
                pass
        for link in self.links.values():
            if link.proto is not None:
                link.proto.close()
