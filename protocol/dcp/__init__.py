"""DCP, sans-IO, by side: wire/ (the codec both sides use), client/ (the consumer) and
server/ (the producer of `serve dcp`). The wire imports neither side."""
