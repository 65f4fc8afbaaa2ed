"""`dcptool trace`: the story of one DCP key in captures. One event per frame that touched
the key (its changes, with the snapshot each came in), the rollbacks that undid one of its
changes and the change that restored it, stream ends / resumes / re-routes of its vbucket
and topology moves after its first change, a drop of its collection; then one verdict per
key (live, deleted, expired, undone, not_seen) with a sentence that explains it.

The rules are those of replay (REPLAY.md, replay/rules/dcp_vbuckets.py): a ROLLBACK answer to a
stream request undoes every change of its vbucket received before it with a by_seqno
above the rollback seqno (the earliest such rollback counts), a document's state is its
last change not undone, a dropped collection's documents are gone. The reads are an
engine's (LocalRows: replay/check/trace_read.py, the row groups the key index says may hold
the key, and the stream rows of its vbucket the story needs; SparkRows: replay/spark/trace.py)
and give the same rows; the story is told here, the same for both."""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from dcptool.protocol.dcp.client.manifest import parse_manifest
from dcptool.protocol.dcp.wire.constants import (
    Status,
    status_name,
    stream_end_reason_name,
)
from dcptool.protocol.dcp.wire.frames import parse_frame
from dcptool.protocol.errors import DcptoolError
from dcptool.replay.check import trace_read as R
from dcptool.replay.check.summary import retained_window
from dcptool.replay.display import key_fields as key_text
from dcptool.replay.rules.dcp_vbuckets import COLLECTION_DROP, DOC_STATES
from dcptool.replay.store import reader
from dcptool.replay.timestamps import iso_ns

TRACE_COLUMNS = ["event", "key", "collection_id", "vbucket", "capture_id", "frame_no", "ts", "node", "conn",
                 "op", "seqno", "cas", "stream_id", "snapshot_start", "snapshot_end", "snapshot_kind",
                 "rollback_seqno", "restored", "restored_seqno", "detail", "verdict", "explain"]
KEY_COLUMNS, VB_COLUMNS = R.KEY_COLUMNS, R.VB_COLUMNS
CHANGE_OPS = tuple(DOC_STATES) + ("commit",)
KEY_OPS = CHANGE_OPS + ("prepare", "abort")
MEMORY, DISK, HISTORY = 0x01, 0x02, 0x10
OSO_START, OSO_END = 0x01, 0x02


def key_fields(key: bytes) -> dict:
    """The output contract's key: text, or key_base64 when it is not UTF-8."""
    text, b64 = key_text(key)
    return {"key": text} if b64 is None else {"key": None, "key_base64": b64}


class TraceError(DcptoolError):
    """Bad trace arguments against the captures (a collection name they do not hold...)."""


def vbucket_of(key: bytes, num_vbuckets: int) -> int:
    """Couchbase's vbucket of a key: CRC32, bits 16..30, modulo the vbucket count."""
    return ((zlib.crc32(key) >> 16) & 0x7FFF) % num_vbuckets


@dataclass
class Capture:
    """What trace needs of the captures besides the key's rows (read once for all keys)."""
    files: list
    ranks: dict
    options: dict = field(default_factory=dict)
    num_vbuckets: int | None = None
    # a retention ring's dropped head (replay/store/retained.py): vbucket -> its last seqno
    # dropped, and the record's file name(s)
    retained: dict = field(default_factory=dict)
    record: str = ""

    def order(self, row: dict) -> tuple[int, int]:
        return self.ranks.get(row["capture_id"], len(self.ranks)), row["frame_no"]


# ------------------------------------------------------------------------------ reading

