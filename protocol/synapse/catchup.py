"""Catch-up of missed replication rows, sans-IO: what a Synapse worker does when a POSITION
shows that a stream moved on while it was not listening.

A worker that holds token ``committed`` for (stream, instance) and receives ``POSITION stream
instance prev new`` with ``committed < prev`` asks the stream's writer (the process named by
``instance``) for the rows it missed:

    GET /_synapse/replication/get_repl_stream_updates/<stream>/<txn_id>?from_token=C&upto_token=N
    Authorization: Bearer <worker_replication_secret>

and gets ``{"updates": [[token, row], ...], "upto_token": U, "limited": bool}``: the rows with
``C < token <= U``; ``limited`` means "ask again from U" (a page). Synapse's own client
(synapse/replication/tcp/handler.py, ``_process_position``) then treats the rows as RDATA.

This module plans those requests (``Fetch``), checks an answer (``parse_page``) and turns a
page into the RDATA lines the writer would have sent live (``page_lines``): the row JSON
encoded as Synapse encodes it (compact separators, ASCII escapes), rows sharing a token sent
with the token ``batch`` but the last, as Synapse's ``_batch_updates`` does. A page ends with
``POSITION stream instance from upto``: the range the writer vouched for (replay fills a gap
with it). The capture records these lines with the direction ``catch-up`` (CAPTURE_FORMAT.md).
"""

from __future__ import annotations

import dataclasses
import json
import re
import urllib.parse

from dcptool.protocol.errors import ErrorCode, RemoteError
from dcptool.protocol.synapse import commands as C
from dcptool.protocol.text import printable

PATH = "/_synapse/replication/get_repl_stream_updates"
MAX_PAGES = 10_000          # a writer that pages forever (limited=true, no progress) is cut off
MAX_ANSWER = 256 * 1024 * 1024  # bytes of one answer's body
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"))


@dataclasses.dataclass(frozen=True, slots=True)
class Page:
    """One answer: the rows (token, row JSON text as Synapse sends it in RDATA), the token the
    writer answered up to, and whether there is more."""
    updates: tuple[tuple[int, str], ...]
    upto_token: int
    limited: bool


def valid_name(name: str) -> bool:
    """A stream or instance name we put in a URL or a line (Synapse's are word characters)."""
    return bool(_NAME.match(name))


def request_target(stream: str, from_token: int, upto_token: int, txn: str) -> str:
    """The request target (path and query) of one page."""
    if not valid_name(stream):
        raise ValueError(f"not a stream name: {stream!r}")
    query = urllib.parse.urlencode({"from_token": from_token, "upto_token": upto_token})
    return f"{PATH}/{urllib.parse.quote(stream, safe='')}/{urllib.parse.quote(txn, safe='')}?{query}"


def parse_page(body: bytes, from_token: int, upto_token: int) -> Page:
    """Check one answer's JSON. Every row's token must lie in (from_token, answered upto], the
    tokens must not go down, and the answered upto must lie in (from_token, upto_token] (a
    page that makes no progress is an error: asking again would loop)."""
    def bad(why: str) -> RemoteError:
        return RemoteError(ErrorCode.BAD_CATCH_UP, f"catch-up answer: {why}")
    if len(body) > MAX_ANSWER:
        raise bad(f"{len(body)} bytes, above the {MAX_ANSWER} bytes accepted")
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"not JSON ({printable(str(exc))[:80]})") from None
    if not isinstance(doc, dict):
        raise bad("not a JSON object")
    updates, upto, limited = doc.get("updates"), doc.get("upto_token"), doc.get("limited")
    if not isinstance(updates, list) or not isinstance(limited, bool) or type(upto) is not int:
        raise bad("needs updates (a list), upto_token (an integer) and limited (a boolean)")
    if not from_token <= upto <= upto_token or (limited and upto == from_token):
        raise bad(f"upto_token {upto} outside ({from_token}, {upto_token}]")
    out: list[tuple[int, str]] = []
    last = from_token
    for item in updates:
        if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int):
            raise bad("an update is not [token, row]")
        token = item[0]
        if not last <= token <= upto or token == from_token:
            raise bad(f"row token {token} outside ({from_token}, {upto}] or going back")
        last = token
        try:
            out.append((token, _ENCODER.encode(item[1])))
        except ValueError as exc:
            raise bad(f"a row cannot be encoded ({exc})") from None
    return Page(tuple(out), upto, limited)


def page_lines(stream: str, instance: str, page: Page, from_token: int, upto_token: int) -> list[str]:
    """The lines a page stands for: its rows as RDATA (batched as the writer batches them),
    then ``POSITION stream instance from upto``: the range it covers."""
    ups = page.updates
    lines = []
    for i, (token, row) in enumerate(ups):
        last_of_token = i + 1 == len(ups) or ups[i + 1][0] != token
        lines.append(C.format_line(C.Rdata(stream, instance, token if last_of_token else None, row)))
    lines.append(C.format_line(C.Position(stream, instance, from_token, upto_token)))
    return lines


@dataclasses.dataclass
class Fetch:
    """The catch-up of one (stream, instance) from ``from_token`` up to ``upto_token``, page
    by page: ``target(txn)`` is the next request, ``answered(page)`` moves on."""
    stream: str
    instance: str
    from_token: int
    upto_token: int
    pages: int = 0
    rows: int = 0

    @property
    def done(self) -> bool:
        return self.from_token >= self.upto_token

    def target(self, txn: str) -> str:
        return request_target(self.stream, self.from_token, self.upto_token, txn)

    def answered(self, body: bytes) -> list[str]:
        """The lines of the next page's answer; raises RemoteError for a bad answer."""
        page = parse_page(body, self.from_token, self.upto_token)
        # a last page (limited false) covers the whole range asked for: the writer has
        # nothing more up to the position it announced
        end = page.upto_token if page.limited else self.upto_token
        lines = page_lines(self.stream, self.instance, page, self.from_token, end)
        self.pages += 1
        self.rows += len(page.updates)
        if self.pages >= MAX_PAGES and page.limited:
            raise RemoteError(ErrorCode.BAD_CATCH_UP,
                              f"catch-up of {self.stream}/{self.instance}: more than {MAX_PAGES} pages")
        self.from_token = end
        return lines


def fetch_for(stream: str, instance: str, committed: int, new_token: int) -> Fetch | None:
    """The catch-up a gap asks for: rows after ``committed`` up to ``new_token`` (None when the
    names are not ones we can put in a URL, or there is nothing to fetch)."""
    if new_token <= committed or not (valid_name(stream) and valid_name(instance)):
        return None
    return Fetch(stream, instance, committed, new_token)
