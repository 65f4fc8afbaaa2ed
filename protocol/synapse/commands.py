"""Synapse replication commands (synapse/replication/tcp/commands.py, Synapse 1.163).

One frozen dataclass per command. ``Cmd.from_line(rest)`` parses the text after the command
word, ``cmd.to_line()`` gives that text back, and ``parse_line`` / ``format_line`` work on
whole lines. JSON parts (RDATA rows, USER_IP and LOCK_RELEASED arguments) are kept as the
exact text received, so that re-encoding a parsed line gives the same line; the decoded
values are available as properties. A command word we do not know is kept as ``Unknown``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, ClassVar, Protocol, TypeVar, Union

from dcptool.protocol.errors import ErrorCode, LocalError, RemoteError
from dcptool.protocol.text import printable

# Synapse encodes JSON compactly and refuses NaN (synapse/util/json.py).
_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"), ensure_ascii=False)

USER_IP_CHANNEL_SUFFIX = "/USER_IP"


# Tokens and other integers are int64 columns in captures (as in Synapse's Postgres schema).
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# Deepest JSON nesting we parse. Synapse's own rows nest a few levels; orjson (our JSON
# output) refuses more than 254 and Python's parser recurses, so a hostile row of 100k
# brackets would otherwise crash the process instead of being shown as a decode error.
MAX_JSON_DEPTH = 128

_BRACKETS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def json_too_deep(text: str | bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when a JSON text nests arrays and objects deeper than ``limit`` (brackets inside
    strings do not count). Cheap for normal rows: their bracket count is below the limit."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        text = bytes(text).decode("utf-8", "replace")
    if text.count("[") + text.count("{") <= limit:
        return False
    depth = 0
    for m in _BRACKETS.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > limit:
                return True
        elif c in "]}":
            depth -= 1
    return False


def loads_bounded(text: str | bytes) -> Any:
    """json.loads refusing (ValueError) nesting deeper than MAX_JSON_DEPTH."""
    if json_too_deep(text):
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None


def encode_json(value: object) -> str:
    return _ENCODER.encode(value)


def _int(text: str, what: str, cmd: str) -> int:
    # Only canonical decimal integers: anything else would not re-encode to the same text.
    body = text[1:] if text[:1] == "-" else text
    if not body.isdigit() or not body.isascii() or (len(body) > 1 and body[0] == "0"):
        raise RemoteError(ErrorCode.BAD_COMMAND, f"{cmd}: {what} is not an integer: {text!r}")
    # (a length check first: int() of thousands of digits is slow, or refused)
    value = int(text) if len(body) <= 19 else None
    if value is None or not INT64_MIN <= value <= INT64_MAX:
        raise RemoteError(ErrorCode.BAD_COMMAND,
                          f"{cmd}: {what} does not fit in int64: {printable(text[:40])}"
                          + ("..." if len(text) > 40 else ""))
    return value


def _split(rest: str, n: int, cmd: str, form: str) -> list[str]:
    parts = rest.split(" ", n - 1)
    if len(parts) != n:
        raise RemoteError(ErrorCode.BAD_COMMAND, f"{cmd}: expected `{cmd} {form}`, got {rest!r}")
    return parts


def _json(text: str, cmd: str) -> Any:
    try:
        return loads_bounded(text)
    except ValueError as exc:
        raise RemoteError(ErrorCode.BAD_COMMAND, f"{cmd}: invalid JSON: {exc}") from None


_S = TypeVar("_S", bound="_Simple")


@dataclasses.dataclass(frozen=True, slots=True)
class _Simple:
    """A command whose whole argument is one opaque string."""
    data: str
    NAME: ClassVar[str] = ""

    @classmethod
    def from_line(cls: type[_S], rest: str) -> _S:
        return cls(rest)

    def to_line(self) -> str:
        return self.data


@dataclasses.dataclass(frozen=True, slots=True)
class Server(_Simple):
    """SERVER <server_name>: first line from a TCP replication server."""
    NAME: ClassVar[str] = "SERVER"


@dataclasses.dataclass(frozen=True, slots=True)
class Error(_Simple):
    """ERROR <text>: the peer complains; over TCP it usually closes next."""
    NAME: ClassVar[str] = "ERROR"


@dataclasses.dataclass(frozen=True, slots=True)
class Ping(_Simple):
    """PING <ms since epoch>: keep-alive, sent at least every 5 s over TCP."""
    NAME: ClassVar[str] = "PING"


@dataclasses.dataclass(frozen=True, slots=True)
class Name(_Simple):
    """NAME <client name>: the client introduces itself (TCP)."""
    NAME: ClassVar[str] = "NAME"


@dataclasses.dataclass(frozen=True, slots=True)
class RemoteServerUp(_Simple):
    """REMOTE_SERVER_UP <server>: a remote homeserver came back."""
    NAME: ClassVar[str] = "REMOTE_SERVER_UP"


@dataclasses.dataclass(frozen=True, slots=True)
class NewActiveTask(_Simple):
    """NEW_ACTIVE_TASK <task_id>: the task scheduler has a new task to run."""
    NAME: ClassVar[str] = "NEW_ACTIVE_TASK"


@dataclasses.dataclass(frozen=True, slots=True)
class CancelTask(_Simple):
    """CANCEL_TASK <task_id>."""
    NAME: ClassVar[str] = "CANCEL_TASK"


@dataclasses.dataclass(frozen=True, slots=True)
class ClearUserSync(_Simple):
    """CLEAR_USER_SYNC <instance_id>: forget the syncing users of an instance."""
    NAME: ClassVar[str] = "CLEAR_USER_SYNC"

    @property
    def instance_id(self) -> str:
        return self.data


@dataclasses.dataclass(frozen=True, slots=True)
class Replicate:
    """REPLICATE: ask for a POSITION of every stream. Synapse sends ``REPLICATE `` (with a
    trailing space, an empty argument); ``trailing_space`` keeps what was received."""
    trailing_space: bool = True
    NAME: ClassVar[str] = "REPLICATE"

    @classmethod
    def from_line(cls, rest: str) -> Replicate:
        return cls(True)

    def to_line(self) -> str:
        return ""


@dataclasses.dataclass(frozen=True, slots=True)
class Rdata:
    """RDATA <stream> <instance> <token|batch> <row json>. ``token`` None means `batch`:
    the row belongs to the next RDATA of the same stream with a numeric token."""
    stream: str
    instance: str
    token: int | None
    row_json: str
    NAME: ClassVar[str] = "RDATA"

    @classmethod
    def from_line(cls, rest: str) -> Rdata:
        stream, instance, token, row = _split(rest, 4, "RDATA", "<stream> <instance> <token> <row>")
        tok = None if token == "batch" else _int(token, "token", "RDATA")
        return cls(stream, instance, tok, row)

    @classmethod
    def make(cls, stream: str, instance: str, token: int | None, row: object) -> Rdata:
        return cls(stream, instance, token, encode_json(row))

    def to_line(self) -> str:
        tok = "batch" if self.token is None else str(self.token)
        return f"{self.stream} {self.instance} {tok} {self.row_json}"

    @property
    def row(self) -> Any:
        return _json(self.row_json, "RDATA")

    @property
    def batch(self) -> bool:
        return self.token is None


@dataclasses.dataclass(frozen=True, slots=True)
class Position:
    """POSITION <stream> <instance> <prev_token> <new_token>: the writer's stream moved
    from prev_token to new_token; a reader behind prev_token has missed rows."""
    stream: str
    instance: str
    prev_token: int
    new_token: int
    NAME: ClassVar[str] = "POSITION"

    @classmethod
    def from_line(cls, rest: str) -> Position:
        stream, instance, prev, new = _split(rest, 4, "POSITION",
                                             "<stream> <instance> <prev_token> <new_token>")
        return cls(stream, instance, _int(prev, "prev_token", "POSITION"),
                   _int(new, "new_token", "POSITION"))

    def to_line(self) -> str:
        return f"{self.stream} {self.instance} {self.prev_token} {self.new_token}"


@dataclasses.dataclass(frozen=True, slots=True)
class UserSync:
    """USER_SYNC <instance_id> <user_id> <device_id|None> start|end <last_sync_ms>."""
    instance_id: str
    user_id: str
    device_id: str | None
    is_syncing: bool
    last_sync_ms: int
    NAME: ClassVar[str] = "USER_SYNC"

    @classmethod
    def from_line(cls, rest: str) -> UserSync:
        inst, user, device, state, last = _split(
            rest, 5, "USER_SYNC", "<instance_id> <user_id> <device_id> start|end <last_sync_ms>")
        if state not in ("start", "end"):
            raise RemoteError(ErrorCode.BAD_COMMAND, f"USER_SYNC: state {state!r} is not start|end")
        return cls(inst, user, None if device == "None" else device, state == "start",
                   _int(last, "last_sync_ms", "USER_SYNC"))

    def to_line(self) -> str:
        return (f"{self.instance_id} {self.user_id} {self.device_id} "
                f"{'start' if self.is_syncing else 'end'} {self.last_sync_ms}")


@dataclasses.dataclass(frozen=True, slots=True)
class FederationAck:
    """FEDERATION_ACK <instance> <token>: the federation sender has handled up to token."""
    instance: str
    token: int
    NAME: ClassVar[str] = "FEDERATION_ACK"

    @classmethod
    def from_line(cls, rest: str) -> FederationAck:
        parts = rest.split(" ")
        if len(parts) != 2:
            raise RemoteError(ErrorCode.BAD_COMMAND, f"FEDERATION_ACK: expected <instance> <token>, got {rest!r}")
        return cls(parts[0], _int(parts[1], "token", "FEDERATION_ACK"))

    def to_line(self) -> str:
        return f"{self.instance} {self.token}"


@dataclasses.dataclass(frozen=True, slots=True)
class UserIp:
    """USER_IP <user_id> <json [access_token, ip, user_agent, device_id, last_seen]>, on the
    Redis channel ``<server_name>/USER_IP``. It carries an access token: see ``redacted``."""
    user_id: str
    json_text: str
    NAME: ClassVar[str] = "USER_IP"

    @classmethod
    def from_line(cls, rest: str) -> UserIp:
        user, text = _split(rest, 2, "USER_IP", "<user_id> <json>")
        value = _json(text, "USER_IP")
        if not isinstance(value, list) or len(value) != 5:
            raise RemoteError(ErrorCode.BAD_COMMAND, "USER_IP: expected a JSON array of 5 items")
        return cls(user, text)

    @classmethod
    def make(cls, user_id: str, access_token: str, ip: str, user_agent: str, device_id: str | None,
             last_seen: int) -> UserIp:
        return cls(user_id, encode_json([access_token, ip, user_agent, device_id, last_seen]))

    def to_line(self) -> str:
        return f"{self.user_id} {self.json_text}"

    @property
    def fields(self) -> dict[str, Any]:
        token, ip, ua, device, last = loads_bounded(self.json_text)
        return {"access_token": token, "ip": ip, "user_agent": ua, "device_id": device,
                "last_seen": last}


@dataclasses.dataclass(frozen=True, slots=True)
class LockReleased:
    """LOCK_RELEASED <json [instance, lock_name, lock_key]>."""
    json_text: str
    NAME: ClassVar[str] = "LOCK_RELEASED"

    @classmethod
    def from_line(cls, rest: str) -> LockReleased:
        value = _json(rest, "LOCK_RELEASED")
        if not isinstance(value, list) or len(value) != 3:
            raise RemoteError(ErrorCode.BAD_COMMAND, "LOCK_RELEASED: expected a JSON array of 3 items")
        return cls(rest)

    def to_line(self) -> str:
        return self.json_text

    @property
    def fields(self) -> dict[str, Any]:
        inst, name, key = loads_bounded(self.json_text)
        return {"instance": inst, "lock_name": name, "lock_key": key}


@dataclasses.dataclass(frozen=True, slots=True)
class Unknown:
    """A command word Synapse did not define when this was written: kept, not an error."""
    name: str
    rest: str | None  # None when the line had no space after the word

    @property
    def NAME(self) -> str:  # noqa: N802 - same attribute as the known commands
        return self.name

    def to_line(self) -> str:
        return self.rest or ""


Command = Union[Server, Rdata, Position, Error, Ping, Name, Replicate, UserSync, ClearUserSync,
                FederationAck, UserIp, RemoteServerUp, LockReleased, NewActiveTask, CancelTask,
                Unknown]

class _CommandClass(Protocol):
    """A known command's class: its word and the parser of the text after it."""
    NAME: str

    def from_line(self, rest: str) -> Command: ...


