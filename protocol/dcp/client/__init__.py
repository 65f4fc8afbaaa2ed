"""The DCP consumer, sans-IO: the handshake, streams, rollbacks, flow control, the collections manifest and the cluster router."""
