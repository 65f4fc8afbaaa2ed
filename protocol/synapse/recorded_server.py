"""Synapse playback, sans-IO (`dcptool serve synapse --from CAPTURE`): the greeting, PING and
REPLICATE handling of server.ServerConnection, with the recorded lines instead of a feed.

The recording is a list of recorded connections, each the server's replication lines
(POSITION, RDATA, ...) in recorded order with their mono_ns. One cursor is shared by all
client connections, as a live server's stream moves on: after REPLICATE a connection gets
the lines from the cursor on. A connection that starts where a recorded connection started
gets that connection's recorded POSITIONs; one that starts in the middle (after a fault
cut the previous one) first gets a POSITION `token token` for every (stream, instance)
served so far. When a recorded connection's lines are all sent and the recording goes on
in another connection, the client is disconnected, as it was in the recording.

Pacing and faults count the replayed lines over all connections, each fault once; time is
an argument."""

from __future__ import annotations

import dataclasses
from typing import Callable

from dcptool.protocol.synapse.client import PING_INTERVAL, PING_TIMEOUT
from dcptool.protocol.synapse.server import ServerConnection

DEFAULT_STALL = 5.0
CHUNK = 2000


@dataclasses.dataclass(frozen=True)
class LineFaults:
    disconnect_at: int | None = None
    stall_at: int | None = None
    stall_seconds: float = DEFAULT_STALL
    corrupt_at: int | None = None


class _NoFeed:
    """server.ServerConnection answers REPLICATE with feed.positions(): here the recorded
    POSITIONs are part of the played lines."""

    def positions(self) -> list[str]:
        return []


def corrupt_line(line: bytes) -> bytes:
    """The line with its JSON cut short (the last byte of an RDATA row dropped)."""
    return line[:-1] if line.endswith((b"]", b"}")) else line + b"{"


class PlaybackFeed:
    """What every connection of one playback server shares: the recording and its cursor."""

    def __init__(self, connections: list[tuple[list[bytes], list[int]]], *, pace: float | None = None,
                 faults: LineFaults | None = None):
        self.connections = [c for c in connections if c[0]]
        self.pace = pace
        self.faults = faults or LineFaults()
        self.seg = 0
        self.pos = 0
        self.served = 0
        self.tokens: dict[tuple[str, str], int] = {}
        self.disconnect_done = self.stall_done = self.corrupt_done = False
        self.stall_until: float | None = None

    @property
    def done(self) -> bool:
        return self.seg >= len(self.connections)

    def track(self, line: bytes) -> None:
        parts = line.split(b" ", 5)
        try:
            if parts[0] == b"RDATA" and len(parts) >= 5 and parts[3] != b"batch":
                self.tokens[(parts[1].decode(), parts[2].decode())] = int(parts[3])
            elif parts[0] == b"POSITION" and len(parts) >= 5:
                self.tokens[(parts[1].decode(), parts[2].decode())] = int(parts[4])
        except (ValueError, UnicodeDecodeError):
            pass

    def positions(self) -> list[bytes]:
        return [b"POSITION %s %s %d %d" % (s.encode(), i.encode(), t, t) for (s, i), t in self.tokens.items()]


class PlaybackSession:
    """One client connection: connect(), receive(), tick() as server.ServerConnection, and
    pull(now) -> (lines to send, close?)."""

    def __init__(self, feed: PlaybackFeed, server_name: str, *, ping_interval: float = PING_INTERVAL,
                 timeout: float = PING_TIMEOUT, wall_ms: Callable[[], int] | None = None):
        self.feed = feed
        self.conn = ServerConnection(server_name, _NoFeed(), ping_interval=ping_interval, timeout=timeout,
                                     wall_ms=wall_ms)
        self.started = False
        self.anchor: tuple[float, int] | None = None
        self.next_due: float | None = None

    def connect(self, now: float) -> list[str]:
        return self.conn.connect(now)

    def receive(self, lines: list[bytes], now: float) -> list[str]:
        return self.conn.receive(lines, now)

    def tick(self, now: float) -> tuple[list[str], bool]:
        return self.conn.tick(now)

    def sent(self, now: float) -> None:
        self.conn.sent(now)

    def next_deadline(self) -> float | None:
        times = [t for t in (self.next_due, self.feed.stall_until) if t is not None]
        return min(times) if times else None

    def pull(self, now: float, limit: int = CHUNK) -> tuple[list[bytes], bool]:
        feed, faults = self.feed, self.feed.faults
        self.next_due = None
        if not self.conn.replicated or feed.done:
            return [], False
        if feed.stall_until is not None:
            if now < feed.stall_until:
                return [], False
            feed.stall_until = None
        out: list[bytes] = []
        if not self.started:
            self.started = True
            if feed.pos:
                out.extend(feed.positions())
        lines, monos = feed.connections[feed.seg]
        while len(out) < limit and feed.pos < len(lines):
            i = feed.pos
            if feed.pace is not None:
                if self.anchor is None:
                    self.anchor = (now, monos[i])
                due = self.anchor[0] + (monos[i] - self.anchor[1]) / (feed.pace * 1e9)
                if due > now:
                    self.next_due = due
                    break
            line = lines[i]
            if (faults.corrupt_at is not None and not feed.corrupt_done and feed.served >= faults.corrupt_at
                    and line.startswith(b"RDATA ")):
                feed.corrupt_done = True
                line = corrupt_line(line)
            feed.track(lines[i])
            out.append(line)
            feed.pos += 1
            feed.served += 1
            if faults.disconnect_at is not None and not feed.disconnect_done and feed.served >= faults.disconnect_at:
                feed.disconnect_done = True
                return out, True
            if faults.stall_at is not None and not feed.stall_done and feed.served >= faults.stall_at:
                feed.stall_done = True
                feed.stall_until = now + faults.stall_seconds
                self.next_due = feed.stall_until
                return out, False
        if feed.pos >= len(lines):
            feed.seg += 1
            feed.pos = 0
            if not feed.done:   # the recording went on in another connection: drop this one
                return out, True
        return out, False
