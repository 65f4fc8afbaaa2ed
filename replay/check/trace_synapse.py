"""`dcptool trace CAPTURE --event-id ID`: the story of Synapse events in captures. One row
per RDATA row that carried the event id (its stream, instance, token as sent, the token
that committed it by the rules of REPLAY.md, connection, frame, time), then one verdict per
id: `seen` (with the rows, in one sentence) or `not_seen`, with the gaps (POSITION
told of tokens never received, replay/rules/synapse_tables.py) of the streams that carry event ids:
where a row of the event would have been lost. The committed tokens and the gaps are those
of the in-process replay (replay/local/engine.py, the `rows` and `gaps` tables)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc

from dcptool.replay.check import trace_read as R
from dcptool.replay.check.summary import retained_window
from dcptool.replay.check.trace import TraceError
from dcptool.replay.local.engine import replay_local
from dcptool.replay.store import reader
from dcptool.replay.timestamps import iso_ns

SYNAPSE_COLUMNS = ["event", "event_id", "stream", "instance", "token", "batch", "committed_token", "capture_id",
                   "frame_no", "ts", "conn", "from_token", "to_token", "detail", "verdict", "explain"]
FRAME_COLUMNS = ["capture_id", "frame_no", "ts", "conn", "direction", "command", "stream", "instance", "token",
                 "batch", "row"]
# the streams whose rows name events (Synapse's replication/tcp/streams): where a lost row
# of an event would be
EVENT_STREAMS = ("events", "backfill", "receipts", "un_partial_stated_event")


def _names(value, event_id: str) -> bool:
    """Whether the decoded JSON `value` holds `event_id` as a string, at any depth."""
    if isinstance(value, str):
        return value == event_id
    if isinstance(value, list):
        return any(_names(v, event_id) for v in value)
    if isinstance(value, dict):
        return any(_names(v, event_id) for v in value.values())
    return False


def _carrying(files, event_ids: list[str]) -> list[dict]:
    """The inbound RDATA frames whose row text names one of the ids (a substring match on
    the JSON string, then checked on the decoded row)."""
    out = []
    for f in files:
        t = reader.read_file(f, FRAME_COLUMNS)
        mask = pc.equal(t.column("command").cast(pa.string()), "RDATA")
        hit = pc.fill_null(pc.equal(t.column("direction").cast(pa.string()), "in"), False)
        text = pa.array([False] * t.num_rows)
        for eid in event_ids:
            text = pc.or_(text, pc.fill_null(pc.match_substring(t.column("row"), json.dumps(eid)), False))
        out.extend(R.pylist(t.filter(pc.and_(pc.and_(pc.fill_null(mask, False), hit), text))))
    return out


def _replayed(files) -> tuple[dict, list[dict]]:
    """((capture_id, frame_no) -> committed token of the RDATA rows that committed, the gaps)."""
    rep = replay_local(files, tables=["rows", "gaps"])
    rows = rep.table("rows").select(["capture_id", "frame_no", "token"]).to_pylist()
    return {(r["capture_id"], r["frame_no"]): r["token"] for r in rows}, R.pylist(rep.table("gaps"))


def _clock(ns) -> str:
    s = iso_ns(ns)
    return s[11:19] + " UTC" if s and len(s) > 19 else "?"


def trace_synapse(paths: list[str], event_ids: list[str]) -> list[dict]:
    """trace_events of the captures at `paths`; TraceError when they are DCP captures."""
    files = reader.find_captures(paths)
    if reader.protocol_of(files) != "synapse":
        raise TraceError("--event-id traces Synapse events; these are DCP captures (give KEYs)")
    return trace_events(files, event_ids, retained_window(paths))


def trace_events(files, event_ids: list[str], window: dict | None = None) -> list[dict]:
    """The trace rows of Synapse `event_ids` in the captures `files` (see the module docstring);
    `window`: what a retention ring dropped (summary.retained_window), told for an id not seen."""
    ranks = reader.capture_ranks(files)

    def order(r):
        return ranks.get(r["capture_id"], len(ranks)), r["frame_no"]

    hits = sorted(_carrying(files, event_ids), key=order)
    committed, gaps = _replayed(files)
    gaps.sort(key=order)
    out: list[dict] = []
    for eid in dict.fromkeys(event_ids):
        mine = []
        for h in hits:
            try:
                if not _names(json.loads(h["row"]), eid):
                    continue
            except ValueError:
                continue
            e = dict.fromkeys(SYNAPSE_COLUMNS)
            e.update(event="rdata", event_id=eid, stream=h["stream"], instance=h["instance"], token=h["token"],
                     batch=bool(h["batch"]), committed_token=committed.get((h["capture_id"], h["frame_no"])),
                     capture_id=h["capture_id"], frame_no=h["frame_no"], ts=iso_ns(h["ts"]), conn=h["conn"])
            e["detail"] = ("never committed: no numeric RDATA of its stream followed on its connection"
                           if e["committed_token"] is None else None)
            mine.append(e)
            out.append(e)
        out.extend(_verdict(eid, mine, gaps, window))
    return out


def _retained(eid: str, window: dict | None) -> tuple[list[dict], str]:
    """The `retained_away` rows of the streams that carry event ids whose head a retention
    ring dropped, and the sentence that tells it ("" when none was)."""
    if window is None:
        return [], ""
    heads = [e for e in window["streams"] if e["stream"] in EVENT_STREAMS]
    rows = []
    for h in heads:
        e = dict.fromkeys(SYNAPSE_COLUMNS)
        e.update(event="retained_away", event_id=eid, stream=h["stream"], instance=h["instance"],
                 to_token=h["token"], detail=f"the rows up to token {h['token']} were retained away by the ring "
                                             f"({', '.join(window['records'])})")
        rows.append(e)
    if not heads:
        return rows, ""
    spans = ", ".join(f"{h['stream']}/{h['instance']} up to token {h['token']}" for h in heads)
    return rows, (f"; the rows of {spans} were retained away by the ring ({', '.join(window['records'])}): "
                  f"it may have been among them")


def _verdict(eid: str, mine: list[dict], gaps: list[dict], window: dict | None = None) -> list[dict]:
    v = dict.fromkeys(SYNAPSE_COLUMNS)
    v.update(event="verdict", event_id=eid)
    if mine:
        last = mine[-1]
        where = "; ".join(
            f"{e['stream']}/{e['instance']} " + (f"token {e['committed_token']}" if e["committed_token"] is not None
                                                  else "never committed")
            + (" (sent in a batch)" if e["batch"] else "") + f" on conn {e['conn']} at {_clock_text(e['ts'])}"
            for e in mine)
        v.update(verdict="seen", stream=last["stream"], instance=last["instance"], token=last["token"],
                 committed_token=last["committed_token"], capture_id=last["capture_id"], frame_no=last["frame_no"],
                 ts=last["ts"], conn=last["conn"],
                 explain=f"{eid!r}: carried by {len(mine)} RDATA row{'s' if len(mine) != 1 else ''}: {where}")
        return [v]
    near = [g for g in gaps if g["stream"] in EVENT_STREAMS]
    rows = []
    for g in near:
        e = dict.fromkeys(SYNAPSE_COLUMNS)
        e.update(event="gap", event_id=eid, stream=g["stream"], instance=g["instance"], capture_id=g["capture_id"],
                 frame_no=g["frame_no"], ts=iso_ns(g["ts"]), from_token=g["from_token"], to_token=g["to_token"],
                 detail=f"POSITION: tokens after {g['from_token']} up to {g['to_token']} were never received")
        rows.append(e)
    if near:
        spans = ", ".join(f"{g['stream']}/{g['instance']} {g['from_token']}..{g['to_token']} at {_clock(g['ts'])}"
                          for g in near)
        why = f"the streams that carry event ids lost rows in {len(near)} gap{'s' if len(near) != 1 else ''}: {spans}"
    else:
        why = "the streams that carry event ids had no gap: it was not sent on these connections"
    head, told = _retained(eid, window)
    if told and not near:
        why = "the streams that carry event ids had no gap in the retained window"
    v.update(verdict="not_seen", explain=f"{eid!r}: no RDATA row carried it; {why}{told}")
    return head + rows + [v]


def _clock_text(ts: str | None) -> str:
    return ts[11:19] + " UTC" if ts and len(ts) > 19 else "?"
