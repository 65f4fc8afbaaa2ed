"""The server side of Synapse's TCP replication, sans-IO, for `dcptool serve synapse` and
the tests: the per-connection protocol (SERVER and PING on connect, POSITION for every
stream on REPLICATE, PING keep-alive, ERROR on lines it cannot accept) and a deterministic
feed of RDATA lines, generated from a seed or read from a recording.

The feed is shared by all connections: its tokens move on whether or not a client is
connected, as a real writer's do, so a client that reconnects sees POSITIONs that either
continue from what it committed or show a gap.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable, Iterable, Iterator, Protocol

from dcptool.protocol.errors import RemoteError
from dcptool.protocol.synapse import commands as C
from dcptool.protocol.synapse.client import PING_INTERVAL, PING_TIMEOUT
from dcptool.protocol.synapse.framing import MAX_LINE

# Streams a stock Synapse main process announces, in its order (1.163).
ANNOUNCED_STREAMS = ("events", "backfill", "presence", "presence_federation", "typing",
                     "receipts", "push_rules", "pushers", "caches", "device_lists", "to_device",
                     "account_data", "profile_updates", "sticky_events", "thread_subscriptions",
                     "un_partial_stated_room", "un_partial_stated_event", "quarantined_media")

_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"


class Feed:
    """An ordered source of server lines (RDATA mostly) with the current token per
    (stream, instance). ``take(n)`` hands out the next lines; ``skip(n)`` drops them
    without sending (to make a gap)."""

    def __init__(self, lines: Iterable[str], instance: str = "master"):
        self._it: Iterator[str] = iter(lines)
        self.instance = instance
        self.tokens: dict[tuple[str, str], int] = {
            (s, instance): (1 if s not in ("presence_federation", "typing", "caches") else 0)
            for s in ANNOUNCED_STREAMS}
        self.done = False
        self.sent = 0

    def take(self, n: int) -> list[str]:
        out: list[str] = []
        if n <= 0 or self.done:
            return out
        for line in self._it:
            self._track(line)
            out.append(line)
            if len(out) >= n:
                break
        else:
            self.done = True
        self.sent += len(out)
        return out

    def skip(self, n: int) -> int:
        return len(self.take(n))

    def _track(self, line: str) -> None:
        if line.startswith("RDATA "):
            parts = line.split(" ", 4)
            if len(parts) == 5 and parts[3] != "batch":
                try:
                    self.tokens[(parts[1], parts[2])] = int(parts[3])
                except ValueError:
                    pass

    def positions(self) -> list[str]:
        return [C.format_line(C.Position(s, i, t, t)) for (s, i), t in self.tokens.items()]


def _id(rng: random.Random, sigil: str, n: int = 43) -> str:
    return sigil + "".join(rng.choice(_B64) for _ in range(n))


def generated_lines(seed: int, items: int | None, *, instance: str = "master",
                    server_name: str = "localhost", batch_every: int = 7) -> Iterator[str]:
    """A deterministic mix of RDATA lines shaped like Synapse's (mostly `events` rows of
    ~150 bytes, with `batch` runs, plus typing, presence, receipts, device_lists,
    account_data and to_device). ``items`` None means endless."""
    rng = random.Random(seed)
    users = [f"@user{i}:{server_name}" for i in range(8)]
    rooms = [_id(rng, "!") for _ in range(4)]
    tokens = {s: 1 for s in ANNOUNCED_STREAMS}
    tokens["typing"] = 0
    # A pool of ids reused round-robin keeps generation cheap at benchmark rates.
    pool = [_id(rng, "$") for _ in range(256)]
    types = ["m.room.message"] * 6 + ["m.reaction", "m.room.member"]
    n = 0
    k = 0
    while items is None or n < items:
        k += 1
        r = rng.random() if k % 16 == 0 else 0.0
        if r < 0.9:
            tokens["events"] += 1
            ev = pool[k & 255]
            room = rooms[k & 3]
            if k % batch_every == 0 and (items is None or n + 2 <= items):
                # a state change: the state row is batched with the event it belongs to
                yield (f'RDATA events {instance} batch ["state",["{room}","m.room.member",'
                       f'"{users[k & 7]}","{ev}"]]')
                n += 1
                yield (f'RDATA events {instance} {tokens["events"]} ["ev",["{ev}","{room}",'
                       f'"m.room.member","{users[k & 7]}",null,null,"join",0,0]]')
            else:
                yield (f'RDATA events {instance} {tokens["events"]} ["ev",["{ev}","{room}",'
                       f'"{types[k & 7]}",null,null,null,null,0,0]]')
        elif r < 0.93:
            tokens["typing"] += 1
            yield f'RDATA typing {instance} {tokens["typing"]} ["{rooms[k & 3]}",["{users[k & 7]}"]]'
        elif r < 0.95:
            tokens["presence"] += 1
            ts = 1_700_000_000_000 + k
            yield (f'RDATA presence {instance} {tokens["presence"]} ["{users[k & 7]}","online",'
                   f'{ts},{ts},{ts},null,1]')
        elif r < 0.97:
            tokens["receipts"] += 1
            yield (f'RDATA receipts {instance} {tokens["receipts"]} ["{rooms[k & 3]}","m.read",'
                   f'"{users[k & 7]}","{pool[k & 255]}",null,{{"ts":{1_700_000_000_000 + k}}}]')
        elif r < 0.98:
            tokens["device_lists"] += 1
            yield f'RDATA device_lists {instance} {tokens["device_lists"]} ["{users[k & 7]}",false,0]'
        elif r < 0.99:
            tokens["account_data"] += 1
            yield (f'RDATA account_data {instance} {tokens["account_data"]} '
                   f'["{users[k & 7]}","{rooms[k & 3]}","m.tag"]')
        else:
            tokens["to_device"] += 1
            yield f'RDATA to_device {instance} {tokens["to_device"]} ["{users[k & 7]}"]'
        n += 1


def recorded_lines(text: str) -> list[str]:
    """Server lines from a recording: the vectors' TSV (`ts<TAB>channel<TAB>line`), a TCP
    session (`ts << line`, client lines `>>` skipped), or one line per line. Only what a
    server sends is kept (RDATA, POSITION is recomputed, LOCK_RELEASED, REMOTE_SERVER_UP)."""
    out = []
    for raw in text.splitlines():
        if not raw.strip() or raw.startswith("#"):
            continue
        if "\t" in raw:
            line = raw.split("\t", 2)[-1]
        elif " << " in raw[:40]:
            line = raw.split(" << ", 1)[1]
        elif " >> " in raw[:40]:
            continue
        else:
            line = raw
        word = line.split(" ", 1)[0]
        if word in ("RDATA", "LOCK_RELEASED", "REMOTE_SERVER_UP"):
            out.append(line)
    return out


class Positions(Protocol):
    """What a connection asks of its feed: the POSITION lines that answer REPLICATE (Feed;
    playback's recorded lines carry their own)."""

    def positions(self) -> list[str]: ...


@dataclasses.dataclass
class ServerConnection:
    """One client connection, sans-IO. ``connect`` gives the greeting; ``receive`` the
    answers to the client's lines; ``tick`` the keep-alive."""
    server_name: str
    feed: Positions
    ping_interval: float = PING_INTERVAL
    timeout: float = PING_TIMEOUT
    max_line: int = MAX_LINE
    client_name: str | None = None
    replicated: bool = False
    closing: bool = False
    _last_sent: float = 0.0
    _last_recv: float = 0.0
    _ping_seen: bool = False
    wall_ms: Callable[[], int] | None = None  # gives wall-clock ms; None: derive from `now`

    def _ms(self, now: float) -> int:
        return self.wall_ms() if self.wall_ms is not None else int(now * 1000)

    def connect(self, now: float) -> list[str]:
        self._last_sent = self._last_recv = now
        return [C.format_line(C.Server(self.server_name)), C.format_line(C.Ping(str(self._ms(now))))]

    def receive(self, lines: list[bytes], now: float) -> list[str]:
        out: list[str] = []
        if lines:
            self._last_recv = now
        for raw in lines:
            if not raw.strip():
                continue
            try:
                cmd = C.parse_line(raw.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(C.format_line(C.Error("invalid UTF-8")))
                continue
            except RemoteError as exc:
                out.append(C.format_line(C.Error(f"failed to parse line: {exc.message}")))
                continue
            name = cmd.NAME
            if name not in C.CLIENT_COMMANDS:
                out.append(C.format_line(C.Error(f"invalid command: {name}")))
                continue
            if isinstance(cmd, C.Name):
                self.client_name = cmd.data
            elif isinstance(cmd, C.Ping):
                self._ping_seen = True
            elif isinstance(cmd, C.Replicate):
                self.replicated = True
                out.extend(self.feed.positions())
        return out

    def sent(self, now: float) -> None:
        self._last_sent = now

    def tick(self, now: float) -> tuple[list[str], bool]:
        """(lines to send, close?)"""
        if self._ping_seen and now - self._last_recv > self.timeout:
            self.closing = True
            return [C.format_line(C.Error("ping timeout"))], True
        if now - self._last_sent >= self.ping_interval:
            self._last_sent = now
            return [C.format_line(C.Ping(str(self._ms(now))))], False
        return [], False
