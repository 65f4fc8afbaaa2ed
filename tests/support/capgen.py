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

from dcptool.replay.store.schema import (
    FORMAT_VERSION,
    META_CAPTURE_ID,
    META_FORMAT,
    META_OPTIONS,
    META_PROTOCOL,
    META_SEGMENT,
    META_SOURCE,
    META_STARTED_AT,
    META_VERSION,
    capture_schema,
)
from dcptool.replay.store.segment import dictionary_columns

BASE_TS = 1_763_800_000_000_000_000  # 2025-11-22, ns
OPCODES = {"get_cluster_config": 0xB5, "hello": 0x1F, "open": 0x50, "control": 0x5E, "stream_req": 0x53, "stream_end": 0x55,
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
    # and its body length (bytes 8-11) says what follows, as in every real frame (verify's dcp.raw_short)
    magic = row.get("magic") or 0x80
    raw = bytearray([magic, row.get("opcode") or 0]) + rng.randbytes(rng.randrange(22, 40))
    raw[8:12] = (len(raw) - 24).to_bytes(4, "big")
    return bytes(raw)


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


class _Cluster:
    """The generated cluster: nodes, the map (revEpoch, rev, per vbucket [active, replica]),
    and the consumer's connections (one per node, opaques counted per connection)."""

    def __init__(self, rng: random.Random, run: _Run, nvb: int):
        self.rng, self.run = rng, run
        self.hosts = [f"10.0.{i}.{rng.randrange(1, 250)}" for i in range(4)]
        self.port = rng.choice([11210, 12000])
        self.live = [0, 1, 2]                   # node indexes in the cluster
        self.epoch, self.rev = rng.randrange(1, 5), rng.randrange(1, 100)
        self.map = [[i % 3, (i + 1) % 3] for i in range(nvb)]
        self.conns: dict[int, dict] = {}        # node -> {"conn", "opaque"}
        self.truth: dict[tuple[int, int], list] = {}
        self.carriers: list[tuple[dict, tuple[int, int], str]] = []   # (row, config key, via)
        self._note()

    def addr(self, i: int) -> str:
        return f"{self.hosts[i]}:{self.port}"

    def _note(self):
        self.truth[(self.epoch, self.rev)] = [
            (self.addr(a) if a >= 0 else None, [self.addr(r) for r in rs if r >= 0])
            for a, *rs in self.map]

    def config_json(self, answering: int) -> bytes:
        from dcptool.protocol.dcp.wire.cluster_config import ClusterConfig, Node
        nodes = tuple(Node(self.hosts[i], self.port) for i in range(len(self.hosts)))
        cfg = ClusterConfig(rev=self.rev, rev_epoch=self.epoch, name="b", uuid="u", nodes=nodes,
                            vbucket_map=tuple(tuple(r) for r in self.map), num_replicas=1)
        return cfg.render(this_node=answering)   # the answering node as $HOST

    def new_map(self, map_, epoch_bump=False):
        self.map = map_
        self.rev += 1
        if epoch_bump:
            self.epoch += 1
        self._note()

    def connect(self, i: int):
        self.run.conn += 1
        self.conns[i] = {"conn": self.run.conn, "opaque": 100}
        for op in ("hello", "open", "control"):
            self.resp(i, self.req(i, op, 0))
        if self.rng.random() < 0.6:
            self.config_reply(i, self.req(i, "get_cluster_config", 0))

    def add(self, i: int, direction: str, **cols) -> dict:
        self.run.conn = self.conns[i]["conn"]
        return self.run.add(direction, node=self.addr(i), **cols)

    def req(self, i: int, op: str, vb: int, **kw) -> dict:
        c = self.conns[i]
        c["opaque"] += 1
        return self.add(i, "out", magic=0x80, opcode=OPCODES[op], op=op, vbucket=vb, opaque=c["opaque"], **kw)

    def resp(self, i: int, r: dict, status=0, raw_value: bytes | None = None, **kw) -> dict:
        row = self.add(i, "in", magic=0x81, opcode=r["opcode"], op=r["op"], vbucket=r["vbucket"],
                       opaque=r["opaque"], status=status, **kw)
        if raw_value is not None:
            from dcptool.protocol.dcp.wire.frames import encode_frame
            row["raw"] = encode_frame(0x81, r["opcode"], vbucket_or_status=status, opaque=r["opaque"],
                                      datatype=0x01, value=raw_value)
            row["value_len"] = len(raw_value)
            row["datatype"] = 0x01
        return row

    def config_reply(self, i: int, r: dict):
        row = self.resp(i, r, raw_value=self.config_json(i))
        self.carriers.append((row, (self.epoch, self.rev), "get_cluster_config"))

    def notify(self, i: int):
        from dcptool.protocol.dcp.wire.frames import encode_frame
        value = self.config_json(i)
        extras = self.epoch.to_bytes(8, "big") + self.rev.to_bytes(8, "big")
        raw = encode_frame(0x82, 0x01, extras=extras, key=b"b", value=value, datatype=0x01)
        row = self.add(i, "in", magic=0x82, opcode=0x01, op="unknown_0x01", opaque=0, key=b"b",
                       value_len=len(value), datatype=0x01, raw=raw)
        self.carriers.append((row, (self.epoch, self.rev), "clustermap_notification"))


def _cluster_run(rng: random.Random, n_events: int) -> tuple[list[dict], _Cluster]:
    """A consumer streaming every vbucket from its active node while the map changes:
    rebalance moves (stream end "state changed", NOT_MY_VBUCKET with the config, reopen on
    the new owner without rollback), failovers (the node goes silent, its replicas are
    promoted a few mutations behind: ROLLBACK, then reopen), config polls, notifications,
    a node added, reconnects."""
    run = _Run(rng)
    nvb = rng.choice([4, 8, 16])
    cl = _Cluster(rng, run, nvb)
    keys = [f"doc-{i}".encode() for i in range(rng.choice([5, 20]))]
    seqno = [0] * nvb
    logs = [[(rng.getrandbits(64), 0)] for _ in range(nvb)]
    streams: dict[int, dict] = {}       # vb -> {"node", "opaque", "left"}
    replica_lag = [0] * nvb             # mutations the replica has not got yet

    def open_stream(vb: int, start: int | None = None):
        a = cl.map[vb][0]
        if a not in cl.conns:
            cl.connect(a)
        mine = seqno[vb] if start is None else start
        r = cl.req(a, "stream_req", vb, req_flags=0, req_start_seqno=mine, req_end_seqno=2**64 - 1,
                   req_vbucket_uuid=logs[vb][0][0], req_snap_start=mine, req_snap_end=mine)
        if mine > seqno[vb]:  # the new owner has less: roll back to its branch point
            cl.resp(a, r, status=0x23, rollback_seqno=seqno[vb])
            r = cl.req(a, "stream_req", vb, req_flags=0, req_start_seqno=seqno[vb], req_end_seqno=2**64 - 1,
                       req_vbucket_uuid=logs[vb][0][0], req_snap_start=seqno[vb], req_snap_end=seqno[vb])
        cl.resp(a, r, failover_log=[{"vbucket_uuid": u, "seqno": s} for u, s in logs[vb]])
        streams[vb] = {"node": a, "opaque": r["opaque"], "left": 0}

    def item(vb: int, st: dict):
        op = rng.choices(["mutation", "deletion", "expiration"], [6, 2, 1])[0]
        seqno[vb] += 1
        replica_lag[vb] = min(replica_lag[vb] + 1, rng.randrange(0, 4))
        cols = dict(magic=0x80, opcode=OPCODES[op], op=op, vbucket=vb, opaque=st["opaque"],
                    cas=rng.getrandbits(64), datatype=1, collection_id=None, key=rng.choice(keys),
                    by_seqno=seqno[vb], rev_seqno=rng.randrange(1, 50))
        if op == "mutation":
            cols.update(value_len=rng.randrange(1, 100), item_flags=0, expiration=0, lock_time=0)
        else:
            cols.update(value_len=0, delete_time=rng.getrandbits(32))
        cl.add(st["node"], "in", **cols)

    seed_node = rng.choice(cl.live)
    cl.connect(seed_node)
    cl.config_reply(seed_node, cl.req(seed_node, "get_cluster_config", 0))
    for vb in range(nvb):
        open_stream(vb)
    for _ in range(n_events):
        x = rng.random()
        if x < 0.04 and len(cl.live) > 2:
            # rebalance: one vbucket moves to another node (takeover)
            vb = rng.choice([v for v in range(nvb) if v in streams])
            old = cl.map[vb][0]
            new = rng.choice([i for i in cl.live if i != old])
            m = [list(r) for r in cl.map]
            m[vb] = [new, old]
            cl.new_map(m)
            cl.add(old, "in", magic=0x80, opcode=OPCODES["stream_end"], op="stream_end", vbucket=vb,
                   opaque=streams.pop(vb)["opaque"], stream_end_reason=2)
            logs[vb].insert(0, (rng.getrandbits(64), seqno[vb]))   # turned active: a new entry
            if rng.random() < 0.5:
                # asked the old owner again first: NOT_MY_VBUCKET with the new config
                r = cl.req(old, "stream_req", vb, req_flags=0, req_start_seqno=seqno[vb],
                           req_end_seqno=2**64 - 1, req_vbucket_uuid=logs[vb][1][0])
                row = cl.resp(old, r, status=0x07, raw_value=cl.config_json(old))
                cl.carriers.append((row, (cl.epoch, cl.rev), "not_my_vbucket"))
            elif rng.random() < 0.5:
                cl.notify(old)
            open_stream(vb)
            continue
        if x < 0.06 and len(cl.live) > 2:
            # failover: a node goes silent; replicas are promoted, a few mutations behind
            dead = rng.choice(cl.live)
            cl.live.remove(dead)
            cl.conns.pop(dead, None)
            m = [list(r) for r in cl.map]
            moved = [vb for vb in range(nvb) if m[vb][0] == dead]
            for vb in range(nvb):
                if m[vb][0] == dead:
                    m[vb] = [m[vb][1] if m[vb][1] in cl.live else rng.choice(cl.live), -1]
                elif m[vb][1] == dead:
                    m[vb][1] = -1
            cl.new_map(m, epoch_bump=rng.random() < 0.3)
            ours = {vb: seqno[vb] for vb in moved}
            for vb in moved:
                streams.pop(vb, None)
                seqno[vb] -= replica_lag[vb]
                replica_lag[vb] = 0
                logs[vb].insert(0, (rng.getrandbits(64), seqno[vb]))
            survivor = rng.choice(cl.live)
            if survivor not in cl.conns:
                cl.connect(survivor)
            cl.config_reply(survivor, cl.req(survivor, "get_cluster_config", 0))
            for vb in moved:
                open_stream(vb, start=ours[vb])
            continue
        if x < 0.07 and len(cl.live) < len(cl.hosts):
            # a node is added (no vbuckets yet): a new config, polled
            cl.live.append(next(i for i in range(len(cl.hosts)) if i not in cl.live and i not in cl.conns))
            cl.new_map([list(r) for r in cl.map])
            i = rng.choice(sorted(cl.conns))
            cl.config_reply(i, cl.req(i, "get_cluster_config", 0))
            continue
        if x < 0.10:
            # a poll that finds the same revision (counted once in `topology`)
            i = rng.choice(sorted(cl.conns))
            cl.config_reply(i, cl.req(i, "get_cluster_config", 0))
            continue
        if x < 0.12:
            # a dropped connection: reconnect to the same node, reopen its streams
            i = rng.choice(sorted(cl.conns))
            cl.connect(i)
            for vb in [v for v, st in streams.items() if st["node"] == i]:
                open_stream(vb)
            continue
        if x < 0.14:
            i = rng.choice(sorted(cl.conns))
            cl.add(i, "in", magic=0x80, opcode=OPCODES["noop"], op="noop", opaque=1)
            cl.add(i, "out", magic=0x81, opcode=OPCODES["noop"], op="noop", opaque=1, status=0)
            continue
        if not streams:
            continue
        vb = rng.choice(sorted(streams))
        st = streams[vb]
        if st["left"] <= 0:
            n = rng.randrange(1, 5)
            cl.add(st["node"], "in", magic=0x80, opcode=OPCODES["snapshot_marker"], op="snapshot_marker",
                   vbucket=vb, opaque=st["opaque"], snap_version="2.0", snap_start=seqno[vb] + 1,
                   snap_end=seqno[vb] + n, snap_flags=0x01, max_visible_seqno=seqno[vb] + n,
                   high_completed_seqno=seqno[vb])
            st["left"] = n
            continue
        item(vb, st)
        st["left"] -= 1
    for r in run.rows:
        r.setdefault("raw", _raw(rng, r))
    return run.rows, cl


def generate(protocol: str, seed: int, n_events: int = 200, max_captures: int = 3) -> list[tuple[dict, pa.Table]]:
    """A run cut into 1..max_captures captures: [(metadata, table)] in capture order."""
    rng = random.Random(seed)
    rows = _dcp_run(rng, n_events) if protocol == "dcp" else _synapse_run(rng, n_events)
    return _cut(protocol, rng, rows, seed, max_captures)


def generate_cluster(seed: int, n_events: int = 300, max_captures: int = 3):
    """A DCP run against a generated multi-node cluster (`_cluster_run`), cut into captures
    like `generate`. Returns (captures, truth): truth["maps"] maps each config's
    (rev_epoch, rev) to its vbucket map [(active "host:port" or None, [replicas])];
    truth["first"] maps each config a frame carried to the first such frame:
    (capture_id, frame_no, node, via)."""
    rng = random.Random(seed)
    rows, cl = _cluster_run(rng, n_events)
    captures = _cut("dcp", rng, rows, seed, max_captures)
    first: dict[tuple[int, int], tuple] = {}
    for row, key, via in cl.carriers:     # in frame order; _cut numbered the rows in place
        first.setdefault(key, (row["capture_id"], row["frame_no"], row["node"], via))
    return captures, {"maps": cl.truth, "first": first}


def as_version_1(captures: list[tuple[dict, pa.Table]]) -> list[tuple[dict, pa.Table]]:
    """The same captures as format version 1 wrote them: no `node` column."""
    out = []
    for meta, table in captures:
        m = dict(meta, **{META_FORMAT: "1"})
        out.append((m, table.drop_columns(["node"])))   # write_captures writes the metadata of m
    return out


def _cut(protocol: str, rng: random.Random, rows: list[dict], seed: int, max_captures: int):
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
        meta = {META_FORMAT: FORMAT_VERSION, META_PROTOCOL: protocol, META_CAPTURE_ID: cid,
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
                   row_group_size: int | None = None, dictionary=None) -> list[str]:
    """Writes each capture as 1..max_segments segments; the very last segment of the last
    capture is an in-progress Arrow IPC stream when `in_progress_last` (cut short by
    `truncate_bytes`, as a SIGKILL leaves it). Parquet segments use the capture writer's
    dictionary columns, or pyarrow's `use_dictionary=dictionary` when given (True: every
    column, as other writers do). Returns the paths written."""
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
                enc = dictionary_columns(part.schema) if dictionary is None else dictionary
                pq.write_table(part, path, compression="zstd", row_group_size=row_group_size, use_dictionary=enc)
            paths.append(path)
    return paths


SYNC_OPCODES = {"prepare": 0x68, "commit": 0x6A, "abort": 0x6B, "system_event": 0x5F}


def with_sync_and_drop(captures: list[tuple[dict, pa.Table]], seed: int) -> list[tuple[dict, pa.Table]]:
    """`captures` (generate's DCP output) with durable writes and a collection drop appended to
    each capture, on a vbucket it streams and above its seqnos: a prepare and its commit, a
    prepare and its abort, a commit whose prepare is not in the capture, then the drop of
    collection 8 (system event 1). Seeded; the rules of REPLAY.md all get some work."""
    rng = random.Random(seed)
    out = []
    for meta, table in captures:
        ts = table.schema.get_field_index("ts")
        rows = table.set_column(ts, "ts", table.column("ts").cast(pa.int64())).to_pylist()
        items = [r for r in rows if r["direction"] == "in" and r.get("by_seqno") is not None and r["vbucket"] is not None]
        if not items:
            out.append((meta, table))
            continue
        vb = rng.choice(items)["vbucket"]
        seqno = max(r["by_seqno"] for r in items if r["vbucket"] == vb)
        last = rows[-1]
        keys = [r["key"] for r in items if r["vbucket"] == vb] + [b"doc-sync"]
        cid = rng.choice([0, 8]) if any(r.get("collection_id") is not None for r in items) else None
        extra = [("prepare", keys[0]), ("commit", keys[0]), ("prepare", keys[-1]), ("abort", keys[-1]),
                 ("commit", b"doc-lone"), ("system_event", None)]
        for i, (op, key) in enumerate(extra):
            seqno += 1
            row = {"capture_id": last["capture_id"], "frame_no": last["frame_no"] + 1 + i, "conn": last["conn"],
                   "ts": last["ts"] + 1000 * (i + 1),
                   "direction": "in", "magic": 0x80, "opcode": SYNC_OPCODES[op], "op": op, "vbucket": vb,
                   "by_seqno": seqno}
            if op == "system_event":
                row.update(system_event_id=1, collection_id=8 if cid is not None else None)
            else:
                row.update(key=key, collection_id=cid, rev_seqno=rng.randrange(1, 50), cas=rng.getrandbits(64),
                           datatype=1, value_len=rng.randrange(0, 300) if op != "abort" else 0,
                           item_flags=rng.getrandbits(32) if op == "prepare" else None,
                           expiration=0 if op == "prepare" else None)
            rows.append(row)
        out.append((meta, to_table("dcp", rows, meta)))
    return out
