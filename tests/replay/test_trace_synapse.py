"""`dcptool trace CAPTURE --event-id ID` on a capture of a real Synapse's replication lines
(fixtures/synapse: Synapse 1.163.2 over Redis, users registering, a room, messages),
written through the capture writer: the RDATA rows that carried an event, the token that
committed a row sent in a batch, and for an event never carried, the gap a POSITION told."""

from __future__ import annotations

import json

import pytest

from dcptool.replay.check.trace_synapse import trace_events
from dcptool.replay.store.reader import find_captures
from tests.support.capture_rows import Rec
from tests.support.cli_util import run
from tests.support.paths import ROOT

TSV = ROOT / "fixtures" / "synapse" / "synapse-1.163.2-redis-lines.tsv"
# in a batch, then named again by the `state` row at token 2 that committed it
CREATE = "$M05qdUHtxEfQ6M10M3oLzmXOk6jlVG2f0_TbdQxYtzs"
MESSAGE = "$pJ17a9n_F6-oCqyNpeNNG6LHI-jrGk4oA1F5TQeHdRA"   # sent on the TCP session only
LOST = "$lost-in-the-gap"


def _row(line: str, ts: int) -> dict:
    cmd, _, rest = line.partition(" ")
    row = {"command": cmd, "ts": ts, "conn": 1}
    if cmd == "RDATA":
        stream, instance, token, data = rest.split(" ", 3)
        row.update(stream=stream, instance=instance, row=data, batch=token == "batch",
                   token=None if token == "batch" else int(token))
    elif cmd == "POSITION":
        stream, instance, prev, new = rest.split(" ")
        row.update(stream=stream, instance=instance, prev_token=int(prev), new_token=int(new))
    else:
        row["args"] = rest
    return row


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    d = tmp_path_factory.mktemp("syn_trace")
    rec = Rec(str(d), "synapse")
    last = 0
    for line in TSV.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        ts, _, text = line.split("\t", 2)
        last = int(float(ts) * 1e9)
        rec.add(**_row(text, last))
    top = 0     # the events stream's last token (RDATA or POSITION), where the gap starts
    for r in rec.rows:
        if r.get("stream") == "events":
            top = r.get("token") or r.get("new_token") or top
    # a POSITION that skips tokens: rows of the events stream lost on the way
    rec.add(**_row(f"POSITION events master {top + 5} {top + 5}", last + 1000))
    rec.close()
    return str(d), top


def test_event_carried_in_a_batch_and_committed(capture):
    d, _ = capture
    rows = trace_events(find_captures([d]), [CREATE])
    carried = [r for r in rows if r["event"] == "rdata"]
    assert [(r["stream"], r["instance"], r["batch"], r["committed_token"]) for r in carried][:2] == [
        ("events", "master", True, 2), ("events", "master", False, 2)]
    assert all(r["conn"] == 1 and r["ts"].endswith("Z") for r in carried)
    v = rows[-1]
    assert v["event"] == "verdict" and v["verdict"] == "seen"
    assert "token 2 (sent in a batch)" in v["explain"] and v["explain"].startswith(repr(CREATE))


def test_event_never_carried_names_the_gap(capture):
    d, top = capture
    rows = trace_events(find_captures([d]), [LOST, MESSAGE])
    for eid in (LOST, MESSAGE):
        mine = [r for r in rows if r["event_id"] == eid]
        assert [r["event"] for r in mine] == ["gap", "verdict"]
        gap, v = mine
        assert (gap["stream"], gap["from_token"], gap["to_token"]) == ("events", top, top + 5)
        assert v["verdict"] == "not_seen" and f"events/master {top}..{top + 5}" in v["explain"]


def test_cli_event_id(capture):
    d, _ = capture
    res = run("trace", d, "--event-id", CREATE, "--format", "jsonl")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert rows[-1]["verdict"] == "seen" and rows[-1]["event_id"] == CREATE
    bad = run("trace", d, "some-key")
    assert bad.returncode == 2 and "--event-id" in bad.stderr and "Traceback" not in bad.stderr
