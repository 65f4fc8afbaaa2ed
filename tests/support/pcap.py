"""A minimal pcap writer for feeding our frames to tshark: one TCP segment per payload
between two loopback endpoints, sequence numbers continuous, checksums left zero (tshark
does not verify them by default)."""

from __future__ import annotations

import struct


def _ip_tcp(src_port, dst_port, seq, ack, payload):
    tcp = struct.pack(">HHIIBBHHH", src_port, dst_port, seq, ack, 5 << 4, 0x18, 65535, 0, 0)
    total = 20 + len(tcp) + len(payload)
    ip = struct.pack(">BBHHHBBH4s4s", 0x45, 0, total, 0, 0x4000, 64, 6, 0,
                     bytes([127, 0, 0, 1]), bytes([127, 0, 0, 1]))
    return ip + tcp + payload


def write_pcap(path, segments, server_port=11210, client_port=40000):
    """segments: [(from_server: bool, payload bytes)]."""
    seq = {True: 1000, False: 5000}
    with open(path, "wb") as fh:
        fh.write(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 262144, 101))  # LINKTYPE_RAW (IPv4)
        for i, (from_server, payload) in enumerate(segments):
            sp, dp = (server_port, client_port) if from_server else (client_port, server_port)
            pkt = _ip_tcp(sp, dp, seq[from_server], seq[not from_server], payload)
            seq[from_server] += len(payload)
            fh.write(struct.pack("<IIII", 1_700_000_000 + i, 0, len(pkt), len(pkt)))
            fh.write(pkt)
