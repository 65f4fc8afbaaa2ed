"""A tcpdump file -> captures (`dcptool import`): the packets are streamed from the file
(fileformat.py), each TCP connection reassembled in both directions (tcp.py), its protocol
found (flows.py) and its frames or lines written through the capture writer in the format
of a live capture (sinks.py): packet times as `ts`, one `conn` per TCP connection, `node`
the server's address, and `dcptool.imported_from` metadata naming the file.

DCP goes to the output directory; when the file also holds Synapse connections they go to
DIR/synapse (and the other way round), since a directory holds captures of one protocol."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field

import dcptool.capture.pcap.flows as flows
import dcptool.capture.pcap.tcp as tcp
from dcptool.capture.pcap.fileformat import PacketBatch, Truncated, read_batches
from dcptool.capture.pcap.packets import ACK, FIN, RST, SYN, addr, parse, parse_batch
from dcptool.capture.pcap.pcap_errors import UndecodablePcap
from dcptool.capture.pcap.sinks import FLUSH_BYTES, DcpSink, SynapseSink

META_IMPORTED_FROM = "dcptool.imported_from"
KNOWN_PORTS = flows.DCP_PORTS | flows.TLS_PORTS | flows.REDIS_PORTS


@dataclass
class ImportResult:
    path: str
    format: str = ""
    packets: int = 0
    tcp_packets: int = 0
    connections: dict = field(default_factory=dict)   # protocol -> count
    rows: dict = field(default_factory=dict)          # protocol -> rows written
    outputs: dict = field(default_factory=dict)       # protocol -> directory
    files: list = field(default_factory=list)
    gaps: int = 0
    lost_bytes: int = 0
    retransmitted: int = 0
    midstream: int = 0
    fragments: int = 0
    truncated: bool = False


def _writer_class():
    from dcptool.replay.store.writer import CaptureWriter

    class ImportWriter(CaptureWriter):
        """The capture writer with the import's metadata key on every segment."""

        def __init__(self, *a, imported_from: str, **kw):
            super().__init__(*a, **kw)
            self.imported_from = imported_from

        def _segment_metadata(self, segment: int) -> dict[str, str]:
            md = super()._segment_metadata(segment)
            md[META_IMPORTED_FROM] = self.imported_from
            return md
    return ImportWriter


class _Flow:
    def __init__(self, client: str, server: str, pool: tcp.Pool):
        self.client, self.server = client, server
        self.dirs = {True: tcp.Direction(pool=pool), False: tcp.Direction(pool=pool)}
        self.proto: str | None = None
        self.framers: dict = {}
        self.fins: set[bool] = set()     # the directions (from the client?) that sent a FIN
        self.last_ts = 0


def _port(addr: str) -> int:
    return int(addr.rpartition(":")[2])


