"""Serving TCP connections until a stop, for the Synapse stand-ins (`serve synapse`, its
playback and its catch-up listener): each connection's handler is tracked; at the stop the
listener closes, the handlers get `grace` seconds to see the stop and end, and the ones still
blocked (a client that stopped reading leaves a handler in `drain()` forever) have their
connection cut and are cancelled. A handler never ends as cancelled: Python 3.11's
`start_server` reports a cancelled handler task as an error with a traceback, so a stop, or
a client that hung up while its handler waited, would print one."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Served:
    """The live connections of one server: `wrap(handle)` is what start_server gets."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[None]] = set()
        self.writers: set[asyncio.StreamWriter] = set()

    def wrap(self, handle: Handler) -> Handler:
        async def guarded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            if task is not None:
                self.tasks.add(task)
            self.writers.add(writer)
            try:
                await handle(reader, writer)
            except asyncio.CancelledError:
                writer.transport.abort()   # cut at the stop: end as a handler that returned
            finally:
                self.writers.discard(writer)
                if task is not None:
                    self.tasks.discard(task)
        return guarded

    async def end(self, grace: float) -> None:
        """Let the handlers end within `grace` seconds; then cut and cancel the rest (bounded)."""
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=grace)
        for w in list(self.writers):
            w.transport.abort()
        left = set(self.tasks)
        for t in left:
            t.cancel()
        if left:
            await asyncio.wait(left, timeout=grace)


async def serve_until_stopped(handle: Handler, bind: str, port: int, on_listening: Callable[[str, int], None],
                              stop: asyncio.Event, grace: float = 1.0) -> None:
    """Listen on bind:port with `handle` per connection, announce the address, serve until
    `stop` is set; then end the connections as Served.end does."""
    served = Served()
    server = await asyncio.start_server(served.wrap(handle), bind, port)
    sock = server.sockets[0].getsockname()
    on_listening(sock[0], sock[1])
    try:
        await stop.wait()
    finally:
        server.close()
        await served.end(grace)


async def close_served(writer: asyncio.StreamWriter, reader_task: asyncio.Future[None]) -> None:
    """End a served connection: stop reading, send what is queued, close; a client that does
    not read within a second is cut."""
    reader_task.cancel()
    if reader_task.done() and not reader_task.cancelled():
        reader_task.exception()   # a reset seen by the reader: retrieved, not logged at exit
    try:
        await asyncio.wait_for(writer.drain(), 1.0)
    except (ConnectionError, OSError, asyncio.TimeoutError):
        pass
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), 1.0)
    except (ConnectionError, OSError, asyncio.TimeoutError):
        writer.transport.abort()
