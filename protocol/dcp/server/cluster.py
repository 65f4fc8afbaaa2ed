"""The producer's cluster, sans-IO: N KV nodes serving one generated bucket, R replicas,
a deterministic (seeded) vbucket placement, and scripted topology events (docs/CLUSTER.md):

- rebalance: a share of the vbuckets moves to other nodes by takeover. The vbucket keeps
  its data and failover log and gains the entry kv_engine adds when a vbucket turns active
  (new uuid at the current high seqno), so a consumer resuming there does not roll back.
- failover of a node: the node stops answering; each of its active vbuckets is promoted on
  its first live replica, which lags `loss` mutations behind: a new failover entry at the
  replica's seqno, the lost tail rewritten on the new branch, so consumers that were ahead
  roll back. A vbucket without a live replica is left uncovered (-1 in the map).
- add node: a spare node joins (its port is bound from the start); a later rebalance
  moves vbuckets to it first.

Every event bumps `rev`. Node indexes are stable for the life of the cluster; the config's
serverList lists the joined, live nodes only, and its map is re-indexed accordingly.

After every event each live connection that negotiated HELLO Duplex and a cluster-map change
notification gets the new config pushed as a server request (`notifications`): the whole
config for 0x0d, only (revEpoch, rev) for 0x1f (brief; it wins when a client asks both).
"""

from __future__ import annotations

import dataclasses
import random

from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.cluster_config import ClusterConfig, Node
from dcptool.protocol.dcp.wire.constants import SERVER_OP_CLUSTERMAP_CHANGE_NOTIFICATION, Feature
from dcptool.protocol.dcp.server.bucket import Bucket

MAX_REPLICAS = 3
NOTIFY_OPAQUE_BASE = 20_000_000   # opaques of our server requests (apart from noops')


@dataclasses.dataclass(slots=True)
class ClusterNode:
    index: int
    host: str = "127.0.0.1"
    port: int = 11210
    tls_port: int | None = None
    joined: bool = True
    alive: bool = True

    @property
    def serving(self) -> bool:
        return self.joined and self.alive


@dataclasses.dataclass(frozen=True, slots=True)
class Move:
    vb: int
    old: int          # node index, -1 for none
    new: int          # node index, -1 for none (uncovered)
    seqno: int        # the new failover entry's seqno (branch point on failover)


@dataclasses.dataclass(frozen=True, slots=True)
class Change:
    kind: str                     # "rebalance", "failover", "add-node"
    rev: int
    moves: tuple[Move, ...] = ()
    node: int | None = None       # failed or added node


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    at: int                       # stream frames served cluster-wide
    kind: str                     # "rebalance", "failover", "add-node"
    node: int | None = None       # failover target


