"""Running `serve`'s servers without the CLI: the signals that end one cleanly
(server_stop_event), the event loop with a port that cannot be had as ConnectFailed
(run_server), and the playback of a recorded capture as a live DCP producer or Synapse
server (serve_dcp_recording, serve_synapse_recording; the capture is read by
replay/playback_source.py first, so nothing listens for a capture that cannot be played)."""

from __future__ import annotations

import asyncio
import time

from dcptool.capture.run import STOP_SIGNALS
from dcptool.protocol.errors import ConnectFailed

# Lazy imports: only where start-up time needs them (cli/servers/ imports this module for
# `serve --help`; the producers and transports, numpy with them, load when a server runs).


def server_stop_event():
    """For `serve ...` (inside its event loop): an asyncio.Event set by SIGINT (even when the
    parent ignored it), SIGTERM or SIGHUP. Stopping is the normal end of a server, so it
    closes its connections and exits 0; call it before printing the listening line, so a
    signal sent as soon as that line is read is never lost."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError, ValueError):
            pass
    return stop


def run_server(coro, bind: str, port: int) -> None:
    """Run a server's coroutine to its end; Ctrl-C ends it quietly, a port that cannot be
    listened on is ConnectFailed."""
    try:
        asyncio.run(coro)
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        raise ConnectFailed(f"cannot listen on {bind}:{port}: {exc.strerror or exc}") from None


def serve_dcp_recording(recording, users: dict, *, bind: str, port: int, tls, pace: float | None,
                        disconnect_at, stall_at: int | None, stall_seconds: float, corrupt_at,
                        on_listening, handshake_timeout: float = 10.0) -> None:
    """A recorded DCP capture (replay/playback_source.py load_dcp) served as a producer until a stop
    signal; on_listening(host, port) once it listens."""
    from dcptool.protocol.dcp.server.recorded_producer import Faults, PlaybackModel
    from dcptool.protocol.transport.dcp_server import ProducerServer

    model = PlaybackModel(recording, users, pace=pace,
                          faults=Faults(disconnect_at=disconnect_at, stall_at=stall_at, stall_seconds=stall_seconds,
                                        corrupt_at=corrupt_at))
    # PlaybackModel stands in for a ServerModel by duck typing (connect, buckets, users, ...): no common base
    server = ProducerServer(model, handshake_timeout=handshake_timeout)  # type: ignore[arg-type]

    async def main():
        stop = server_stop_event()   # stopping is how a server ends: exit 0, as serve dcp does
        host, p = await server.start(bind, port, tls)
        on_listening(host, p)
        await stop.wait()
        await server.close()

    run_server(main(), bind, port)


def serve_synapse_recording(recording, *, bind: str, port: int, server_name: str, ping: float, timeout: float,
                            pace: float | None, disconnect_at, stall_at: int | None, stall_seconds: float,
                            corrupt_at, on_listening) -> None:
    """A recorded Synapse capture (replay/playback_source.py load_synapse) served over TCP until a
    stop signal; on_listening(host, port) once it listens."""
    from dcptool.protocol.synapse.recorded_server import (
        LineFaults,
        PlaybackFeed,
        PlaybackSession,
    )
    from dcptool.protocol.transport.synapse_playback import serve_playback

    feed = PlaybackFeed(recording.connections, pace=pace,
                        faults=LineFaults(disconnect_at=disconnect_at, stall_at=stall_at, stall_seconds=stall_seconds,
                                          corrupt_at=corrupt_at))

    def make_session():
        return PlaybackSession(feed, server_name, ping_interval=ping, timeout=timeout,
                               wall_ms=lambda: time.time_ns() // 1_000_000)

    async def main():
        stop = server_stop_event()
        await serve_playback(bind, port, make_session, on_listening=on_listening, stop=stop)

    run_server(main(), bind, port)
