"""dcptool.protocol: the wire. Sans-IO codecs and state machines for DCP and Synapse
replication; the only I/O lives in protocol/transport.py."""
