"""dcptool: capture, stream and replay DCP and Synapse replication streams.

The code lives in the top-level folders cli/, protocol/, capture/, replay/ and restore/,
installed as dcptool.cli, dcptool.protocol, dcptool.capture, dcptool.replay and
dcptool.restore (see pyproject.toml).
"""

__version__ = "0.1.0"
