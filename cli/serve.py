"""`dcptool serve dcp|synapse`: built-in servers. Each subcommand lives in its own module
and is imported only when run."""

from __future__ import annotations

import importlib

import click

SERVERS = {
    "dcp": ("dcptool.cli.servers.serve_dcp:serve_dcp", "A DCP producer serving a generated bucket."),
    "synapse": ("dcptool.cli.servers.serve_synapse:serve_synapse",
                "A Synapse replication server speaking the TCP line protocol."),
}


class _LazyServe(click.Group):
    def list_commands(self, ctx):
        return list(SERVERS)

    def get_command(self, ctx, name):
        entry = SERVERS.get(name)
        if entry is None:
            return None
        module, _, attr = entry[0].partition(":")
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx, formatter):
        with formatter.section("Servers"):
            formatter.write_dl([(n, h) for n, (_, h) in SERVERS.items()])


@click.group(cls=_LazyServe)
def serve():
    """Run a built-in server for trying dcptool and testing consumers.

    Binds 127.0.0.1 by default; --port 0 picks a free port. The first stdout line is
    {"listening": "HOST:PORT"} once the server accepts connections.
    """
