"""IPv4/TCP packets: built for export (checksums computed, so no tool flags them), and
taken apart for import from the link types tcpdump writes (Ethernet, Linux cooked v1/v2,
BSD loopback, raw IP), IPv4 and IPv6. Fragments and non-TCP packets are skipped."""

from __future__ import annotations

import socket
import struct
from typing import NamedTuple

import numpy as np

FIN, SYN, RST, PSH, ACK = 0x01, 0x02, 0x04, 0x08, 0x10
_IP = struct.Struct(">BBHHHBBH4s4s")
_TCP = struct.Struct(">HHIIBBHHH")
_TCP_HEAD = struct.Struct(">HHIIBB")


def _checksum(data: bytes) -> bytes:
    """The Internet checksum of data, as the two bytes to store."""
    if len(data) % 2:
        data += b"\x00"
    s = int(np.frombuffer(data, dtype=">u2").sum(dtype=np.uint64))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return struct.pack(">H", ~s & 0xFFFF)


def tcp_packet(src: bytes, sport: int, dst: bytes, dport: int, seq: int, ack: int, flags: int,
               payload: bytes = b"", ident: int = 0) -> bytes:
    """One IPv4 packet (src/dst: 4-byte addresses) carrying one TCP segment."""
    tcp = _TCP.pack(sport, dport, seq & 0xFFFFFFFF, ack & 0xFFFFFFFF, 5 << 4, flags, 65535, 0, 0)
    pseudo = src + dst + struct.pack(">BBH", 0, 6, len(tcp) + len(payload))
    csum = _checksum(pseudo + tcp + payload)
    tcp = tcp[:16] + csum + tcp[18:]
    total = 20 + len(tcp) + len(payload)
    ip = _IP.pack(0x45, 0, total, ident & 0xFFFF, 0x4000, 64, 6, 0, src, dst)
    ip = ip[:10] + _checksum(ip) + ip[12:]
    return ip + tcp + payload


class Segment(NamedTuple):
    src: str          # "host:port"
    dst: str
    seq: int
    ack: int
    flags: int
    payload: bytes    # or a memoryview into the packet


def _ip_offset(linktype: int, data: bytes) -> int | None:
    """Where the IP header starts under this link type, or None (not IP)."""
    if linktype == 1:                          # Ethernet, with VLAN tags
        off, etype = 12, None
        while len(data) >= off + 2:
            etype = int.from_bytes(data[off:off + 2], "big")
            if etype in (0x8100, 0x88A8):
                off += 4
                continue
            break
        return off + 2 if etype in (0x0800, 0x86DD) else None
    if linktype in (101, 12, 14, 228, 229):    # raw IP (and its old DLT numbers)
        return 0
    if linktype == 113:                        # Linux cooked capture v1
        return 16 if data[14:16] in (b"\x08\x00", b"\x86\xdd") else None
    if linktype == 276:                        # Linux cooked capture v2
        return 20 if data[0:2] in (b"\x08\x00", b"\x86\xdd") else None
    if linktype in (0, 108):                   # BSD loopback: a 4-byte address family
        return 4
    return None


_ADDRS: dict = {}
_V4 = struct.Struct(">BxHxxHxBxxII")    # version/ihl, total length, fragment, protocol, src, dst


def addr(raw, port: int) -> str:
    """"host:port" of an address (an int for IPv4, 16 bytes for IPv6), cached: a capture
    has few endpoints, so the text is built once per endpoint, not once per packet."""
    key = (raw, port)
    text = _ADDRS.get(key)
    if text is None:
        if len(_ADDRS) > 65536:
            _ADDRS.clear()
        text = _ADDRS[key] = _addr_text(raw, port)
    return text


def _addr_text(raw, port: int) -> str:
    if isinstance(raw, int):
        return f"{socket.inet_ntop(socket.AF_INET, raw.to_bytes(4, 'big'))}:{port}"
    return f"[{socket.inet_ntop(socket.AF_INET6, raw)}]:{port}"