COMMANDS: dict[str, _CommandClass] = {c.NAME: c for c in (
    Server, Rdata, Position, Error, Ping, Name, Replicate, UserSync, ClearUserSync,
    FederationAck, UserIp, RemoteServerUp, LockReleased, NewActiveTask, CancelTask)}

# What each side may send (Synapse's VALID_SERVER_COMMANDS / VALID_CLIENT_COMMANDS).
SERVER_COMMANDS = frozenset({"SERVER", "RDATA", "POSITION", "ERROR", "PING", "REMOTE_SERVER_UP",
                             "LOCK_RELEASED"})
CLIENT_COMMANDS = frozenset({"NAME", "REPLICATE", "PING", "USER_SYNC", "CLEAR_USER_SYNC",
                             "FEDERATION_ACK", "USER_IP", "ERROR", "REMOTE_SERVER_UP",
                             "LOCK_RELEASED"})


def split_word(line: str) -> tuple[str, str | None]:
    """'RDATA a b' -> ('RDATA', 'a b'); 'REPLICATE' -> ('REPLICATE', None)."""
    idx = line.find(" ")
    if idx < 0:
        return line, None
    return line[:idx], line[idx + 1:]


def parse_line(line: str) -> Command:
    """Parse one line (no newline). Raises RemoteError(BAD_COMMAND) when a known command's
    arguments do not parse; unknown command words give ``Unknown``."""
    name, rest = split_word(line)
    cls = COMMANDS.get(name)
    if cls is None:
        return Unknown(name, rest)
    if cls is Replicate:
        return Replicate(rest is not None)
    if rest is None:
        raise RemoteError(ErrorCode.BAD_COMMAND, f"{name} without arguments")
    return cls.from_line(rest)


