"""Packet captures in and out (issue 28): `export_pcap` writes a capture as IPv4/TCP
packets Wireshark reads (pcap or pcapng), `import_pcap` turns a tcpdump file back into a
capture. The file formats go through dpkt (fileformat.py); TCP reassembly (tcp.py),
protocol detection and framing (flows.py) are ours."""

from __future__ import annotations

from dcptool.capture.pcap.errors import NotAPacketFile, UndecodablePcap

__all__ = ["NotAPacketFile", "UndecodablePcap", "export_pcap", "import_pcap"]


def export_pcap(*args, **kw):
    from dcptool.capture.pcap.export import export_pcap as run
    return run(*args, **kw)


def import_pcap(*args, **kw):
    from dcptool.capture.pcap.importer import import_pcap as run
    return run(*args, **kw)
