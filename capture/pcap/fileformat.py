"""pcap and pcapng files through dpkt: the file header, pcapng's section and interface
blocks and the writers are dpkt's. The packet records are walked here, over chunked reads
(the file is streamed, never loaded whole), because dpkt's readers hand timestamps out as
float seconds, which loses the nanoseconds a capture records (`ts` round trips exactly).

`read_batches(path)` yields the packets in `PacketBatch`es: a pcap file is read in blocks
and each block's record headers walked with struct.unpack_from, the batch being the block
itself with packet offsets (no object or copy per packet; dpkt's per-packet objects were
the import's cost); pcapng blocks are walked one at a time and joined into batches.
`read_packets(path)` yields (ts_ns, linktype, data, wire_len) one packet at a time, data a
read-only memoryview into a block of the file. `PacketWriter` writes raw IPv4 packets
(LINKTYPE_RAW) with nanosecond timestamps."""

from __future__ import annotations

import struct
from decimal import Decimal
from typing import Iterator, NamedTuple

import dpkt
import dpkt.pcap
import dpkt.pcapng as ng
import numpy as np

from dcptool.capture.pcap.pcap_errors import NotAPacketFile

LINKTYPE_RAW = 101          # IPv4/IPv6 with no link header (the pcap LINKTYPE_ value)
CHUNK = 4 * 2**20
SNAPLEN = 262144
_PCAP_MAGICS = {0xA1B2C3D4: 1_000, 0xA1B23C4D: 1}   # magic -> ns per fraction unit
_NG_SHB = 0x0A0D0D0A


class Truncated:
    """Set when the file ended inside a record (a capture cut short)."""

    def __init__(self):
        self.truncated = False
        self.packets = 0
        self.format = "?"


