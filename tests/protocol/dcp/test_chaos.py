"""Random topology schedules (`serve dcp --chaos SEED`, protocol/dcp/server/chaos.py): the
seeded draw, its JSON round trip, the invariants the producer checks after every event, and
a seeded property test: a capture of a 3-node cluster running a schedule, SIGKILLed and
resumed at a seeded point, replays to the producer's final bucket (nothing the cluster kept
is lost; what the capture saw and the bucket no longer has is in a failover's lost tail)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections import Counter

import pytest

from dcptool.protocol.dcp.client import consumer as dcp_consumer
from dcptool.protocol.dcp.server import chaos
from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.server.cluster import Event
from tests.support.chaos_run import BOUND, LOSS, run_schedule
from tests.support.cluster_state import final_state

DCPTOOL = os.path.join(os.path.dirname(sys.executable), "dcptool")


# --------------------------------------------------------------------------- drawing

def test_same_seed_same_schedule_and_seeds_differ():
    a = chaos.draw(7, 3, 1, 3000, LOSS)
    assert a == chaos.draw(7, 3, 1, 3000, LOSS)
    assert a.to_json() == chaos.draw(7, 3, 1, 3000, LOSS).to_json()
    assert len({chaos.draw(s, 3, 1, 3000, LOSS).to_json() for s in range(20)}) == 20
    assert all(e.loss <= LOSS for s in range(50) for e in chaos.draw(s, 3, 1, 3000, LOSS).events if e.loss is not None)


def test_json_round_trip():
    for seed in range(50):
        s = chaos.draw(seed, 3, 1, 3000, LOSS)
        line = s.to_json()
        assert "\n" not in line
        d = json.loads(line)
        assert d["seed"] == seed and all({"at", "kind"} <= set(e) for e in d["events"])
        assert chaos.from_json(line) == s


@pytest.mark.parametrize("text, says", [
    ("nope", "not JSON"),
    ('{"nodes": 3}', "events"),
    ('{"nodes": 3, "events": [{"at": 5, "kind": "explode"}]}', "kind must be one of"),
    ('{"nodes": 3, "events": [{"at": 5, "kind": "hang", "node": 1}]}', "'loss' is required"),
    ('{"nodes": 3, "events": [{"at": 5, "kind": "rev-epoch", "node": 1}]}', "'node' is not taken"),
    ('{"nodes": 3, "events": [{"at": 0, "kind": "rev-epoch"}]}', "'at' must be an integer >= 1"),
    ('{"nodes": 3, "spares": 1, "events": [{"at": 5, "kind": "rebalance-in", "node": 4}]}', "does not exist"),
])
def test_a_bad_schedule_is_one_clear_error(text, says):
    with pytest.raises(chaos.ScheduleError, match=says):
        chaos.from_json(text)


def test_every_kind_is_reachable_over_seeds():
    seen = Counter(e.kind for s in range(200) for e in chaos.draw(s, 3, 1, 3000, LOSS).events)
    assert set(seen) == set(chaos.KINDS), set(chaos.KINDS) - set(seen)
    # without replicas nothing can fail over, node 0 never leaves
    none = [e for s in range(100) for e in chaos.draw(s, 3, 0, 3000, LOSS).events]
    assert not {e.kind for e in none} & {"graceful-failover", "hard-failover", "hang"}
    assert not any(e.node == 0 and e.kind != "restart" for s in range(200)
                   for e in chaos.draw(s, 3, 1, 3000, LOSS).events)


# --------------------------------------------------------------------------- invariants

def run_sans_io(seed: int, schedule: chaos.Schedule, loss_bound: int = LOSS):
    model = P.server_from_options(vbuckets=32, items=400, seed=seed, nodes=schedule.nodes,
                                  replicas=schedule.replicas)
    cl = chaos.install(model, schedule, seed, loss_bound)
    for ev in schedule.events:
        model.apply_changes(cl.fire_due(ev.at, loss_bound))
    return model, cl


def test_every_drawn_schedule_keeps_the_invariants():
    kinds = Counter()
    for seed in range(150):
        sched = chaos.draw(seed, 3, 1, 3000, LOSS)
        model, cl = run_sans_io(seed, sched)
        assert cl.broken is None
        assert [c.kind for c in cl.changes] == [e.kind for e in sched.events]
        kinds.update(c.kind for c in cl.changes)
        assert not chaos.check(cl, cl.changes[-1], chaos.snapshot(cl)) or cl.changes[-1].moves
    assert set(kinds) == set(chaos.KINDS)


def test_events_do_what_they_say():
    sched = chaos.Schedule(1, 3, 1, 2, (Event(1, "hard-failover", 2, 5), Event(2, "full-recovery", 2),
                                        Event(3, "restart", 0, 3), Event(4, "rev-epoch"), Event(5, "swap", 1, other=3),
                                        Event(6, "hang", 2, 0)))
    model, cl = run_sans_io(3, sched)
    ch = {c.kind: c for c in cl.changes}
    assert all(mv.seqno >= 0 for mv in ch["hard-failover"].moves) and ch["hard-failover"].loss == 5
    assert {mv.new for mv in ch["full-recovery"].moves} == {2}
    assert all(mv.old == mv.new == 0 for mv in ch["restart"].moves) and ch["restart"].drop == (0,)
    assert (ch["rev-epoch"].rev, cl.rev_epoch) == (1, 2)
    assert not cl.nodes[1].serving and cl.nodes[3].serving and {mv.new for mv in ch["swap"].moves} == {3}
    assert cl.muted == {2} and not cl.nodes[2].serving and ch["hang"].drop == ()
    assert {n.index for n in cl.serving_nodes()} == {0, 3}
    # a restart lost its tail: the newest failover entry of node 0's vbuckets is below the old high
    vb = ch["restart"].moves[0].vb
    assert cl.bucket.vbuckets[vb].failover_log[0][1] == ch["restart"].moves[0].seqno


@pytest.mark.parametrize("first", ["hard-failover", "graceful-failover"])
def test_delta_recovery_keeps_the_node_s_data_and_full_recovery_starts_empty(first):
    """The node failed over, writes went on, then it is added back: delta recovery keeps
    what it had (rolled back to the branch a hard failover made) and is sent only the
    difference; full recovery keeps nothing and is sent everything (docs/CLUSTER.md)."""
    runs = {}
    for how in ("delta-recovery", "full-recovery"):
        sched = chaos.Schedule(None, 3, 1, 2, (Event(1, first, 2, 3 if first == "hard-failover" else None),
                                               Event(2, "rev-epoch"), Event(3, how, 2)))
        model = P.server_from_options(vbuckets=16, items=400, seed=4, nodes=3, replicas=1)
        cl = chaos.install(model, sched, 4, LOSS)
        model.apply_changes(cl.fire_due(1, LOSS))
        model.buckets["default"].mutate_random(200)        # the cluster goes on without node 2
        for at in (2, 3):
            model.apply_changes(cl.fire_due(at, LOSS))
        assert cl.broken is None, cl.broken
        runs[how] = (cl.changes[-1], cl)
    delta, cl = runs["delta-recovery"]
    full, _ = runs["full-recovery"]
    highs = {vb: v.high_seqno for vb, v in enumerate(cl.bucket.vbuckets)}
    assert full.recovered and all(kept == 0 and sent == highs[vb] for vb, kept, sent in full.recovered)
    assert delta.recovered and all(kept + sent == highs[vb] for vb, kept, sent in delta.recovered)
    assert sum(sent for _, _, sent in delta.recovered) < sum(sent for _, _, sent in full.recovered)
    failed = {mv.vb: mv.seqno for mv in cl.changes[0].moves}       # node 2's actives as it left
    kept = {vb: k for vb, k, _ in delta.recovered}
    for vb in set(failed) & set(kept):   # its copy goes back to the branch the failover made
        assert kept[vb] == failed[vb] if first == "hard-failover" else kept[vb] >= failed[vb]


def test_a_delta_recovery_that_drops_the_data_is_caught():
    sched = chaos.Schedule(None, 3, 1, 2, (Event(1, "graceful-failover", 2), Event(2, "delta-recovery", 2)))
    model = P.server_from_options(vbuckets=16, items=200, seed=1, nodes=3, replicas=1)
    cl = chaos.install(model, sched, 1, LOSS)
    cl.fire_due(1, LOSS)
    cl.kept_by = lambda node, vb: 0          # a delta recovery that behaves as a full one
    with pytest.raises(chaos.InvariantBroken, match="dropped its data"):
        cl.fire_due(2, LOSS)


def _break(cl, how: str):
    v = cl.bucket.vbuckets[0]
    if how == "two-copies":
        cl.vbmap[0] = [cl.vbmap[0][0], cl.vbmap[0][0]]
    elif how == "dead-active":
        cl.vbmap[0][0] = -1
    elif how == "log-order":
        v.failover_log.insert(0, (12345, v.high_seqno))
        v.failover_log.insert(1, (12346, v.high_seqno + 5))
    elif how == "no-new-entry":     # a takeover that forgets kv_engine's new failover entry
        for vb in cl.bucket.vbuckets:
            vb.turn_active = lambda uuid: None


@pytest.mark.parametrize("how, says", [("two-copies", "two copies"), ("dead-active", "no serving active"),
                                       ("log-order", "fall toward the newest"),
                                       ("no-new-entry", "no new failover entry")])
def test_a_broken_state_is_caught(how, says):
    kind = "rebalance-stop" if how == "no-new-entry" else "rev-epoch"
    sched = chaos.Schedule(None, 3, 1, 2, (Event(1, kind),))
    model = P.server_from_options(vbuckets=16, items=200, seed=1, nodes=3, replicas=1)
    cl = chaos.install(model, sched, 1, LOSS)
    _break(cl, how)
    with pytest.raises(chaos.InvariantBroken, match=says):
        cl.fire_due(1, LOSS)
    assert says in cl.broken and f"after {kind} at frame 1" in cl.broken


def test_a_loss_above_the_bound_is_caught_and_reported_once():
    sched = chaos.Schedule(None, 3, 1, 2, (Event(1, "hard-failover", 1, 20), Event(2, "rev-epoch")))
    model = P.server_from_options(vbuckets=16, items=200, seed=1, nodes=3, replicas=1)
    cl = chaos.install(model, sched, 1, LOSS)
    seen = []
    cl.on_broken = seen.append
    cl.fire_due(5, LOSS)
    assert len(seen) == 1 and "above the loss bound 8" in seen[0]


# --------------------------------------------------------------------------- the CLI

def _serve(*args):
    return subprocess.Popen([DCPTOOL, "serve", "dcp", "--port", "0", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_serve_prints_the_schedule_first_and_replays_a_file(tmp_path):
    srv = _serve("--nodes", "3", "--replicas", "1", "--items", "2000", "--chaos", "11")
    try:
        first, second = srv.stdout.readline(), srv.stdout.readline()
    finally:
        srv.terminate()
        srv.communicate(timeout=BOUND)
    assert chaos.from_json(first) == chaos.draw(11, 3, 1, 2000, 10)
    assert len(json.loads(second)["nodes"]) == 3 + 2          # the spares listen from the start
    f = tmp_path / "s.json"
    f.write_text(first)
    srv = _serve("--nodes", "3", "--replicas", "1", "--items", "2000", "--schedule", str(f))
    try:
        assert srv.stdout.readline() == first
    finally:
        srv.terminate()
        srv.communicate(timeout=BOUND)
    bad = subprocess.run([DCPTOOL, "serve", "dcp", "--port", "0", "--nodes", "4", "--schedule", str(f)],
                         capture_output=True, text=True, timeout=BOUND)
    assert bad.returncode == 2 and "drawn for --nodes 3 --replicas 1" in bad.stderr


def test_a_loss_above_the_bound_is_refused_before_listening(tmp_path):
    """The schedule is checked before the server listens (issue 36): a loss above
    --failover-loss never reaches the running cluster's invariant check (which stops the
    server loudly: test_a_loss_above_the_bound_is_caught_and_reported_once, sans-IO)."""
    f = tmp_path / "s.json"
    f.write_text(chaos.Schedule(None, 3, 1, 0, (Event(50, "hard-failover", 2, 30),)).to_json())
    srv = _serve("--nodes", "3", "--replicas", "1", "--items", "2000", "--schedule", str(f),
                 "--failover-loss", "10")
    out, err = srv.communicate(timeout=BOUND)
    assert srv.returncode == 2 and out == ""
    assert "loss 30 is above --failover-loss 10" in err and len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------- property test

SEEDS = list(range(20))


@pytest.mark.integration
@pytest.mark.parametrize("seed", SEEDS)
def test_a_killed_and_resumed_capture_survives_a_random_schedule(tmp_path, seed):
    run_schedule(tmp_path, seed)


def test_the_schedule_line_replays_the_same_run(tmp_path):
    """A failing seed reproduces with --schedule: the same JSON gives the same events."""
    sched = chaos.from_json(chaos.draw(3, 3, 1, 2400, LOSS).to_json())
    a, _ = run_sans_io(3, sched)
    b, _ = run_sans_io(3, chaos.draw(3, 3, 1, 2400, LOSS))
    assert final_state(a) == final_state(b)
    assert [dataclasses.astuple(c) for c in a.cluster.changes] == [dataclasses.astuple(c) for c in b.cluster.changes]


@pytest.mark.parametrize("args, says", [
    (["--chaos", "1", "--rebalance-at", "100"], "replace --rebalance-at"),
    (["--chaos", "1", "--schedule", "SCHED"], "go alone"),
    (["--schedule", "BAD"], "kind must be one of"),
])
def test_chaos_usage_errors_are_one_line_exit_2(tmp_path, args, says):
    (tmp_path / "s.json").write_text(chaos.draw(1, 3, 1, 1000).to_json())
    (tmp_path / "b.json").write_text('{"nodes": 3, "events": [{"at": 1, "kind": "meteor"}]}')
    args = [str(tmp_path / "s.json") if a == "SCHED" else str(tmp_path / "b.json") if a == "BAD" else a
            for a in args]
    res = subprocess.run([DCPTOOL, "serve", "dcp", "--port", "0", "--nodes", "3", "--replicas", "1", *args],
                         capture_output=True, text=True, timeout=BOUND)
    assert res.returncode == 2 and says in res.stderr and "Traceback" not in res.stderr


@pytest.mark.integration
def test_a_vbucket_that_moves_away_and_straight_back_is_served_again(tmp_path):
    """Node 3 rebalanced in and gracefully failed over at the same frame: every vbucket it
    took goes back to the node it left, the map that says so comes before that node's stream
    end. (When that map comes on another connection, after the stream end was sent but
    before it is read, the router still waits for a newer map: bench_chaos.py seeds 1037,
    1076, 1101, 1145, by timing; consumer routing, issue 25 item 1.)"""
    sched = chaos.Schedule(None, 3, 1, 2, (Event(300, "rebalance-in", 3), Event(300, "graceful-failover", 3)))
    model, _ = run_schedule(tmp_path, 1, sched)
    back = [mv for mv in model.cluster.changes[1].moves]
    assert back and all(mv.old == 3 for mv in back)
    assert {mv.vb: mv.new for mv in back} == {mv.vb: mv.old for mv in model.cluster.changes[0].moves}


# --------------------------------------------------------------------------- found by the SDK property

def test_a_rollback_into_a_deduplicated_snapshot_restarts_at_a_whole_snapshot():
    """A memory snapshot is deduplicated: a key written at 11 and again at 20 comes once, at
    20. A failover that keeps seqnos up to 15 (KV writes lost, not rewritten) makes the key's
    version at 11 the live one; a consumer told to roll back to 15 has no state at 15 and
    must go back to the end of the last whole snapshot (10), or it never learns the key's
    version at 11 (SDK property seed 1: the replayed documents missed a durable commit)."""
    from tests.support.dcp_pair import Pair, cfg
    srv, bucket, vb = _dedup_bucket()
    first = Pair(srv, cfg(to="now")).run()
    assert [s for s, _ in first.data()[0]][-9:] == list(range(12, 21))          # 11 deduplicated away
    state = {v: dataclasses.replace(s, ended_reason=None) for v, s in first.cons.streams.resume_state().items()}
    r = vb.fail_over(777, 15, bucket.rng, bucket.next_cas())
    second = Pair(srv, cfg(to="now"), resume=state).run()
    assert [e.seqno for e in second.of(dcp_consumer.Rollback)] == [r] == [15]
    held = {}
    for run in (first, second):       # the rollback drops what is above 15, the restart refills
        for seqno, key in run.data()[0]:
            held[key] = seqno
        if run is first:
            held = {k: s for k, s in held.items() if s <= r}
    assert held == {k: it.seqno for k, it in vb.latest().items()}


def _dedup_bucket():
    from dcptool.protocol.dcp.server.bucket import Item
    srv = P.server_from_options(vbuckets=1, items=10, seed=2, checkpoint_items=100)
    bucket = srv.buckets["default"]
    vb = bucket.vbuckets[0]
    for key in [b"again", b"b1", b"b2", b"b3", b"b4", b"b5", b"b6", b"b7", b"b8", b"again"]:
        vb.mem.append(Item(vb.high_seqno + 1, key, b'{"v":%d}' % vb.high_seqno, 1, bucket.next_cas(), kv=True))
    return srv, bucket, vb


def test_a_resumed_capture_rolled_back_into_a_deduplicated_snapshot_replays_the_bucket(tmp_path):
    """The same across processes: `capture --resume` takes the whole-snapshot ends from the
    capture's rows (replay/store/resume.py), so the resumed run restarts at 10, not 15."""
    from tests.support.chaos_run import documents_of
    from tests.support.threaded_server import ThreadedServer
    srv, bucket, vb = _dedup_bucket()
    out = tmp_path / "cap"
    with ThreadedServer(srv) as ts:
        url = f"couchbase://{ts.host}:{ts.port}/default"
        args = [DCPTOOL, "capture", url, "-o", str(out), "--quiet", "--to", "now", "--timeout", "5s"]
        first = subprocess.run(args, capture_output=True, text=True, timeout=BOUND)
        assert first.returncode == 0, first.stderr
        ts.loop.call_soon_threadsafe(lambda: vb.fail_over(777, 15, bucket.rng, bucket.next_cas()))
        deadline = time.monotonic() + BOUND
        while vb.failover_log[0][0] != 777:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        second = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=BOUND)
        assert second.returncode == 0, second.stderr
    want = {key.decode(): (it.seqno, it.cas) for key, it in vb.latest().items()}
    assert documents_of(out) == {0: want}
    # the restart below the rollback seqno is no rewind to verify (it follows the ROLLBACK)
    check = subprocess.run([DCPTOOL, "verify", str(out), "--format", "jsonl"], capture_output=True, text=True,
                           timeout=BOUND)
    assert check.returncode == 0 and "resume_rewind" not in check.stdout, check.stdout + check.stderr


