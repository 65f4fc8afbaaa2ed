"""Random topology schedules for `serve dcp --chaos SEED`, sans-IO: a seeded draw of what
Couchbase clusters go through (docs/SERVE.md "Break it with a schedule"), its JSON form
(`--schedule FILE` replays one), and the invariants the producer checks after every event
(cluster.Cluster._chaos calls `snapshot` before and `check` after).

Node 0 is the seed clients bootstrap from: it may restart but never leaves, fails or hangs.
The draw follows the cluster's node states so that every event can happen: a failover only
while every vbucket has a replica (the last rebalance rebuilt them), a recovery only of a
node failed over, a rebalance in or a swap only with a spare (or ejected) node, and at least
two serving nodes left after a rebalance out or a failover.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from typing import TYPE_CHECKING, Any, NoReturn

from dcptool.protocol.dcp.server.cluster import Change, Cluster, Event, Move
from dcptool.protocol.errors import DcptoolError

if TYPE_CHECKING:
    from dcptool.protocol.dcp.server.shared import ServerModel

KINDS = ("rebalance-in", "rebalance-out", "swap", "rebalance-stop", "graceful-failover", "hard-failover",
         "delta-recovery", "full-recovery", "hang", "restart", "rev-epoch")
LOSSY = ("hard-failover", "hang", "restart")       # a new branch below the high seqno
DEFAULT_SPARES = 2
MAX_LOG = 25                                      # kv_engine's max_failover_entries


class InvariantBroken(DcptoolError):
    """The producer broke one of its own invariants after a chaos event (exit 1)."""


class ScheduleError(DcptoolError, ValueError):
    """A schedule file that is not one (its message names what is wrong)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Schedule:
    seed: int | None
    nodes: int
    replicas: int
    spares: int
    events: tuple[Event, ...]

    def to_json(self) -> str:
        evs = []
        for e in self.events:
            d = {"at": e.at, "kind": e.kind}
            for f in ("node", "other", "loss"):
                if getattr(e, f) is not None:
                    d[f] = getattr(e, f)
            evs.append(d)
        return json.dumps({"seed": self.seed, "nodes": self.nodes, "replicas": self.replicas,
                           "spares": self.spares, "events": evs}, separators=(",", ":"))


MAX_DEPTH = 8          # a schedule nests 3 deep ({"events": [{...}]}); json.loads recurses


def _depth(text: str) -> int:
    """How deep the JSON nests, without recursing (strings skipped)."""
    depth = deepest = 0
    for tok in _BRACKETS.finditer(text):
        c = tok.group()
        if c in ("[", "{"):
            depth += 1
            deepest = max(deepest, depth)
        elif c in ("]", "}"):
            depth -= 1
    return deepest


_BRACKETS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def from_json(text: str) -> Schedule:
    """Parse what to_json wrote; ScheduleError (one line) when it is not a schedule."""
    if _depth(text) > MAX_DEPTH:
        raise ScheduleError(f"not a schedule: JSON nested deeper than {MAX_DEPTH} levels")
    try:
        d = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ScheduleError(f"not JSON: {exc}") from None
    if not isinstance(d, dict) or not isinstance(d.get("events"), list):
        raise ScheduleError('not a schedule: an object with "events" (a list) is expected')

    def integer(obj: dict[str, Any], key: str, default: int | None = None, low: int = 0) -> int:
        v = obj.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise ScheduleError(f"{key!r} must be an integer >= {low}, not {v!r}")
        return v

    def optional(obj: dict[str, Any], key: str) -> int | None:    # node, other, loss: null or absent is None
        return None if obj.get(key) is None else integer(obj, key)

    nodes = integer(d, "nodes", low=1)
    spares = integer(d, "spares", 0)
    replicas = integer(d, "replicas", 0)
    total = nodes + spares
    events = []
    for i, e in enumerate(d["events"]):
        if not isinstance(e, dict) or e.get("kind") not in KINDS:
            raise ScheduleError(f"event {i}: kind must be one of {', '.join(KINDS)}, not "
                                f"{e.get('kind') if isinstance(e, dict) else e!r}")
        ev = Event(integer(e, "at", low=1), e["kind"], optional(e, "node"), optional(e, "loss"), optional(e, "other"))
        need = _params(ev.kind)
        for f in ("node", "other", "loss"):
            if (f in need) != (getattr(ev, f) is not None):
                raise ScheduleError(f"event {i} ({ev.kind}): {f!r} is {'required' if f in need else 'not taken'}")
        for f in ("node", "other"):
            if getattr(ev, f) is not None and getattr(ev, f) >= total:
                raise ScheduleError(f"event {i} ({ev.kind}): node {getattr(ev, f)} does not exist "
                                    f"(nodes 0..{total - 1} with the spares)")
        events.append(ev)
    seed = d.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ScheduleError(f"'seed' must be an integer or null, not {seed!r}")
    return Schedule(seed, nodes, replicas, spares, tuple(sorted(events, key=lambda e: e.at)))


