"""The replication client's state machine, sans-IO: lines in, lines to send and events out;
time is always passed in (seconds, any monotonic origin).

What it keeps, per (stream, instance):
- the committed token: the token of the last RDATA with a numeric token. RDATA rows with
  the token ``batch`` belong to the next numeric RDATA of the same stream and instance
  (Synapse's batch rule); until it arrives they are pending, not committed.
- POSITION checks: Synapse's reader considers itself caught up when
  ``prev_token <= committed <= new_token``. A reader behind ``prev_token`` missed rows
  (a gap it cannot fetch over this protocol); one ahead of ``new_token`` sees the writer
  go back (a restarted server). Both are reported as ``Gap``; then the committed token
  moves to ``new_token`` and pending batch rows are dropped, as Synapse does.

Keep-alive (TCP only): send PING when nothing was sent for ``ping_interval``; once a PING was
received, a connection silent for ``timeout`` is dead (RemoteError DEAD_CONNECTION).

The per-line work for RDATA is one dict update (the split is shared with the capture, see
bulk.py) because it runs for every line of a capture.
"""

from __future__ import annotations

import dataclasses
from typing import Union

from dcptool.protocol.errors import ErrorCode, RemoteError
from dcptool.protocol.synapse import commands as C
from dcptool.protocol.synapse.bulk import Scan, SplitLines, split_lines
from dcptool.protocol.text import printable

PING_INTERVAL = 5.0
PING_TIMEOUT = 25.0


@dataclasses.dataclass(frozen=True, slots=True)
class Gap:
    """A POSITION that does not continue from what we had committed."""
    stream: str
    instance: str
    committed: int
    prev_token: int
    new_token: int

    @property
    def kind(self) -> str:
        return "missed" if self.committed < self.prev_token else "rewind"


@dataclasses.dataclass(frozen=True, slots=True)
class ServerError:
    """The server sent ERROR."""
    text: str


@dataclasses.dataclass(frozen=True, slots=True)
class ServerName:
    name: str


Event = Union[Gap, ServerError, ServerName]