class LocalRows:
    """The reads of a trace in this process (replay/check/trace_read.py); the Spark engine's
    are replay/spark/trace.SparkRows, with the same methods and rows."""

    def __init__(self, cap: "Capture"):
        self.cap = cap

    def key_rows(self, keys: list[bytes], vbuckets: set[int] | None) -> list[dict]:
        return R.key_rows(self.cap.files, keys, vbuckets)

    def vbucket_rows(self, vbuckets: set[int], anchors: list[tuple]) -> list[dict]:
        return R.vbucket_rows(self.cap.files, vbuckets, self.cap.ranks, anchors)

    def topology(self) -> list[dict]:
        return R.topology(self.cap.files, self.cap.ranks)

    def highest_streamed_vbucket(self) -> int | None:
        expr = R.op_in(("stream_req", "get_failover_log")) & pc.field("vbucket").is_valid()
        high = None
        for f in self.cap.files:
            t = R.read_where(f, ["vbucket", "op"], expr)
            if t.num_rows:
                m = pc.max(t.column("vbucket")).as_py()
                high = m if high is None else max(high, m)
        return high


def key_rows(cap: Capture, rows, keys: list[bytes], vbuckets: set[int] | None = None) -> list[dict]:
    """The `in` frames of the keys (changes, prepares, aborts), in capture order."""
    out = [r for r in rows.key_rows(keys, vbuckets)
           if r["op"] in KEY_OPS and r["direction"] == "in" and r["decode_error"] is None
           and r["vbucket"] is not None]
    out.sort(key=cap.order)
    return out


def vbucket_rows(cap: Capture, rows, vbuckets: set[int], krows: list[dict]) -> list[dict]:
    """The stream frames of the vbuckets (both directions), in capture order: those the
    story of the key rows `krows` needs (trace_read.vbucket_rows)."""
    anchors = [(cap.order(r), r["vbucket"]) for r in krows]
    out = [r for r in rows.vbucket_rows(vbuckets, anchors) if r["decode_error"] is None] if vbuckets else []
    out.sort(key=cap.order)
    return out


def open_capture(paths: list[str]) -> Capture:
    files = reader.find_captures(paths)
    if reader.protocol_of(files) != "dcp":
        raise TraceError("trace explains DCP keys; these are Synapse captures (trace them with --event-id ID)")
    options: dict = {}
    for f in files:     # the latest capture's options (a resume keeps the filter)
        try:
            options = json.loads(f.metadata.get("dcptool.options") or "{}") or options
        except ValueError:
            pass
    cap = Capture(files, reader.capture_ranks(files), options)
    window = retained_window(paths)
    if window is not None:
        cap.retained = {v["vbucket"]: v["last_seqno"] for v in window["vbuckets"]}
        cap.record = ", ".join(window["records"])
    return cap


def retained_row(cap: Capture, key: bytes, cid, vb: int | None) -> dict | None:
    """The `retained_away` event of a key whose vbucket's head a retention ring dropped
    (changes up to `seqno`), None when none was."""
    if vb is None or not cap.retained.get(vb):
        return None
    e = dict.fromkeys(TRACE_COLUMNS)
    e.update(key_fields(key))
    e.update(event="retained_away", collection_id=cid, vbucket=vb, seqno=cap.retained[vb],
             detail=f"vbucket {vb}'s changes up to seqno {cap.retained[vb]} were retained away by the ring "
                    f"({cap.record})")
    return e


def _power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def vbucket_count(rows, topology: list[dict]) -> int | None:
    """The bucket's vbucket count: the cluster map's, else from the highest vbucket a stream
    was asked for (rounded up to a power of two, as Couchbase buckets have 64, 128, 1024)."""
    if topology:
        return max(r["vbucket"] for r in topology) + 1
    high = rows.highest_streamed_vbucket()
    if rows.cap.retained:       # a ring may have dropped the stream requests
        high = max([*rows.cap.retained, *([] if high is None else [high])])
    return _power_of_two(high + 1) if high is not None else None