class Cluster:
    def __init__(self, bucket: Bucket, nodes: int = 1, replicas: int = 0, seed: int = 0,
                 spare_nodes: int = 0, rebalance_share: float = 0.25, events: tuple[Event, ...] = ()):
        if nodes < 1:
            raise ValueError("a cluster has at least one node")
        if not 0 <= replicas <= MAX_REPLICAS:
            raise ValueError(f"replicas must be 0..{MAX_REPLICAS}")
        self.bucket = bucket
        self.nodes = [ClusterNode(i, joined=i < nodes) for i in range(nodes + spare_nodes)]
        self.replicas = replicas
        self.rebalance_share = rebalance_share
        self.rng = random.Random(f"cluster:{seed}")
        self.uuid = "%032x" % self.rng.getrandbits(128)
        self.rev = 1
        self.rev_epoch = 1
        order = list(range(nodes))
        self.rng.shuffle(order)
        self.vbmap: list[list[int]] = []
        for vb in range(bucket.num_vbuckets):
            row = [order[vb % nodes]]
            for k in range(1, replicas + 1):
                row.append(order[(vb + k) % nodes] if k < nodes else -1)
            self.vbmap.append(row)
        self.events = sorted(events, key=lambda e: e.at)
        self.changes: list[Change] = []
        self._config: ClusterConfig | None = None
        self._rendered: dict[tuple[int, int], bytes] = {}
        self.pushes = 0               # cluster-map change notifications sent

    # ---- queries
    def serving_nodes(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.serving]

    def is_active(self, node: int, vb: int) -> bool:
        return 0 <= vb < len(self.vbmap) and self.vbmap[vb][0] == node

    def active_vbuckets(self, node: int) -> list[int]:
        return [vb for vb, row in enumerate(self.vbmap) if row[0] == node]

    def replica_vbuckets(self, node: int) -> list[int]:
        return [vb for vb, row in enumerate(self.vbmap) if node in row[1:]]

    def vbuckets_in_state(self, node: int, extras: bytes) -> list[int]:
        """GET_ALL_VB_SEQNOS on node `node`: every vbucket on a single node; on a cluster the
        active ones (no extras, or state 1), the replicas (state 2), none for pending / dead."""
        if len(self.nodes) == 1:
            return list(range(len(self.vbmap)))
        state = int.from_bytes(extras[:4], "big") if len(extras) >= 4 else 1
        return self.active_vbuckets(node) if state == 1 else self.replica_vbuckets(node) if state == 2 else []

    def config(self) -> ClusterConfig:
        if self._config is None:
            members = self.serving_nodes()
            pos = {n.index: i for i, n in enumerate(members)}
            vbmap = tuple(tuple(pos.get(x, -1) for x in row) for row in self.vbmap)
            self._config = ClusterConfig(
                rev=self.rev, rev_epoch=self.rev_epoch, name=self.bucket.name, uuid=self.uuid,
                nodes=tuple(Node(n.host, n.port, n.tls_port, mgmt=8091) for n in members),
                vbucket_map=vbmap, num_replicas=self.replicas)
        return self._config

    def render(self, node: int) -> bytes:
        """The config as node `node` answers it (thisNode and $HOST on its own entry)."""
        key = (self.rev, node)
        data = self._rendered.get(key)
        if data is None:
            cfg = self.config()
            me = next((i for i, n in enumerate(self.serving_nodes()) if n.index == node), None)
            data = self._rendered[key] = cfg.render(me)
        return data

    def render_global(self, node: int) -> bytes:
        """What node `node` answers before a bucket is selected: the cluster part only."""
        me = next((i for i, n in enumerate(self.serving_nodes()) if n.index == node), None)
        return self.config().render_global(me)

    def set_address(self, node: int, host: str, port: int, tls_port: int | None = None) -> None:
        n = self.nodes[node]
        n.host, n.port, n.tls_port = host, port, tls_port
        self._dirty()

    def _dirty(self) -> None:
        self._config = None
        self._rendered.clear()

    def _bump(self, change_kind: str, moves=(), node=None) -> Change:
        self.rev += 1
        self._dirty()
        ch = Change(change_kind, self.rev, tuple(moves), node)
        self.changes.append(ch)
        return ch

    # ---- scripted events
    def next_event_at(self) -> int | None:
        return self.events[0].at if self.events else None

    def fire_due(self, frames: int, loss: int) -> list[Change]:
        """Run every scripted event whose frame count has been reached, in order."""
        out = []
        while self.events and self.events[0].at <= frames:
            ev = self.events.pop(0)
            if ev.kind == "rebalance":
                out.append(self.rebalance())
            elif ev.kind == "failover":
                out.append(self.fail_over(ev.node, loss))
            elif ev.kind == "add-node":
                out.append(self.add_node())
        return out

    # ---- topology events
    def rebalance(self, share: float | None = None) -> Change:
        """Move vbuckets by takeover: first to fill under-loaded nodes (a node just added),
        else `share` of the vbuckets, each to its first live replica (or the next node)."""
        members = [n.index for n in self.serving_nodes()]
        nvb = len(self.vbmap)
        count = {i: 0 for i in members}
        for row in self.vbmap:
            if row[0] in count:
                count[row[0]] += 1
        ideal = nvb // len(members)
        order = list(range(nvb))
        self.rng.shuffle(order)
        plan: list[tuple[int, int]] = []
        if min(count.values()) < ideal:
            for vb in order:
                owner = self.vbmap[vb][0]
                low = min(members, key=lambda i: (count[i], i))
                if count[low] >= ideal:
                    break
                if owner in count and count[owner] > ideal:
                    plan.append((vb, low))
                    count[owner] -= 1
                    count[low] += 1
        elif len(members) > 1:
            k = max(1, round(nvb * (self.rebalance_share if share is None else share)))
            for vb in sorted(order[:k]):
                row = self.vbmap[vb]
                target = next((r for r in row[1:] if r in count), None)
                if target is None:
                    target = members[(members.index(row[0]) + 1) % len(members)] if row[0] in count else members[0]
                plan.append((vb, target))
        moves = []
        for vb, new in sorted(plan):
            old = self.vbmap[vb][0]
            v = self.bucket.vbuckets[vb]
            v.turn_active(self.rng.randrange(1, 1 << 48))
            self.vbmap[vb] = self._row(new, [old] + self.vbmap[vb][1:])
            moves.append(Move(vb, old, new, v.high_seqno))
        return self._bump("rebalance", moves)

    def _row(self, active: int, candidates: list[int]) -> list[int]:
        reps = []
        for r in candidates:
            if r != active and r >= 0 and r not in reps and self.nodes[r].serving:
                reps.append(r)
        members = [n.index for n in self.serving_nodes()]
        for r in members:   # top up replicas from the other nodes
            if len(reps) >= self.replicas:
                break
            if r != active and r not in reps:
                reps.append(r)
        reps = reps[:self.replicas]
        return [active] + reps + [-1] * (self.replicas - len(reps))

    def fail_over(self, node: int, loss: int) -> Change:
        """The node stops answering; its active vbuckets are promoted on replicas that are
        `loss` mutations behind."""
        if not 0 <= node < len(self.nodes) or not self.nodes[node].serving:
            return self._bump("failover", (), node)
        self.nodes[node].alive = False
        moves = []
        for vb, row in enumerate(self.vbmap):
            if row[0] == node:
                promoted = next((r for r in row[1:] if r >= 0 and self.nodes[r].serving), -1)
                v = self.bucket.vbuckets[vb]
                seqno = -1
                if promoted >= 0:
                    seqno = v.fail_over(self.rng.randrange(1, 1 << 48), v.high_seqno - loss, self.rng,
                                        self.bucket.next_cas())
                    self.vbmap[vb] = [promoted] + [r if r != node and r != promoted else -1 for r in row[1:]]
                else:
                    self.vbmap[vb] = [-1] + [-1 if r == node else r for r in row[1:]]
                moves.append(Move(vb, node, promoted, seqno))
            elif node in row[1:]:
                self.vbmap[vb] = [row[0]] + [-1 if r == node else r for r in row[1:]]
        self.bucket.generation += 1
        return self._bump("failover", moves, node)

    def add_node(self) -> Change:
        spare = next((n for n in self.nodes if not n.joined), None)
        if spare is None:
            return self._bump("add-node")
        spare.joined = True
        return self._bump("add-node", (), spare.index)