class SynapseClient:
    def __init__(self, name: str = "dcptool", *, expected_server: str | None = None,
                 replicate: bool = True, keepalive: bool = True,
                 ping_interval: float = PING_INTERVAL, timeout: float = PING_TIMEOUT,
                 committed: dict[tuple[str, str], int] | None = None, wait_for_position: bool = False):
        self.name = name
        # As a Synapse worker (replication/tcp/handler.py): after a (re)connection, RDATA of a
        # stream we hold a token of commits nothing until that stream's POSITION came on this
        # connection, so the POSITION's gap covers every row between (a catch-up fetches them).
        self.wait_for_position = wait_for_position
        self._unpositioned: set[tuple[bytes, bytes]] = set()
        self.expected_server = expected_server
        self.replicate = replicate
        self.keepalive = keepalive
        self.ping_interval = ping_interval
        self.timeout = timeout
        self._committed: dict[tuple[bytes, bytes], int] = {}
        for (stream, inst), tok in (committed or {}).items():
            self._committed[(stream.encode(), inst.encode())] = int(tok)
        self._pending: dict[tuple[bytes, bytes], int] = {}
        self.gaps: list[Gap] = []
        self.server_name: str | None = None
        self.error: RemoteError | None = None
        self.connections = 0
        self.data_lines = 0  # RDATA and POSITION lines received, over all connections
        self.positions_seen: set[tuple[str, str]] = set()
        self._last_sent = 0.0
        self._last_recv = 0.0
        self._ping_seen = False

    # -- connection lifecycle -------------------------------------------------------------
    def connect(self, now: float, wall_ms: int | None = None) -> list[str]:
        """A (re)connection was made: reset what belongs to the connection and return the
        lines to send (TCP: NAME, PING, REPLICATE; Redis: REPLICATE only)."""
        self.connections += 1
        self._pending.clear()
        if self.wait_for_position:
            self._unpositioned = set(self._committed)
        self.server_name = None
        self.error = None
        self._ping_seen = False
        self._last_recv = now
        self._last_sent = now
        out = []
        if self.keepalive:
            ms = wall_ms if wall_ms is not None else int(now * 1000)
            out += [C.format_line(C.Name(self.name)), C.format_line(C.Ping(str(ms)))]
        if self.replicate:
            out.append(C.format_line(C.Replicate(not self.keepalive)))
        return out

    def connection_lost(self) -> None:
        # Rows of an unfinished batch never get a token: they will come again (or be
        # covered by the next POSITION), so they are not committed.
        self._pending.clear()

    # -- time -------------------------------------------------------------------------------
    def sent(self, now: float) -> None:
        self._last_sent = now

    def next_deadline(self) -> float | None:
        if not self.keepalive:
            return None
        d = self._last_sent + self.ping_interval
        if self._ping_seen:
            d = min(d, self._last_recv + self.timeout)
        return d

    def tick(self, now: float, wall_ms: int | None = None) -> list[str]:
        """Called when a deadline passes. Returns lines to send; raises RemoteError
        (DEAD_CONNECTION) when the server has been silent for the timeout."""
        if not self.keepalive:
            return []
        if self._ping_seen and now - self._last_recv > self.timeout:
            raise RemoteError(ErrorCode.DEAD_CONNECTION,
                              f"nothing received from the replication server for "
                              f"{now - self._last_recv:.1f} s (timeout {self.timeout:g} s)")
        if now - self._last_sent >= self.ping_interval:
            self._last_sent = now
            ms = wall_ms if wall_ms is not None else int(now * 1000)
            return [C.format_line(C.Ping(str(ms)))]
        return []

    # -- receiving --------------------------------------------------------------------------
    def receive(self, lines: list[bytes], now: float, split: SplitLines | None = None) -> list[Event]:
        """Feed received lines (without newline); ``split`` is ``split_lines(lines)`` when
        the caller already has it. Returns events (Gap, ServerError, ServerName). A
        condition we cannot continue from is left in ``self.error`` after all lines were
        processed, so the caller can record them first."""
        if not lines:
            return []
        self._last_recv = now
        if split is None:
            split = split_lines(lines)
        events: list[Event] = []
        committed = self._committed
        pending = self._pending
        slow = split.slow
        parts = split.parts
        self.data_lines += len(lines) - len(slow)
        start = 0
        held = self._unpositioned
        for stop in slow + [len(lines)]:
            # a run of plain RDATA lines, then one other line
            for p, tok in zip(parts[start:stop], split.tokens[start:stop]):
                key = (p[1], p[2])
                if held and key in held:
                    continue        # before this stream's POSITION on this connection
                if tok is None:
                    pending[key] = pending.get(key, 0) + 1
                else:
                    committed[key] = tok
                    if pending:
                        pending.pop(key, None)
            if stop < len(lines) and lines[stop]:
                self._other(lines[stop], events)
            start = stop + 1
        return events

    def receive_scan(self, scan: Scan, now: float) -> list[Event]:
        """Like ``receive`` for a bulk.Scan block; a block of only well-formed RDATA lines is
        applied with numpy (last numeric token per key, batch rows after it pending)."""
        if scan.n == 0:
            return []
        if not scan.all_fast or self._unpositioned:
            return self.receive(scan.lines(), now)
        import numpy as np
        self._last_recv = now
        self.data_lines += scan.n
        nk = len(scan.keys)
        numeric = np.flatnonzero(~scan.is_batch)
        last = np.full(nk, -1, np.int64)
        np.maximum.at(last, scan.inv[numeric], numeric)
        bidx = np.flatnonzero(scan.is_batch)
        after = bidx > last[scan.inv[bidx]]
        counts = np.bincount(scan.inv[bidx[after]], minlength=nk)
        tokens = scan.tokens
        for u, key in enumerate(scan.keys):
            if last[u] >= 0:
                self._committed[key] = int(tokens[last[u]])
                if counts[u]:
                    self._pending[key] = int(counts[u])
                else:
                    self._pending.pop(key, None)
            elif counts[u]:
                self._pending[key] = self._pending.get(key, 0) + int(counts[u])
        return []

    def _other(self, line: bytes, events: list[Event]) -> None:
        try:
            cmd = C.parse_line(line.decode("utf-8"))
        except (UnicodeDecodeError, RemoteError):
            return  # recorded with its decode_error by the capture; nothing to track
        if isinstance(cmd, C.Position):
            self.data_lines += 1
            key = (cmd.stream.encode(), cmd.instance.encode())
            self.positions_seen.add((cmd.stream, cmd.instance))
            have = self._committed.get(key)
            if have is not None and not (cmd.prev_token <= have <= cmd.new_token):
                gap = Gap(cmd.stream, cmd.instance, have, cmd.prev_token, cmd.new_token)
                self.gaps.append(gap)
                events.append(gap)
            self._committed[key] = cmd.new_token
            self._pending.pop(key, None)
            self._unpositioned.discard(key)
        elif isinstance(cmd, C.Ping):
            self._ping_seen = True
        elif isinstance(cmd, C.Server):
            self.server_name = cmd.data
            events.append(ServerName(cmd.data))
            if self.expected_server is not None and cmd.data != self.expected_server and self.error is None:
                self.error = RemoteError(
                    ErrorCode.SERVER_NAME_MISMATCH,
                    f"the replication server calls itself {printable(repr(cmd.data))}, expected "
                    f"{printable(repr(self.expected_server))} (check ?server_name= in the source URL)")
        elif isinstance(cmd, C.Error):
            events.append(ServerError(cmd.data))
            if self.error is None:
                self.error = RemoteError(ErrorCode.SERVER_ERROR,
                                         f"the replication server sent ERROR: {printable(cmd.data)}")

    # -- state ------------------------------------------------------------------------------
    def committed(self) -> dict[tuple[str, str], int]:
        """Committed token per (stream, instance)."""
        return {(s.decode("utf-8", "replace"), i.decode("utf-8", "replace")): t
                for (s, i), t in self._committed.items()}

    def pending(self) -> dict[tuple[str, str], int]:
        """Rows of unfinished batches per (stream, instance)."""
        return {(s.decode("utf-8", "replace"), i.decode("utf-8", "replace")): n
                for (s, i), n in self._pending.items() if n}


def effective_tokens(rdata: list[C.Rdata]) -> list[int | None]:
    """The token each RDATA row is committed under: its own, or for a ``batch`` row the
    token of the next numeric RDATA of the same (stream, instance); None if the batch
    never closed."""
    out: list[int | None] = [None] * len(rdata)
    open_rows: dict[tuple[str, str], list[int]] = {}
    for i, cmd in enumerate(rdata):
        key = (cmd.stream, cmd.instance)
        if cmd.token is None:
            open_rows.setdefault(key, []).append(i)
            continue
        out[i] = cmd.token
        for j in open_rows.pop(key, ()):
            out[j] = cmd.token
    return out