def format_line(cmd: Command) -> str:
    """The whole line (without newline) for ``cmd``; ``parse_line(format_line(c)) == c``."""
    if isinstance(cmd, Unknown):
        return cmd.name if cmd.rest is None else f"{cmd.name} {cmd.rest}"
    if isinstance(cmd, Replicate):
        return "REPLICATE " if cmd.trailing_space else "REPLICATE"
    rest = cmd.to_line()
    if "\n" in rest:
        raise LocalError(ErrorCode.BAD_COMMAND, f"{cmd.NAME}: newline inside a command")
    return f"{cmd.NAME} {rest}"


def encode_line(cmd: Command) -> bytes:
    """The line as bytes with its newline (TCP framing)."""
    return format_line(cmd).encode("utf-8") + b"\n"


def redis_channel(cmd: Command, server_name: str) -> str:
    """The Redis channel Synapse publishes ``cmd`` on."""
    return server_name + USER_IP_CHANNEL_SUFFIX if isinstance(cmd, UserIp) else server_name


def redact_user_ip(line: bytes) -> bytes:
    """Replace the access token in a USER_IP line by '*' of the same length (like the SASL
    redaction in DCP captures); any other line is returned unchanged."""
    if not line.startswith(b"USER_IP "):
        return line
    try:
        _, rest = line.split(b" ", 1)
        user, text = rest.split(b" ", 1)
        value = loads_bounded(text)
        token = value[0]
    except (ValueError, IndexError, TypeError, KeyError):
        return line
    if not isinstance(token, str) or not token:
        return line
    needle = encode_json(token).encode("utf-8")  # the token as it appears, quoted
    start = len(b"USER_IP ") + len(user) + 1
    idx = line.find(needle, start)
    if idx < 0:
        return line
    return line[:idx + 1] + b"*" * (len(needle) - 2) + line[idx + len(needle) - 1:]
