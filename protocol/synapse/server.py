"""The server side of Synapse's TCP replication, sans-IO, for `dcptool serve synapse` and
the tests: the per-connection protocol (SERVER and PING on connect, POSITION for every
stream on REPLICATE, PING keep-alive, ERROR on lines it cannot accept) and a deterministic
feed of RDATA lines, generated from a seed or read from a recording.

The feed is shared by all connections: its tokens move on whether or not a client is
connected, as a real writer's do, so a client that reconnects sees POSITIONs that either
continue from what it committed or show a gap.
"""

from __future__ import annotations

import base64
import bisect
import dataclasses
import hashlib
import json
import random
import urllib.parse
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
HISTORY_ROWS = 4_000_000      # rows kept per stream for the catch-up endpoint
PAGE_ROWS = 100               # rows per catch-up answer, as Synapse's _STREAM_UPDATE_TARGET_ROW_COUNT


class Feed:
    """An ordered source of server lines (RDATA mostly) with the current token per
    (stream, instance). ``take(n)`` hands out the next lines; ``skip(n)`` drops them
    without sending (to make a gap)."""

    def __init__(self, lines: Iterable[str], instance: str = "master", keep_history: bool = False):
        self._it: Iterator[str] = iter(lines)
        self.instance = instance
        self.keep_history = keep_history
        # with keep_history (a catch-up endpoint to answer): what was handed out, per (stream,
        # instance): (token, row JSON), `batch` rows under the token of the row that closes
        # them; bounded
        self.history: dict[tuple[str, str], list[tuple[int, str]]] = {}
        self.horizon: dict[tuple[str, str], int] = {}     # rows at or below it were let go
        self._open: dict[tuple[str, str], list[str]] = {}
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
            if len(parts) != 5:
                return
            key = (parts[1], parts[2])
            if parts[3] == "batch":
                if self.keep_history:
                    self._open.setdefault(key, []).append(parts[4])
                return
            try:
                token = int(parts[3])
            except ValueError:
                return
            self.tokens[key] = token
            if not self.keep_history:
                return
            rows = self.history.setdefault(key, [])
            rows.extend((token, r) for r in self._open.pop(key, ()))
            rows.append((token, parts[4]))
            if len(rows) > HISTORY_ROWS:
                cut = len(rows) - HISTORY_ROWS // 2
                self.horizon[key] = rows[cut - 1][0]
                del rows[:cut]

    def updates(self, stream: str, instance: str, from_token: int, upto_token: int,
                limit: int = PAGE_ROWS) -> tuple[list[tuple[int, str]], int, bool] | None:
        """Synapse's get_updates_since for this feed: the rows with from < token <= upto, at
        most about `limit` (whole tokens), the token answered up to, and whether there is more.
        None when the rows asked for were let go (older than the history kept)."""
        key = (stream, instance)
        if from_token < self.horizon.get(key, 0):
            return None
        rows = self.history.get(key, [])
        lo = bisect.bisect_right(rows, from_token, key=lambda r: r[0])
        hi = bisect.bisect_right(rows, upto_token, key=lambda r: r[0])
        if hi - lo <= limit:
            return rows[lo:hi], upto_token, False
        end = lo + limit
        last = rows[end - 1][0]
        while end < hi and rows[end][0] == last:   # a token's rows go in one page
            end += 1
        return rows[lo:end], last, True

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
    # Every event has an id of its own, as Synapse's (a hash of the event): 43 URL-safe
    # base64 characters of a keyed BLAKE2b of the event's number, cheap at benchmark rates.
    key = seed.to_bytes(8, "little", signed=True)

    def event_id(k: int) -> str:
        digest = hashlib.blake2b(k.to_bytes(8, "little"), key=key, digest_size=32).digest()
        return "$" + base64.urlsafe_b64encode(digest).decode()[:43]
    last_ev = event_id(0)
    types = ["m.room.message"] * 6 + ["m.reaction", "m.room.member"]
    n = 0
    k = 0
    while items is None or n < items:
        k += 1
        r = rng.random() if k % 16 == 0 else 0.0
        if r < 0.9:
            tokens["events"] += 1
            ev = last_ev = event_id(k)
            room = rooms[k & 3]
            if k % batch_every == 0 and (items is None or n + 2 <= items):
                # a state event, as Synapse replicates one: its `ev` row batched with the
                # `state` row that closes the token
                yield (f'RDATA events {instance} batch ["ev",["{ev}","{room}",'
                       f'"m.room.member","{users[k & 7]}",null,null,"join",0,0]]')
                n += 1
                yield (f'RDATA events {instance} {tokens["events"]} ["state",["{room}","m.room.member",'
                       f'"{users[k & 7]}","{ev}"]]')
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
                   f'"{users[k & 7]}","{last_ev}",null,{{"ts":{1_700_000_000_000 + k}}}]')
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


UPDATES_PATH = "/_synapse/replication/get_repl_stream_updates/"


def catch_up_answer(feed: Feed, target: str, authorization: str | None,
                    secret: str | None) -> tuple[int, bytes]:
    """The answer (status, JSON body) of the replication listener to GET ``target``, as a
    Synapse writer answers get_repl_stream_updates for its own instance: 401 without the
    right `Bearer` secret when one is set, 400 for an unknown stream or bad tokens, 404 for
    another path."""
    def answer(status: int, doc: dict[str, object]) -> tuple[int, bytes]:
        return status, json.dumps(doc, separators=(",", ":")).encode()
    if secret is not None and authorization != f"Bearer {secret}":
        return answer(401, {"errcode": "M_UNAUTHORIZED", "error": "Invalid Authorization header."})
    path, _, query = target.partition("?")
    if not path.startswith(UPDATES_PATH):
        return answer(404, {"errcode": "M_UNRECOGNIZED", "error": "Unrecognized request"})
    parts = [urllib.parse.unquote(p) for p in path[len(UPDATES_PATH):].split("/") if p]
    args = urllib.parse.parse_qs(query)
    if len(parts) not in (1, 2) or (parts[0], feed.instance) not in feed.tokens:
        return answer(400, {"errcode": "M_UNKNOWN", "error": "Unknown stream"})
    try:
        lo, hi = int(args["from_token"][0]), int(args["upto_token"][0])
    except (KeyError, ValueError):
        return answer(400, {"errcode": "M_INVALID_PARAM", "error": "from_token and upto_token are required integers"})
    got = feed.updates(parts[0], feed.instance, lo, hi)
    if got is None:
        return answer(400, {"errcode": "M_UNKNOWN", "error": "rows no longer kept"})
    rows, upto, limited = got
    body = ('{"updates":[' + ",".join(f"[{t},{r}]" for t, r in rows)
            + f'],"upto_token":{upto},"limited":{"true" if limited else "false"}}}')
    return 200, body.encode()
