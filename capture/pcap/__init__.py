"""Packet captures in and out (issue 28): export.py writes a capture as IPv4/TCP packets
Wireshark reads (pcap or pcapng), importer.py turns a tcpdump file back into a capture. The
file formats go through dpkt (fileformat.py); TCP reassembly (tcp.py), protocol detection
and framing (flows.py) and the batches for the capture writer (sinks.py) are ours."""
