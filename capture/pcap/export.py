"""A capture as IPv4/TCP packets (`dcptool export`): one TCP connection per `conn` of each
capture, client 127.0.0.1:(40000 + conn), server the `node` the connection went to (or
127.0.0.1:--port). Each connection opens with SYN / SYN-ACK / ACK at its first frame's
time, every frame or line goes in its direction stamped with the row's `ts` (consecutive rows of
one connection and direction with the same `ts`, one read on the wire, share segments of at
most `mss` bytes), every segment acknowledging what the peer sent so far,
and FIN / FIN-ACK / ACK close it at its last frame's time. Rows are read a batch at a time.

Synapse TCP lines get their newline back; a Redis capture's rows (those with a `channel`)
become RESP: `message` pushes from the server, PUBLISH commands from the client."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from dcptool.capture.pcap.fileformat import PacketWriter
from dcptool.capture.pcap.packets import ACK, FIN, PSH, SYN, tcp_packet

DEFAULT_MSS = 16384
CLIENT_IP = bytes([127, 0, 0, 1])
CLIENT_PORT_BASE = 40000
ISN_CLIENT, ISN_SERVER = 1_000_000, 2_000_000
REDIS_PORT, SYNAPSE_PORT, DCP_PORT = 6379, 9092, 11210


@dataclass
class _Conn:
    server_ip: bytes
    server_port: int
    client_port: int
    seq: dict = field(default_factory=lambda: {True: ISN_CLIENT + 1, False: ISN_SERVER + 1})
    last_ts: int = 0
    ident: int = 0


@dataclass
class ExportResult:
    path: str
    packets: int = 0
    frames: int = 0
    connections: int = 0
    bytes: int = 0
    protocol: str = ""
    servers: list = field(default_factory=list)


def _server_of(node, port_override: int | None, default_port: int) -> tuple[bytes, int]:
    host, port = "127.0.0.1", default_port
    if node:
        h, _, p = str(node).rpartition(":")
        h = h.strip("[]")
        if p.isdigit():
            port = int(p)
        try:
            ip = ipaddress.ip_address(h)
            host = str(ip) if ip.version == 4 else host
        except ValueError:
            pass    # a host name: the packets go to 127.0.0.1
    if port_override is not None:
        port = port_override
    return ipaddress.IPv4Address(host).packed, port


def _resp(*parts: bytes) -> bytes:
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


class Exporter:
    def __init__(self, writer: PacketWriter, protocol: str, mss: int, port: int | None):
        self.w = writer
        self.protocol = protocol
        self.mss = mss
        self.port = port
        self.conns: dict[tuple, _Conn] = {}
        self.frames = 0
        self.bytes = 0
        self._run: list | None = None    # rows waiting to share segments

    def _packet(self, c: _Conn, from_client: bool, ts: int, flags: int, payload: bytes = b"") -> None:
        seq = c.seq[from_client]
        ack = c.seq[not from_client] if flags & ACK else 0
        c.ident += 1
        if from_client:
            pkt = tcp_packet(CLIENT_IP, c.client_port, c.server_ip, c.server_port, seq, ack, flags, payload, c.ident)
        else:
            pkt = tcp_packet(c.server_ip, c.server_port, CLIENT_IP, c.client_port, seq, ack, flags, payload, c.ident)
        self.w.write(ts, pkt)
        c.seq[from_client] = seq + len(payload) + (1 if flags & (SYN | FIN) else 0)

    def _open(self, key, node, ts: int, default_port: int) -> _Conn:
        ip, port = _server_of(node, self.port, default_port)
        c = _Conn(ip, port, CLIENT_PORT_BASE + len(self.conns) + 1)
        c.seq = {True: ISN_CLIENT, False: ISN_SERVER}
        self.conns[key] = c
        self._packet(c, True, ts, SYN)
        self._packet(c, False, ts, SYN | ACK)
        self._packet(c, True, ts, ACK)
        return c

    def frame(self, key, node, ts: int, from_client: bool, data: bytes, default_port: int) -> None:
        """Rows of one connection and direction with the same ts arrived (or left) in one
        read: they share segments, as they did on the wire."""
        self.frames += 1
        self.bytes += len(data)
        run = self._run
        if run is not None and run[0] == key and run[2] == ts and run[3] == from_client:
            run[4].append(data)
            run[5] += len(data)
            if run[5] >= self.mss:
                self._end_run()
            return
        self._end_run()
        self._run = [key, node, ts, from_client, [data], len(data), default_port]

    def _end_run(self) -> None:
        run, self._run = self._run, None
        if run is None:
            return
        key, node, ts, from_client, parts, _, default_port = run
        c = self.conns.get(key) or self._open(key, node, ts, default_port)
        c.last_ts = ts
        data = b"".join(parts)
        for i in range(0, len(data), self.mss):
            self._packet(c, from_client, ts, PSH | ACK, data[i:i + self.mss])

    def close_all(self) -> None:
        self._end_run()
        for c in self.conns.values():
            self._packet(c, True, c.last_ts, FIN | ACK)
            self._packet(c, False, c.last_ts, FIN | ACK)
            self._packet(c, True, c.last_ts, ACK)

    def table(self, t) -> None:
        cid = t.column("capture_id").to_pylist()
        conn = t.column("conn").to_pylist()
        node = t.column("node").to_pylist()
        ts = t.column("ts").cast("int64").to_pylist()
        out = [d == "out" for d in t.column("direction").to_pylist()]
        raw = t.column("raw").to_pylist()
        chan: list[str | None] = (t.column("channel").to_pylist() if "channel" in t.column_names
                                  else [None] * len(raw))
        for i in range(len(raw)):
            data = raw[i] or b""
            channel = chan[i]
            if self.protocol == "dcp":
                port = DCP_PORT
            elif channel is None:
                data, port = data + b"\n", SYNAPSE_PORT
            else:
                ch = channel.encode()
                data = _resp(b"PUBLISH", ch, data) if out[i] else _resp(b"message", ch, data)
                port = REDIS_PORT
            self.frame((cid[i], conn[i]), node[i], ts[i] or 0, out[i], data, port)


def export_pcap(paths: list[str], output: str, *, port: int | None = None, mss: int = DEFAULT_MSS,
                kind: str | None = None) -> ExportResult:
    """Write the captures named by `paths` to `output` as pcapng (or pcap: `kind`, else the
    suffix of `output`). Raises CaptureError for paths that are not captures."""
    from dcptool.replay.store.discovery import check_output, written_whole
    from dcptool.replay.store.reader import (
        find_captures,
        iter_capture_tables,
        protocol_of,
    )
    check_output(output)      # never over a capture file, never into a capture directory
    files = find_captures(paths)
    protocol = protocol_of(files)
    kind = kind or ("pcap" if output.lower().endswith(".pcap") else "pcapng")
    cols = ["capture_id", "conn", "node", "ts", "direction", "raw"] + (["channel"] if protocol == "synapse" else [])
    with written_whole(output) as tmp:    # the inputs found and readable first; renamed in at the end
        writer = PacketWriter(tmp, kind)
        ex = Exporter(writer, protocol, mss, port)
        try:
            for t in iter_capture_tables(files, columns=cols, batch_rows=65536):
                ex.table(t)
            ex.close_all()
        finally:
            writer.close()
    servers = sorted({f"{'.'.join(map(str, c.server_ip))}:{c.server_port}" for c in ex.conns.values()})
    return ExportResult(path=output, packets=writer.packets, frames=ex.frames, connections=len(ex.conns),
                        bytes=ex.bytes, protocol=protocol, servers=servers)
