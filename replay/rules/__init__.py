"""The rules REPLAY.md names, shared by both engines: DCP and Synapse state, durable writes, history, topology, point in time, result tables and checksums."""