def collection_ids(cap: Capture, name: str) -> int:
    """`--collection S.C` (or a collection id, 0x9 or 9) to its id, through the collections
    manifest a GET_COLLECTIONS_MANIFEST answer in the capture holds."""
    text = name.strip()
    if text.lower().startswith("0x"):
        try:
            return int(text, 16)
        except ValueError:
            raise TraceError(f"--collection {name!r}: not a collection id") from None
    if text.isdigit():
        return int(text)
    if text in ("_default", "_default._default"):
        return 0
    expr = R.op_in(("get_collections_manifest",)) & (pc.field("direction").cast(pa.string()) == "in")
    names: list[str] = []
    for r in R.rows_where(cap.files, ["op", "direction", "status", "raw"], expr):
        if r["status"] != 0 or not r["raw"]:
            continue
        try:
            man = parse_manifest(parse_frame(r["raw"]).value)
        except Exception:   # noqa: BLE001 - a damaged manifest is no answer, the next may be
            continue
        scope, _, coll = text.partition(".")
        if scope in man.scopes and coll in man.scopes[scope][1]:
            return man.scopes[scope][1][coll]
        names = man.names()
    known = f"; the capture's manifest has {', '.join(names)}" if names else \
        "; the capture holds no collections manifest (give the id, e.g. 0x8)"
    raise TraceError(f"--collection {name!r} is not known{known}")


# ------------------------------------------------------------------------------ the story

def _snapshot_kind(flags: int | None) -> str:
    f = flags or 0
    kind = "disk" if f & DISK else "memory" if f & MEMORY else "unknown"
    return kind + ("+history" if f & HISTORY else "")


def _clock(ns: int | None) -> str:
    s = iso_ns(ns)
    return s[11:19] + " UTC" if s and len(s) > 19 else "?"


def _base(row: dict, event: str, key: bytes, cid) -> dict:
    out = dict.fromkeys(TRACE_COLUMNS)
    out.update(key_fields(key))
    out.update(event=event, collection_id=cid, vbucket=row.get("vbucket"), capture_id=row.get("capture_id"),
               frame_no=row.get("frame_no"), ts=iso_ns(row.get("ts")), node=row.get("node"), conn=row.get("conn"),
               op=row.get("op"), stream_id=row.get("stream_id"))
    return out


@dataclass
class _Change:
    row: dict
    order: tuple
    state: str | None
    undone_by: dict | None = None


def _undoer(c: _Change) -> dict:
    """The rollback that undid `c`, one of the changes a rollback undid."""
    assert c.undone_by is not None, "an undone change"
    return c.undone_by


