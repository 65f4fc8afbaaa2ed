"""dcptool: capture, stream and replay DCP and Synapse replication streams.

The code lives in the top-level folders cli/, capture/, live/, serve/, restore/, protocol/ and
replay/, installed as dcptool.cli, dcptool.capture, dcptool.live, dcptool.serve,
dcptool.restore, dcptool.protocol and dcptool.replay (see pyproject.toml; docs/ARCHITECTURE.md
draws them).
"""

__version__ = "0.1.0"
