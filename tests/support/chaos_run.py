"""One random topology schedule end to end (tests/protocol/dcp/test_chaos.py and
tests/bench/bench_chaos.py): `serve dcp` with the schedule, a capture SIGKILLed at a seeded
point and resumed, and what the property says checked against the producer's bucket."""

from __future__ import annotations

import random
import signal
import subprocess
import time

from dcptool.protocol.dcp.server import chaos
from dcptool.protocol.dcp.server import producer as P
from dcptool.replay.local import engine as local
from dcptool.replay.store.reader import find_captures, read_capture_table
from tests.support.cluster_state import final_state, survivors
from tests.support.paths import DCPTOOL
from tests.support.threaded_server import ThreadedServer

BOUND = 60                  # seconds one schedule may take, at most
LOSS = 8
ITEMS = 1200                # per schedule: 32 vbuckets, 3 nodes, 1 replica
COLUMNS = ["direction", "op", "status", "vbucket", "by_seqno", "key", "rollback_seqno"]


def _rows(out) -> list[dict]:
    rows = read_capture_table(find_captures([str(out)]), COLUMNS).to_pylist()
    for r in rows:
        if isinstance(r["key"], bytes):
            r["key"] = r["key"].decode()
    return rows


def documents_of(out) -> dict[int, dict[str, tuple[int, int]]]:
    """Replayed documents: vbucket -> key -> (by_seqno, cas) (a rewritten tail has the lost
    keys at the same seqnos: only the cas tells the branches apart)."""
    got: dict[int, dict[str, tuple[int, int]]] = {}
    for d in local.replay_local(find_captures([str(out)])).table("documents").to_pylist():
        key = d["key"].decode() if isinstance(d["key"], bytes) else d["key"]
        got.setdefault(d["vbucket"], {})[key] = (d["by_seqno"], d["cas"])
    return got


def _model_documents(model) -> dict[int, dict[str, tuple[int, int]]]:
    out = {}
    for v in model.buckets["default"].vbuckets:
        docs = {key.decode(): (it.seqno, it.cas) for key, it in v.latest().items()}
        if docs:
            out[v.vbid] = docs
    return out


def _capture(url, out, *args):
    return [DCPTOOL, "capture", url, "-o", str(out), "--quiet", "--timeout", "5s", "--noop-interval", "1s", "--to", "now", *args]


def run_schedule(tmp_path, seed: int, schedule: chaos.Schedule | None = None, items: int = ITEMS,
                 vbuckets: int = 32):
    """One schedule end to end; returns (model, rows). Asserts what the property says."""
    sched = schedule or chaos.draw(seed, 3, 1, items * 6 // 5, LOSS)
    model = P.server_from_options(vbuckets=vbuckets, items=items, seed=seed, nodes=3, replicas=1,
                                  scenarios=P.Scenarios(failover_loss=LOSS, slow=0.003, slow_frames=16))
    cl = chaos.install(model, sched, seed, LOSS)
    kill_at = random.Random(f"kill:{seed}").randrange(items // 10, items * 3 // 4)
    out = tmp_path / f"cap{seed}"
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        proc = subprocess.Popen(_capture(url, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + BOUND
        while model.stream_frames < kill_at and proc.poll() is None:
            assert time.monotonic() < deadline, f"seed {seed}: the capture never reached frame {kill_at}"
            time.sleep(0.002)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(BOUND)
        proc.stderr.close()
        # an event that fires while a resumed run streams other vbuckets changes a vbucket
        # whose stream already reached its `--to now` point (on a loaded host the kill comes
        # later, and so do the runs): the bucket moved on behind the capture, and the next
        # resume must catch up (rolled back where the branch moved). Resumed until a run sees
        # no event fire (the schedule is finite).
        for _ in range(len(sched.events) + 1):
            fired = len(cl.changes)
            res = subprocess.run(_capture(url, out, "--resume"), capture_output=True, text=True, timeout=BOUND)
            assert res.returncode == 0, f"seed {seed} {sched.to_json()}: {res.stderr}"
            if len(cl.changes) == fired:
                break
    assert cl.broken is None, cl.broken
    want = final_state(model)
    rows = _rows(out)
    assert survivors(rows) == want, f"seed {seed}: {sched.to_json()}"
    assert documents_of(out) == _model_documents(model), f"seed {seed}: {sched.to_json()}"
    # what was captured and is no longer in the bucket lies in a lossy event's lost tail
    branch = {}
    for ch in cl.changes:
        if ch.kind in chaos.LOSSY or ch.kind == "failover":
            for mv in ch.moves:
                branch[mv.vb] = min(branch.get(mv.vb, mv.seqno), mv.seqno)
    history = {v.vbid: {it.seqno: it.key.decode() for it in v.items()} for v in model.buckets["default"].vbuckets}
    for r in rows:
        if r["direction"] == "in" and r["op"] in ("mutation", "deletion", "expiration") and r["status"] is None:
            if history[r["vbucket"]].get(r["by_seqno"]) != r["key"]:
                assert r["vbucket"] in branch and r["by_seqno"] > branch[r["vbucket"]], (seed, r)
    return model, rows
