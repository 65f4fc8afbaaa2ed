"""Which node streams which vbucket, sans-IO (docs/CLUSTER.md): the current cluster config,
vbucket -> active node, and the vbuckets waiting for a map that gives them a (new) owner.

A vbucket waits when its stream ended "state changed", was refused NOT_MY_VBUCKET, or its
node stopped answering. It goes to the owner in the newest map held, whatever node it left:
at once when that is another node or the map is newer than when it left; to the same node
under the same map after a backoff (RETRY_FIRST, doubling to RETRY_MAX per try until it is
served again), as real clients retry by the newest map they hold: a topology that moved a
vbucket away and back leaves it on the node it left. At its deadline (the timeout from when
it first stopped being served) it is unserved, with the reason. Time is an argument;
nothing here does I/O.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from dcptool.protocol.dcp.wire import cluster_config
from dcptool.protocol.dcp.wire.cluster_config import ClusterConfig

# why a vbucket was not served (the summary's `unserved` values)
NO_ACTIVE = "no active node in the cluster map"
NODE_DOWN = "its node stopped answering and no replica was promoted in time"
REFUSED = "refused (NOT_MY_VBUCKET) by the owner of every cluster map held until the timeout"
RETRY_FIRST = 0.1       # seconds before a vbucket goes back to the node it left, same map
RETRY_MAX = 2.0         # the backoff doubles per try up to this


@dataclasses.dataclass(slots=True)
class Waiting:
    vb: int
    left: str | None          # the node ("host:port") it left, None: never had one
    since_key: tuple[int, int] | None   # the config (revEpoch, rev) when it left
    deadline: float
    why: str
    retry_at: float = 0.0     # when it may go back to the node it left under the same map


class Router:
    def __init__(self, requested: list[int] | None, tls: bool = False, shard: tuple[int, int] | None = None):
        self.requested = requested
        self.shard = shard        # (index, count): without requested vbuckets, vb % count == index
        self.tls = tls
        self.config: ClusterConfig | None = None
        self.waiting: dict[int, Waiting] = {}
        self.unserved: dict[int, str] = {}
        self.configs_applied = 0
        self._since: dict[int, float] = {}     # when a vbucket began to wait (until served again)
        self._tries: dict[int, int] = {}       # waits since it was last served (the backoff)

    # ---- the map
    def apply(self, raw: bytes, host_used: str) -> bool:
        """Parse a config (RemoteError BAD_CLUSTER_CONFIG when malformed); True when it is
        newer than the current one and now current."""
        cfg = cluster_config.parse(raw, host_used)
        if not cluster_config.newer(cfg, self.config):
            return False
        self.config = cfg
        self.configs_applied += 1
        return True

    @property
    def key(self) -> tuple[int, int] | None:
        return None if self.config is None else self.config.key

    def node_addresses(self) -> list[str]:
        return [self.address_of(n) for n in self.config.nodes] if self.config else []

    def address_of(self, node: Any) -> str:
        host, port = node.kv_address(self.tls)
        if port is None:            # no kvSSL port under TLS: the plain one is all we know
            port = node.kv
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def owner(self, vb: int) -> str | None:
        """"host:port" of the vbucket's active node, None when the map has none."""
        cfg = self.config
        if cfg is None or not 0 <= vb < cfg.num_vbuckets:
            return None
        node = cfg.active_node(vb)
        return None if node is None else self.address_of(node)

    def wanted(self) -> list[int]:
        """The vbuckets to stream: the requested ones, else every vbucket of the map."""
        if self.requested is not None:
            return list(self.requested)
        if self.config is None:
            return []
        return [vb for vb in range(self.config.num_vbuckets)
                if self.shard is None or vb % self.shard[1] == self.shard[0]]

    def outside(self) -> list[int]:
        """Requested vbuckets the map does not have at all."""
        n = self.config.num_vbuckets if self.config else 0
        return [vb for vb in self.requested or () if vb >= n]

    def plan(self, vbuckets: Iterable[int]) -> dict[str, list[int]]:
        """Owner -> vbuckets (in order) of those that have an active node."""
        out: dict[str, list[int]] = {}
        for vb in vbuckets:
            o = self.owner(vb)
            if o is not None:
                out.setdefault(o, []).append(vb)
        return out

    # ---- waiting vbuckets
    def wait(self, vb: int, left: str | None, now: float, timeout: float, why: str, backoff: bool = True) -> None:
        """The vbucket needs an owner; its deadline runs from when it first stopped being
        served (retries to a node that is still down do not move it). Back to the node it
        left under the same map: after the backoff, or at once without `backoff` (a stream
        that ended while the newest map already named that node again)."""
        since = self._since.setdefault(vb, now)
        tries = self._tries.get(vb, 0)
        self._tries[vb] = tries + 1
        delay = min(RETRY_FIRST * 2 ** tries, RETRY_MAX) if backoff else 0.0
        self.waiting[vb] = Waiting(vb, left, self.key, since + timeout, why, now + delay)

    def served(self, vb: int) -> None:
        """A stream of the vbucket is open again: a later wait starts a new deadline and backoff."""
        self._since.pop(vb, None)
        self._tries.pop(vb, None)

    def ready(self, down: set[str] | frozenset[str] = frozenset(), now: float | None = None) -> dict[str, list[int]]:
        """Waiting vbuckets that may go to a node now, by owner in the newest map: the owner
        is not a node known down, and it is another node than the one left, or the map is
        newer since, or (with `now`) its retry time has come."""
        out: dict[str, list[int]] = {}
        for vb, w in sorted(self.waiting.items()):
            o = self.owner(vb)
            if o is None or o in down:
                continue
            newer = self.key is not None and w.since_key is not None and self.key > w.since_key
            if o != w.left or newer or (now is not None and now >= w.retry_at):
                out.setdefault(o, []).append(vb)
        for vbs in out.values():
            for vb in vbs:
                del self.waiting[vb]
        return out

    def next_retry(self, down: set[str] | frozenset[str] = frozenset()) -> float | None:
        """The earliest retry time of a vbucket whose owner is the node it left (a node known
        down is not retried: its own backoff says when)."""
        times = []
        for w in self.waiting.values():
            o = self.owner(w.vb)
            if o is not None and o == w.left and o not in down:
                times.append(w.retry_at)
        return min(times, default=None)

    def expire(self, now: float) -> dict[int, str]:
        """Waiting vbuckets past their deadline: now unserved, with the reason."""
        gone = {vb: w.why for vb, w in self.waiting.items() if now >= w.deadline}
        for vb in gone:
            del self.waiting[vb]
        self.unserved.update(gone)
        return gone

    def next_deadline(self) -> float | None:
        return min((w.deadline for w in self.waiting.values()), default=None)


def split(vbuckets: list[int], n: int) -> list[list[int]]:
    """A node's vbuckets over n connections, round robin (every group non-empty)."""
    n = max(1, min(n, len(vbuckets)))
    return [vbuckets[i::n] for i in range(n)]


# --------------------------------------------------------------------------- events

@dataclasses.dataclass(frozen=True, slots=True)
class MapApplied:
    """A newer cluster map is current: its (revEpoch, rev) and its KV nodes ("host:port")."""
    rev_epoch: int
    rev: int
    nodes: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Rerouted:
    """A vbucket goes to `node` (after a handoff, a refusal or a node that stopped answering)."""
    vbucket: int
    node: str


@dataclasses.dataclass(frozen=True, slots=True)
class Unserved:
    vbucket: int
    reason: str
