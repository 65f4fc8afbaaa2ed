"""Seeded generator of valid DCP and Synapse captures (CAPTURE_FORMAT.md, columns from
replay/store/schema.py) for replay tests and benchmarks.

DCP: a handshake, then per vbucket stream requests answered with a failover log or a
ROLLBACK, snapshot markers (memory, disk, history with duplicate keys), mutations,
deletions, expirations, seqno-advanced, stream ends, noops and buffer acks, undecodable
frames, and reconnects (the connection number goes up and streams are requested again).
Synapse: RDATA with numeric and `batch` tokens, POSITION with and without gaps, other
commands in both directions, and reconnects that leave batch rows waiting.

A run can be cut into several captures (as `capture --resume` makes) and each capture into
segments; `write_captures` writes them as finished Parquet segments or, for the last one,
as an in-progress Arrow IPC stream, optionally truncated as a SIGKILL would leave it."""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import uuid

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from dcptool.replay.store.schema import (META_CAPTURE_ID, META_FORMAT, META_OPTIONS, META_PROTOCOL,
                                   META_SEGMENT, META_SOURCE, META_STARTED_AT, META_VERSION,
                                   capture_schema)

BASE_TS = 1_763_800_000_000_000_000  # 2025-11-22, ns
OPCODES = {"hello": 0x1F, "open": 0x50, "control": 0x5E, "stream_req": 0x53, "stream_end": 0x55,
           "snapshot_marker": 0x56, "mutation": 0x57, "deletion": 0x58, "expiration": 0x59,
           "noop": 0x5C, "buffer_ack": 0x5D, "seqno_advanced": 0x64, "get_failover_log": 0x54}