class _Story:
    """One document (vbucket, collection, key): its events and verdict."""

    def __init__(self, cap: Capture, key: bytes, cid, vb: int, topo: list[dict]):
        self.cap, self.key, self.cid, self.vb, self.topo = cap, key, cid, vb, topo
        self.events: list[tuple[tuple, int, dict]] = []
        self.changes: list[_Change] = []
        self.dropped: dict | None = None

    def add(self, order, row: dict, prio: int = 0) -> None:
        self.events.append((order, prio, row))

    def build(self, krows: list[dict], vrows: list[dict]) -> None:
        cap = self.cap
        merged = [(cap.order(r), 1, r) for r in krows] + [(cap.order(r), 0, r) for r in vrows]
        merged.sort(key=lambda x: (x[0], x[1]))
        snap: dict = {}        # stream id -> (start, end, kind) of the snapshot it is in
        node_of_stream = None
        rollbacks = [r for r in vrows if r["op"] == "stream_req" and r["direction"] == "in"
                     and r["status"] == Status.ROLLBACK and r["rollback_seqno"] is not None]
        for order, is_key, r in merged:
            sid = r.get("stream_id")
            op = r["op"]
            if is_key:
                self._change(order, r, snap.get(sid), rollbacks)
                continue
            if op == "snapshot_marker" and r["direction"] == "in":
                snap[sid] = (r["snap_start"], r["snap_end"], _snapshot_kind(r["snap_flags"]))
            elif op == "oso_snapshot" and r["direction"] == "in":
                snap[sid] = (None, None, "oso") if (r["snap_flags"] or 0) & OSO_START else None
            elif op == "stream_end" and r["direction"] == "in":
                snap.pop(sid, None)
                self._after_first(order, r, "stream_end",
                                  detail=f"stream end: {stream_end_reason_name(r['stream_end_reason'] or 0)}")
            elif op == "stream_req" and r["direction"] == "in":
                node_of_stream = self._answer(order, r, node_of_stream)
            elif (op == "system_event" and r["direction"] == "in" and r["system_event_id"] == COLLECTION_DROP
                  and self.cid is not None and r["collection_id"] == self.cid):
                if self.changes and self.dropped is None:
                    self.dropped = r
                    e = _base(r, "collection_drop", self.key, self.cid)
                    e.update(seqno=r["by_seqno"], detail=f"collection 0x{self.cid:x} dropped")
                    self.add(order, e)
        self._topology_moves()

    def _after_first(self, order, r, event, **extra) -> None:
        if not self.changes:
            return
        e = _base(r, event, self.key, self.cid)
        e.update(extra)
        self.add(order, e)

    def _answer(self, order, r, node_before):
        """A stream request's answer: resumed, re-routed, refused (rollbacks are told where
        they undo a change)."""
        if r["status"] == Status.SUCCESS:
            node = r.get("node")
            if self.changes:
                moved = node_before is not None and node is not None and node != node_before
                self._after_first(order, r, "reroute" if moved else "stream_resume",
                                  detail=(f"stream reopened on {node} (was {node_before})" if moved
                                          else "stream reopened"))
            return node or node_before
        if r["status"] != Status.ROLLBACK:
            self._after_first(order, r, "stream_refused", detail=f"stream request refused: {status_name(r['status'])}")
        return node_before

    def _change(self, order, r, snap, rollbacks) -> None:
        op = r["op"]
        e = _base(r, "change", self.key, self.cid)
        e.update(seqno=r["by_seqno"], cas=r["cas"])
        if snap:
            e.update(snapshot_start=snap[0], snapshot_end=snap[1], snapshot_kind=snap[2])
        state = DOC_STATES.get(op, "live" if op == "commit" else None)
        if state is None:         # a prepare or an abort: shown, changes nothing
            e["event"] = op
            self.add(order, e)
            return
        ch = _Change(r, order, state)
        for rb in rollbacks:     # the earliest later rollback of the vbucket below its seqno undoes it
            if self.cap.order(rb) > order and r["by_seqno"] is not None and r["by_seqno"] > rb["rollback_seqno"]:
                ch.undone_by = rb
                break
        self.changes.append(ch)
        self.add(order, e)

    def _topology_moves(self) -> None:
        """Active node changes of the vbucket in the cluster maps after the first change."""
        if not self.changes:
            return
        first = self.changes[0].order
        before = None
        for t in self.topo:
            if t["vbucket"] != self.vb:
                continue
            o = self.cap.order(t)
            if before is not None and t["active"] != before and o > first:
                e = _base(t, "topology", self.key, self.cid)
                e.update(vbucket=self.vb, op=None, detail=f"cluster map rev {t['rev']}: active {before} -> {t['active']}")
                self.add(o, e)
            before = t["active"]

    def _move_before(self, rb: dict) -> str:
        """', after its active node moved from A to B' when the maps say so before `rb`."""
        o = self.cap.order(rb)
        seq = [t for t in self.topo if t["vbucket"] == self.vb and self.cap.order(t) < o]
        for a, b in zip(reversed(seq[:-1]), reversed(seq)):
            if a["active"] != b["active"]:
                return f" after its active node moved from {a['active']} to {b['active']}"
        return ""

    def rollbacks_and_verdict(self) -> list[dict]:
        """The rollback events (with what restored the change) and the verdict."""
        alive = [c for c in self.changes if c.undone_by is None]
        last = alive[-1] if alive else None
        for c in self.changes:
            rb = c.undone_by
            if rb is None:
                continue
            restored = last is not None and last.order > self.cap.order(rb)
            e = _base(rb, "rollback", self.key, self.cid)
            e.update(seqno=c.row["by_seqno"], rollback_seqno=rb["rollback_seqno"], restored=restored,
                     restored_seqno=last.row["by_seqno"] if last is not None and restored else None,
                     detail=f"undid its change at seqno {c.row['by_seqno']} (frame {c.row['frame_no']})")
            self.add(self.cap.order(rb), e, 1)
        return self._verdict(last)

    def _rollback_text(self, rb: dict) -> str:
        return (f"the rollback of vbucket {self.vb} to seqno {rb['rollback_seqno']} at {_clock(rb['ts'])}"
                f"{self._move_before(rb)}")

    def _verdict(self, last: _Change | None) -> list[dict]:
        name = self.key.decode("utf-8", "replace")
        v = _base({"vbucket": self.vb}, "verdict", self.key, self.cid)
        v["op"] = None
        undone = [c for c in self.changes if c.undone_by is not None]
        if last is None:
            rb = _undoer(undone[-1])
            v.update(verdict="undone", seqno=undone[-1].row["by_seqno"], rollback_seqno=rb["rollback_seqno"],
                     restored=False,
                     explain=f"{name!r}: every change received ({len(undone)}) was undone; the last, at seqno "
                             f"{undone[-1].row['by_seqno']}, by {self._rollback_text(rb)}; not restored")
            return [v]
        r = last.row
        v.update(seqno=r["by_seqno"], cas=r["cas"], capture_id=r["capture_id"], frame_no=r["frame_no"],
                 ts=iso_ns(r["ts"]), node=r["node"], conn=r["conn"])
        if self.dropped is not None and self.cap.order(self.dropped) > last.order:
            d = self.dropped
            v.update(verdict="deleted", explain=f"{name!r}: its collection 0x{self.cid:x} was dropped on vbucket "
                                                f"{self.vb} at seqno {d['by_seqno']} at {_clock(d['ts'])}, after its "
                                                f"{last.row['op']} at seqno {r['by_seqno']}")
            return [v]
        v["verdict"] = last.state
        text = f"{name!r}: {last.state} since its {r['op']} at seqno {r['by_seqno']} on vbucket {self.vb} " \
               f"at {_clock(r['ts'])}"
        n = len(self.changes)
        text += f" ({n} change{'s' if n != 1 else ''} received)"
        after = [c for c in undone if c.order < last.order]
        later = [c for c in undone if c.order > last.order]
        if after:
            rb = _undoer(after[-1])
            text += (f"; its change at seqno {after[-1].row['by_seqno']} was undone by {self._rollback_text(rb)}, "
                     f"and restored by this one")
            v.update(rollback_seqno=rb["rollback_seqno"], restored=True)
        if later:
            rb = _undoer(later[-1])
            text += (f"; its later change at seqno {later[-1].row['by_seqno']} was undone by "
                     f"{self._rollback_text(rb)}; not restored")
            v.update(rollback_seqno=rb["rollback_seqno"], restored=False)
        v["explain"] = text
        return [v]

    def rows(self) -> list[dict]:
        verdict = self.rollbacks_and_verdict()
        head = retained_row(self.cap, self.key, self.cid, self.vb)
        if head is not None:      # before every event: the history the ring dropped
            self.add((-1, -1), head)
            for v in verdict:
                v["explain"] += (f"; its history up to seqno {head['seqno']} was retained away by the ring "
                                 f"({self.cap.record})")
        self.events.sort(key=lambda x: (x[0], x[1]))
        return [e for _, _, e in self.events] + verdict


