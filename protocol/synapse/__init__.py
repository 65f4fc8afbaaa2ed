"""Synapse replication, sans-IO: the line protocol (commands, framing, rows), the columnar line scan, the client state (tokens, positions, gaps), and the servers of `serve synapse`."""