def parse(linktype: int, data) -> Segment | None:
    """The TCP segment in a captured packet (bytes or a memoryview), or None (not
    IPv4/IPv6 TCP, a fragment, cut before the TCP header). The payload is what was captured
    of it (snaplen may cut it), a slice of `data` (no copy). Headers are read with struct
    at their offsets, nothing copied."""
    off = _ip_offset(linktype, data)
    if off is None or len(data) < off + 20:
        return None
    v = data[off] >> 4
    if v == 4:
        vihl, total, frag, proto, src, dst = _V4.unpack_from(data, off)
        ihl = (vihl & 0x0F) * 4
        if proto != 6 or frag & 0x3FFF or ihl < 20:
            return None
        t = off + ihl
        end = off + total if total else len(data)
    elif v == 6:
        if len(data) < off + 40 or data[off + 6] != 6:
            return None
        plen = int.from_bytes(data[off + 4:off + 6], "big")
        src, dst = bytes(data[off + 8:off + 24]), bytes(data[off + 24:off + 40])
        t = off + 40
        end = t + plen
    else:
        return None
    if len(data) < t + 20:
        return None
    sport, dport, seq, ack, doff, flags = _TCP_HEAD.unpack_from(data, t)
    start = t + (doff >> 4) * 4
    return Segment(addr(src, sport), addr(dst, dport), seq, ack, flags, data[start:min(end, len(data))])


_RAW_LINKS = (101, 12, 14, 228, 229)
# link type -> (bytes before the IP header, where its EtherType sits or None)
_BULK_LINKS = {1: (14, 12), 113: (16, 14), 276: (20, 0), 0: (4, None), 108: (4, None),
               **{lt: (0, None) for lt in _RAW_LINKS}}


def _be(u8: np.ndarray, at: np.ndarray, width: int) -> np.ndarray:
    """The big-endian unsigned integers of `width` bytes at offsets `at`."""
    v = u8[at].astype(np.uint64)
    for k in range(1, width):
        v = (v << np.uint64(8)) | u8[at + k]
    return v


def parse_batch(linktype: int, buf, starts: np.ndarray, ends: np.ndarray):
    """The IPv4/TCP headers of a batch of packets (packet i is buf[starts[i]:ends[i]]) read
    for all of them at once with numpy. Returns None when the link type has no bulk path,
    else (bulk, columns): bulk[i] says packet i was read here, the columns (lists, one
    value per packet, meaningless where bulk is False) are src, sport, dst, dport, seq, ack,
    flags, payload start, payload end. Packets not read here (IPv6, VLAN tags, fragments,
    not TCP, cut short) are for `parse`, which gives the same answer one at a time."""
    layout = _BULK_LINKS.get(linktype)
    if layout is None:
        return None
    off, etype_at = layout
    u8 = np.frombuffer(buf, np.uint8)
    n = len(starts)
    ok = ends - starts >= off + 40
    idx = np.flatnonzero(ok)
    s = starts[idx]
    if etype_at is not None:
        keep = (u8[s + etype_at] == 0x08) & (u8[s + etype_at + 1] == 0x00)
        idx, s = idx[keep], s[keep]
    ip = s + off
    first = u8[ip]
    ihl = (first & 0x0F).astype(np.int64) * 4
    frag = _be(u8, ip + 6, 2) & 0x3FFF
    keep = ((first >> 4) == 4) & (u8[ip + 9] == 6) & (frag == 0) & (ihl >= 20) & (ip + ihl + 20 <= ends[idx])
    idx, ip, ihl = idx[keep], ip[keep], ihl[keep]
    end = ends[idx]
    t = ip + ihl
    total = _be(u8, ip + 2, 2).astype(np.int64)
    pend = np.minimum(np.where(total > 0, ip + total, end), end)
    pstart = t + (u8[t + 12] >> 4).astype(np.int64) * 4
    bulk = np.zeros(n, bool)
    bulk[idx] = True
    cols = []
    for values in (_be(u8, ip + 12, 4), _be(u8, t, 2), _be(u8, ip + 16, 4), _be(u8, t + 2, 2),
                   _be(u8, t + 4, 4), _be(u8, t + 8, 4), u8[t + 13], pstart, pend):
        full = np.zeros(n, np.int64)
        full[idx] = values
        cols.append(full.tolist())
    return bulk.tolist(), cols
