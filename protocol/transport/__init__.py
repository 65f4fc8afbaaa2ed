"""The I/O edge: asyncio TCP/TLS connections and Redis pub/sub. Bytes are read here and
fed to the sans-IO state machines of protocol/dcp and protocol/synapse; nothing else in
dcptool.protocol does I/O."""