def _not_seen(cap: Capture, key: bytes, cid, vb: int | None, vrows: list[dict]) -> dict:
    name = key.decode("utf-8", "replace")
    v = dict.fromkeys(TRACE_COLUMNS)
    v.update(key_fields(key))
    v.update(event="verdict", verdict="not_seen", collection_id=cid, vbucket=vb)
    if vb is None:
        v["explain"] = f"{name!r}: never received; the captures do not tell the bucket's vbucket count (give --vbucket)"
        return v
    filt = (cap.options.get("collection_filter") or {}).get("collections")
    mine = [r for r in vrows if r["vbucket"] == vb]
    answers = [r for r in mine if r["op"] == "stream_req" and r["direction"] == "in"]
    opened = [r for r in answers if r["status"] == Status.SUCCESS]
    refused = [r for r in answers if r["status"] not in (Status.SUCCESS, Status.ROLLBACK)]
    ends = [r["snap_end"] for r in mine if r["op"] == "snapshot_marker" and r["snap_end"] is not None]
    high = max(ends) if ends else None
    if filt is not None and cid is not None and f"{cid:x}" not in [str(x).lower() for x in filt]:
        why = (f"filtered out: the capture's collection filter streamed collections "
               f"{', '.join('0x' + str(x) for x in filt)}, not 0x{cid:x}")
    elif cap.retained.get(vb):
        why = (f"vbucket {vb}'s changes up to seqno {cap.retained[vb]} were retained away by the ring "
               f"({cap.record}); the key was not seen after that"
               + (f" (the retained window holds it to seqno {high})" if high is not None else ""))
    elif vb in cap.retained and not answers:
        why = (f"its vbucket {vb} was streamed (its stream request was retained away by the ring, {cap.record}, "
               f"before any change of it)" + (f" to seqno {high}" if high is not None else "") + ", without this key")
    elif not answers:
        why = f"its vbucket {vb} was never streamed"
    elif not opened:
        why = f"its vbucket {vb} was unserved: every stream request was refused ({status_name(refused[-1]['status'])})"
    else:
        why = (f"its vbucket {vb} was streamed ({len(opened)} stream(s) opened) to seqno {high}"
               if high is not None else f"its vbucket {vb} was streamed but sent no snapshot")
        if filt is not None and cid is None:
            why += f"; only collections {', '.join('0x' + str(x) for x in filt)} were streamed"
        else:
            why += ", without this key"
    gone = "not received in the retained window" if cap.retained.get(vb) else "never received"
    v["explain"] = f"{name!r}: {gone}; {why}"
    return v


