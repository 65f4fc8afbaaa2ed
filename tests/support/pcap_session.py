"""Real packet captures for the pcap tests: Debian's tcpdump on `lo` around a `dcptool`
session with a built-in server, and hand-made pcaps with holes, reordering and
retransmissions (packets from capture/pcap/packets.py)."""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time

import pytest

from dcptool.capture.pcap.fileformat import (
    LINKTYPE_RAW,
    PacketWriter,
    Truncated,
    read_packets,
)
from dcptool.capture.pcap.packets import ACK, FIN, PSH, SYN, parse, tcp_packet
from tests.support.processes import stop_process

DCPTOOL = os.path.join(os.path.dirname(sys.executable), "dcptool")
LO = bytes([127, 0, 0, 1])


def require_tcpdump() -> str:
    path = shutil.which("tcpdump")
    if path is None:
        pytest.skip("tcpdump is not installed (Debian package tcpdump); scripts/setup.sh --test installs it")
    return path


def _read_line(stream, deadline: float) -> bytes:
    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    try:
        while time.monotonic() < deadline:
            if sel.select(timeout=max(0.0, deadline - time.monotonic())):
                return stream.readline()
        return b""
    finally:
        sel.close()


class Server:
    """`dcptool serve KIND --port 0 ARGS` until stopped; `port` from its first stdout line."""

    def __init__(self, kind: str, *args: str):
        self.proc = subprocess.Popen([DCPTOOL, "serve", kind, "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = _read_line(self.proc.stdout, time.monotonic() + 60)
        assert line, f"serve {kind} did not start"
        self.address = json.loads(line)["listening"]
        self.port = int(self.address.rpartition(":")[2])

    def stop(self) -> None:
        stop_process(self.proc)


def fins(path: str, port: int) -> int:
    """FIN packets to or from `port` in the pcap written so far."""
    n = 0
    for _ts, lt, data, _w in read_packets(path, Truncated()):
        seg = parse(lt, data)
        if seg is not None and seg.flags & FIN and (seg.src.endswith(f":{port}") or seg.dst.endswith(f":{port}")):
            n += 1
    return n


class Tcpdump:
    """tcpdump -i lo writing every packet to or from `port` to `path` (packet-buffered)."""

    def __init__(self, path: str, port: int):
        exe = require_tcpdump()
        self.path, self.port = path, port
        self.proc = subprocess.Popen([exe, "-i", "lo", "-U", "-s", "0", "-B", "16384", "-w", path,
                                      f"tcp port {port}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        line = _read_line(self.proc.stderr, time.monotonic() + 30)
        assert b"listening on" in line, line

    def stop_after_close(self, connections: int = 1, timeout: float = 30.0) -> None:
        """Stop once both FINs of `connections` connections are in the file (bounded)."""
        deadline = time.monotonic() + timeout
        while fins(self.path, self.port) < 2 * connections and time.monotonic() < deadline:
            time.sleep(0.05)
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(10)
        self.proc.stderr.close()


def write_flow(path: str, packets, kind: str = "pcap", port: int = 11210) -> None:
    """packets: [(ts_ns, from_client, seq_offset, flags, payload)] of one connection
    127.0.0.1:40001 -> 127.0.0.1:`port` whose ISNs are 1000 (client) and 5000 (server);
    each packet acknowledges every byte the peer sent before it in the list. flags None:
    a packet the capture lost (not written, but acknowledged by the peer)."""
    w = PacketWriter(path, kind)
    sent = {True: 0, False: 0}
    try:
        for ts, from_client, off, flags, payload in packets:
            isn, peer_isn = (1000, 5000) if from_client else (5000, 1000)
            src, sport, dport = LO, (40001 if from_client else port), (port if from_client else 40001)
            if flags is not None:
                w.write(ts, tcp_packet(src, sport, LO, dport, isn + off, peer_isn + 1 + sent[not from_client],
                                       flags, payload))
            if payload:
                sent[from_client] = max(sent[from_client], off - 1 + len(payload))
    finally:
        w.close()


def handshake(ts: int = 1_700_000_000_000_000_000):
    return [(ts, True, 0, SYN, b""), (ts, False, 0, SYN | ACK, b""), (ts, True, 1, ACK, b"")]


__all__ = ["ACK", "FIN", "PSH", "LINKTYPE_RAW", "Server", "Tcpdump", "handshake", "require_tcpdump", "write_flow"]
