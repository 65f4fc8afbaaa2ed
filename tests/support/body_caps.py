"""DCP captures whose change frames are real frames (header, extras, the LEB128 collection
prefix of the key, the value as sent: JSON or binary, Snappy when asked, an xattr section),
for the body tests of REPLAY.md "Bodies". Each document's bodies as the application stored
them are kept beside (`Built.stored`), so tests check the engines against what was written,
not against another reading of the frames."""

from __future__ import annotations

import json
import random
import struct
from dataclasses import dataclass, field

import cramjam

from tests.support import capture_rows

OPCODES = {"mutation": 0x57, "deletion": 0x58, "expiration": 0x59, "prepare": 0x5F, "commit": 0x5C,
           "stream_req": 0x53, "snapshot_marker": 0x56}
TS0 = 1_763_800_000_000_000_000


def xattr_section(pairs: list[tuple[bytes, bytes]]) -> bytes:
    body = b"".join(struct.pack(">I", len(k) + len(v) + 2) + k + b"\0" + v + b"\0" for k, v in pairs)
    return struct.pack(">I", len(body)) + body


def leb128(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def frame(opcode: int, vb: int, key: bytes, extras: bytes, value: bytes, datatype: int, cas: int,
          magic: int = 0x80, opaque: int = 7) -> bytes:
    body = len(extras) + len(key) + len(value)
    return struct.pack(">BBHBBHIIQ", magic, opcode, len(key), len(extras), datatype, vb, body, opaque, cas) \
        + extras + key + value


@dataclass
class Built:
    rows: list[dict] = field(default_factory=list)
    # (vbucket, collection_id, key) -> {value, xattrs, value_json} of each change, in order
    stored: dict = field(default_factory=dict)
    ts: int = TS0

    def add(self, direction: str, **cols) -> dict:
        self.ts += 1000
        row = dict(conn=1, ts=self.ts, mono_ns=self.ts - TS0, direction=direction, **cols)
        row.setdefault("raw", bytes(24))
        self.rows.append(row)
        return row


def change(b: Built, op: str, vb: int, key: bytes, seqno: int, *, cid: int | None, value: bytes = b"",
           json_value: bool = False, xattrs: list | None = None, snappy: bool = False, cas: int = 1,
           flags: int = 0, expiry: int = 0) -> None:
    """One change frame (op: mutation, deletion, expiration, prepare) and its row."""
    dt = (0x01 if json_value else 0) | (0x04 if xattrs is not None else 0)
    sent = (xattr_section(xattrs) if xattrs is not None else b"") + value
    if snappy:
        dt |= 0x02
        sent = bytes(cramjam.snappy.compress_raw(sent))
    wire_key = (leb128(cid) if cid is not None else b"") + key
    if op in ("mutation", "prepare"):
        extras = struct.pack(">QQIIIHB", seqno, 3, flags, expiry, 0, 0, 0)
    else:
        extras = struct.pack(">QQI", seqno, 3, 0)
    row = dict(magic=0x80, opcode=OPCODES[op], op=op, vbucket=vb, opaque=7, cas=cas, datatype=dt,
               collection_id=cid, key=key, value_len=len(sent), by_seqno=seqno, rev_seqno=3,
               raw=frame(OPCODES[op], vb, wire_key, extras, sent, dt, cas))
    if op in ("mutation", "prepare"):
        row.update(item_flags=flags, expiration=expiry, lock_time=0)
    b.add("in", **row)
    text = None
    if json_value:
        try:
            text = value.decode("utf-8")
        except UnicodeDecodeError:
            text = None
    xj = None
    if xattrs is not None:
        xj = "{" + ",".join(json.dumps(k.decode(), ensure_ascii=False, separators=(",", ":")) + ":" + v.decode()
                            for k, v in xattrs) + "}"
    b.stored.setdefault((vb, cid, key), []).append(dict(value=value, xattrs=xj, value_json=text, op=op, seqno=seqno))


def commit(b: Built, vb: int, key: bytes, seqno: int, prepared: int, *, cid: int | None) -> None:
    wire_key = (leb128(cid) if cid is not None else b"") + key
    raw = frame(OPCODES["commit"], vb, wire_key, struct.pack(">QQ", prepared, seqno), b"", 0, 0)
    b.add("in", magic=0x80, opcode=OPCODES["commit"], op="commit", vbucket=vb, opaque=7, cas=0,
          collection_id=cid, key=key, by_seqno=seqno, value_len=0, raw=raw)


def stream(b: Built, vb: int) -> None:
    b.add("out", magic=0x80, opcode=OPCODES["stream_req"], op="stream_req", vbucket=vb, opaque=7,
          req_start_seqno=0)
    b.add("in", magic=0x81, opcode=OPCODES["stream_req"], op="stream_req", vbucket=vb, opaque=7, status=0,
          failover_log=[{"vbucket_uuid": 0xAB + vb, "seqno": 0}])


def generate(seed: int, snappy: bool, docs: int = 30, vbuckets: int = 3) -> Built:
    """Streams of `vbuckets` vbuckets, one snapshot each round: JSON documents (some with
    xattrs, some not UTF-8), binary ones, deletions and expirations with and without xattrs,
    documents replaced; with `snappy` about half the values are sent Snappy-compressed."""
    rng = random.Random(seed)
    b = Built()
    seqno = {vb: 0 for vb in range(vbuckets)}
    for vb in range(vbuckets):
        stream(b, vb)
    for _ in range(4):
        for vb in range(vbuckets):
            n = rng.randrange(3, 8)
            b.add("in", magic=0x80, opcode=OPCODES["snapshot_marker"], op="snapshot_marker", vbucket=vb,
                  opaque=7, snap_start=seqno[vb] + 1, snap_end=seqno[vb] + n, snap_flags=1, snap_version="2.0")
            for _ in range(n):
                seqno[vb] += 1
                key = b"doc-%d" % rng.randrange(docs)
                cid = None if vb == 0 else rng.choice([0, 8])
                op = rng.choices(["mutation", "deletion", "expiration"], [8, 2, 1])[0]
                xattrs = None
                if rng.random() < 0.4:
                    xattrs = [(b"_sync", b'{"rev":"%d-a","seq":%d}' % (seqno[vb], seqno[vb])),
                              (b"meta", b'"caf\xc3\xa9"')][:rng.randrange(1, 3)]
                kind = rng.random()
                if op != "mutation":
                    value, js = b"", False
                elif kind < 0.6:
                    value, js = json.dumps({"type": rng.choice(["order", "user"]), "n": seqno[vb],
                                            "name": "\u00e9l\u00e8ve"}, ensure_ascii=False).encode(), True
                elif kind < 0.7:
                    value, js = b'{"bad":"\xff"}', True          # JSON datatype, not UTF-8
                else:
                    value, js = rng.randbytes(rng.randrange(0, 40)), False
                change(b, op, vb, key, seqno[vb], cid=cid, value=value, json_value=js, xattrs=xattrs,
                       snappy=snappy and rng.random() < 0.5, cas=rng.getrandbits(63),
                       flags=rng.getrandbits(32), expiry=rng.choice([0, 1_900_000_000]))
    return b


def sync_capture() -> Built:
    """A prepare then its commit; a commit whose prepare is not in the capture; a mutation
    with xattrs then its deletion that keeps them (a tombstone with xattrs); a rollback that
    undoes a change."""
    b = Built()
    stream(b, 0)
    change(b, "prepare", 0, b"p", 1, cid=None, value=b'{"v":"prepared"}', json_value=True,
                     xattrs=[(b"_sync", b'{"s":1}')], snappy=True)
    commit(b, 0, b"p", 2, 1, cid=None)
    commit(b, 0, b"orphan", 3, 0, cid=None)
    change(b, "mutation", 0, b"t", 4, cid=None, value=b'{"v":1}', json_value=True,
                     xattrs=[(b"_sync", b'{"rev":"1"}')])
    change(b, "deletion", 0, b"t", 5, cid=None, xattrs=[(b"_sync", b'{"rev":"2","deleted":true}')])
    change(b, "mutation", 0, b"r", 6, cid=None, value=b'{"v":"first"}', json_value=True)
    change(b, "mutation", 0, b"r", 7, cid=None, value=b'{"v":"second"}', json_value=True)
    b.add("out", op="stream_req", vbucket=0, opaque=8, req_start_seqno=7)
    b.add("in", op="stream_req", vbucket=0, opaque=8, status=0x23, rollback_seqno=6)
    return b


def write(b: Built, directory: str, cuts=()) -> list:
    return capture_rows.write(b.rows, directory, cuts=cuts)
