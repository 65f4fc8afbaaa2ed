"""dcptool: capture, stream and replay DCP and Synapse replication streams.

The code lives in the top-level folders cli/, protocol/ and replay/, installed as
dcptool.cli, dcptool.protocol and dcptool.replay (see pyproject.toml).
"""

__version__ = "0.1.0"
