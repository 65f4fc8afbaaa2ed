"""The `serve` subcommands: the built-in DCP producer and Synapse servers, and playback of a capture."""
