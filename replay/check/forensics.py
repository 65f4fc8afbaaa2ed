"""Rollback forensics (`verify --explain`): for each rollback of a DCP capture, when, which
vbucket, the failover entries involved, the seqno range undone and the documents whose
changes were received and then undone ("phantom changes"), with whether a later change
restored them.

The `rollbacks` and `undone` tables of the local engine give the rollbacks and the undone
changes; one more pass over a few columns, only for the vbuckets that rolled back, gives the
failover logs before and after each rollback, the stream request it answered and the highest
seqno received before it."""

from __future__ import annotations

import base64
from collections import defaultdict

import numpy as np
import pyarrow as pa

from dcptool.protocol.dcp.wire.constants import Status
from dcptool.replay.local import engine as local
from dcptool.replay.rules.as_of import AS_OF_COLUMNS, AsOf
from dcptool.replay.rules.columns import (
    as_numpy,
    as_strings,
    equals,
    is_in,
    ordered_frames,
)
from dcptool.replay.rules.dcp_vbuckets import DOC_STATES, dcp_vbucket_frames
from dcptool.replay.store import reader
from dcptool.replay.timestamps import iso_ns

_SCAN = ["capture_id", "frame_no", "direction", "vbucket", "op", "status", "decode_error", "by_seqno",
         "failover_log", "req_start_seqno", "req_vbucket_uuid"]
_ITEM_OPS = tuple(DOC_STATES) + ("seqno_advanced",)


def key_fields(key: bytes | None) -> dict:
    """The output contract's key: text, or key_base64 when it is not UTF-8."""
    if key is None:
        return {"key": None}
    try:
        return {"key": key.decode("utf-8")}
    except UnicodeDecodeError:
        return {"key": None, "key_base64": base64.b64encode(key).decode("ascii")}


def _entry_under(log: list | None, seqno: int) -> dict | None:
    """The failover entry whose branch holds `seqno`: the newest entry starting at or below it."""
    for e in log or []:
        if e["seqno"] is not None and e["seqno"] <= seqno:
            return e
    return None


