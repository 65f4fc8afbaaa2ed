"""The server a producer's connections share, sans-IO: buckets, users and their SCRAM
credentials, failure scenarios, the cluster and its topology events (what they do to open
connections), and `server_from_options`, the generated server `serve dcp` runs."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
from typing import Any, ClassVar

from dcptool.protocol.dcp.server.bucket import Bucket
from dcptool.protocol.dcp.server.cluster import Change, Cluster, Event, notifications
from dcptool.protocol.dcp.server.manifest import Manifest
from dcptool.protocol.dcp.wire import sasl
from dcptool.protocol.dcp.wire.constants import StreamEndReason

STATS_KEPT = 1000      # per-connection stats kept (the newest)

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
    corrupt_value_at: int | None = None    # the N-th compressed value sent does not decompress
    # cluster topology events (--rebalance-at, --failover-at N:NODE, --add-node-at) live in
    # cluster.Cluster.events; failover_loss is also how far a promoted replica lags


class ServerModel:
    """What all connections of one server share: buckets, users, scenario state.
    `connection_class` (producer.ProducerConnection, set there) makes each connection."""

    # producer.ProducerConnection (producer.py imports this module: connections are duck-typed here)
    connection_class: ClassVar[type[Any] | None] = None

    def __init__(self, buckets: list[Bucket], users: dict[str, str] | None = None,
                 scenarios: Scenarios | None = None, seed: int = 0, cluster: Cluster | None = None):
        self.buckets = {b.name: b for b in buckets}
        self.cluster = cluster          # None: a single node, made when the transport binds
        self.connections: set[Any] = set()   # open ones
        self.topology_changes = 0       # transports wake every connection when this moves
        self.scenarios = scenarios or Scenarios()
        self.users = dict(users or {})
        self._creds: dict[tuple[str, str], sasl.ScramCredentials] = {}
        for user, password in self.users.items():
            for mech in sasl.SCRAM_HASHES:
                salt = hashlib.sha256(f"{seed}:{user}:{mech}".encode()).digest()[:16]
                self._creds[(user, mech)] = sasl.ScramCredentials.derive(mech, password, salt, 4096)
        self.connections_by_name: dict[tuple[Any, ...], Any] = {}
        self.stream_frames = 0          # stream frames sent by every connection together
        self.failover_done = False
        self.disconnect_done = False
        self.end_reason_done: set[int] = set()
        self.silent_active = False
        self.accepted = 0
        # tests (tests/support/chaos_sdk.py): every stream, open or to come, ends (OK) once it
        # has sent the bucket's high seqno, so a `--to forever` capture finishes with all of it
        self.drain = False
        # one dict per connection, kept after it closes: the last STATS_KEPT only, so a server
        # does not grow with the connections it has seen
        self.stats: collections.deque[dict[str, Any]] = collections.deque(maxlen=STATS_KEPT)

    def credentials(self, user: str, mech: str) -> sasl.ScramCredentials | None:
        return self._creds.get((user, mech))

    def check_plain(self, user: str, password: str) -> bool:
        import hmac
        expected = self.users.get(user)
        return expected is not None and hmac.compare_digest(expected.encode(), password.encode())

    def bind_node(self, node: int, host: str, port: int, tls_port: int | None = None) -> None:
        """The transport tells where node `node` listens (a single node by default)."""
        if self.cluster is None:
            first = next((b for b in self.buckets.values() if isinstance(b, Bucket)), None)
            if first is None:
                return
            self.cluster = Cluster(first, seed=first.seed)     # its uuid: the bucket's seed and name
        if node < len(self.cluster.nodes):
            self.cluster.set_address(node, host, port, tls_port)

    def cluster_for(self, bucket: object) -> Cluster | None:
        cl = self.cluster
        return cl if cl is not None and cl.bucket is bucket else None

    def connect(self, now: float, node: int = 0) -> Any:
        self.accepted += 1
        make = self.connection_class
        assert make is not None, "producer.py sets ServerModel.connection_class"
        conn = make(self, now, self.accepted, node)
        cl = self.cluster
        if cl is not None and node < len(cl.nodes) and not cl.nodes[node].alive:
            conn.close(f"node {node} has failed over")
        else:
            self.connections.add(conn)
        return conn

    def apply_changes(self, changes: list[Change]) -> None:
        """Topology events: streams of moved vbuckets end with "state changed" on the old
        owner; every connection to a failed node drops."""
        if changes and self.cluster is not None:
            for conn, frame in notifications(self.cluster, sorted(self.connections, key=lambda c: c.conn_id)):
                conn.push(frame)     # the new map first, then the stream ends and drops
        for ch in changes:
            self.topology_changes += 1
            conns = sorted(self.connections, key=lambda c: c.conn_id)
            if ch.kind == "failover" and ch.node is not None:
                for conn in conns:
                    if conn.node == ch.node:
                        conn.close(f"node {ch.node} failed over")
                continue
            for node in ch.drop:     # chaos (cluster.py): a node left, restarted or failed
                for conn in conns:
                    if conn.node == node:
                        conn.close(f"node {node}: {ch.kind}")
            for mv in ch.moves:
                for conn in conns:
                    if conn.node == mv.old and self.cluster_for(conn.bucket) is not None:
                        conn.end_stream(mv.vb, StreamEndReason.STATE_CHANGED)


def server_from_options(*, bucket: str = "default", vbuckets: int = 64, items: int = 10_000, seed: int = 0,
                        value_size: int = 61, users: dict[str, str] | None = None, scenarios: Scenarios | None = None,
                        checkpoint_items: int = 100, nodes: int = 1, replicas: int = 0,
                        events: tuple[Event, ...] = (), manifest: Manifest | None = None) -> ServerModel:
    """A server for one generated bucket; `nodes` > 1 or `events` make it a cluster
    (cluster.Cluster; events are cluster.Event, add-node events reserve spare nodes)."""
    b = Bucket(bucket, vbuckets, items, seed, value_size, checkpoint_items, manifest)
    cluster = None
    if nodes > 1 or replicas or events:
        spare = sum(1 for e in events if e.kind == "add-node")
        cluster = Cluster(b, nodes, replicas, seed, spare, events=tuple(events))
    return ServerModel([b], users, scenarios, seed, cluster)


def rate_items(rate: float, since: float, now: float, carry: float) -> tuple[int, float]:
    """How many live items to generate for `rate` per second between since and now."""
    want = rate * max(0.0, now - since) + carry
    n = int(math.floor(want))
    return n, want - n