def sniff(path: str) -> str:
    """'pcap' or 'pcapng' from the first bytes; NotAPacketFile otherwise."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
    except IsADirectoryError:
        raise NotAPacketFile(f"{path}: a directory, not a pcap or pcapng file") from None
    if len(head) == 4:
        if struct.unpack("<I", head)[0] == _NG_SHB:
            return "pcapng"
        if struct.unpack("<I", head)[0] in _PCAP_MAGICS or struct.unpack(">I", head)[0] in _PCAP_MAGICS:
            return "pcap"
    raise NotAPacketFile(f"{path}: not a pcap or pcapng file (first bytes {head.hex() or 'none'})")


class _Chunks:
    """A file read in blocks of CHUNK bytes, taken in records as memoryviews into the
    block (no copy per record). Each block is a fresh bytes object, so a view stays valid
    as long as its holder keeps it; holders that keep bytes beyond the packet (out-of-order
    segments) copy them. Only a record that straddles two blocks is copied, alone."""

    def __init__(self, fh):
        self.fh = fh
        self.buf = memoryview(b"")
        self.pos = 0

    def take(self, n: int) -> memoryview | None:
        """The next n bytes, or None when the file ends first (what was there is dropped)."""
        end = self.pos + n
        if end <= len(self.buf):
            self.pos = end
            return self.buf[end - n:end]
        rest = self.buf[self.pos:]
        more = self.fh.read(max(CHUNK, n - len(rest)))   # large reads go straight into the bytes
        self.buf, self.pos = memoryview(more), n - len(rest)
        if self.pos > len(more):
            self.pos = len(more)
            return None
        return memoryview(bytes(rest) + more[:self.pos]) if rest else self.buf[:self.pos]

    def at_end(self) -> bool:
        if self.pos < len(self.buf):
            return False
        self.buf, self.pos = memoryview(self.fh.read(CHUNK)), 0
        return not self.buf


def _pcap_header(fh) -> tuple[struct.Struct, int, int]:
    """(record header struct, ns per fraction unit, link type) from a pcap file header
    (dpkt's FileHdr)."""
    head = fh.read(24)
    try:
        fhdr = dpkt.pcap.FileHdr(head)
        if fhdr.magic not in _PCAP_MAGICS:
            fhdr = dpkt.pcap.LEFileHdr(head)
    except dpkt.NeedData:
        raise NotAPacketFile("the pcap file header is cut short") from None
    unit = _PCAP_MAGICS.get(fhdr.magic)
    if unit is None:
        raise NotAPacketFile("not a pcap or pcapng file")
    rec = struct.Struct(("<" if isinstance(fhdr, dpkt.pcap.LEFileHdr) else ">") + "IIII")
    return rec, unit, fhdr.linktype & 0x0FFFFFFF


def _pcap_records(fh, state: Truncated) -> Iterator[tuple[int, int, memoryview, int]]:
    rec, unit, linktype = _pcap_header(fh)
    chunks = _Chunks(fh)
    while not chunks.at_end():
        hdr = chunks.take(16)
        if hdr is None:
            state.truncated = True
            return
        sec, frac, caplen, wire = rec.unpack(hdr)
        data = chunks.take(caplen) if caplen <= SNAPLEN * 4 else None
        if data is None:
            state.truncated = True
            return
        state.packets += 1
        yield sec * 1_000_000_000 + frac * unit, linktype, data, wire


def _ng_interface(buf: bytes, le: bool) -> tuple[int, tuple[int, int, int]]:
    """(linktype, ns per timestamp unit numerator/denominator as (mul, div)) of an IDB."""
    idb = ng.InterfaceDescriptionBlockLE(buf) if le else ng.InterfaceDescriptionBlock(buf)
    mul, div, offset = 1_000, 1, 0     # default resolution: microseconds
    for opt in idb.opts:
        if opt.code == ng.PCAPNG_OPT_IF_TSRESOL and opt.data:
            v = opt.data[0]
            if v & 0x80:
                mul, div = 1_000_000_000, 2 ** (v & 0x7F)
            else:
                exp = v & 0x7F
                mul, div = (10 ** (9 - exp), 1) if exp <= 9 else (1, 10 ** (exp - 9))
        elif opt.code == ng.PCAPNG_OPT_IF_TSOFFSET and len(opt.data) >= 8:
            offset = struct.unpack("<q" if le else ">q", opt.data[:8])[0]
    return idb.linktype, (mul, div, offset)


def _pcapng_records(fh, state: Truncated) -> Iterator[tuple[int, int, memoryview, int]]:
    chunks = _Chunks(fh)
    le = True
    ifaces: list[tuple[int, tuple[int, int, int]]] = []
    while not chunks.at_end():
        head = chunks.take(8)
        if head is None:
            state.truncated = True
            return
        btype, blen = struct.unpack("<II" if le else ">II", head)
        if btype == _NG_SHB:
            bom = chunks.take(4)
            if bom is None:
                state.truncated = True
                return
            le = bom == b"\x4d\x3c\x2b\x1a"
            blen = struct.unpack("<I" if le else ">I", head[4:])[0]
            rest = chunks.take(blen - 12) if blen >= 28 else None
            if rest is None:
                if state.packets == 0 and not ifaces:
                    raise NotAPacketFile("the pcapng section header is cut short or broken")
                state.truncated = True
                return
            ifaces = []          # interface ids are per section
            continue
        if blen < 12 or blen % 4:
            state.truncated = True     # a broken block length: nothing after it can be trusted
            return
        body = chunks.take(blen - 8)
        if body is None:
            state.truncated = True
            return
        if btype == ng.PCAPNG_BT_IDB:
            ifaces.append(_ng_interface(bytes(head) + bytes(body), le))
        elif btype == ng.PCAPNG_BT_EPB:
            iface, hi, lo, caplen, wire = struct.unpack_from("<IIIII" if le else ">IIIII", body)
            if iface >= len(ifaces):
                continue
            linktype, (mul, div, offset) = ifaces[iface]
            ticks = (hi << 32) | lo
            ts = ticks * mul // div + offset * 1_000_000_000
            state.packets += 1
            yield ts, linktype, body[20:20 + caplen], wire
        elif btype == ng.PCAPNG_BT_SPB and ifaces:
            wire = struct.unpack_from("<I" if le else ">I", body)[0]
            state.packets += 1
            yield 0, ifaces[0][0], body[4:4 + min(wire, blen - 16)], wire


class PacketBatch(NamedTuple):
    """Packets of one link type over one buffer: packet i is buf[starts[i]:ends[i]],
    captured at ts[i] (ns)."""
    linktype: int
    buf: memoryview
    ts: list
    starts: np.ndarray
    ends: np.ndarray


def _pcap_batches(fh, state: Truncated) -> Iterator[PacketBatch]:
    """A pcap file in blocks of CHUNK bytes, the record headers of each block walked with
    unpack_from: one batch per block over the block itself (packet bytes are not copied;
    the few bytes of a record cut by the block's end start the next block)."""
    rec, unit, linktype = _pcap_header(fh)
    unpack = rec.unpack_from
    tail = b""
    while True:
        block = bytearray(len(tail) + CHUNK)
        block[:len(tail)] = tail
        view = memoryview(block)
        got = len(tail)
        while got < len(block):
            n = fh.readinto(view[got:])
            if not n:
                break
            got += n
        buf, n, pos = view[:got].toreadonly(), got, 0
        ts, starts, ends = [], [], []
        cut = False
        while pos + 16 <= n:
            sec, frac, caplen, _wire = unpack(buf, pos)
            if caplen > SNAPLEN * 4:
                cut = True       # a broken record length: nothing after it can be trusted
                break
            end = pos + 16 + caplen
            if end > n:
                break
            ts.append(sec * 1_000_000_000 + frac * unit)
            starts.append(pos + 16)
            ends.append(end)
            pos = end
        state.packets += len(ts)
        if ts:
            yield PacketBatch(linktype, buf, ts, np.array(starts, np.int64), np.array(ends, np.int64))
        tail = bytes(buf[pos:])
        if cut or got < len(block):          # the file ended (or broke): a tail is a cut record
            state.truncated = bool(tail)
            return


def _joined(records) -> Iterator[PacketBatch]:
    """Packets one at a time (pcapng) gathered by link type into batches over one buffer."""
    parts: list = []
    ts: list = []
    kind, size = -1, 0          # (kind: set by the first record, before any batch)
    for t, linktype, data, _wire in records:
        if parts and (linktype != kind or size >= CHUNK):
            yield _batch(kind, parts, ts)
            parts, ts, size = [], [], 0
        kind = linktype
        parts.append(data)
        ts.append(t)
        size += len(data)
    if parts:
        yield _batch(kind, parts, ts)


def _batch(linktype: int, parts: list, ts: list) -> PacketBatch:
    lens = np.fromiter(map(len, parts), np.int64, len(parts))
    ends = np.cumsum(lens)
    return PacketBatch(linktype, memoryview(b"".join(parts)), ts, ends - lens, ends)


def read_batches(path: str, state: Truncated) -> Iterator[PacketBatch]:
    """The packets of the file in batches (`PacketBatch`), in file order; a file cut inside
    a record ends them with state.truncated set."""
    kind = sniff(path)
    state.format = kind
    with open(path, "rb") as fh:
        yield from (_pcap_batches(fh, state) if kind == "pcap" else _joined(_pcapng_records(fh, state)))


def read_packets(path: str, state: Truncated) -> Iterator[tuple[int, int, memoryview, int]]:
    """(ts_ns, linktype, captured bytes, length on the wire) of every packet, in file
    order. A file cut inside a record ends the iteration with state.truncated set."""
    kind = sniff(path)
    state.format = kind
    with open(path, "rb") as fh:
        yield from (_pcap_records(fh, state) if kind == "pcap" else _pcapng_records(fh, state))


class PacketWriter:
    """Raw IPv4 packets into a pcap (nanosecond magic) or pcapng (if_tsresol 9) file."""

    def __init__(self, path: str, kind: str):
        self.fh = open(path, "wb")
        self.kind = kind
        self.packets = 0
        if kind == "pcapng":
            idb = ng.InterfaceDescriptionBlockLE(
                snaplen=SNAPLEN, linktype=LINKTYPE_RAW,
                opts=[ng.PcapngOptionLE(code=ng.PCAPNG_OPT_IF_TSRESOL, data=b"\x09"),
                      ng.PcapngOptionLE(code=ng.PCAPNG_OPT_ENDOFOPT)])
            ng.Writer(self.fh, snaplen=SNAPLEN, linktype=LINKTYPE_RAW, idb=idb)
            self._write = self._epb
        else:
            self._pcap = dpkt.pcap.Writer(self.fh, snaplen=SNAPLEN, linktype=LINKTYPE_RAW, nano=True)
            self._write = self._pcap_record

    def _epb(self, ts_ns: int, pkt: bytes) -> None:
        self.fh.write(bytes(ng.EnhancedPacketBlockLE(ts_high=ts_ns >> 32, ts_low=ts_ns & 0xFFFFFFFF,
                                                      caplen=len(pkt), pkt_len=len(pkt), pkt_data=pkt)))

    def _pcap_record(self, ts_ns: int, pkt: bytes) -> None:
        self._pcap.writepkt_time(pkt, Decimal(ts_ns).scaleb(-9))

    def write(self, ts_ns: int, pkt: bytes) -> None:
        self._write(ts_ns, pkt)
        self.packets += 1

    def close(self) -> None:
        self.fh.close()
