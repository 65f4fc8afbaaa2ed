"""Capture rows built by hand. `Rec` writes rows through the real CaptureWriter (frame_no
counted for you); `Run` makes the rows of a clean DCP run as a careful consumer and a correct
server would (streams, snapshots, a resume, a rollback) for verify to find broken on purpose;
`write` puts rows on disk as one capture cut into segments; `checks` names a report's findings."""

from __future__ import annotations

import os
import random

import pyarrow as pa
import pyarrow.parquet as pq

from dcptool.replay.store import schema as S
from dcptool.replay.store.schema import META_SEGMENT, capture_schema
from dcptool.replay.store.writer import CaptureWriter
from tests.support import capgen

DCP_TYPES = dict(S.fields("dcp"))
SYN_TYPES = dict(S.fields("synapse"))


class Rec:
    """Builds rows with increasing frame_no and writes them through a CaptureWriter."""

    def __init__(self, directory, protocol="dcp", **kw):
        self.w = CaptureWriter(directory, protocol, source="test://", options={}, **kw)
        self.types = DCP_TYPES if protocol == "dcp" else SYN_TYPES
        self.rows: list[dict] = []
        self.n = 0

    def add(self, **row):
        row.setdefault("direction", "in")
        row["frame_no"] = self.n
        self.n += 1
        self.rows.append(row)

    def flush(self):
        if not self.rows:
            return
        names = sorted({k for r in self.rows for k in r})
        schema = pa.schema([(k, self.types[k]) for k in names])
        self.w.write(pa.Table.from_pylist(self.rows, schema=schema))
        self.rows = []

    def close(self):
        self.flush()
        return self.w.close()

    # DCP helpers
    def stream_ok(self, vb, log):
        self.add(direction="out", op="stream_req", vbucket=vb, req_start_seqno=0)
        self.add(op="stream_req", vbucket=vb, status=0,
                 failover_log=[{"vbucket_uuid": u, "seqno": s} for u, s in log])

    def marker(self, vb, start, end):
        self.add(op="snapshot_marker", vbucket=vb, snap_start=start, snap_end=end)

    def items(self, vb, first, last, op="mutation"):
        for s in range(first, last + 1):
            self.add(op=op, vbucket=vb, by_seqno=s, key=b"k%d" % s)


UUID_A, UUID_B = 0xAAAA, 0xBBBB


class Run:
    """Rows of a clean DCP run, as a careful consumer and a correct server make them."""

    def __init__(self, seed: int = 0, vbuckets=(0, 1, 2)):
        self.rng = random.Random(seed)
        self.rows: list[dict] = []
        self.conn = 1
        self.opaque = 100
        self.ts = capgen.BASE_TS
        self.vbs = list(vbuckets)
        self.last = {vb: 0 for vb in self.vbs}
        self.log = {vb: [(UUID_A, 0)] for vb in self.vbs}

    def add(self, direction, **cols):
        self.ts += 1000
        row = dict(conn=self.conn, ts=self.ts, mono_ns=self.ts, direction=direction, raw=bytes(24), **cols)
        self.rows.append(row)
        return row

    def request(self, vb, start=None, uuid=None, answer="ok", rollback_to=None, snap=None):
        self.opaque += 1
        start = self.last[vb] if start is None else start
        ss, se = snap or (start, start)
        self.add("out", op="stream_req", vbucket=vb, opaque=self.opaque, req_start_seqno=start,
                 req_end_seqno=2**64 - 1, req_vbucket_uuid=self.log[vb][0][0] if uuid is None else uuid,
                 req_snap_start=ss, req_snap_end=se, req_flags=0)
        if answer == "rollback":
            self.add("in", op="stream_req", vbucket=vb, opaque=self.opaque, status=0x23,
                     rollback_seqno=rollback_to)
            return
        self.add("in", op="stream_req", vbucket=vb, opaque=self.opaque, status=0,
                 failover_log=[{"vbucket_uuid": u, "seqno": s} for u, s in self.log[vb]])

    def snapshot(self, vb, n):
        first = self.last[vb] + 1
        self.add("in", op="snapshot_marker", vbucket=vb, snap_start=first, snap_end=first + n - 1,
                 snap_flags=1, snap_version="2.0")
        for s in range(first, first + n):
            self.add("in", op=self.rng.choice(["mutation", "mutation", "deletion"]), vbucket=vb,
                     by_seqno=s, rev_seqno=1, key=b"k%d" % self.rng.randrange(50))
        self.last[vb] = first + n - 1

    def clean(self, rounds=6):
        """Streams, snapshots, a reconnect that resumes, and a rollback after a failover."""
        for vb in self.vbs:
            self.request(vb)
        for r in range(rounds):
            for vb in self.vbs:
                self.snapshot(vb, self.rng.randrange(1, 6))
            if r == 2:                       # the connection drops; the streams resume
                self.conn += 1
                for vb in self.vbs:
                    self.request(vb)
            if r == 4:                       # vb 0 failed over: the server lost 2 seqnos
                vb = self.vbs[0]
                back = self.last[vb] - 2
                self.conn += 1
                self.request(vb, answer="rollback", rollback_to=back)
                self.last[vb] = back
                self.log[vb].insert(0, (UUID_B, back))
                self.request(vb, uuid=UUID_A)
                for other in self.vbs[1:]:
                    self.request(other)
        for vb in self.vbs:
            self.add("in", op="stream_end", vbucket=vb, stream_end_reason=0)
        return self


def write(rows, directory, protocol="dcp", cuts=(), name_started="2025-11-22T01:02:03.000000Z",
          cid="c0ffee00-0000-4000-8000-000000000001", **write_kw):
    """One capture of `rows` as segments cut at `cuts` (row indices); frame_no 0..n-1."""
    os.makedirs(directory, exist_ok=True)
    for i, r in enumerate(rows):
        r.update(capture_id=cid, frame_no=i)
    meta = {"dcptool.format": "1", "dcptool.protocol": protocol, "dcptool.capture_id": cid,
            "dcptool.started_at": name_started, "dcptool.version": "test",
            "dcptool.source": "couchbase://127.0.0.1/b", "dcptool.options": "{}"}
    table = capgen.to_table(protocol, rows, meta)
    bounds = [0, *cuts, len(rows)]
    paths = []
    for seg in range(len(bounds) - 1):
        part = table.slice(bounds[seg], bounds[seg + 1] - bounds[seg])
        m = dict(meta, **{META_SEGMENT: str(seg)})
        part = part.replace_schema_metadata(capture_schema(protocol, m).metadata)
        path = os.path.join(directory, capgen.file_name(meta, seg))
        pq.write_table(part, path, compression="zstd", **write_kw)
        paths.append(path)
    return paths


def checks(report):
    return [f.check for f in report.findings]