# --------------------------------------------------------------------------- notifications

def notify_mode(features) -> str | None:
    """"full", "brief" or None: what a connection with these HELLO features gets pushed."""
    if Feature.DUPLEX not in features:
        return None
    if Feature.CLUSTERMAP_CHANGE_NOTIFICATION_BRIEF in features:
        return "brief"
    return "full" if Feature.CLUSTERMAP_CHANGE_NOTIFICATION in features else None


def notifications(cluster: Cluster, conns) -> list[tuple[object, bytes]]:
    """(connection, frame) for every open connection (producer.ProducerConnection: `closed`,
    `bucket`, `node`, `features`) of a serving node that selected the cluster's bucket and
    negotiated a notification: a server request (magic 0x82, opcode 0x01), key = bucket name,
    extras = revEpoch i64 + rev i64, value = the config as that node renders it (JSON), or
    nothing when brief."""
    out = []
    for conn in conns:
        mode = notify_mode(conn.features)
        if (mode is None or conn.closed or conn.bucket is not cluster.bucket
                or not 0 <= conn.node < len(cluster.nodes) or not cluster.nodes[conn.node].serving):
            continue
        value = b"" if mode == "brief" else cluster.render(conn.node)
        cluster.pushes += 1
        req = m.Request(opcode=SERVER_OP_CLUSTERMAP_CHANGE_NOTIFICATION, magic=0x82,
                        opaque=NOTIFY_OPAQUE_BASE + cluster.pushes, key=cluster.bucket.name.encode(),
                        extras=cluster.rev_epoch.to_bytes(8, "big") + cluster.rev.to_bytes(8, "big"),
                        value=value, datatype=1 if value else 0)
        out.append((conn, m.encode(req)))
    return out
