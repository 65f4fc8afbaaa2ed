"""A row-by-row interpreter of REPLAY.md, written for the tests only: one Python loop over
the frames in order, state in dicts, no vectorisation. The engines must agree with it."""

from __future__ import annotations

import cramjam
import orjson
import pyarrow as pa

from dcptool.replay.rules import tables as T
from dcptool.replay.rules.dcp_vbuckets import DOC_STATES, VB_OPS
from dcptool.replay.store import reader


def _ns(ts) -> int | None:
    return None if ts is None else ts


def frames_in_order(files) -> list[dict]:
    t = reader.read_capture_table(files)
    t = t.set_column(t.column_names.index("ts"), "ts", t.column("ts").cast(pa.int64()))
    return t.to_pylist()


def dcp(files) -> dict[str, pa.Table]:
    rows = frames_in_order(files)
    changes: dict[int, list[dict]] = {}       # vb -> changes and seqno-advanced, in order
    failover: dict[int, list] = {}
    snapshots: list[dict] = []
    open_snap: dict[int, dict] = {}
    last_marker: dict[int, dict] = {}
    rollbacks: list[dict] = []
    undone_rows: list[dict] = []              # each undone document change, with its rollback
    vbs: dict[int, dict] = {}
    for at, f in enumerate(rows):
        vb = f["vbucket"]
        if f["direction"] != "in" or vb is None or f["decode_error"] is not None or f["op"] not in VB_OPS:
            continue
        v = vbs.setdefault(vb, dict(mutations=0, deletions=0, expirations=0, snapshots=0, rollbacks=0,
                                    stream_end_reason=None, first_ts=f["ts"], last_ts=f["ts"]))
        v["first_ts"] = min(v["first_ts"], f["ts"])
        v["last_ts"] = max(v["last_ts"], f["ts"])
        op = f["op"]
        if op == "stream_req":
            if f["status"] == 0 and f["failover_log"] is not None:
                failover[vb] = f["failover_log"]
            elif f["status"] == 0x23 and f["rollback_seqno"] is not None:
                undone = 0
                for c in changes.get(vb, []):
                    if not c["undone"] and c["by_seqno"] is not None and c["by_seqno"] > f["rollback_seqno"]:
                        c["undone"] = True
                        undone += c["doc"]
                        if c["doc"]:
                            undone_rows.append(dict(change=c, rollback=f, rollback_at=at))
                rollbacks.append(dict(vbucket=vb, capture_id=f["capture_id"], frame_no=f["frame_no"],
                                      ts=f["ts"], rollback_seqno=f["rollback_seqno"], undone=undone))
                v["rollbacks"] += 1
        elif op == "snapshot_marker":
            prev = last_marker.get(vb)
            if prev is not None and f["snap_start"] is not None and prev["snap_end"] is not None \
                    and f["snap_start"] > prev["snap_end"]:
                prev["complete"] = True
            s = dict(vbucket=vb, capture_id=f["capture_id"], frame_no=f["frame_no"], ts=f["ts"],
                     snap_version=f["snap_version"], snap_start=f["snap_start"], snap_end=f["snap_end"],
                     snap_flags=f["snap_flags"], items=0, first_seqno=None, last_seqno=None, complete=False)
            snapshots.append(s)
            open_snap[vb] = last_marker[vb] = s
            v["snapshots"] += 1
        elif op == "stream_end":
            open_snap.pop(vb, None)
            v["stream_end_reason"] = f["stream_end_reason"]
        elif op in DOC_STATES or op == "seqno_advanced":
            seq = f["by_seqno"] if f["by_seqno"] is not None else -1
            s = open_snap.get(vb)
            if s is not None and seq == (s["snap_end"] if s["snap_end"] is not None else -1):
                s["complete"] = True
            doc = op in DOC_STATES
            if doc:
                v[{"mutation": "mutations", "deletion": "deletions", "expiration": "expirations"}[op]] += 1
                if s is not None:
                    s["items"] += 1
                    if s["first_seqno"] is None:
                        s["first_seqno"] = seq
                    s["last_seqno"] = seq
            changes.setdefault(vb, []).append(dict(f, by_seqno=seq, doc=doc, undone=False, at=at))
    documents: dict[tuple, dict] = {}
    for vb, cs in changes.items():
        for c in cs:
            if c["doc"] and not c["undone"]:
                documents[(vb, c["collection_id"], c["key"])] = c  # the later frame wins
    docs = [dict(vbucket=c["vbucket"], collection_id=c["collection_id"], key=c["key"],
                 by_seqno=c["by_seqno"], rev_seqno=c["rev_seqno"], cas=c["cas"], state=DOC_STATES[c["op"]],
                 datatype=c["datatype"], item_flags=c["item_flags"], expiration=c["expiration"],
                 value_len=c["value_len"], capture_id=c["capture_id"], frame_no=c["frame_no"], ts=c["ts"],
                 **body(c["raw"], c["value_len"], c["datatype"]))
            for c in documents.values()]
    vrows = []
    undone = [_undone_row(u, documents) for u in undone_rows]
    for vb, v in vbs.items():
        states = [d["state"] for d in docs if d["vbucket"] == vb]
        alive = [c["by_seqno"] for c in changes.get(vb, []) if not c["undone"]]
        log = failover.get(vb)
        vrows.append(dict(vbucket=vb, vbucket_uuid=log[0]["vbucket_uuid"] if log else None,
                          high_seqno=max(alive) if alive else None, live=states.count("live"),
                          deleted=states.count("deleted"), expired=states.count("expired"),
                          mutations=v["mutations"], deletions=v["deletions"], expirations=v["expirations"],
                          snapshots=v["snapshots"], rollbacks=v["rollbacks"],
                          last_snapshot_complete=last_marker[vb]["complete"] if vb in last_marker else None,
                          stream_end_reason=v["stream_end_reason"], first_ts=v["first_ts"], last_ts=v["last_ts"]))
    frows = [dict(vbucket=vb, position=i, vbucket_uuid=e["vbucket_uuid"], seqno=e["seqno"])
             for vb, log in failover.items() for i, e in enumerate(log)]
    return _tables("dcp", documents=docs, vbuckets=vrows, snapshots=snapshots, rollbacks=rollbacks,
                   failover=frows, undone=undone)


