"""Frames and lines of imported connections -> Arrow batches for the capture writer.

Every frame gets its `frame_no` when it is complete (in packet order across all
connections of the protocol). Pieces are collected until `FLUSH_BYTES` are held, then
built per (connection, direction) in one decode each, put back in frame order and written.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

FLUSH_BYTES = 16 * 2**20
FEATURE_COLLECTIONS = 0x12


class _Conn:
    def __init__(self, no: int, node: str):
        self.no, self.node = no, node
        self.collections = False
        self.opaque_vb: dict[int, int] = {}


class Sink:
    """Shared by both protocols: frame numbering, fragments, flushing."""

    protocol = ""

    def __init__(self, make_writer):
        self.make_writer = make_writer
        self.writer = None
        self.frame_no = 0
        self.pieces: list = []
        self.held = 0
        self.conns: dict[int, _Conn] = {}
        self.fragments = 0
        self.rows = 0
        self.written = 0

    def _build(self, pieces: list) -> list:
        """The held pieces as tables (each protocol's sink builds its own rows)."""
        raise NotImplementedError

    def conn(self, node: str) -> _Conn:
        c = _Conn(len(self.conns) + 1, node)
        self.conns[c.no] = c
        return c

    auto_flush = True

    def _add(self, piece, nbytes: int, n: int) -> None:
        self.pieces.append(piece)
        self.frame_no += n
        self.rows += n
        self.held += nbytes
        if self.auto_flush and self.held >= FLUSH_BYTES:
            self.flush()

    def fragment(self, conn: _Conn, out: bool, raw: bytes, ts: int, why: str, pkt: int = 0, where: int = 0) -> None:
        """A flagged row of bytes that are no whole frame. DCP orders it by (packet, where)."""
        self.fragments += 1
        order = self.frame_no if self.auto_flush else pkt * 4 + where
        self._add(("err", conn, out, raw, order, ts, why), len(raw), 1)

    def _take(self) -> tuple[pa.Table, bool] | None:
        """The rows held, as one table (the writer opened at the first), and whether it was
        built from several pieces; None when nothing is held."""
        if not self.pieces:
            return None
        if self.writer is None:
            self.writer = self.make_writer(self.protocol)
        pieces, self.pieces, self.held = self.pieces, [], 0
        tables = self._build(pieces)
        return (pa.concat_tables(tables) if len(tables) > 1 else tables[0]), len(tables) > 1

    def flush(self) -> None:
        taken = self._take()
        if taken is None:
            return
        t, several = taken
        if several:
            t = t.take(pa.array(np.argsort(t.column("frame_no").to_numpy(), kind="stable")))
        self.writer.write(t)

    def close(self):
        self.flush()
        return self.writer.close() if self.writer is not None else []


def _groups(pieces, kinds):
    """Pieces grouped by (conn, direction, kind, flag), in order within each group."""
    groups: dict = {}
    for p in pieces:
        if p[0] in kinds:
            groups.setdefault((p[1].no, p[2], p[0], p[-1] if p[0] == "dcp" else None), []).append(p)
    return groups


class DcpSink(Sink):
    """Frames arrive per direction in bulk (flows.DcpFramer), each with the number of the
    packet that completed it; the importer flushes (after every framer cut what it held),
    and the flush orders the rows by packet and numbers them."""

    protocol = "dcp"
    auto_flush = False

    def frames(self, conn: _Conn, out: bool, buf: bytes, offsets, lengths, ts, pkt) -> None:
        n = len(offsets)
        if not out:
            self._hello(conn, buf, offsets)
        self._add(("dcp", conn, out, buf, offsets, lengths, pkt * 4 + 1, ts, conn.collections), len(buf), n)

    def flush(self) -> None:
        """The rows held, in packet order, numbered and written: whole runs of one group
        are written as zero-copy slices of their decoded batch (no reordering copy)."""
        if not self.pieces:
            return
        if self.writer is None:
            self.writer = self.make_writer(self.protocol)
        pieces, self.pieces, self.held = self.pieces, [], 0
        for b in in_order(self._build(pieces)):
            n = b.num_rows
            b = b.set_column(b.schema.get_field_index("frame_no"), "frame_no",
                             pa.array(np.arange(self.written, self.written + n, dtype=np.int64)))
            self.written += n
            self.writer.write(b)

    @staticmethod
    def _hello(conn: _Conn, buf: bytes, offsets) -> None:
        u8 = np.frombuffer(buf, np.uint8)
        hits = np.flatnonzero((u8[offsets] == 0x81) & (u8[offsets + 1] == 0x1F))
        for i in hits.tolist():
            o = int(offsets[i])
            keylen = int.from_bytes(buf[o + 2:o + 4], "big")
            extlen, status = buf[o + 4], int.from_bytes(buf[o + 6:o + 8], "big")
            body = int.from_bytes(buf[o + 8:o + 12], "big")
            value = buf[o + 24 + extlen + keylen:o + 24 + body]
            if status == 0:
                feats = {int.from_bytes(value[j:j + 2], "big") for j in range(0, len(value) - 1, 2)}
                conn.collections = FEATURE_COLLECTIONS in feats

    def _build(self, pieces) -> list:
        from dcptool.replay.store.dcp_batch import SCHEMA, to_record_batch
        out = []
        groups = _groups(pieces, ("dcp",))
        for key in sorted(groups, key=lambda k: (k[0], not k[1])):   # a connection's requests first
            group = groups[key]
            conn, is_out, collections = group[0][1], group[0][2], group[0][-1]
            bufs, offs, lens, fnos, tss = [], [], [], [], []
            base = 0
            for _, _, _, buf, o, ln, order, ts, _ in group:
                bufs.append(buf)
                offs.append(o + base)
                lens.append(ln)
                fnos.append(order)
                tss.append(ts)
                base += len(buf)
            buf = bufs[0] if len(bufs) == 1 else b"".join(bufs)   # one piece (the usual): no copy
            o, ln = np.concatenate(offs), np.concatenate(lens)
            from dcptool.protocol.dcp.wire import columnar
            b = columnar.decode_batch(buf, o, ln, collections=collections, opaque_vbuckets=conn.opaque_vb)
            ts = np.concatenate(tss)
            out.append(to_record_batch(
                b, frame_no=np.concatenate(fnos), conn=conn.no, ts_ns=ts, mono_ns=ts,
                direction=np.full(len(o), 1 if is_out else 0, dtype=np.uint8), node=conn.node))
        errs = [p for p in pieces if p[0] == "err"]
        if errs:
            out.append(_fragments(SCHEMA, errs).combine_chunks().to_batches()[0])
        return out


MAX_RUNS = 64     # a flush cut into more runs than this (and 1 per 256 rows) is reordered by one take


def in_order(batches: list) -> list:
    """The rows of batches (each sorted by frame_no, the order key) merged in frame_no
    order, ties in list order, as record batches: slices of the inputs where whole runs
    keep their place, one reordered copy when the rows interleave finely."""
    keys = [b.column("frame_no").to_numpy() for b in batches]
    if len(batches) == 1 and (len(keys[0]) < 2 or not (np.diff(keys[0]) < 0).any()):
        return batches
    allk = np.concatenate(keys)
    perm = np.argsort(allk, kind="stable")
    which = np.repeat(np.arange(len(batches)), [len(k) for k in keys])[perm]
    starts = np.flatnonzero((np.diff(perm) != 1) | (np.diff(which) != 0)) + 1
    if len(starts) > max(MAX_RUNS, len(perm) // 256):
        t = pa.Table.from_batches(batches)
        return t.take(pa.array(perm)).combine_chunks().to_batches()
    base = np.concatenate([[0], np.cumsum([len(k) for k in keys])])
    bounds = np.concatenate([[0], starts, [len(perm)]])
    out = []
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        i = int(which[lo])
        out.append(batches[i].slice(int(perm[lo] - base[i]), hi - lo))
    return out


def _fragments(schema: pa.Schema, errs) -> pa.Table:
    n = len(errs)
    ts = pa.array([p[5] for p in errs], pa.int64())
    given = {
        "frame_no": pa.array([p[4] for p in errs], pa.int64()),
        "conn": pa.array([p[1].no for p in errs], pa.int32()),
        "node": pa.array([p[1].node for p in errs], pa.string()).dictionary_encode(),
        "ts": ts.cast(pa.timestamp("ns", tz="UTC")),
        "mono_ns": ts,
        "direction": pa.array(["out" if p[2] else "in" for p in errs], pa.string()).dictionary_encode(),
        "raw": pa.array([p[3] for p in errs], pa.binary()),
        "decode_error": pa.array([p[6] for p in errs], pa.string()),
    }
    arrays = [given[f.name].cast(f.type) if f.name in given else pa.nulls(n, f.type) for f in schema]
    return pa.Table.from_arrays(arrays, schema=schema)


class SynapseSink(Sink):
    protocol = "synapse"

    def lines(self, conn: _Conn, out: bool, lines: list, ts: int, channel: str | None = None) -> None:
        self._add(("syn", conn, out, lines, self.frame_no, ts, channel), sum(map(len, lines)), len(lines))

    def _build(self, pieces) -> list:
        from dcptool.replay.store.synapse_batch import build_batch
        out = []
        for p in pieces:
            if p[0] == "syn":
                _, conn, is_out, lines, fno, ts, channel = p
                rb = build_batch(lines, frame_no=fno, conn=conn.no, ts_ns=ts, mono_ns=ts,
                                 direction="out" if is_out else "in", channel=channel, node=conn.node)
            else:
                _, conn, is_out, raw, fno, ts, why = p
                rb = build_batch([raw], frame_no=fno, conn=conn.no, ts_ns=ts, mono_ns=ts,
                                 direction="out" if is_out else "in", errors={0: why}, node=conn.node)
            out.append(pa.Table.from_batches([rb]))
        return [pa.concat_tables(out, promote_options="permissive")] if out else []