def trace(paths: list[str], keys: list[bytes], collection: str | None = None,
          vbucket: int | None = None, engine=None) -> list[dict]:
    """The trace rows of `keys` (see the module docstring), key after key, each key's
    events in capture order then its verdict (one per document found: a key without
    `collection` may live in several collections). `engine`: a function of the Capture
    giving its reads (LocalRows, this process, by default; replay/spark/trace.SparkRows)."""
    cap = open_capture(paths)
    rows = (engine or LocalRows)(cap)
    cid = collection_ids(cap, collection) if collection is not None else None
    topo = rows.topology()
    keys = list(dict.fromkeys(keys))
    # the key's vbucket prunes row groups by their vbucket statistics: the one given, or
    # Couchbase's hash when a cluster map tells the vbucket count
    maps = max(r["vbucket"] for r in topo) + 1 if topo else None
    prune = {vbucket} if vbucket is not None else {vbucket_of(k, maps) for k in keys} if maps else None
    krows = key_rows(cap, rows, keys, prune)
    if cid is not None:
        krows = [r for r in krows if (r["collection_id"] or 0) == cid]
    if vbucket is not None:
        krows = [r for r in krows if r["vbucket"] == vbucket]
    count = None
    found_vb = {r["key"]: r["vbucket"] for r in krows}
    if vbucket is None and any(k not in found_vb for k in keys):
        count = vbucket_count(rows, topo)
    want = {k: (vbucket if vbucket is not None else found_vb.get(k, vbucket_of(k, count) if count else None))
            for k in keys}
    # every vbucket a key was received in (not one per key: a key of several documents may
    # be in several), and the one each unseen key would be in
    vbs = {v for v in want.values() if v is not None} | {r["vbucket"] for r in krows}
    vrows = vbucket_rows(cap, rows, vbs, krows)
    out: list[dict] = []
    for k in keys:
        docs: dict = {}
        for r in krows:
            if r["key"] == k:
                docs.setdefault((r["vbucket"], r["collection_id"]), []).append(r)
        if not docs:
            head = retained_row(cap, k, cid, want[k])
            out.extend([head] if head is not None else [])
            out.append(_not_seen(cap, k, cid, want[k], vrows))
            continue
        for (vb, c), mine in sorted(docs.items(), key=lambda x: (x[0][0], x[0][1] or 0)):
            story = _Story(cap, k, c, vb, topo)
            story.build(mine, [r for r in vrows if r["vbucket"] == vb])
            out.extend(story.rows())
    return out