# --------------------------------------------------------------------------- the SDK writes

SDK_SEEDS = list(range(100, 120))
SDK_JOBS = 4        # schedules at once (their time is mostly processes starting), one SDK process


@pytest.fixture(scope="module")
def sdk_runs(tmp_path_factory):
    """Every SDK schedule, run SDK_JOBS at a time: seed -> None or the failure."""
    pytest.importorskip("couchbase")
    from concurrent.futures import ThreadPoolExecutor

    from tests.support.chaos_sdk import run_sdk_schedule

    def one(seed):
        try:
            run_sdk_schedule(tmp_path_factory.mktemp(f"sdk{seed}"), seed)
            return seed, None
        except BaseException as exc:  # noqa: BLE001 - reported by the seed's own test
            return seed, exc
    with ThreadPoolExecutor(SDK_JOBS) as pool:
        return dict(pool.map(one, SDK_SEEDS))


@pytest.mark.integration
@pytest.mark.parametrize("seed", SDK_SEEDS)
def test_sdk_writes_during_a_random_schedule_replay_to_what_the_sdk_reads(sdk_runs, seed):
    """The official SDK writes a seeded mix while a schedule runs and a capture is SIGKILLed
    and resumed: the replayed documents equal the SDK's read-back, key for key and CAS for
    CAS, and no acknowledged durable write is missing (tests/support/chaos_sdk.py)."""
    if sdk_runs[seed] is not None:
        raise sdk_runs[seed]