def validate(schedule: Schedule, max_loss: int) -> None:
    """ScheduleError (one line) naming the first event `--chaos` could never draw: the
    schedule is replayed over the node states `draw` follows (node 0 never leaves, fails or
    hangs; a failover only while every vbucket has a replica and more than two nodes serve;
    a recovery only of a node failed over; a rebalance in or a swap only with a spare or
    ejected node), and no event loses more than `max_loss` (--failover-loss) seqnos."""
    state = {i: "in" for i in range(schedule.nodes)}
    state.update({schedule.nodes + i: "spare" for i in range(schedule.spares)})
    degraded = False
    for e in schedule.events:
        options = _eligible(state, schedule.replicas, degraded)
        pick = (e.node, e.other) if e.kind == "swap" else e.node
        what = f"event at {e.at} ({e.kind}" + "".join(f" {f} {getattr(e, f)}" for f in ("node", "other")
                                                      if getattr(e, f) is not None) + ")"
        if e.kind not in options or (options[e.kind] and pick not in options[e.kind]):
            raise ScheduleError(f"{what}: {_why_not(e, state, schedule.replicas, degraded)}; --chaos never "
                                "draws it")
        if e.loss is not None and e.loss > max_loss:
            raise ScheduleError(f"{what}: loss {e.loss} is above --failover-loss {max_loss}")
        degraded = _advance(state, e.kind, e.node, e.other, degraded)


_STATE_WORDS = {"in": "serving", "spare": "a spare", "out": "ejected", "failed": "failed over"}


def _why_not(e: Event, state: dict[int, str], replicas: int, degraded: bool) -> str:
    """Why `_eligible` leaves the event out, in words."""
    serving = sum(1 for s in state.values() if s == "in")
    kind, node = e.kind, e.node

    def now(n: int | None) -> str:
        return _STATE_WORDS[state[n]] if n is not None and n in state else "unknown"

    if node == 0 and kind in ("rebalance-out", "swap", "graceful-failover", "hard-failover", "hang"):
        return "node 0 (the seed clients bootstrap from) never leaves, fails or hangs"
    if kind in ("graceful-failover", "hard-failover", "hang"):
        if not replicas:
            return "a failover needs --replicas 1 or more"
        if degraded:
            return "a failover needs every vbucket to have a replica, and none was rebuilt since the last failover"
        if serving <= 2:
            return f"a failover must leave two nodes serving ({serving} serve)"
    if kind == "rebalance-out" and serving <= 2:
        return f"a rebalance out must leave two nodes serving ({serving} serve)"
    if kind == "rebalance-stop":
        return f"a rebalance needs two serving nodes ({serving} serve)"
    if kind in ("delta-recovery", "full-recovery"):
        return f"node {node} is {now(node)}: only a node failed over is recovered"
    if kind == "rebalance-in":
        return f"node {node} is {now(node)}: only a spare or ejected node joins"
    if kind == "swap" and state.get(e.other if e.other is not None else -1) not in ("spare", "out"):
        return f"node {e.other} is {now(e.other)}: a swap brings in a spare or ejected node"
    return f"node {node} is {now(node)}, not serving"


def _params(kind: str) -> tuple[str, ...]:
    from dcptool.protocol.dcp.server.cluster import CHAOS_METHODS
    return CHAOS_METHODS[kind][1]


# --------------------------------------------------------------------------- drawing

