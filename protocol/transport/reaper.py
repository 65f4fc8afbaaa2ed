"""Giving memory back when clients go (`serve dcp`, docs/CLI.md): a server's connections
leave reference cycles behind (asyncio keeps a failed TLS handshake's exception, whose
traceback holds the SSL objects, about 300 KB each), and glibc keeps freed heap unless
asked. From a socket accepted or closed until every connection accepted by then is
through its TLS handshake, the Reaper collects them and hands freed heap back to the
system (malloc_trim), once a second at most; a full collection that takes t seconds
waits REAP_SHARE * t before the next, so it never costs more than 1/REAP_SHARE of the
time whatever the heap holds.

With `freeze` (the `serve dcp` process, not a server inside another program: it is the
whole process's heap), what survived a young collection is frozen once a second
(gc.freeze): the documents KV writes keep piling up are long-lived, and Python's automatic
full collections would otherwise walk them all, a pause that grows with the bucket (over
100 ms at 150k writes) and stalls every stream. The reaper's own full collections unfreeze
first, so the cycles connections left are still collected; without TLS they run only once
a connection closed (a plain socket leaves nothing behind before)."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import time
from typing import Any, Callable

REAP_EVERY = 1.0     # seconds between looks
REAP_SHARE = 20      # a collection taking t seconds waits REAP_SHARE * t before the next


def malloc_trim() -> Callable[..., Any] | None:
    """glibc's malloc_trim, or None where there is none."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


class Reaper:
    """`accepted` and `gone` are counted by the server (sockets accepted before any TLS
    handshake, connections closed); `run()` is its task."""

    def __init__(self, handshake_timeout: float | None, freeze: bool = False):
        self.handshake_timeout = handshake_timeout or 0.0
        self.freeze = freeze
        self.tls = False            # the server's sockets are TLS (set by the server)
        self.accepted = 0
        self.gone = 0
        self.collections = 0
        self._seen = (0, 0)
        self._gone_reaped = 0

    async def run(self) -> None:
        trim = malloc_trim()
        until = next_ok = 0.0
        pending = False
        while True:
            await asyncio.sleep(REAP_EVERY)
            now = time.monotonic()
            seen = (self.accepted, self.gone)
            if seen != self._seen:
                self._seen = seen
                pending = True
                until = now + self.handshake_timeout + 2 * REAP_EVERY
            quiet = self.freeze and not self.tls and self.gone == self._gone_reaped
            if now < next_ok or not (pending or now <= until) or quiet:
                if self.freeze:     # (quiet: without TLS only a closed connection leaves cycles)
                    gc.collect(1)       # young garbage first: only what is alive is frozen
                    gc.freeze()
                continue
            pending = False
            self._gone_reaped = self.gone
            t0 = time.monotonic()
            if self.freeze:
                gc.unfreeze()
            gc.collect()
            if self.freeze:
                gc.freeze()
            if trim is not None:
                trim(0)
            self.collections += 1
            next_ok = now + REAP_SHARE * (time.monotonic() - t0)