class Importer:
    def __init__(self, path: str, output: str, dcp_ports, note, compression: str = "zstd",
                 pending_limit: int = tcp.POOL_LIMIT):
        self.path, self.output, self.note, self.compression = path, output, note, compression
        self.pool = tcp.Pool(pending_limit)
        self.dcp_ports = frozenset(dcp_ports)
        self.flows: dict[tuple[str, str], _Flow] = {}
        self.res = ImportResult(path=path)
        self.info = {"file": os.path.basename(path), "format": ""}
        self.sinks = {"dcp": DcpSink(self._make_writer), "synapse": SynapseSink(self._make_writer)}
        self.skipped: dict[str, int] = {}
        self.pkt = 0           # packet number: frames are ordered by the packet that completed them
        self.since_flush = 0

    def _make_writer(self, protocol: str):
        out = self.output if not self.res.outputs else os.path.join(self.output, protocol)
        self.res.outputs[protocol] = out
        meta = json.dumps(self.info, sort_keys=True, separators=(",", ":"))
        return _writer_class()(out, protocol, source=f"pcap:{os.path.basename(self.path)}",
                               options={"imported_from": self.info}, imported_from=meta,
                               compression=self.compression)

    # -- flows
    def _flow_for(self, src: str, dst: str, flags: int) -> _Flow:
        f = self.flows.get((src, dst))
        if f is not None and not (flags & SYN and not flags & ACK and f.dirs[True].next is not None):
            return f
        if f is not None:
            self._close(f, "the connection was reused")
        if flags & SYN:
            client, server = (src, dst) if not flags & ACK else (dst, src)
        elif _port(dst) in KNOWN_PORTS | self.dcp_ports or (
                _port(src) not in KNOWN_PORTS | self.dcp_ports and _port(dst) < _port(src)):
            client, server = src, dst
        else:
            client, server = dst, src
        f = _Flow(client, server, self.pool)
        self.flows[(client, server)] = self.flows[(server, client)] = f
        return f

    def batch(self, b: PacketBatch) -> None:
        """A batch of packets: IPv4/TCP headers read for all of them at once (parse_batch),
        the others one at a time (parse); then each segment in file order."""
        buf, segment = b.buf, self.segment
        got = parse_batch(b.linktype, buf, b.starts, b.ends)
        starts, ends = b.starts.tolist(), b.ends.tolist()
        if got is None:
            bulk, cols = [False] * len(starts), [starts] * 9
        else:
            bulk, cols = got
        for ts, fast, s, e, src, sport, dst, dport, seq, ack, flags, ps, pe in zip(b.ts, bulk, starts, ends, *cols):
            if fast:
                segment(ts, addr(src, sport), addr(dst, dport), seq, ack, flags, buf[ps:pe], e - s)
                continue
            seg = parse(b.linktype, buf[s:e])
            if seg is not None:
                segment(ts, seg.src, seg.dst, seg.seq, seg.ack, seg.flags, seg.payload, e - s)

    def segment(self, ts: int, src: str, dst: str, seq: int, ack: int, flags: int, payload, size: int) -> None:
        """One TCP segment of `size` captured bytes, in capture order."""
        self.pkt += 1
        self.since_flush += size
        if self.since_flush >= FLUSH_BYTES:
            self.flush()
        self.res.tcp_packets += 1
        f = self._flow_for(src, dst, flags)
        f.last_ts = ts
        from_client = src == f.client
        d, peer = f.dirs[from_client], f.dirs[not from_client]
        if flags & SYN:
            d.syn(seq)
            seq += 1
        if flags & ACK and not peer.is_acked(ack):
            items: list = []
            peer.acked(ack, items)
            self._deliver(f, not from_client, items, ts)
        if f.proto is not None and payload and d.in_order(seq, len(payload)):
            framer = f.framers.get(from_client)      # the stream as it comes: straight to the framer
            if framer is not None:
                framer.data(payload, ts, self.pkt)
        else:
            items = []
            d.segment(seq, payload, items)
            self._deliver(f, from_client, items, ts)
            if self.pool.bytes > self.pool.limit:
                self._shed(ts)
        if flags & FIN:
            d.fin(seq, len(payload))
            f.fins.add(from_client)
        if flags & RST or len(f.fins) == 2:
            self._close(f, "the connection closed")

    def _deliver(self, f: _Flow, from_client: bool, items: list, ts: int) -> None:
        if not items:
            return
        if f.proto is None:
            first = next((x[1] for x in items if x[0] == tcp.DATA), None)
            if first is None:
                return
            self._start(f, bytes(first))
        framer = f.framers.get(from_client)
        if framer is None:
            return
        for kind, x in items:
            if kind == tcp.DATA:
                framer.data(x, ts, self.pkt)
            else:
                framer.gap(x, ts, self.pkt)

    def _shed(self, ts: int) -> None:
        """Too many bytes wait behind holes: the directions holding most give their first
        hole up as lost (flagged like any other) until the pool is under its limit."""
        dirs = [(f, c) for f in {id(f): f for f in self.flows.values()}.values() for c in (True, False)]
        while self.pool.bytes > self.pool.limit:
            f, from_client = max(dirs, key=lambda fc: fc[0].dirs[fc[1]].pending_bytes)
            if not f.dirs[from_client].pending:
                return
            items: list = []
            f.dirs[from_client].skip_hole(items)
            self._deliver(f, from_client, items, ts)

    def _start(self, f: _Flow, first: bytes) -> None:
        f.proto = flows.detect(_port(f.server), first, self.dcp_ports)
        if f.proto in ("dcp", "synapse", "redis"):
            sink = self.sinks["synapse" if f.proto == "redis" else f.proto]
            conn = sink.conn(f.server)
            midstream = not (f.dirs[True].saw_syn or f.dirs[False].saw_syn)
            self.res.midstream += midstream
            make = {"dcp": flows.DcpFramer, "synapse": flows.LineFramer, "redis": flows.RespFramer}[f.proto]
            f.framers = {True: make(sink, conn, True, midstream), False: make(sink, conn, False, midstream)}
            self.res.connections[sink.protocol] = self.res.connections.get(sink.protocol, 0) + 1
            if midstream:
                self.note(f"warning: {f.client} -> {f.server} ({f.proto}) began before the capture; "
                          "decoded from the first whole frame, the bytes before it flagged")
            return
        self.skipped[f.proto] = self.skipped.get(f.proto, 0) + 1
        what = {"tls": "a TLS connection (encrypted)", "other": "a connection of an unknown protocol"}[f.proto]
        self.note(f"skipped {what}: {f.client} -> {f.server}")

    def _close(self, f: _Flow, why: str) -> None:
        for from_client in (True, False):
            d = f.dirs[from_client]
            items: list = []
            d.finish(items)
            self._deliver(f, from_client, items, f.last_ts)
            if from_client in f.framers:
                f.framers[from_client].end(f.last_ts, why)
            self.res.gaps += d.gaps
            self.res.lost_bytes += d.lost_bytes
            self.res.retransmitted += d.retransmitted
        for key in ((f.client, f.server), (f.server, f.client)):
            if self.flows.get(key) is f:
                del self.flows[key]

    def flush(self) -> None:
        """Every open connection cuts what it holds into frames (the server's side first:
        a HELLO reply read there sets how the client's frames decode), then the rows are
        written."""
        self.since_flush = 0
        for f in {id(f): f for f in self.flows.values()}.values():
            for from_client in (False, True):
                if from_client in f.framers:
                    f.framers[from_client].scan()
        for sink in self.sinks.values():
            sink.flush()

    def run(self) -> ImportResult:
        state = Truncated()
        for b in read_batches(self.path, state):
            if not self.info["format"]:
                self.info["format"] = state.format
            self.batch(b)
        self.res.format, self.res.packets, self.res.truncated = state.format, state.packets, state.truncated
        for f in list({id(f): f for f in self.flows.values()}.values()):
            self._close(f, "the capture ended")
        for sink in self.sinks.values():
            self.res.files += sink.close()
            self.res.fragments += sink.fragments
            if sink.rows:
                self.res.rows[sink.protocol] = sink.rows
        return self.res


