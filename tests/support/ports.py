"""Loopback ports without the bind-close-reuse race.

Our own servers bind port 0 themselves and report the port they got (ThreadedServer.port,
HostileDcp.port, `serve synapse|dcp --port 0` printing {"listening": ...}); use that. For the
rest:
- `refused_port()`: a port where a connection is refused, held for the block by a socket that
  is bound but not listening (nothing else can bind it meanwhile, and a connect gets RST).
- `start_with_retry(start)`: for third-party servers that need their port on the command line
  and cannot report a port 0 (Spark master/worker, Synapse's HTTP listener): pick a port,
  start, and pick again if the start failed because the port was taken in between."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A 127.0.0.1 port on which connecting is refused while the block runs."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def pick_port() -> int:
    """A port that was free a moment ago: only for `start_with_retry` (another process may
    take it before the server binds it, which the retry absorbs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortTaken(Exception):
    """Raised by a `start` callback when its server could not bind the port it was given."""


def start_with_retry(start: Callable[[], T], attempts: int = 5) -> T:
    """`start()` (which picks its ports with pick_port and raises PortTaken when a bind
    failed), tried again with fresh ports up to `attempts` times."""
    for attempt in range(attempts):
        try:
            return start()
        except PortTaken:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")