def body(raw, value_len, datatype) -> dict:
    """value / xattrs / value_json of a change, as REPLAY.md "Bodies" says, one frame at a time:
    the value as sent is the frame's last value_len bytes; Snappy undone (a value that does not
    decompress: all null); the xattr section cut off and its pairs as a JSON object."""
    out = dict(value=None, xattrs=None, value_json=None)
    if raw is None or value_len is None or value_len > len(raw) - 24:
        return out
    v = raw[len(raw) - value_len:]
    dt = datatype or 0
    if dt & 2:
        try:
            v = bytes(cramjam.snappy.decompress_raw(v))
        except Exception:  # noqa: BLE001 - any failure means "does not decompress"
            return out
    if dt & 4:
        if len(v) < 4 or 4 + int.from_bytes(v[:4], "big") > len(v):
            return out
        n = int.from_bytes(v[:4], "big")
        out["xattrs"] = _xattrs(v[4:4 + n])
        v = v[4 + n:]
    out["value"] = v
    if dt & 1:
        try:
            out["value_json"] = v.decode("utf-8")
        except UnicodeDecodeError:
            pass
    return out


def _xattrs(section: bytes) -> str | None:
    pairs, i = [], 0
    while i < len(section):
        n = int.from_bytes(section[i:i + 4], "big")
        pair = section[i + 4:i + 4 + n]
        i += 4 + n
        if len(pair) != n or i > len(section) or not pair.endswith(b"\0") or b"\0" not in pair[:-1]:
            return None
        k, val = pair[:-1].split(b"\0", 1)
        try:
            orjson.loads(val)
            text = val.decode("utf-8")
        except (orjson.JSONDecodeError, UnicodeDecodeError):
            text = orjson.dumps(val.decode("utf-8", "replace")).decode()
        pairs.append(orjson.dumps(k.decode("utf-8", "replace")).decode() + ":" + text)
    return "{" + ",".join(pairs) + "}"


