"""The DCP producer behind `serve dcp`, sans-IO: connections, the generated bucket, streams and their options, the cluster and topology events, and playback of a capture."""