def explain_rollbacks(files: list, as_of: AsOf | None = None) -> list[dict]:
    """One dict per rollback of a DCP capture, in frame order (JSON-ready: timestamps as
    RFC 3339, keys as text). See the module docstring; `as_of` as for replay."""
    if reader.protocol_of(files) != "dcp":
        return []
    rep = local.replay_local(files, as_of=as_of)
    rb_table = rep.table("rollbacks")
    if rb_table.num_rows == 0:
        return []
    rbs = rb_table.drop_columns(["ts"]).to_pylist()   # timestamps as integers: no pandas, no rounding
    for r, ts in zip(rbs, rb_table.column("ts").cast(pa.int64()).to_pylist()):
        r["ts"] = ts
    undone = defaultdict(list)
    for u in rep.table("undone").drop_columns(["ts", "change_ts"]).to_pylist():
        undone[(u["capture_id"], u["frame_no"])].append(u)

    # one pass for the vbuckets that rolled back: frame order (`_seq`) of each frame
    # concerned, the failover logs, stream requests sent, and seqnos received
    vbs = sorted({r["vbucket"] for r in rbs})
    ranks = reader.capture_ranks(files)
    cols = list(dict.fromkeys(_SCAN + (AS_OF_COLUMNS if as_of else [])))
    logs, requests, items, where = defaultdict(list), defaultdict(list), defaultdict(list), {}
    wanted = {(r["capture_id"], r["frame_no"]) for r in rbs}
    for t in ordered_frames(files, cols, ranks):
        vb_ok = as_numpy(t.column("vbucket").is_valid(), dtype=bool)
        vb = np.where(vb_ok, as_numpy(t.column("vbucket"), fill=0, dtype=np.int64), -1)
        keep = np.isin(vb, vbs) & as_numpy(t.column("decode_error").is_null(), dtype=bool)
        if as_of:
            keep &= as_of.mask(t)
        if not keep.any():
            continue
        t = t.filter(pa.array(keep))
        vb = vb[keep]
        seq = as_numpy(t.column("_seq"), dtype=np.int64)
        inbound = dcp_vbucket_frames(t)
        is_req = is_in(t.column("op"), ["stream_req"])
        status = as_numpy(t.column("status"), fill=0xFFFF, dtype=np.int64)
        ok = inbound & is_req & (status == Status.SUCCESS) & as_numpy(t.column("failover_log").is_valid(), dtype=bool)
        for i in np.flatnonzero(ok):
            logs[int(vb[i])].append((int(seq[i]), t.column("failover_log")[int(i)].as_py()))
        sent = equals(t.column("direction"), "out") & is_req
        sent &= ~as_numpy(t.column("req_start_seqno").is_null(), dtype=bool)
        for i in np.flatnonzero(sent):
            requests[int(vb[i])].append((int(seq[i]), t.column("req_start_seqno")[int(i)].as_py(),
                                        t.column("req_vbucket_uuid")[int(i)].as_py()))
        item = inbound & is_in(t.column("op"), _ITEM_OPS) & as_numpy(t.column("by_seqno").is_valid(), dtype=bool)
        if item.any():
            items_seqno = as_numpy(t.column("by_seqno"), fill=0, dtype=np.int64)
            for v in np.unique(vb[item]):
                m = item & (vb == v)
                items[int(v)].append((seq[m], items_seqno[m]))
        cids = as_strings(t.column("capture_id")).to_pylist()
        fnos = t.column("frame_no").to_pylist()
        for i in np.flatnonzero(inbound & is_req & (status == Status.ROLLBACK)):
            k = (cids[i], fnos[i])
            if k in wanted:
                where[k] = int(seq[i])

    out = []
    for r in sorted(rbs, key=lambda r: where.get((r["capture_id"], r["frame_no"]), -1)):
        vb, rs = r["vbucket"], where.get((r["capture_id"], r["frame_no"]), -1)
        before = [log for s, log in logs[vb] if s < rs]
        after = [log for s, log in logs[vb] if s > rs]
        asked = [(start, uuid) for s, start, uuid in requests[vb] if s < rs]
        high = None
        for s, seqnos in items[vb]:
            m = seqnos[s < rs]
            if len(m):
                high = int(m.max()) if high is None else max(high, int(m.max()))
        log_after = after[0] if after else None
        log_before = before[-1] if before else None
        docs: dict = {}
        for u in undone[(r["capture_id"], r["frame_no"])]:
            d = docs.setdefault((u["collection_id"], u["key"]), {
                "collection_id": u["collection_id"], **key_fields(u["key"]), "by_seqnos": [],
                "restored": u["restored"], "restored_seqno": u["restored_seqno"]})
            d["by_seqnos"].append(u["by_seqno"])
        for d in docs.values():
            d["by_seqnos"].sort(key=lambda x: -1 if x is None else x)
        ts = r["ts"]
        out.append({
            "vbucket": vb, "capture_id": r["capture_id"], "frame_no": r["frame_no"],
            "ts": iso_ns(ts),
            "rollback_seqno": r["rollback_seqno"],
            "requested_start_seqno": asked[-1][0] if asked else None,
            "requested_vbucket_uuid": asked[-1][1] if asked else None,
            "failover_before": log_before, "failover_after": log_after,
            "failover_entry": _entry_under(log_after if log_after is not None else log_before, r["rollback_seqno"]),
            "undone_from": r["rollback_seqno"] + 1,
            "undone_to": high if high is not None and high > r["rollback_seqno"] else None,
            "undone_changes": r["undone"],
            "documents": sorted(docs.values(), key=lambda d: (d["collection_id"] is not None, d["collection_id"] or 0,
                                                              d.get("key") or "", d.get("key_base64") or "")),
        })
    return out
