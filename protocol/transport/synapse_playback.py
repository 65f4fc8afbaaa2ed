"""The I/O of `serve synapse --from CAPTURE`: an asyncio TCP server around the sans-IO
playback sessions of protocol/synapse/recorded_server.py."""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Sequence

from dcptool.protocol.synapse.framing import LineFramer
from dcptool.protocol.synapse.recorded_server import PlaybackSession
from dcptool.protocol.transport.served import close_served, serve_until_stopped
from dcptool.protocol.transport.synapse_tcp_redis import read_client_lines


async def serve_playback(bind: str, port: int, make_session: Callable[[], PlaybackSession], *,
                         on_listening: Callable[[str, int], None],
                         stop: asyncio.Event | None = None, clock: Callable[[], float] = time.monotonic) -> None:
    """Accept replication clients on bind:port until `stop`; each gets make_session()."""
    stop = stop or asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = make_session()
        framer = LineFramer()
        wake = asyncio.Event()

        def write(lines: Sequence[bytes | str]) -> None:
            if lines:
                data = b"\n".join(x if isinstance(x, bytes) else x.encode("utf-8") for x in lines) + b"\n"
                writer.write(data)
                session.sent(clock())

        async def woken() -> None:
            wake.set()

        rt = asyncio.ensure_future(read_client_lines(reader, framer, write,
                                                     lambda lines: session.receive(lines, clock()), after=woken))
        try:
            write(session.connect(clock()))
            while not rt.done() and not stop.is_set():
                out, close = session.tick(clock())
                write(out)
                if close:
                    break
                lines, close = session.pull(clock())
                write(lines)
                await writer.drain()
                if close:
                    break
                if lines:
                    continue
                wake.clear()
                deadline = session.next_deadline()
                timeout = 0.05 if deadline is None else min(0.05, max(0.0, deadline - clock()))
                try:
                    await asyncio.wait_for(wake.wait(), timeout)
                except (asyncio.TimeoutError, TimeoutError):
                    pass
        except (ConnectionError, OSError):
            pass
        finally:
            await close_served(writer, rt)

    await serve_until_stopped(handle, bind, port, on_listening, stop)
