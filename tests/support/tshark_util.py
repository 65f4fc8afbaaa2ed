"""Run Wireshark's couchbase dissector (tshark) over frames and compare with our decoder,
for the fields tshark decodes correctly. tshark gets these wrong, so they are not compared:
stream-end reasons, rollback responses, snapshot marker V2.x, keys without a collection
prefix (it always splits a LEB128 id), and it shows the opaque byte-swapped."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile

import pytest

from tests.support.pcap import write_pcap

SEGMENT = 32_000   # an IPv4 packet holds at most 65535 bytes: split big reads


class Recorder:
    """A transport tap (transport.dcp_client.Session(tap=...)) that keeps a session's bytes both ways:
    `frames` [(from_server, frame)] and `segments` [(from_server, payload)] in wire order, for
    tshark_frames."""

    def __init__(self):
        self.segments: list[tuple[bool, bytes]] = []
        self.frames: list[tuple[bool, bytes]] = []

    def on_received(self, buf, offsets, lengths, ts, mono):
        for o, n in zip(offsets.tolist(), lengths.tolist()):
            self.frames.append((True, bytes(buf[o:o + n])))
        data = bytes(buf[:offsets[-1] + lengths[-1]]) if len(offsets) else b""
        for i in range(0, len(data), SEGMENT):
            self.segments.append((True, data[i:i + SEGMENT]))

    def on_sent(self, frame, ts, mono):
        self.frames.append((False, frame))
        self.segments.append((False, frame))


def require_tshark() -> str:
    path = shutil.which("tshark")
    if path is None:
        pytest.skip("tshark is not installed (Debian package tshark); scripts/setup.sh --test installs it")
    return path


def _flat(obj, out):
    for k, v in obj.items():
        if isinstance(v, dict):
            _flat(v, out)
        elif not k.startswith("_ws"):
            out.setdefault(k, v)
    return out


def tshark_frames(segments, port=11210) -> list[dict]:
    """segments: [(from_server, payload)]; one flat dict of couchbase.* fields per PDU."""
    exe = require_tshark()
    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/frames.pcap"
        write_pcap(path, segments, server_port=port)
        out = subprocess.run([exe, "-r", path, "-T", "json", "--no-duplicate-keys", "-d", f"tcp.port=={port},couchbase",
                              "-o", "tcp.desegment_tcp_streams:TRUE"],
                             capture_output=True, timeout=120, check=True)
    pdus = []
    for pkt in json.loads(out.stdout):
        # with --no-duplicate-keys, several PDUs of one segment arrive as a list
        layer = pkt["_source"]["layers"].get("couchbase")
        if layer is None:
            continue
        for one in layer if isinstance(layer, list) else [layer]:
            pdus.append(_flat(one, {}))
    return pdus


def _int(text: str) -> int:
    return int(text, 16) if text.startswith("0x") else int(text)


def compare(row: dict, raw: bytes, ts: dict) -> list[str]:
    """Differences between our row and tshark's fields, over what tshark gets right."""
    diffs = []

    def eq(name, ours, theirs):
        if theirs is not None and ours != theirs:
            diffs.append(f"{name}: ours {ours!r} tshark {theirs!r}")

    g = ts.get
    eq("magic", row["magic"], _int(g("couchbase.magic")))
    eq("opcode", row["opcode"], _int(g("couchbase.opcode")))
    eq("cas", row["cas"], _int(g("couchbase.cas")))
    eq("datatype", row["datatype"], _int(g("couchbase.datatype")))
    eq("opaque", row["opaque"], int.from_bytes(_int(g("couchbase.opaque")).to_bytes(4, "big"), "little"))
    eq("total_bodylength", len(raw) - 24, _int(g("couchbase.total_bodylength")))
    if "status" in row:
        eq("status", row["status"], _int(g("couchbase.status")) if g("couchbase.status") else None)
    else:
        eq("vbucket", row["vbucket"], _int(g("couchbase.vbucket")) if g("couchbase.vbucket") else None)
    if row.get("stream_id") is not None and g("couchbase.flex_frame.frame.dcp_stream_id"):
        eq("stream_id", row["stream_id"], _int(g("couchbase.flex_frame.frame.dcp_stream_id")))
    for ours, theirs in (("by_seqno", "couchbase.extras.by_seqno"), ("rev_seqno", "couchbase.extras.rev_seqno"),
                         ("expiration", "couchbase.extras.expiration"), ("lock_time", "couchbase.extras.lock_time"),
                         ("req_start_seqno", "couchbase.extras.start_seqno"),
                         ("req_end_seqno", "couchbase.extras.end_seqno"),
                         ("req_vbucket_uuid", "couchbase.extras.vbucket_uuid"),
                         ("req_snap_start", "couchbase.extras.snap_start_seqno"),
                         ("req_snap_end", "couchbase.extras.snap_end_seqno")):
        if ours in row and g(theirs) is not None:
            eq(ours, row[ours], _int(g(theirs)))
    if row.get("op") == "snapshot_marker" and row.get("snap_version") == "1":
        eq("snap_start", row["snap_start"], _int(g("couchbase.extras.start_seqno")))
        eq("snap_end", row["snap_end"], _int(g("couchbase.extras.end_seqno")))
        eq("snap_flags", row["snap_flags"], _int(g("couchbase.extras.flags")))
    if row.get("op") == "mutation":
        eq("item_flags", row["item_flags"], _int(g("couchbase.extras.flags")))
    # a system event's key is the collection's name, with no id prefix (tshark reads one
    # anyway); our collection_id for it comes from the event's value
    if row.get("collection_id") is not None and g("couchbase.key.collection_id") and row.get("op") != "system_event":
        eq("collection_id", row["collection_id"], _int(g("couchbase.key.collection_id")))
        eq("key", row["key"].decode("latin-1"), g("couchbase.key.logical_key"))
    return diffs
