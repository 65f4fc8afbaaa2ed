"""`capture` from a cluster (`serve dcp --nodes 3 --replicas 1`), then `replay`: every vbucket's
surviving mutations once, in seqno order, rollbacks visible; and SIGKILL of the capture at
seeded kill points with the map changed (a rebalance) while it was down, then `--resume`: no
gap, no duplicate. The producer's own final bucket contents are the oracle."""

from __future__ import annotations

import random
import signal
import subprocess
import threading

import pytest

from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.server.cluster import Event
from dcptool.replay.local import engine as local
from dcptool.replay.store.reader import find_captures, read_capture_table
from tests.support.cluster_state import final_state, survivors
from tests.support.live_capture import data_on_disk, served
from tests.support.paths import DCPTOOL
from tests.support.threaded_server import ThreadedServer

pytestmark = pytest.mark.integration
BOUND = 120
COLUMNS = ["frame_no", "conn", "node", "direction", "op", "status", "vbucket", "by_seqno", "key", "rollback_seqno",
           "req_start_seqno"]


def capture(url, out, *args):
    return subprocess.run([DCPTOOL, "capture", url, "-o", str(out), "--quiet", "--timeout", "5s", *args],
                          capture_output=True, text=True, timeout=BOUND)


def rows_of(out) -> list[dict]:
    rows = read_capture_table(find_captures([str(out)]), COLUMNS).to_pylist()
    for r in rows:
        if isinstance(r["key"], bytes):
            r["key"] = r["key"].decode()
    return rows


def documents(out) -> dict[int, dict[str, int]]:
    docs = local.replay_local(find_captures([str(out)])).table("documents").to_pylist()
    got: dict[int, dict[str, int]] = {}
    for d in docs:
        key = d["key"].decode() if isinstance(d["key"], bytes) else d["key"]
        got.setdefault(d["vbucket"], {})[key] = d["by_seqno"]
    return got


def test_capture_then_replay_gives_the_producers_final_bucket(tmp_path):
    # paced (16 frames per connection every 10 ms) so that every node is still streaming when
    # node 2 fails at frame 3500: a node that had already sent all it has would leave
    # nothing to roll back, whatever the load on the machine
    model = P.server_from_options(vbuckets=16, items=6000, seed=9, nodes=3, replicas=1,
                                  events=(Event(1500, "rebalance"), Event(3500, "failover", 2)),
                                  scenarios=P.Scenarios(failover_loss=12, slow=0.01, slow_frames=16))
    with ThreadedServer(model) as srv:
        res = capture(f"couchbase://{srv.host}:{srv.port}/default", tmp_path)
        nodes = {f"{h}:{p}" for h, p in srv.addresses}
    assert res.returncode == 0, res.stderr
    want = final_state(model)
    rows = rows_of(tmp_path)
    assert survivors(rows) == want
    assert documents(tmp_path) == {vb: d for vb, d in want.items() if d}
    assert {r["node"] for r in rows} == nodes
    # (conn, opaque) stays unique: conn numbers are never reused for another node
    node_of = {}
    for r in rows:
        assert node_of.setdefault(r["conn"], r["node"]) == r["node"]
    replay = local.replay_local(find_captures([str(tmp_path)]))
    rollbacks = replay.table("rollbacks").to_pylist()
    assert rollbacks and sum(r["undone"] for r in rollbacks) > 0
    # every config received is in the capture, the newest with the failover's revision
    configs = [r for r in rows if r["op"] == "get_cluster_config" and r["direction"] == "in"]
    assert len(configs) >= 3


@pytest.mark.parametrize("seed", [1, 2])
def test_kill_then_resume_across_a_rebalance_no_gap_no_duplicate(tmp_path, seed):
    rng = random.Random(seed)
    kill_at = rng.randrange(1000, 2500)         # stream frames served cluster-wide
    model = P.server_from_options(vbuckets=16, items=4000, seed=seed, nodes=3, replicas=1,
                                  scenarios=P.Scenarios(slow=0.01, slow_frames=8))
    out = tmp_path / "caps"
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        proc = subprocess.Popen([DCPTOOL, "capture", url, "-o", str(out), "--quiet", "--timeout", "5s"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # the seeded kill point: that many frames served, and some of them on disk
        served(model, kill_at, proc, BOUND)
        data_on_disk(out, (), proc, BOUND)
        proc.send_signal(signal.SIGKILL)
        proc.wait(BOUND)
        proc.stderr.close()
        # the map changes while the capture is down
        done = threading.Event()

        def rebalance():
            model.scenarios.slow = 0.0
            model.apply_changes([model.cluster.rebalance()])
            done.set()
        srv.loop.call_soon_threadsafe(rebalance)
        assert done.wait(BOUND)
        moved = model.cluster.changes[-1].moves
        assert moved
        res = capture(url, out, "--resume")
    assert res.returncode == 0, res.stderr
    assert "resuming" in res.stderr
    rows = rows_of(out)
    want = final_state(model)
    assert survivors(rows) == want
    assert documents(out) == {vb: d for vb, d in want.items() if d}
    # the second run continued from the recorded state (not from 0) for some vbuckets
    assert any(r["op"] == "stream_req" and r["direction"] == "out" and (r["req_start_seqno"] or 0) > 0
               for r in rows)