def import_pcap(path: str, output: str, *, ports=(), note=None, compression: str = "zstd") -> ImportResult:
    """Import the packet file at `path` into captures under `output`. `ports`: more server
    ports that carry memcached/DCP. `note(text)` hears one line per skipped or mid-stream
    connection. Raises OutputIsCapture (`output` is a capture directory already), NotAPacketFile
    (not pcap/pcapng) or UndecodablePcap (nothing in it could be decoded).

    The capture is written into a hidden directory beside `output` and moved into `output`
    only when the import succeeded: a failed import leaves nothing in `output`."""
    from dcptool.replay.store.discovery import check_output, temporary_name
    check_output(output, directory=True)
    work = temporary_name(output, "importing")
    os.makedirs(work)
    try:
        imp = Importer(path, work, flows.DCP_PORTS | set(ports), note or (lambda text: None), compression)
        res = imp.run()
        if not res.rows:
            skipped = ", ".join(f"{n} {k}" for k, n in sorted(imp.skipped.items()))
            raise UndecodablePcap(
                f"{path}: nothing to import: {res.packets} packets, {res.tcp_packets} TCP"
                + (f", connections skipped: {skipped}" if skipped else ", no DCP, Synapse or Redis connection")
                + (" (the file is cut short)" if res.truncated else ""))
        _move_into(work, output)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res.outputs = {k: output + v[len(work):] for k, v in res.outputs.items()}
    res.files = [dict(f, path=output + f["path"][len(work):]) if isinstance(f, dict) else f for f in res.files]
    return res


def _move_into(work: str, output: str) -> None:
    """The files of the finished import (and its `synapse/` beside DCP) into `output`: the
    directory renamed when `output` does not exist yet, else file by file (the names are new:
    each carries its capture's random id)."""
    if not os.path.exists(output):
        os.rename(work, output)
        return
    for name in sorted(os.listdir(work)):
        src, dest = os.path.join(work, name), os.path.join(output, name)
        if os.path.isdir(src):
            os.makedirs(dest, exist_ok=True)
            _move_into(src, dest)
        else:
            os.rename(src, dest)