def _undone_row(u: dict, documents: dict) -> dict:
    """A row of `undone`: the change, its rollback, and whether the document's current change
    (its last one not undone) was received after the rollback (restored, at its by_seqno)."""
    c, r = u["change"], u["rollback"]
    cur = documents.get((c["vbucket"], c["collection_id"], c["key"]))
    restored = cur is not None and cur["at"] > u["rollback_at"]
    return dict(vbucket=c["vbucket"], capture_id=r["capture_id"], frame_no=r["frame_no"], ts=r["ts"],
                rollback_seqno=r["rollback_seqno"], collection_id=c["collection_id"], key=c["key"],
                by_seqno=c["by_seqno"], op=c["op"], change_capture_id=c["capture_id"],
                change_frame_no=c["frame_no"], change_ts=c["ts"], restored=restored,
                restored_seqno=cur["by_seqno"] if restored else None)


def synapse(files) -> dict[str, pa.Table]:
    rows = frames_in_order(files)
    ranks = reader.capture_ranks(files)
    groups: dict[tuple, dict] = {}
    out_rows, gaps, commands = [], [], {}
    conn = None
    for f in rows:
        if f["command"] is not None:
            c = commands.setdefault(f["command"], dict(command=f["command"], count=0, first_ts=f["ts"], last_ts=f["ts"]))
            c["count"] += 1
            c["first_ts"], c["last_ts"] = min(c["first_ts"], f["ts"]), max(c["last_ts"], f["ts"])
        key = (ranks[f["capture_id"]], f["conn"])
        if key != conn:
            if conn is not None:  # a reconnect drops rows still waiting for a token
                for g in groups.values():
                    g["dropped"] += len(g["waiting"])
                    g["waiting"] = []
            conn = key
        if f["direction"] != "in" or f["stream"] is None or f["decode_error"] is not None \
                or f["command"] not in ("RDATA", "POSITION"):
            continue
        g = groups.setdefault((f["stream"], f["instance"]), dict(
            stream=f["stream"], instance=f["instance"], token=None, rows=0, batches=0, gaps=0, dropped=0,
            waiting=[], first_ts=f["ts"], last_ts=f["ts"], index={}))
        g["first_ts"], g["last_ts"] = min(g["first_ts"], f["ts"]), max(g["last_ts"], f["ts"])
        if f["command"] == "RDATA":
            if f["batch"] or f["token"] is None:
                g["waiting"].append(f)
                continue
            if g["waiting"]:
                g["batches"] += 1
            for r in g["waiting"] + [f]:
                i = g["index"].get(f["token"], 0)
                g["index"][f["token"]] = i + 1
                out_rows.append(dict(stream=g["stream"], instance=g["instance"], token=f["token"], index=i,
                                     row=r["row"], capture_id=r["capture_id"], frame_no=r["frame_no"], ts=r["ts"]))
                g["rows"] += 1
            g["waiting"] = []
            g["token"] = f["token"]
        else:
            if g["token"] is not None and f["prev_token"] is not None and g["token"] < f["prev_token"]:
                gaps.append(dict(stream=g["stream"], instance=g["instance"], capture_id=f["capture_id"],
                                 frame_no=f["frame_no"], ts=f["ts"], from_token=g["token"], to_token=f["prev_token"]))
                g["gaps"] += 1
            new = f["new_token"] if f["new_token"] is not None else f["token"]
            if new is not None:
                g["token"] = new
    positions = [dict(stream=g["stream"], instance=g["instance"], token=g["token"], rows=g["rows"],
                      batches=g["batches"], gaps=g["gaps"], dropped=g["dropped"], pending=len(g["waiting"]),
                      first_ts=g["first_ts"], last_ts=g["last_ts"]) for g in groups.values()]
    return _tables("synapse", positions=positions, rows=out_rows, gaps=gaps, commands=list(commands.values()))


def _tables(protocol, **named) -> dict[str, pa.Table]:
    out = {}
    for name, rows in named.items():
        schema = T.schema_of(protocol, name)
        cols = {}
        for fld in schema:
            vals = [r[fld.name] for r in rows]
            typ = pa.int64() if pa.types.is_timestamp(fld.type) else fld.type
            cols[fld.name] = pa.array(vals, typ).cast(fld.type)
        out[name] = T.canonical(protocol, name, pa.table(cols))
    return out
