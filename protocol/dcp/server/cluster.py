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
import hashlib
import random
from collections.abc import Iterable
from typing import Any, Callable, Protocol, TypeVar

from dcptool.protocol.dcp.server.bucket import Bucket
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.cluster_config import ClusterConfig, Node
from dcptool.protocol.dcp.wire.constants import (
    SERVER_OP_CLUSTERMAP_CHANGE_NOTIFICATION,
    Feature,
)

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
    kind: str                     # "rebalance", "failover", "add-node", or a chaos kind (chaos.py)
    rev: int
    moves: tuple[Move, ...] = ()
    node: int | None = None       # failed or added node
    drop: tuple[int, ...] = ()    # nodes whose open connections close (left, restarted, failed)
    loss: int = 0                 # seqnos each moved or warmed-up vbucket lost (hard failover, restart)
    # a recovery (chaos delta-recovery / full-recovery): (vb, seqnos the node kept, seqnos
    # streamed to it from the active) for each vbucket it holds after it
    recovered: tuple[tuple[int, int, int], ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    at: int                       # stream frames served cluster-wide
    kind: str                     # "rebalance", "failover", "add-node", or a chaos kind (chaos.py)
    node: int | None = None       # failover target (chaos: the node the event is about)
    loss: int | None = None       # chaos: seqnos lost (hard failover, hang, restart)
    other: int | None = None      # chaos swap: the spare node that comes in


class Checker(Protocol):
    """The invariants a chaos run keeps (chaos.install): `snapshot` before an event, `check`
    after it (what is broken; empty when all hold)."""

    def snapshot(self, cluster: Cluster) -> Any: ...

    def check(self, cluster: Cluster, change: Change, before: Any) -> list[str]: ...


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
        draw = self.rng.getrandbits(128)     # drawn as before: the map's shuffle below stays the same
        # the bucket's UUID (the config's "uuid", its identity: a capture directory holds one,
        # CAPTURE_FORMAT.md): stable for a bucket name and seed, another for another seed
        self.uuid = hashlib.sha256(f"bucket:{bucket.name}:{seed}:{draw:032x}".encode()).hexdigest()[:32]
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
        self.muted: set[int] = set()  # nodes that stopped answering (sockets kept open, chaos "hang")
        self.loss_bound: int | None = None   # chaos: the most a failover or restart may lose
        self.broken: str | None = None       # the first broken invariant (chaos.check)
        self.on_broken: Callable[[str], None] | None = None  # called with it (chaos.install: raise InvariantBroken)
        self.checker: Checker | None = None                 # chaos.install: snapshot() before, check() after an event
        # a failed-over node's data as it left: node -> {vb: (its copy's high seqno, the failover
        # uuids the vbucket had then)}; delta recovery starts from it, full recovery drops it
        self.held: dict[int, dict[int, tuple[int, frozenset[int]]]] = {}

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

    def _bump(self, change_kind: str, moves: Iterable[Move] = (), node: int | None = None,
              drop: Iterable[int] = (), loss: int = 0, recovered: Iterable[tuple[int, int, int]] = ()) -> Change:
        self.rev += 1
        self._dirty()
        ch = Change(change_kind, self.rev, tuple(moves), node, tuple(drop), loss, tuple(recovered))
        self.changes.append(ch)
        return ch

    # ---- scripted events
    def next_event_at(self) -> int | None:
        return self.events[0].at if self.events else None

    def fire_due(self, frames: int, loss: int) -> list[Change]:
        """Run every scripted event whose frame count has been reached, in order."""
        out: list[Change] = []
        while self.events and self.events[0].at <= frames:
            ev = self.events.pop(0)
            if ev.kind == "rebalance":
                out.append(self.rebalance())
            elif ev.kind == "failover" and ev.node is not None:    # (always: --failover-at N:NODE)
                out.append(self.fail_over(ev.node, loss))
            elif ev.kind == "add-node":
                out.append(self.add_node())
            elif ev.kind in CHAOS_METHODS:
                out.append(self._chaos(ev))
        return out

    def _chaos(self, ev: Event) -> Change:
        """One event of a random schedule (chaos.py), then the invariants kv_engine and
        ns_server keep (`checker`); the first broken one goes to on_broken (stop loudly)."""
        chk = self.checker
        before = chk.snapshot(self) if chk is not None else None
        name, args = CHAOS_METHODS[ev.kind]
        ch: Change = getattr(self, name)(*[getattr(ev, a) for a in args])
        problems = chk.check(self, ch, before) if chk is not None else []
        if problems and self.broken is None:
            self.broken = f"chaos: after {ev.kind} at frame {ev.at} (rev {ch.rev}): {problems[0]}"
            if self.on_broken is not None:
                self.on_broken(self.broken)
        return ch

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
        self._freeze(node)
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

    # ---- chaos events (chaos.py draws them; docs/SERVE.md "Break it with a schedule")
    def _members(self) -> list[int]:
        return [n.index for n in self.serving_nodes()]

    def _takeover(self, vb: int, new: int, moves: list[Move]) -> None:
        """vbucket `vb` turns active on `new` with its data (a failover entry at its high seqno)."""
        old = self.vbmap[vb][0]
        v = self.bucket.vbuckets[vb]
        v.turn_active(self.rng.randrange(1, 1 << 48))
        self.vbmap[vb] = self._row(new, [old] + self.vbmap[vb][1:])
        moves.append(Move(vb, old, new, v.high_seqno))

    def _fill(self, moves: list[Move], limit: int | None = None) -> None:
        """Takeovers from the most to the least loaded serving nodes until each has its
        share (`limit`: stop after that many, a rebalance stopped half way)."""
        members = self._members()
        count = {i: 0 for i in members}
        for row in self.vbmap:
            if row[0] in count:
                count[row[0]] += 1
        ideal = len(self.vbmap) // len(members)
        order = list(range(len(self.vbmap)))
        self.rng.shuffle(order)
        for vb in order:
            if limit is not None and len(moves) >= limit:
                break
            owner = self.vbmap[vb][0]
            low = min(members, key=lambda i: (count[i], i))
            if count[low] >= ideal:
                break
            if owner in count and count[owner] > ideal:
                count[owner] -= 1
                count[low] += 1
                self._takeover(vb, low, moves)

    def _top_up(self) -> None:
        """A rebalance rebuilds every vbucket's replicas on serving nodes (no stream moves)."""
        for vb, row in enumerate(self.vbmap):
            if row[0] >= 0:
                self.vbmap[vb] = self._row(row[0], row[1:])

    def _move_off(self, node: int, moves: list[Move], to: int | None = None) -> None:
        """Every vbucket active on `node` moves by takeover: to `to`, else to its first
        serving replica, else to the least loaded serving node."""
        members = [i for i in self._members() if i != node]
        count = {i: len(self.active_vbuckets(i)) for i in members}
        for vb in self.active_vbuckets(node):
            target = to
            if target is None:
                target = next((r for r in self.vbmap[vb][1:] if r in count), None)
            if target is None:
                target = min(members, key=lambda i: (count[i], i))
            count[target] = count.get(target, 0) + 1
            self._takeover(vb, target, moves)

    def _join(self, node: int) -> list[Move]:
        """The node joins (alive, answering) and takes its share of actives: the moves."""
        n = self.nodes[node]
        n.joined = n.alive = True
        self.muted.discard(node)
        moves: list[Move] = []
        self._fill(moves)
        self._top_up()
        return moves

    def rebalance_in(self, node: int) -> Change:
        """A spare (or ejected) node joins and a rebalance gives it its share of actives."""
        moves = self._join(node)
        return self._bump("rebalance-in", moves, node)

    def rebalance_out(self, node: int) -> Change:
        """The node's actives move away by takeover, then it leaves the cluster (ejected)."""
        moves: list[Move] = []
        members = [i for i in self._members() if i != node]
        count = {i: len(self.active_vbuckets(i)) for i in members}
        for vb in self.active_vbuckets(node):
            target = min(members, key=lambda i: (count[i], i))
            count[target] += 1
            self._takeover(vb, target, moves)
        self.nodes[node].joined = self.nodes[node].alive = False
        self._top_up()
        return self._bump("rebalance-out", moves, node, drop=(node,))

    def swap(self, out: int, into: int) -> Change:
        """Swap rebalance: `into` joins and takes over exactly what `out` had; `out` leaves."""
        n = self.nodes[into]
        n.joined = n.alive = True
        self.muted.discard(into)
        moves: list[Move] = []
        self._move_off(out, moves, to=into)
        self.vbmap = [[row[0]] + [(-1 if row[0] == into else into) if r == out else r for r in row[1:]]
                      for row in self.vbmap]
        self.nodes[out].joined = self.nodes[out].alive = False
        self._top_up()
        return self._bump("swap", moves, out, drop=(out,))

    def rebalance_stop(self) -> Change:
        """A rebalance stopped half way: half of the takeovers it planned are done (and
        stay done), the map says so; the rest never happen."""
        moves: list[Move] = []
        members = self._members()
        if len(members) > 1:
            planned = max(1, round(len(self.vbmap) * self.rebalance_share))
            order = list(range(len(self.vbmap)))
            self.rng.shuffle(order)
            for vb in sorted(order[:max(1, planned // 2)]):
                row = self.vbmap[vb]
                if row[0] not in members:
                    continue
                others = [i for i in members if i != row[0]]
                target = next((r for r in row[1:] if r in others), others[0])
                self._takeover(vb, target, moves)
        return self._bump("rebalance-stop", moves)

    def graceful_failover(self, node: int) -> Change:
        """Each active vbucket of the node is promoted on a replica by takeover (nothing is
        lost); the node stays failed over (out of the map) until a recovery adds it back."""
        moves: list[Move] = []
        self._freeze(node)
        self._move_off(node, moves)
        self.nodes[node].alive = False
        self.vbmap = [[row[0]] + [-1 if r == node else r for r in row[1:]] for row in self.vbmap]
        return self._bump("graceful-failover", moves, node, drop=(node,))

    def hard_failover(self, node: int, loss: int) -> Change:
        return self._relabel(self.fail_over(node, loss), kind="hard-failover", drop=(node,), loss=loss)

    def _relabel(self, ch: Change, **kw: Any) -> Change:
        new = dataclasses.replace(ch, **kw)
        self.changes[-1] = new
        return new

    def _freeze(self, node: int) -> None:
        """The node's copies as it fails over (a hard failover: its active copies still hold
        the tail the promoted replicas lack)."""
        self.held[node] = {vb: (self.bucket.vbuckets[vb].high_seqno,
                                frozenset(u for u, _ in self.bucket.vbuckets[vb].failover_log))
                           for vb, row in enumerate(self.vbmap) if node in row}

    def kept_by(self, node: int, vb: int) -> int:
        """What delta recovery keeps of the node's copy of vb: up to the lowest branch point
        the vbucket took since the node left (kv_engine rolls its copy back there), 0 when
        it had no copy."""
        high, uuids = self.held.get(node, {}).get(vb, (0, frozenset()))
        v = self.bucket.vbuckets[vb]
        since = [seqno for u, seqno in v.failover_log if u not in uuids]
        return max(0, min([high, v.high_seqno] + since))

    def recover(self, node: int, delta: bool = True) -> Change:
        """Add back a failed-over node and rebalance actives onto it by takeover. Delta: the
        node keeps its data and each vbucket it holds again catches up from the active (the
        difference streamed; its copy rolled back to where the vbucket branched since it
        left); full: the node starts empty and everything is streamed to it. Both look the
        same on a consumer's DCP stream; `Change.recovered` says what each kept."""
        moves = self._join(node)
        recovered = []
        for vb, row in enumerate(self.vbmap):
            if node in row:
                kept = self.kept_by(node, vb) if delta else 0
                recovered.append((vb, kept, self.bucket.vbuckets[vb].high_seqno - kept))
        self.held.pop(node, None)
        return self._bump("delta-recovery" if delta else "full-recovery", moves, node, drop=(node,),
                          recovered=recovered)

    def full_recovery(self, node: int) -> Change:
        return self.recover(node, delta=False)

    def hang(self, node: int, loss: int) -> Change:
        """The node stops answering without closing its sockets (the transport neither
        reads nor writes them, new connections are accepted and ignored); auto-failover
        then promotes its vbuckets as a hard failover (losing `loss`)."""
        self.muted.add(node)
        return self._relabel(self.fail_over(node, loss), kind="hang", loss=loss)

    def restart(self, node: int, loss: int) -> Change:
        """The node restarts having lost its memory: warm-up from disk, each of its active
        vbuckets `loss` seqnos behind, with a new failover entry there (consumers that saw
        more roll back); its connections drop; the map is unchanged."""
        moves = []
        for vb in self.active_vbuckets(node):
            v = self.bucket.vbuckets[vb]
            seqno = v.fail_over(self.rng.randrange(1, 1 << 48), v.high_seqno - loss, self.rng,
                                self.bucket.next_cas())
            moves.append(Move(vb, node, node, seqno))
        self.bucket.generation += 1
        return self._bump("restart", moves, node, drop=(node,), loss=loss)

    def bump_rev_epoch(self) -> Change:
        """A new revEpoch (as after a quorum-loss recovery): rev starts again at 1 and a
        client must order configs by (revEpoch, rev)."""
        self.rev_epoch += 1
        self.rev = 0
        return self._bump("rev-epoch")

    def add_node(self) -> Change:
        spare = next((n for n in self.nodes if not n.joined), None)
        if spare is None:
            return self._bump("add-node")
        spare.joined = True
        return self._bump("add-node", (), spare.index)


# chaos kind -> (method, the Event fields it takes)
CHAOS_METHODS = {
    "rebalance-in": ("rebalance_in", ("node",)),
    "rebalance-out": ("rebalance_out", ("node",)),
    "swap": ("swap", ("node", "other")),
    "rebalance-stop": ("rebalance_stop", ()),
    "graceful-failover": ("graceful_failover", ("node",)),
    "hard-failover": ("hard_failover", ("node", "loss")),
    "delta-recovery": ("recover", ("node",)),
    "full-recovery": ("full_recovery", ("node",)),
    "hang": ("hang", ("node", "loss")),
    "restart": ("restart", ("node", "loss")),
    "rev-epoch": ("bump_rev_epoch", ()),
}


# --------------------------------------------------------------------------- notifications

def notify_mode(features: Iterable[int]) -> str | None:
    """"full", "brief" or None: what a connection with these HELLO features gets pushed."""
    if Feature.DUPLEX not in features:
        return None
    if Feature.CLUSTERMAP_CHANGE_NOTIFICATION_BRIEF in features:
        return "brief"
    return "full" if Feature.CLUSTERMAP_CHANGE_NOTIFICATION in features else None


class Notified(Protocol):
    """What `notifications` reads of a connection (producer.ProducerConnection)."""
    @property
    def features(self) -> set[int]: ...
    @property
    def closed(self) -> str | None: ...
    @property
    def bucket(self) -> object: ...
    @property
    def node(self) -> int: ...


_Conn = TypeVar("_Conn", bound=Notified)


def notifications(cluster: Cluster, conns: Iterable[_Conn]) -> list[tuple[_Conn, bytes]]:
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