class _Run:
    """Collects rows of one run; `cut` splits it into captures."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.rows: list[dict] = []
        self.conn = 0
        self.ts = BASE_TS + rng.randrange(10**12)

    def add(self, direction: str, **cols) -> dict:
        self.ts += self.rng.randrange(1, 5_000_000)
        row = {"conn": self.conn, "ts": self.ts, "mono_ns": self.ts - BASE_TS, "direction": direction}
        row.update(cols)
        self.rows.append(row)
        return row


def _raw(rng: random.Random, row: dict) -> bytes:
    # frame bytes are not interpreted by replay; a header-shaped prefix keeps them plausible
    magic = row.get("magic") or 0x80
    return bytes([magic, row.get("opcode") or 0]) + rng.randbytes(rng.randrange(22, 40))


def _dcp_run(rng: random.Random, n_events: int) -> list[dict]:
    run = _Run(rng)
    nvb = rng.choice([1, 2, 3, 4])
    vbs = sorted(rng.sample([0, 1, 2, 5, 63, 511, 1023], nvb))
    collections = rng.random() < 0.5
    keys = [f"doc-{i}".encode() for i in range(rng.choice([3, 8, 40]))]
    opaque = [100]

    def req(op, vb, **kw):
        opaque[0] += 1
        return run.add("out", magic=0x80, opcode=OPCODES[op], op=op, vbucket=vb, opaque=opaque[0], **kw)

    def resp(r, status=0, **kw):
        return run.add("in", magic=0x81, opcode=r["opcode"], op=r["op"], vbucket=r["vbucket"],
                       opaque=r["opaque"], status=status, **kw)

    def handshake():
        for op in ("hello", "open", "control"):
            resp(req(op, 0))

    # producer state per vbucket
    seqno = {v: 0 for v in vbs}
    uuids = {v: [(rng.getrandbits(64), 0)] for v in vbs}
    streaming: dict[int, dict] = {}  # vb -> {"end": snap_end or None, "opaque": o}

    def open_stream(vb):
        r = req("stream_req", vb, req_flags=0, req_start_seqno=seqno[vb], req_end_seqno=2**64 - 1,
                req_vbucket_uuid=uuids[vb][0][0], req_snap_start=seqno[vb], req_snap_end=seqno[vb])
        if seqno[vb] > 0 and rng.random() < 0.25:
            # the server lost changes (failover): ROLLBACK to an earlier seqno
            back = rng.randrange(0, seqno[vb] + 1)
            resp(r, status=0x23, rollback_seqno=back)
            seqno[vb] = back
            uuids[vb].insert(0, (rng.getrandbits(64), back))
            r = req("stream_req", vb, req_flags=0, req_start_seqno=back, req_end_seqno=2**64 - 1,
                    req_vbucket_uuid=uuids[vb][0][0], req_snap_start=back, req_snap_end=back)
        if rng.random() < 0.05:
            # a rollback the generator ignores (the consumer's view only): arbitrary seqno
            resp(r, status=0x23, rollback_seqno=rng.randrange(0, seqno[vb] + 3))
            r = req("stream_req", vb, req_flags=0, req_start_seqno=seqno[vb], req_end_seqno=2**64 - 1)
        resp(r, failover_log=[{"vbucket_uuid": u, "seqno": s} for u, s in uuids[vb]])
        streaming[vb] = {"left": 0, "opaque": r["opaque"], "end": None, "history": False}

    def item(vb, st):
        op = rng.choices(["mutation", "deletion", "expiration"], [6, 2, 1])[0]
        if st["history"] and rng.random() < 0.3:
            seqno[vb] += rng.randrange(0, 2)  # duplicate key history may repeat seqnos too
        else:
            seqno[vb] += rng.randrange(1, 3)
        key = rng.choice(keys)
        cols = dict(magic=0x80, opcode=OPCODES[op], op=op, vbucket=vb, opaque=st["opaque"],
                    cas=rng.getrandbits(64), datatype=rng.choice([0, 1, 3]),
                    collection_id=rng.choice([0, 8, 9]) if collections else None, key=key,
                    by_seqno=seqno[vb], rev_seqno=rng.randrange(1, 50))
        if op == "mutation":
            cols.update(value_len=rng.randrange(0, 300), item_flags=rng.getrandbits(32),
                        expiration=rng.choice([0, 0, rng.getrandbits(32)]), lock_time=0)
        else:
            cols.update(value_len=0, delete_time=rng.getrandbits(32))
        run.add("in", **cols)

    handshake()
    for vb in vbs:
        open_stream(vb)
    for _ in range(n_events):
        x = rng.random()
        if x < 0.03:
            # reconnect: the connection drops, a new one asks for the streams again
            run.conn += 1
            streaming.clear()
            handshake()
            for vb in rng.sample(vbs, len(vbs)):
                open_stream(vb)
            continue
        if x < 0.06:
            run.add("in", magic=0x80, opcode=OPCODES["noop"], op="noop", opaque=1)
            run.add("out", magic=0x81, opcode=OPCODES["noop"], op="noop", opaque=1, status=0)
            continue
        if x < 0.07:
            run.add("in", decode_error="frame too short", magic=0x80)
            continue
        if x < 0.08:
            run.add("out", magic=0x80, opcode=OPCODES["buffer_ack"], op="buffer_ack", opaque=2)
            continue
        if not streaming:
            open_stream(rng.choice(vbs))
            continue
        vb = rng.choice(sorted(streaming))
        st = streaming[vb]
        if st["left"] <= 0:
            y = rng.random()
            if y < 0.08:
                run.add("in", magic=0x80, opcode=OPCODES["stream_end"], op="stream_end", vbucket=vb,
                        opaque=st["opaque"], stream_end_reason=rng.choice([0, 1, 2, 4]))
                del streaming[vb]
                continue
            n = rng.randrange(0, 6)
            history = rng.random() < 0.3
            start = seqno[vb] + 1
            end = seqno[vb] + n + rng.choice([0, 0, 1, 3])
            if rng.random() < 0.1:
                start = max(0, start - rng.randrange(0, 3))  # overlapping (incomplete before)
            flags = rng.choice([0x01, 0x02, 0x05]) | (0x30 if history else 0)
            version = rng.choice(["1", "2.0", "2.2"])
            extra = {}
            if version != "1":
                extra = dict(max_visible_seqno=end, high_completed_seqno=rng.randrange(0, end + 1))
            if version == "2.2":
                extra["purge_seqno"] = rng.randrange(0, start + 1)
            run.add("in", magic=0x80, opcode=OPCODES["snapshot_marker"], op="snapshot_marker",
                    vbucket=vb, opaque=st["opaque"], snap_version=version, snap_start=start,
                    snap_end=end, snap_flags=flags, **extra)
            st.update(left=n, end=end, history=history)
            continue
        if rng.random() < 0.1:
            seqno[vb] = max(seqno[vb], st["end"] if rng.random() < 0.7 else seqno[vb] + 1)
            run.add("in", magic=0x80, opcode=OPCODES["seqno_advanced"], op="seqno_advanced",
                    vbucket=vb, opaque=st["opaque"], by_seqno=seqno[vb])
            st["left"] = 0
            continue
        item(vb, st)
        st["left"] -= 1
    for r in run.rows:
        r["raw"] = _raw(rng, r)
    return run.rows


def _synapse_run(rng: random.Random, n_events: int) -> list[dict]:
    run = _Run(rng)
    groups = [(s, i) for s in rng.sample(["events", "caches", "typing", "receipts"], rng.randrange(1, 4))
              for i in rng.sample(["master", "worker1", "worker2"], rng.randrange(1, 3))]
    token = {g: rng.randrange(0, 100) for g in groups}

    def line(direction, command, **cols):
        text = " ".join(str(v) for v in [command, *[v for v in cols.values() if v is not None]])
        run.add(direction, command=command, raw=text.encode(), **cols)

    def connect():
        line("in", "SERVER", args="matrix.test")
        line("out", "NAME", args=f"dcptool-{rng.randrange(1000)}")
        line("out", "REPLICATE", args=None)
        for g in groups:
            prev = token[g]
            if rng.random() < 0.3:
                token[g] += rng.randrange(1, 20)  # rows we never saw
            run.add("in", command="POSITION", stream=g[0], instance=g[1], prev_token=prev,
                    new_token=token[g], raw=f"POSITION {g[0]} {g[1]} {prev} {token[g]}".encode())

    connect()
    for _ in range(n_events):
        x = rng.random()
        if x < 0.03:
            run.conn += 1
            connect()
            continue
        if x < 0.08:
            cmd = rng.choice(["PING", "USER_SYNC", "REMOTE_SERVER_UP", "PING"])
            line(rng.choice(["in", "out"]), cmd, args=str(rng.randrange(10**6)))
            continue
        if x < 0.09:
            run.add("in", decode_error="line too long", raw=b"X" * 10)
            continue
        g = rng.choice(groups)
        if x < 0.14:
            prev = token[g] + (rng.randrange(1, 5) if rng.random() < 0.5 else -rng.randrange(0, 3))
            new = max(prev, token[g]) + rng.randrange(0, 5)
            token[g] = new
            run.add("in", command="POSITION", stream=g[0], instance=g[1], prev_token=prev,
                    new_token=new, raw=f"POSITION {g[0]} {g[1]} {prev} {new}".encode())
            continue
        row = json.dumps({"k": rng.randrange(100), "v": "é" if rng.random() < 0.1 else "x"})
        if rng.random() < 0.35:
            run.add("in", command="RDATA", stream=g[0], instance=g[1], token=None, batch=True,
                    row=row, raw=f"RDATA {g[0]} {g[1]} batch {row}".encode())
        else:
            token[g] += rng.choice([0, 1, 1, 2])
            run.add("in", command="RDATA", stream=g[0], instance=g[1], token=token[g], batch=False,
                    row=row, raw=f"RDATA {g[0]} {g[1]} {token[g]} {row}".encode())
    return run.rows


def generate(protocol: str, seed: int, n_events: int = 200, max_captures: int = 3) -> list[tuple[dict, pa.Table]]:
    """A run cut into 1..max_captures captures: [(metadata, table)] in capture order."""
    rng = random.Random(seed)
    rows = _dcp_run(rng, n_events) if protocol == "dcp" else _synapse_run(rng, n_events)
    ncap = rng.randrange(1, max_captures + 1)
    # cut at connection changes, as a restarted capture would
    cuts = sorted(rng.sample(range(1, len(rows)), min(ncap - 1, len(rows) - 1))) if len(rows) > 1 else []
    out = []
    start = 0
    started = dt.datetime(2025, 11, 22, 1, 2, 3, tzinfo=dt.timezone.utc) + dt.timedelta(seconds=rng.randrange(10**5))
    for end in cuts + [len(rows)]:
        part = rows[start:end]
        cid = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        base_conn = part[0]["conn"] if part else 0
        for i, r in enumerate(part):
            r.update(capture_id=cid, frame_no=i)
            r["conn"] = r["conn"] - base_conn
        meta = {META_FORMAT: "1", META_PROTOCOL: protocol, META_CAPTURE_ID: cid,
                META_STARTED_AT: started.isoformat(timespec="microseconds").replace("+00:00", "Z"),
                META_VERSION: "0.1.0", META_SOURCE: "couchbase://127.0.0.1/b" if protocol == "dcp" else "synapse://127.0.0.1:9092",
                META_OPTIONS: json.dumps({"seed": seed})}
        out.append((meta, to_table(protocol, part, meta)))
        started += dt.timedelta(seconds=rng.randrange(1, 1000))
        start = end
    return out


def to_table(protocol: str, rows: list[dict], meta: dict | None = None) -> pa.Table:
    schema = capture_schema(protocol)
    cols = {}
    for f in schema:
        vals = [r.get(f.name) for r in rows]
        if f.name == "ts":
            cols[f.name] = pa.array(vals, pa.int64()).cast(f.type)
        elif pa.types.is_dictionary(f.type):
            cols[f.name] = pa.array(vals, pa.string()).dictionary_encode().cast(f.type)
        else:
            cols[f.name] = pa.array(vals, f.type)
    return pa.Table.from_pydict(cols, schema=capture_schema(protocol, meta))


def file_name(meta: dict, segment: int, suffix: str = ".parquet") -> str:
    started = dt.datetime.fromisoformat(meta[META_STARTED_AT].replace("Z", "+00:00"))
    return (f"{meta[META_PROTOCOL]}-{started.strftime('%Y%m%dT%H%M%S.%fZ')}-"
            f"{meta[META_CAPTURE_ID].replace('-', '')[:8]}-{segment:06d}{suffix}")


def write_captures(captures, directory: str, seed: int = 0, max_segments: int = 3,
                   in_progress_last: bool = False, truncate_bytes: int = 0,
                   row_group_size: int | None = None) -> list[str]:
    """Writes each capture as 1..max_segments segments; the very last segment of the last
    capture is an in-progress Arrow IPC stream when `in_progress_last` (cut short by
    `truncate_bytes`, as a SIGKILL leaves it). Returns the paths written."""
    rng = random.Random(seed)
    os.makedirs(directory, exist_ok=True)
    paths = []
    for ci, (meta, table) in enumerate(captures):
        nseg = rng.randrange(1, max_segments + 1)
        cuts = sorted(rng.sample(range(1, table.num_rows), min(nseg - 1, max(table.num_rows - 1, 0))))
        bounds = [0, *cuts, table.num_rows]
        for seg in range(len(bounds) - 1):
            part = table.slice(bounds[seg], bounds[seg + 1] - bounds[seg])
            m = dict(meta, **{META_SEGMENT: str(seg)})
            part = part.replace_schema_metadata(capture_schema(meta[META_PROTOCOL], m).metadata)
            last = ci == len(captures) - 1 and seg == len(bounds) - 2
            if last and in_progress_last:
                path = os.path.join(directory, file_name(meta, seg, ".arrows"))
                sink = pa.BufferOutputStream()
                with ipc.new_stream(sink, part.schema) as w:
                    for b in part.to_batches(max_chunksize=max(1, part.num_rows // 3 or 1)):
                        w.write_batch(b)
                data = sink.getvalue().to_pybytes()
                if truncate_bytes:
                    data = data[: max(0, len(data) - truncate_bytes)]
                with open(path, "wb") as fh:
                    fh.write(data)
            else:
                path = os.path.join(directory, file_name(meta, seg))
                pq.write_table(part, path, compression="zstd", row_group_size=row_group_size)
            paths.append(path)
    return paths