def draw(seed: int, nodes: int, replicas: int, frames: int, max_loss: int = 10,
         spares: int = DEFAULT_SPARES, count: int | None = None) -> Schedule:
    """A seeded schedule of `count` events (3..7 when None) at stream-frame counts spread
    over [frames/20, frames*9/10] (`frames`: about what a consumer will be sent, e.g. the
    bucket's items). Same arguments, same schedule."""
    rng = random.Random(f"chaos:{seed}")
    if count is None:
        count = rng.randint(3, 7)
    lo = max(1, frames // 20)
    hi = max(lo + count, frames * 9 // 10)
    ats = sorted(rng.sample(range(lo, hi + 1), count))
    state = {i: "in" for i in range(nodes)}
    state.update({nodes + i: "spare" for i in range(spares)})
    degraded = False        # some vbucket lacks a replica (after a failover, until a rebalance)
    events = []
    for at in ats:
        options = _eligible(state, replicas, degraded)
        kind = rng.choice(sorted(options))
        pick = rng.choice(options[kind]) if options[kind] else None
        node, other = pick if isinstance(pick, tuple) else (pick, None)     # a tuple: a swap's (node, other)
        loss = None
        if kind in LOSSY:
            loss = rng.randint(0, max_loss)
        events.append(Event(at, kind, node, loss, other))
        degraded = _advance(state, kind, node, other, degraded)
    return Schedule(seed, nodes, replicas, spares, tuple(events))


def _eligible(state: dict[int, str], replicas: int, degraded: bool) -> dict[str, list[int] | list[tuple[int, int]]]:
    members = [n for n, s in state.items() if s == "in"]
    movable = [n for n in members if n != 0]
    free = [n for n, s in state.items() if s in ("spare", "out")]
    failed = [n for n, s in state.items() if s == "failed"]
    out: dict[str, list[int] | list[tuple[int, int]]] = {"rev-epoch": [], "restart": members}
    if len(members) >= 2:
        out["rebalance-stop"] = []
    if free:
        out["rebalance-in"] = free
        if movable:
            out["swap"] = [(a, b) for a in movable for b in free]
    if len(members) > 2 and movable:
        out["rebalance-out"] = movable
    if replicas and not degraded and len(members) > 2 and movable:
        out["graceful-failover"] = movable
        out["hard-failover"] = movable
        out["hang"] = movable
    if failed:
        out["delta-recovery"] = failed
        out["full-recovery"] = failed
    return out


def _advance(state: dict[int, str], kind: str, node: int | None, other: int | None, degraded: bool) -> bool:
    """The node states after the event (load() and draw() give every event its nodes)."""
    if kind in ("rebalance-in", "delta-recovery", "full-recovery"):
        assert node is not None
        state[node] = "in"
        return False
    if kind == "rebalance-out":
        assert node is not None
        state[node] = "out"
        return False
    if kind == "swap":
        assert node is not None and other is not None
        state[node], state[other] = "out", "in"
        return False
    if kind in ("graceful-failover", "hard-failover", "hang"):
        assert node is not None
        state[node] = "failed"
        return True
    return degraded


# --------------------------------------------------------------------------- invariants

def snapshot(cluster: Cluster) -> dict[str, Any]:
    """What `check` compares against: each vbucket's high seqno and failover log, and the
    data failed-over nodes left with."""
    return {"high": [v.high_seqno for v in cluster.bucket.vbuckets],
            "logs": [list(v.failover_log) for v in cluster.bucket.vbuckets],
            "held": {n: dict(h) for n, h in cluster.held.items()}}


def check(cluster: Cluster, change: Change, before: dict[str, Any]) -> list[str]:
    """The invariants after one event; a list of what is broken (empty: all hold)."""
    problems = _map_problems(cluster) + _recovery_problems(cluster, change, before)
    moved: dict[int, Move] = {}
    for move in change.moves:
        if move.new >= 0:
            moved[move.vb] = move
    bound = cluster.loss_bound
    if change.loss and bound is not None and change.loss > bound:
        problems.append(f"{change.kind} lost {change.loss} seqnos, above the loss bound {bound} (--failover-loss)")
    for v in cluster.bucket.vbuckets:
        log, old_log, old_high = v.failover_log, before["logs"][v.vbid], before["high"][v.vbid]
        problems += _log_problems(v.vbid, log, v.high_seqno)
        mv = moved.get(v.vbid)
        if mv is None:
            if log != old_log:
                problems.append(f"vbucket {v.vbid}: its failover log changed but it did not move")
            continue
        if log[0][0] in {u for u, _ in old_log} or log[0][1] != mv.seqno:
            problems.append(f"vbucket {v.vbid}: no new failover entry at {mv.seqno} after {change.kind} "
                            f"(newest is {log[0]})")
        lost = old_high - mv.seqno
        if change.kind not in LOSSY and change.kind != "failover" and lost:
            problems.append(f"vbucket {v.vbid}: {change.kind} lost {lost} seqnos (a takeover loses none)")
        elif bound is not None and lost > bound:
            problems.append(f"vbucket {v.vbid}: the promoted copy was {lost} seqnos behind, above the loss "
                            f"bound {bound} (--failover-loss)")
    return problems


def _recovery_problems(cluster: Cluster, change: Change, before: dict[str, Any]) -> list[str]:
    """Delta recovery keeps the node's data (rolled back to where each vbucket branched
    since it left) and streams the difference; full recovery starts empty; either way the
    node's copies end whole (kept + streamed = the high seqno)."""
    if change.kind not in ("delta-recovery", "full-recovery"):
        return []
    out: list[str] = []
    held = before.get("held", {}).get(change.node, {})
    holds = {vb for vb, row in enumerate(cluster.vbmap) if change.node in row}
    if {vb for vb, _, _ in change.recovered} != holds:
        out.append(f"node {change.node}: {change.kind} accounts for vbuckets {sorted(vb for vb, _, _ in change.recovered)}, "
                   f"it holds {sorted(holds)}")
    for vb, kept, streamed in change.recovered:
        v = cluster.bucket.vbuckets[vb]
        if kept + streamed != v.high_seqno or kept < 0 or streamed < 0:
            out.append(f"vbucket {vb}: node {change.node} kept {kept} and was sent {streamed} seqnos, "
                       f"not its high seqno {v.high_seqno}")
        if change.kind == "full-recovery" and kept:
            out.append(f"vbucket {vb}: full recovery of node {change.node} kept {kept} seqnos (it starts empty)")
        if change.kind == "delta-recovery":
            high, uuids = held.get(vb, (0, frozenset()))
            branch = min([seqno for u, seqno in v.failover_log if u not in uuids], default=high)
            if kept > high or kept > branch:
                out.append(f"vbucket {vb}: delta recovery of node {change.node} kept {kept} seqnos, past its "
                           f"copy ({high}) or the branch since it left ({branch})")
            elif kept < min(high, branch):
                out.append(f"vbucket {vb}: delta recovery of node {change.node} dropped its data ({kept} of "
                           f"{min(high, branch)} seqnos kept)")
    return out


def _map_problems(cluster: Cluster) -> list[str]:
    out: list[str] = []
    for node in cluster.muted:
        if cluster.nodes[node].serving:
            out.append(f"node {node} stopped answering but is still in the map")
    for vb, row in enumerate(cluster.vbmap):
        if len(row) != cluster.replicas + 1:
            out.append(f"vbucket {vb}: map row {row} is not 1 active + {cluster.replicas} replicas")
            continue
        active, reps = row[0], [r for r in row[1:] if r >= 0]
        if active < 0 or not cluster.nodes[active].serving:
            out.append(f"vbucket {vb}: no serving active node (map row {row})")
        if len(set(reps)) != len(reps) or active in reps:
            out.append(f"vbucket {vb}: a node holds two copies (map row {row})")
        if any(not cluster.nodes[r].serving for r in reps):
            out.append(f"vbucket {vb}: a replica on a node that is not serving (map row {row})")
    return out


def _log_problems(vb: int, log: list[tuple[int, int]], high: int) -> list[str]:
    if not log or len(log) > MAX_LOG:
        return [f"vbucket {vb}: {len(log)} failover entries (1..{MAX_LOG})"]
    out = []
    if any(log[i][1] < log[i + 1][1] for i in range(len(log) - 1)):
        out.append(f"vbucket {vb}: failover log seqnos fall toward the newest entry: {log}")
    if log[0][1] > high:
        out.append(f"vbucket {vb}: newest failover entry at {log[0][1]}, above the high seqno {high}")
    if len({u for u, _ in log}) != len(log):
        out.append(f"vbucket {vb}: a uuid twice in the failover log")
    return out


# --------------------------------------------------------------------------- a server

def install(model: ServerModel, schedule: Schedule, seed: int = 0, loss_bound: int | None = None) -> Cluster:
    """Give `model` (shared.server_from_options with schedule.nodes, no events) the
    schedule's cluster: its nodes plus spares, the events, the loss bound checked."""
    bucket = next(iter(model.buckets.values()))
    cl = Cluster(bucket, schedule.nodes, schedule.replicas, seed, schedule.spares, events=schedule.events)
    cl.loss_bound = loss_bound
    cl.checker = _Checker()
    cl.on_broken = _raise
    model.cluster = cl
    return cl


class _Checker:
    snapshot = staticmethod(snapshot)
    check = staticmethod(check)


def _raise(message: str) -> NoReturn:
    raise InvariantBroken(message)
